"""One rank of the distributed tests: trains every scenario it is given and saves the results.

Run as a script, once per rank, by ``test_parallel.py`` (the environment carries ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, as torchrun would set them)::

    python _worker.py SCENARIOS_JSON OUTPUT_DIR

For the ``mismatched-*`` scenarios it trains a lazy budget on batches whose shape and
layout differ between the ranks (``mismatched``); for ``fsdp2-ranks`` it plans and trains
a small Llama under FSDP2 as ``benchmarks/fsdp2_ranks.py`` does, per rank. For each other
scenario it builds the tiny GPT from the same seed, marks it with ``wrap_model``,
wraps it in DDP or shards it with FSDP2, trains on this rank's half of each global batch
and saves the full parameters (or the error raised) to ``OUTPUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ckptwrap  # noqa: E402
from _dist_setup import (  # noqa: E402
    CONFIG, GLOBAL_BATCH, STEPS, build_model, make_optimizer, synthetic_batch,
)
from _allocator import allocator_peak  # noqa: E402
from _noted import NotedSteps  # noqa: E402
import fsdp2_ranks  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def train(scenario: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """Train one scenario; return how many modules were checkpointed and every parameter,
    in full, by qualified name.

    A scenario marks the model before wrapping it in DDP or sharding it with FSDP2, or,
    with ``"order": "shard-first"``, after; a ``budget:`` policy plans on the first
    training forward, or, with ``"example": True``, on this rank's first batch at once.
    """
    model = build_model(scenario["model"])
    share = GLOBAL_BATCH // world
    mine = slice(rank * share, (rank + 1) * share)

    def mark() -> None:
        example = None
        if scenario.get("example"):
            tokens, targets = synthetic_batch(CONFIG, GLOBAL_BATCH, seed=0)
            example = (tokens[mine], targets[mine])
        ckptwrap.wrap_model(
            model, scenario["policy"], use_reentrant=scenario["use_reentrant"], example_inputs=example
        )

    shard_first = scenario.get("order") == "shard-first"
    if not shard_first:
        mark()
    if scenario["strategy"] == "ddp":
        runner = DistributedDataParallel(model, **scenario.get("ddp", {}))
    else:
        for block in model.blocks:
            fully_shard(block)
        runner = fully_shard(model)
    if shard_first:
        mark()
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        tokens, targets = synthetic_batch(CONFIG, GLOBAL_BATCH, seed=step)
        optimizer.zero_grad(set_to_none=True)
        runner(tokens[mine], targets[mine]).backward()
        optimizer.step()
    params = {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        for name, param in model.named_parameters()
    }
    return {"wrapped": len(model.ckptwrap_plan), "params": params}


SHAPES = {
    0: [(1, 64), (2, 16), (1, 64), (2, 16), (3, 48), (2, 16), (1, 64)],
    1: [(4, 200), (4, 120), (4, 200), (4, 120), (2, 200), (4, 200), (4, 120)],
}
"""Per rank, each step's (batch, length): the ranks' first batches differ in layout (a
batch of one has no batch variable) and in shape, and so do all later ones; each rank
meets its shapes again, so that it plans some steps from what it measured."""
LONG = GPTConfig(vocab=64, width=32, heads=2, layers=4, seq_len=256, dropout=0.0)


def ranks_batch(rank: int, step: int) -> Any:
    rows, length = SHAPES[rank][step]
    return synthetic_batch(dataclasses.replace(LONG, seq_len=length), rows, seed=100 * step + rank)


def mismatched(strategy: str, rank: int) -> Dict[str, Any]:
    """A lazy budget under DDP or FSDP2 where the ranks' batches differ in layout and
    shape from the first step on: each rank learns from its own steps, with no collective
    of the planner's, so none waits on another. Every step is read at the CPU allocator
    (``torch.profiler``'s memory events, around zero_grad, forward and backward)."""
    torch.manual_seed(0)
    model = GPT(LONG)
    plain = copy.deepcopy(model)
    example = synthetic_batch(dataclasses.replace(LONG, seq_len=200), 4, seed=0)
    budget = ckptwrap.plan(copy.deepcopy(model), "blocks", example_inputs=example).plain_peak // 2
    ckptwrap.wrap_model(model, f"budget:{budget}B")
    with NotedSteps() as noted:
        if strategy == "ddp":
            runner = DistributedDataParallel(model)
        else:
            for block in model.blocks:
                fully_shard(block)
            runner = fully_shard(model)
        optimizer = make_optimizer(model)
        steps = []
        for step in range(len(SHAPES[rank])):
            tokens, targets = ranks_batch(rank, step)

            def run() -> None:
                optimizer.zero_grad(set_to_none=True)
                runner(tokens, targets).backward()

            peak = allocator_peak(run)
            optimizer.step()
            plain.zero_grad(set_to_none=True)
            plain_peak = allocator_peak(lambda: plain(tokens, targets).backward())
            steps.append({"peak": peak, "plain": plain_peak, "checkpointed": len(model.ckptwrap_plan)})
    params = {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        for name, param in model.named_parameters()
    }
    return {"budget": budget, "steps": steps, "measured": noted.measured, "params": params}


_TIMEOUT_S = 240
"""How long a rank waits in one collective for the other."""


def main() -> None:
    scenarios, out_dir = json.loads(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A rank that fails alone leaves the other waiting in a collective; the timeout ends it.
    # It is far above any wait between ranks on a loaded machine (a rank that lags behind
    # the other by more than this is a hang, not load).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=_TIMEOUT_S))
    results: Dict[str, Any] = {}
    failed = None
    try:
        for scenario in scenarios:
            if failed is not None:
                # After a failure the ranks may no longer meet at the same collectives: a
                # next scenario would mismatch them (gloo aborts the process on that).
                results[scenario["name"]] = {"error": f"not run: scenario {failed!r} failed on this rank"}
                continue
            try:
                if scenario["strategy"] == "fsdp2-ranks":
                    results[scenario["name"]] = fsdp2_ranks.rank_report(rank, world)
                elif scenario["strategy"].startswith("mismatched-"):
                    results[scenario["name"]] = mismatched(scenario["strategy"].split("-")[1], rank)
                else:
                    results[scenario["name"]] = train(scenario, rank, world)
            except Exception:  # reported by the test
                results[scenario["name"]] = {"error": traceback.format_exc()}
                failed = scenario["name"]
    finally:
        torch.save(results, out_dir / f"rank{rank}.pt")
        gc.collect()  # a sharded model that outlives the group can crash the process at exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of the distributed tests: trains every scenario it is given and saves the results.

Run as a script, once per rank, by ``test_parallel.py`` (the environment carries ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, as torchrun would set them)::

    python _worker.py SCENARIOS_JSON OUTPUT_DIR

For the ``plan`` scenario it records the budget plans the rank makes alone and applies
with the others. For each other scenario it builds the tiny GPT from the same seed, marks it with ``wrap_model``,
wraps it in DDP or shards it with FSDP2, trains on this rank's half of each global batch
and saves the full parameters (or the error raised) to ``OUTPUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptwrap  # noqa: E402
from _dist_setup import (  # noqa: E402
    CONFIG, GLOBAL_BATCH, STEPS, build_model, make_optimizer, synthetic_batch,
)


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


def budget_plans(rank: int) -> Dict[str, Any]:
    """The budget plans this rank makes on its own batch and on a batch every rank shares.

    Each rank first plans on its own share of the batch, twice as large on rank 1 as on
    rank 0, under one absolute budget that rank 0 meets with nothing checkpointed and rank
    1 does not: each rank plans for its own shape. The ranks agree on the measured costs,
    so a batch both then see gets the same plan on both, from rank 0's costs (their time
    rates, which differ between ranks otherwise, say whose).
    """
    model = build_model("gpt")
    reference = ckptwrap.plan(model, "blocks", example_inputs=synthetic_batch(CONFIG, 2, seed=0))
    budget = f"budget:{reference.plain_peak * 13 // 10 // 1024}KiB;recompute"
    mine = synthetic_batch(CONFIG, 2 * (rank + 1), seed=rank)
    shared = synthetic_batch(CONFIG, 3, seed=7)
    result: Dict[str, Any] = {"own": ckptwrap.plan(model, budget, example_inputs=mine).names}
    eager = ckptwrap.wrap_model(build_model("gpt"), budget, example_inputs=mine)
    lazy = ckptwrap.wrap_model(build_model("gpt"), budget)
    lazy(*mine).backward()
    for path, wrapped in (("eager", eager), ("lazy", lazy)):
        result[path] = wrapped.ckptwrap_plan.names
        wrapped(*shared).backward()
        result[f"{path} shared"] = wrapped.ckptwrap_plan.names
        result[f"{path} rates"] = _rates(wrapped)
    return result


def _rates(model: Any) -> List[float]:
    """The time rates of the costs the model's budget plans are made from."""
    hook = next(h for h in model._forward_pre_hooks.values() if hasattr(h, "planner"))
    fit = hook.planner._layouts[0].fit
    return [timing.rate for _, timing in sorted(fit._timings.items())]


def main() -> None:
    scenarios, out_dir = json.loads(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A rank that fails alone leaves the other waiting in a collective; the timeout ends it.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results: Dict[str, Any] = {}
    try:
        for scenario in scenarios:
            try:
                if scenario["strategy"] == "plan":
                    results[scenario["name"]] = budget_plans(rank)
                else:
                    results[scenario["name"]] = train(scenario, rank, world)
            except Exception:  # reported by the test; the next scenario still runs
                results[scenario["name"]] = {"error": traceback.format_exc()}
    finally:
        torch.save(results, out_dir / f"rank{rank}.pt")
        gc.collect()  # a sharded model that outlives the group can crash the process at exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

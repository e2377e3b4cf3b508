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
from typing import Any, Dict

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
    in full, by qualified name."""
    model = build_model(scenario["model"])
    ckptwrap.wrap_model(model, scenario["policy"], use_reentrant=scenario["use_reentrant"])
    if scenario["strategy"] == "ddp":
        runner = DistributedDataParallel(model, **scenario.get("ddp", {}))
    else:
        for block in model.blocks:
            fully_shard(block)
        runner = fully_shard(model)
    optimizer = make_optimizer(model)
    share = GLOBAL_BATCH // world
    for step in range(STEPS):
        tokens, targets = synthetic_batch(CONFIG, GLOBAL_BATCH, seed=step)
        mine = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad(set_to_none=True)
        runner(tokens[mine], targets[mine]).backward()
        optimizer.step()
    params = {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        for name, param in model.named_parameters()
    }
    return {"wrapped": len(model.ckptwrap_plan), "params": params}


def budget_plans(rank: int) -> Dict[str, Any]:
    """The budget plans this rank makes on its own and applies with the others.

    Each rank plans on its own share of the batch, twice as large on rank 1 as on rank 0,
    under one absolute budget: alone they choose different blocks, so only agreement makes
    them apply the same.
    """
    model = build_model("gpt")
    reference = ckptwrap.plan(model, "blocks", example_inputs=synthetic_batch(CONFIG, 2, seed=0))
    # 1.3 times rank 0's un-checkpointed step peak: rank 0 needs to checkpoint nothing, rank
    # 1, with twice the batch (and about 1.9 times that peak), must, and can.
    budget = f"budget:{reference.plain_peak * 13 // 10 // 1024}KiB;recompute"
    mine = synthetic_batch(CONFIG, 2 * (rank + 1), seed=rank)
    own = ckptwrap.plan(model, budget, example_inputs=mine).names  # plan() alone is not collective
    eager = ckptwrap.wrap_model(build_model("gpt"), budget, example_inputs=mine)
    lazy = ckptwrap.wrap_model(build_model("gpt"), budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that the plan was measured on this forward
        lazy(*mine).backward()
    return {"own": own, "eager": eager.ckptwrap_plan.names, "lazy": lazy.ckptwrap_plan.names}


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

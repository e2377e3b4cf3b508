"""``wrap_model`` under DistributedDataParallel and FSDP2, on two CPU ranks.

Two processes (gloo, loopback) train the tiny GPT for a few steps in every scenario, each
on half of every global batch; every rank's parameters must then equal those of the
un-checkpointed model trained in this process on the whole batches. Both ranks run all
scenarios in one launch, since starting the processes costs more than the training.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from _dist_setup import build_model, loopback_environment, reference_parameters

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)

_WORKER = Path(__file__).resolve().parent / "_worker.py"
_WORLD = 2
_WRAPPED = {"none": 0, "blocks": 4, "every:2": 2}  # of the GPT's 4 blocks


def _scenario(
    strategy: str, policy: str, *, use_reentrant: bool = False, model: str = "gpt",
    order: str = "wrap-first", example: bool = False, **ddp: Any,
):
    name = f"{strategy}-{policy}" + ("-reentrant" if use_reentrant else "")
    name += "".join(f"-{key}" for key, value in sorted(ddp.items()) if value)
    name += "" if model == "gpt" else f"-{model}"
    name += "" if order == "wrap-first" else f"-{order}"
    name += "-example" if example else ""
    return dict(
        name=name, strategy=strategy, policy=policy, use_reentrant=use_reentrant, model=model,
        ddp=ddp, order=order, example=example,
    )


SCENARIOS = [
    _scenario("ddp", "none"),
    _scenario("ddp", "blocks"),
    _scenario("ddp", "every:2"),
    _scenario("ddp", "blocks", use_reentrant=True),
    # The setups that need static_graph with the re-entrant engine (test_ddp_checks.py).
    _scenario("ddp", "every:2", use_reentrant=True, static_graph=True, find_unused_parameters=True),
    _scenario("ddp", "blocks", use_reentrant=True, static_graph=True, model="shared"),
    _scenario("fsdp2", "none"),
    _scenario("fsdp2", "blocks"),
    _scenario("fsdp2", "every:2"),
    _scenario("fsdp2", "blocks", use_reentrant=True),
    # A budget planned lazily or on example inputs, before or after sharding: the planner
    # measures DTensor parameters and the gathered ones FSDP2 frees again.
    _scenario("fsdp2", "budget:90%"),
    _scenario("fsdp2", "budget:90%", order="shard-first"),
    _scenario("fsdp2", "budget:90%", example=True),
    _scenario("fsdp2", "budget:90%", order="shard-first", example=True),
    _scenario("ddp", "budget:90%", order="shard-first"),
]


# Each rank trains on batches of its own shapes and layouts (``_worker.SHAPES``).
MISMATCHED = [dict(name=f"mismatched-{strategy}", strategy=f"mismatched-{strategy}") for strategy in ("ddp", "fsdp2")]
# Plans and budgets per rank under FSDP2 on a small Llama (``benchmarks/fsdp2_ranks.py``).
FSDP2_RANKS = [dict(name="fsdp2-ranks", strategy="fsdp2-ranks")]
OVER = 0.03
"""A step may peak above the budget by this share of the plain peak at the largest shape
so far (on that rank)."""


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(scenarios: List[Dict[str, Any]], out_dir: Path) -> List[Dict[str, Any]]:
    """Run the worker on every rank, as torchrun would, and load what each rank saved."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_loopback_port()))
    env.update(WORLD_SIZE=str(_WORLD), OMP_NUM_THREADS="1", **loopback_environment())
    command = [sys.executable, str(_WORKER), json.dumps(scenarios), str(out_dir)]
    ranks = [
        subprocess.Popen(
            command, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(_WORLD)
    ]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=900)[0])
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, (process, output) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0, f"rank {rank} exited with {process.returncode}:\n{output}"
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(_WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _launch([*SCENARIOS, *MISMATCHED, *FSDP2_RANKS], tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def references():
    """Per model kind: (initial parameters, parameters trained in one process)."""
    return {
        kind: (_parameters(build_model(kind)), reference_parameters(kind))
        for kind in {s["model"] for s in SCENARIOS}
    }


def _parameters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_every_rank_matches_one_process_on_the_global_batch(scenario, ranks, references):
    start, reference = references[scenario["model"]]
    for rank, results in enumerate(ranks):
        result = results[scenario["name"]]
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
        if scenario["policy"] in _WRAPPED:
            expected_wrapped = _WRAPPED[scenario["policy"]] - (scenario["model"] == "shared")
            assert result["wrapped"] == expected_wrapped
        params = result["params"]
        assert params.keys() == reference.keys()
        for name, value in reference.items():
            assert not torch.equal(value, start[name]), f"{name} did not train"
            # The reduction order differs from one process's, so equal up to rounding.
            torch.testing.assert_close(
                params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}"
            )


def _mismatched_reference() -> Dict[str, torch.Tensor]:
    """One process training on both ranks' batches: the mean of their losses."""
    import _worker

    torch.manual_seed(0)
    model = _worker.GPT(_worker.LONG)
    optimizer = _worker.make_optimizer(model)
    for step in range(len(_worker.SHAPES[0])):
        optimizer.zero_grad(set_to_none=True)
        losses = [model(*_worker.ranks_batch(rank, step)) for rank in range(_WORLD)]
        (sum(losses) / _WORLD).backward()
        optimizer.step()
    return _parameters(model)


@pytest.mark.parametrize("scenario", MISMATCHED, ids=[s["name"] for s in MISMATCHED])
def test_ranks_with_other_layouts_and_shapes_each_keep_the_budget(scenario, ranks):
    reference = _mismatched_reference()
    checkpointed = []
    for rank, results in enumerate(ranks):
        result = results[scenario["name"]]
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
        largest = 0
        for step, seen in enumerate(result["steps"]):
            largest = max(largest, seen["plain"])
            assert seen["peak"] <= result["budget"] + OVER * largest, (rank, step, seen, result["budget"])
        assert 1 <= result["measured"] < len(result["steps"]), result["measured"]
        checkpointed.append([seen["checkpointed"] for seen in result["steps"]])
        for name, value in reference.items():
            torch.testing.assert_close(
                result["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}"
            )
    # Each rank planned its own steps: rank 1's longer batches checkpoint more.
    assert sum(checkpointed[1]) > sum(checkpointed[0]), checkpointed


# ----------------------------------------------------------------------------- FSDP2 per rank


def _fsdp2_reports(ranks) -> List[Dict[str, Any]]:
    reports = [results["fsdp2-ranks"] for results in ranks]
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank} failed:\n{report['error']}"
    return reports


def test_under_fsdp2_each_rank_peaks_where_its_plan_says(ranks):
    """Each rank plans its own batch (1 x 96 and 2 x 256 tokens) of a Llama sharded per
    layer, under ``none``, ``blocks`` and a ``budget:total``, with each layer's gathered
    parameters freed after its forward or kept to its backward, and with bfloat16
    parameters: the plan's whole-iteration peak against torch's ``FSDPMemTracker`` on the
    same iteration (real tensors) and the CPU allocator's least of four readings.

    Gloo reduce-scatters and all-gathers through a copy of its own, made on its thread and
    read back on the caller's: up to one layer's gathered parameters (in the reduce
    dtype) that neither FSDP2 nor the plan holds, which the tracker and the allocator see
    when it falls at the iteration's peak (bfloat16 parameters, 1 x 96: 5.6%), and that
    gloo's threads at times free late (the allocator's readings vary by as much from
    iteration to iteration; the tracker's do not). The step measured for the plan meets
    the same copies: once in a loaded run, rank 0's ``none`` under ``keep-gathered``
    predicted one layer's parameters (262,500 bytes) above the tracker. Before the planned
    step's backward was FSDP2's own and counted through its hooks, plans read 7-33% under."""
    for report in _fsdp2_reports(ranks):
        for row in report["planned"]:
            tracked, gloo = row["tracked"], row["unit"]
            assert tracked - gloo - 0.01 * tracked <= row["predicted"] <= 1.01 * tracked + gloo, row
            assert row["least"] - 2 * gloo <= 1.01 * row["predicted"], row


def test_under_fsdp2_a_total_planned_on_example_inputs_after_training_holds(ranks):
    # Applied after one training step: the step starts with the optimizer's state made.
    for report in _fsdp2_reports(ranks):
        (row,) = [row for row in report["planned"] if row["total"] is not None]
        assert 0 < row["checkpointed"] < row["blocks"], row  # between blocks and none: a real choice
        assert row["predicted"] <= row["total"], row
        # The tracker and the allocator's least reading may hold one of gloo's copies (a
        # layer's gathered parameters, see above) where it falls at the peak: with a plan
        # close to its total, that passed 3% of the plain step once in a loaded run (the
        # solver's choice follows measured times; the copy's timing follows gloo's threads).
        assert row["tracked"] <= row["total"] + OVER * row["plain_step"] + row["unit"], row
        assert row["least"] <= row["total"] + OVER * row["plain_step"] + row["unit"], row


def test_under_fsdp2_a_lazy_total_holds_on_every_rank_with_shapes_of_its_own(ranks):
    """``budget:total`` per rank, learned from each rank's own steps (batches of one and
    of four, 32 to 512 tokens, differing between the ranks from the first step): every
    iteration within the total by at most 3% of the largest plain step so far, and gloo's
    copies of two layers' gathered parameters (see above; a single reading per step)."""
    for rank, report in enumerate(_fsdp2_reports(ranks)):
        lazy = report["lazy"]
        largest = 0
        for step, seen in enumerate(lazy["steps"]):
            largest = max(largest, seen["plain"])
            assert seen["peak"] <= lazy["total"] + OVER * largest + lazy["slack"], (rank, step, seen, lazy["total"])
        # The total is between blocks and none at the longest batch: some steps choose.
        assert any(0 < seen["checkpointed"] < 4 for seen in lazy["steps"]), lazy["steps"]

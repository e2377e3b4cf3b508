"""Costs modelled over input shapes: measured once, on example inputs, then predicted at
shapes never profiled, from lengths 16 to 512 and batches of 1 to 8.

At each shape a training step runs under the plan the budget gives it there, read at the
CPU allocator (an independent meter); the plan's predicted step peak, and its predicted
un-checkpointed peak against the plain model's measured one, must be within 5%, and the
planner must not have run the model again to make them.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import ckptwrap

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _zoo import ZOO, has_transformers  # noqa: E402
from wrap._meter import allocator_step_peak  # noqa: E402

pytestmark = pytest.mark.skipif(not has_transformers(), reason="transformers is not installed")

TOLERANCE = 0.05
_SHAPES = [(1, 16), (1, 512), (2, 256), (3, 64), (5, 128), (8, 16), (8, 384), (4, 512)]
"""(batch, length) pairs spanning 16..512 and 1..8; the example is batch 4, length 32."""


def _planner(model: torch.nn.Module):
    return next(h for h in model._forward_pre_hooks.values() if hasattr(h, "planner")).planner


def _peak(workload, model) -> int:
    model.zero_grad(set_to_none=True)

    def step() -> None:
        torch.manual_seed(0)
        workload.loss(model(*workload.args, **workload.kwargs)).backward()

    peak = allocator_step_peak(step)
    model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_step_peaks_at_shapes_never_profiled_are_predicted_within_5_percent(name):
    largest = ZOO[name](4, 512)  # its model takes every length used here
    example = ZOO[name](4, 32)
    plain = copy.deepcopy(largest.model)
    # An absolute budget, so that the plans checkpoint more as the shapes grow.
    reference = ckptwrap.plan(plain, "blocks", example_inputs=largest.args, example_kwargs=largest.kwargs)
    policy = f"budget:{reference.plain_peak // 2}B"
    model = ckptwrap.wrap_model(largest.model, policy, example_inputs=example.args, example_kwargs=example.kwargs)
    measured_runs = _planner(model).measurements
    checkpointed = set()
    for rows, length in _SHAPES:
        workload = ZOO[name](rows, length)
        peak = _peak(workload, model)
        applied = model.ckptwrap_plan
        checkpointed.add(len(applied.names))
        plain_peak = _peak(workload, plain)
        assert abs(applied.predicted_peak - peak) <= TOLERANCE * peak, (rows, length, applied.predicted_peak, peak)
        assert abs(applied.plain_peak - plain_peak) <= TOLERANCE * plain_peak, (rows, length, applied.plain_peak, plain_peak)
    assert _planner(model).measurements == measured_runs, "the cost model alone made the plans"
    assert len(checkpointed) >= 2, checkpointed  # the plans differ from shape to shape


def test_a_scalar_keyword_the_example_lacked_is_planned_without_measuring_again():
    # The Trainer adds num_items_in_batch (a 0-dim tensor) to the batch it passes.
    example = ZOO["gpt2"](4, 32)
    model = ckptwrap.wrap_model(example.model, "budget:60%", example_inputs=example.args,
                                example_kwargs=example.kwargs)
    measured_runs = _planner(model).measurements
    batch = dict(example.kwargs, num_items_in_batch=torch.tensor(4 * 31))
    example.loss(model(*example.args, **batch)).backward()
    assert _planner(model).measurements == measured_runs, "measured again for a scalar"
    longer = ZOO["gpt2"](4, 64)
    batch = dict(longer.kwargs, num_items_in_batch=torch.tensor(4 * 63))
    model(*longer.args, **batch)
    assert _planner(model).measurements == measured_runs, "a new length is a solve"

"""The budget planner on the model zoo at tiny sizes: stacks of blocks and models that are
not (encoder-decoders, a mixture of experts, a U-Net's skip connections, a recurrent cell
called once per time step, ALBERT's shared layer called once per layer).

For each model a budget halfway between the least step peak the planner predicts
reachable and the un-checkpointed peak is planned on example inputs and applied; the
training step's peak, read at the CPU allocator (an independent meter), must match the
plan's prediction within 5% and the budget within 3% of the un-checkpointed peak, and
every gradient must equal the plain model's bit for bit.
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
from _zoo import HF_MODELS, ZOO, has_transformers  # noqa: E402
from wrap._meter import allocator_step_peak  # noqa: E402

PREDICTION = 0.05
"""The plan's predicted step peak may miss the measured one by this share of it."""
OVER = 0.03
"""The measured step peak may pass the budget by this share of the plain peak."""

_NAMES = [name for name in ZOO if name not in HF_MODELS or has_transformers()]
_SIZES = {"vit": (4, 64), "lstm": (16, 64)}
"""Rows and length where they differ from (2, 32): a smaller ViT or LSTM holds too little
for checkpointing to lower its peak (the recurrent cell's regions each keep a generator
state on the CPU)."""


def _step(workload, seed: int = 0) -> torch.Tensor:
    workload.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    return workload.step()


def _peak(workload) -> int:
    workload.model.zero_grad(set_to_none=True)
    peak = allocator_step_peak(lambda: _step(workload))
    workload.model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.parametrize("name", _NAMES)
def test_a_budget_plan_is_predicted_honoured_and_exact(name):
    workload = ZOO[name](*_SIZES.get(name, (2, 32)))
    plain = copy.deepcopy(workload)
    example = dict(example_inputs=workload.args, example_kwargs=workload.kwargs, loss_fn=workload.loss)
    every = ckptwrap.plan(workload.model, workload.candidates, **example)
    budget = (every.predicted_peak + every.plain_peak) // 2
    ckptwrap.wrap_model(workload.model, f"{workload.candidates};budget:{budget}B", **example)
    applied = workload.model.ckptwrap_plan
    assert applied.names, f"{name}: the budget checkpoints nothing"
    measured, plain_peak = _peak(workload), _peak(plain)
    assert abs(applied.predicted_peak - measured) <= PREDICTION * measured, (name, applied.predicted_peak, measured)
    assert abs(applied.plain_peak - plain_peak) <= PREDICTION * plain_peak, (name, applied.plain_peak, plain_peak)
    assert measured <= budget + OVER * plain_peak, (name, measured, budget, plain_peak)
    losses = (_step(workload, seed=5), _step(plain, seed=5))
    assert torch.equal(*losses), name
    for (param, a), b in zip(workload.model.named_parameters(), plain.model.parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), (name, param)

"""Costs learned from training steps at some shapes, then predicted at shapes never
measured: Hugging Face GPT-2 and Llama trained at a few batches and lengths, then at
others between them.

At each new shape a training step runs under the plan the budget gives it there, read at
the CPU allocator (an independent meter); the plan's predicted step peak, and its
predicted un-checkpointed peak against the plain model's measured one, must be within 5%,
and nothing may have been measured to make them.
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
_LEARNED = [(4, 32), (4, 256), (4, 128), (4, 64), (4, 192), (2, 32), (2, 256), (2, 128), (2, 96)]
"""The training shapes the costs are learned from, (batch, length)."""
_NEW = [(3, 96), (4, 160), (2, 200), (3, 224), (4, 48), (3, 40)]
"""Shapes between them, never measured."""


def _peak(model, name: str, rows: int, length: int) -> int:
    workload = ZOO[name](rows, length)
    model.zero_grad(set_to_none=True)

    def step() -> None:
        torch.manual_seed(0)
        workload.loss(model(*workload.args, **workload.kwargs)).backward()

    peak = allocator_step_peak(step)
    model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_step_peaks_at_shapes_never_measured_are_predicted_within_5_percent(name, monkeypatch, noted_steps):
    # Learning as fast as it can: every learning shape without trusted costs is measured
    # (in a loop, measuring to learn is held to a share of the training time, and a
    # bound from the shapes measured stands in meanwhile).
    monkeypatch.setattr("ckptwrap.planner._planner.LEARN_SHARE", 1e9)
    largest = ZOO[name](4, 256)
    plain = copy.deepcopy(largest.model)
    # An absolute budget, so that the plans checkpoint more as the shapes grow.
    reference = ckptwrap.plan(plain, "blocks", example_inputs=largest.args, example_kwargs=largest.kwargs)
    model = ckptwrap.wrap_model(largest.model, f"budget:{reference.plain_peak // 2}B")
    for rows, length in _LEARNED:
        _peak(model, name, rows, length)
    measured = noted_steps.measured
    assert measured < len(_LEARNED), "some learning shapes were solves already"
    checkpointed = set()
    for rows, length in _NEW:
        peak = _peak(model, name, rows, length)
        applied = model.ckptwrap_plan
        checkpointed.add(len(applied.names))
        plain_peak = _peak(plain, name, rows, length)
        assert abs(applied.predicted_peak - peak) <= TOLERANCE * peak, (rows, length, applied.predicted_peak, peak)
        assert abs(applied.plain_peak - plain_peak) <= TOLERANCE * plain_peak, (rows, length, applied.plain_peak, plain_peak)
    assert noted_steps.measured == measured, "the fitted costs alone made the plans"
    assert len(checkpointed) >= 2, checkpointed  # the plans differ from shape to shape


def test_a_scalar_keyword_the_example_lacked_is_planned_without_measuring_again(noted_steps):
    # The Trainer adds num_items_in_batch (a 0-dim tensor) to the batch it passes.
    example = ZOO["gpt2"](4, 32)
    model = ckptwrap.wrap_model(example.model, "budget:60%", example_inputs=example.args,
                                example_kwargs=example.kwargs)
    batch = dict(example.kwargs, num_items_in_batch=torch.tensor(4 * 31))
    example.loss(model(*example.args, **batch)).backward()
    # Planned from the example's measured costs: the same layout of inputs, not a new one.
    forward = noted_steps.forward
    assert not forward["measured"], "measured again for a scalar"
    assert forward["source"] == "measured" and forward["sizes"] == (4, 32), forward

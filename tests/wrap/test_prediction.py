"""The plan's predicted peak against the activation peak measured in one training step.

The meter here counts, from the operator that creates it until it is freed, every
storage the forward or a recomputation creates; storages backward itself creates
(gradients, temporaries) are not counted: that is the quantity the planner predicts.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Tuple

import pytest
import torch
from torch import nn

from ckptwrap import plan, wrap_model

from ._meter import ActivationMeter
from ._models import SEQ, VOCAB, TinyGPT, make, marked

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from factories import ConvPyramid  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

TOLERANCE = 0.10
"""The predicted peak must be within this share of the measured one."""
_MIB = float(1 << 20)


class _Workload(NamedTuple):
    model: nn.Module
    inputs: Tuple[Any, ...]
    """Inputs of ``model.forward``; also the planner's example inputs."""
    loss: Callable[[Any], torch.Tensor]
    """The training loss, from the forward's output."""


def _tiny_gpt() -> _Workload:
    # Wider and with a larger batch than the other tests' TinyGPT (its sequence length is
    # fixed), so that activations dwarf the few constant bytes outside the model.
    model = make(lambda: TinyGPT(layers=6, width=128)).train()
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(123))
    targets = torch.roll(ids, -1, dims=1)
    return _Workload(
        model, (ids,), lambda logits: nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    )


def _small_pyramid() -> _Workload:
    model = make(
        lambda: ConvPyramid(in_channels=3, widths=(8, 16), blocks_per_stage=2, classes=10)
    ).train()
    generator = torch.Generator().manual_seed(7)
    images = torch.randn(2, 3, 32, 32, generator=generator)
    labels = torch.randint(10, (2,), generator=generator)
    return _Workload(model, (images,), lambda logits: nn.functional.cross_entropy(logits, labels))


def _example_gpt() -> _Workload:
    config = GPTConfig(vocab=128, width=64, heads=4, layers=6, seq_len=64)
    model = make(lambda: GPT(config)).train()
    return _Workload(model, synthetic_batch(config, 4, seed=0), lambda loss: loss)


def _three_stage_pyramid() -> _Workload:
    model = make(
        lambda: ConvPyramid(in_channels=3, widths=(8, 24, 72), blocks_per_stage=2, classes=10)
    ).train()
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(10, (4,), generator=torch.Generator().manual_seed(1))
    return _Workload(model, (images,), lambda logits: nn.functional.cross_entropy(logits, labels))


def _measured_peak(model: nn.Module, workload: _Workload) -> int:
    """The activation peak of one training step of ``model`` on the workload's inputs."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with ActivationMeter() as meter:
        loss = workload.loss(model(*workload.inputs))
        meter.in_backward = True
        loss.backward()
    return meter.peak


def _wrapped(workload: _Workload, policy: str) -> Tuple[nn.Module, Optional[int]]:
    """A copy of the model wrapped by ``policy``, and the peak predicted for it.

    For a budget, wrap_model plans on the example inputs itself and the applied plan
    carries the prediction: ``plan()`` on another copy reads the same budget from the same
    bytes but may pick other blocks, since among blocks alike in bytes the solver goes by
    measured, noisy times. Other policies select by name alone, so ``plan()`` on a copy
    predicts for the very modules wrap_model marks.
    """
    planned = plan(copy.deepcopy(workload.model), policy, example_inputs=workload.inputs)
    model = copy.deepcopy(workload.model)
    if "budget:" in policy:
        wrap_model(model, policy, example_inputs=workload.inputs)
        applied = model.ckptwrap_plan
        assert (applied.budget, applied.activation_bytes) == (planned.budget, planned.activation_bytes)
        assert applied.predicted_peak is not None and applied.predicted_peak <= applied.budget
        return model, applied.predicted_peak
    wrap_model(model, policy)
    applied = model.ckptwrap_plan.names
    assert applied == planned.names, f"{policy}: wrap_model chose {applied}, plan() {planned.names}"
    return model, planned.predicted_peak


def _assert_close(policy: str, predicted: Optional[int], measured: int) -> None:
    assert predicted is not None, f"{policy}: the plan has no prediction"
    assert abs(predicted - measured) <= TOLERANCE * measured, (
        f"{policy}: predicted {predicted / _MIB:.2f} MiB, measured {measured / _MIB:.2f} MiB "
        f"({predicted / measured - 1:+.1%})"
    )


_CASES = [
    *(
        (_tiny_gpt, policy)
        for policy in (
            "none", "blocks", "every:2", "first:2", "last:2", "budget:50%", "budget:75%",
            "blocks;selective",
        )
    ),
    *((_small_pyramid, policy) for policy in ("none", "blocks", "every:2", "budget:75%")),
    *(
        (_example_gpt, policy)
        for policy in ("none", "blocks", "every:2", "last:2", "budget:50%", "budget:30%", "blocks;selective")
    ),
    *((_three_stage_pyramid, policy) for policy in ("none", "blocks", "every:2", "budget:70%")),
]


@pytest.mark.parametrize(
    ("build", "policy"), _CASES, ids=[f"{build.__name__[1:]}-{policy}" for build, policy in _CASES]
)
def test_the_predicted_peak_is_within_ten_percent_of_the_measured_one(build, policy):
    workload = build()
    model, predicted = _wrapped(workload, policy)
    assert marked(model) == model.ckptwrap_plan.names
    assert policy == "none" or marked(model), f"{policy}: nothing selected"
    _assert_close(policy, predicted, _measured_peak(model, workload))

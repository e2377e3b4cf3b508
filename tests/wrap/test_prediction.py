"""The plan's predicted peak against the peak of one whole training step, measured.

The meter is the CPU allocator itself, read through ``torch.profiler``'s memory events:
every allocation and free of the step (forward, loss, backward, recomputations,
gradients, operators' workspaces) above what was allocated before it. That is the
quantity the planner predicts and a budget caps.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Tuple

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import plan, wrap_model

from ._meter import allocator_step_peak
from ._models import SEQ, VOCAB, TinyGPT, make, marked

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from factories import ConvPyramid  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

TOLERANCE = 0.05
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


def _gpt2() -> _Workload:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4, bos_token_id=0,
        eos_token_id=0,
    )
    model = make(lambda: transformers.GPT2LMHeadModel(config)).train()
    ids = torch.randint(256, (4, 64), generator=torch.Generator().manual_seed(3))
    targets = ids[:, 1:].flatten()

    def loss(output: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), targets)

    return _Workload(model, (ids,), loss)


def _measured_peak(model: nn.Module, workload: _Workload) -> int:
    """The peak of one training step of ``model`` on the workload's inputs, from fresh
    gradients."""
    model.zero_grad(set_to_none=True)

    def step() -> None:
        torch.manual_seed(1)
        workload.loss(model(*workload.inputs)).backward()

    peak = allocator_step_peak(step)
    model.zero_grad(set_to_none=True)
    return peak


def _wrapped(workload: _Workload, policy: str) -> Tuple[nn.Module, Optional[int]]:
    """A copy of the model wrapped by ``policy``, and the peak predicted for it.

    For a budget, wrap_model plans on the example inputs itself and the applied plan
    carries the prediction: ``plan()`` on another copy reads the same budget from the same
    bytes but may pick other blocks, since among blocks alike in bytes the solver goes by
    measured, noisy times. Other policies select by name alone, so ``plan()`` on a copy
    predicts for the very modules wrap_model marks.
    """
    planned = plan(
        copy.deepcopy(workload.model), policy, example_inputs=workload.inputs, loss_fn=workload.loss
    )
    model = copy.deepcopy(workload.model)
    if "budget:" in policy:
        wrap_model(model, policy, example_inputs=workload.inputs, loss_fn=workload.loss)
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
    *((_gpt2, policy) for policy in ("none", "blocks", "every:2", "budget:50%", "budget:50%;recompute")),
]


@pytest.mark.parametrize(
    ("build", "policy"), _CASES, ids=[f"{build.__name__[1:]}-{policy}" for build, policy in _CASES]
)
def test_the_predicted_step_peak_is_within_five_percent_of_the_measured_one(build, policy):
    workload = build()
    model, predicted = _wrapped(workload, policy)
    assert marked(model) == model.ckptwrap_plan.names
    assert policy == "none" or marked(model), f"{policy}: nothing selected"
    _assert_close(policy, predicted, _measured_peak(model, workload))


_BUDGETS = [
    (build, policy)
    for build in (_example_gpt, _three_stage_pyramid, _gpt2)
    for policy in ("budget:75%", "budget:50%", "budget:30%", "budget:50%;recompute")
]


@pytest.mark.parametrize(
    ("build", "policy"), _BUDGETS, ids=[f"{build.__name__[1:]}-{policy}" for build, policy in _BUDGETS]
)
def test_a_budget_caps_the_measured_step_peak(build, policy):
    """``budget:NN%`` is a share of the un-checkpointed step's peak; the measured step
    stays under it, up to 3% of that peak (the allocator's own rounding and timing)."""
    workload = build()
    plain = _measured_peak(workload.model, workload)
    model = copy.deepcopy(workload.model)
    try:
        wrap_model(model, policy, example_inputs=workload.inputs, loss_fn=workload.loss)
    except ckptwrap.CheckpointError as error:
        # Only a budget below every plan's reach may be refused, and it must say so.
        assert "below the smallest reachable peak" in str(error)
        return
    budget = model.ckptwrap_plan.budget
    fraction = float(policy.split(":")[1].split("%")[0]) / 100
    assert abs(budget - fraction * plain) <= 0.03 * plain, (budget, plain)
    measured = _measured_peak(model, workload)
    assert measured <= budget + 0.03 * plain, (
        f"{policy}: measured {measured / _MIB:.2f} MiB over the budget {budget / _MIB:.2f} MiB"
    )

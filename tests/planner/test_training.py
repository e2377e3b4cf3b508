"""A budget holds where users train: a loop with dynamic padding under a lazy budget, and
the memory of planning itself.

The meter is the CPU allocator (``torch.profiler``'s memory events), around whole
training steps, the ones that plan included; the reference is the un-checkpointed model
trained alongside on the same batches and dropout seeds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ckptwrap

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _loop import gpt_stack, hf_gpt2, lengths, train_step  # noqa: E402
from _zoo import has_transformers  # noqa: E402
from wrap._meter import allocator_step_peak  # noqa: E402

OVER = 0.03
"""A step may peak above the budget by this share of the plain peak at the longest length."""
_STEPS = 48
_ROWS = 4
_LONGEST = 256

_LOOPS = {
    "gpt2": lambda: hf_gpt2(width=32, layers=4, heads=2, vocab=256, longest=_LONGEST),
    "stack": lambda: gpt_stack(width=32, layers=4, heads=2, vocab=256, longest=_LONGEST),
}


def _loop(name: str):
    if name == "gpt2" and not has_transformers():
        pytest.skip("transformers is not installed")
    return _LOOPS[name]()


def _trained(loop, policy: str):
    model = loop.build()
    if policy != "none":
        ckptwrap.wrap_model(model, policy)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("name", sorted(_LOOPS))
@pytest.mark.parametrize("budget", ["bytes", "percent"])
def test_a_lazy_budget_holds_through_a_loop_of_changing_lengths(name, budget):
    loop = _loop(name)
    args, kwargs = loop.batch(_ROWS, _LONGEST, 0)
    longest_plain = ckptwrap.plan(loop.build(), "blocks", example_inputs=args, example_kwargs=kwargs).plain_peak
    policy = f"budget:{longest_plain // 2}B" if budget == "bytes" else "budget:50%"
    model, optimizer = _trained(loop, policy)
    plain, plain_optimizer = _trained(loop, "none")
    drawn = lengths(_STEPS, 8, _LONGEST, seed=3)
    plain_at_longest = 0
    for step, length in enumerate(drawn):
        batch = loop.batch(_ROWS, length, step)
        losses = {}
        peak = allocator_step_peak(lambda: losses.setdefault("model", train_step(model, loop, batch, step, optimizer)))
        reference = allocator_step_peak(
            lambda: losses.setdefault("plain", train_step(plain, loop, batch, step, plain_optimizer))
        )
        if length == _LONGEST:
            plain_at_longest = max(plain_at_longest, reference)
        applied = model.ckptwrap_plan
        assert not applied.pending and applied.budget is not None
        # The step that planned is measured too: its peak must stay in the budget as well.
        assert peak <= applied.budget + OVER * longest_plain, (step, length, peak, applied.budget)
        assert torch.equal(losses["model"], losses["plain"]), (step, length)
        for a, b in zip(model.parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad), (step, length)
            assert torch.equal(a, b), (step, length)
    if budget == "percent":
        # Read against the longest length planned: half its plain peak, in bytes.
        assert abs(applied.budget - longest_plain // 2) <= OVER * longest_plain


@pytest.mark.skipif(not has_transformers(), reason="transformers is not installed")
@pytest.mark.parametrize("layers", [2, 4, 8])
def test_planning_on_example_inputs_stays_inside_the_budget(layers):
    loop = hf_gpt2(width=64, layers=layers, heads=4, vocab=512, longest=256)
    args, kwargs = loop.batch(8, 256, 0)
    model = loop.build()
    policy = "budget:60%"
    peak = allocator_step_peak(
        lambda: ckptwrap.wrap_model(model, policy, example_inputs=args, example_kwargs=kwargs)
    )
    applied = model.ckptwrap_plan
    assert applied.names and peak <= applied.budget, (peak, applied.budget, applied.plain_peak)


@pytest.mark.skipif(not has_transformers(), reason="transformers is not installed")
def test_the_first_training_step_plans_inside_the_budget():
    loop = hf_gpt2(width=64, layers=4, heads=4, vocab=512, longest=256)
    model, optimizer = _trained(loop, "budget:50%")
    batch = loop.batch(8, 256, 0)
    peak = allocator_step_peak(lambda: train_step(model, loop, batch, 0, optimizer))
    applied = model.ckptwrap_plan
    assert applied.names and peak <= applied.budget * 1.01, (peak, applied.budget)

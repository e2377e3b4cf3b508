"""A lazy budget's training step as the planner follows it (``PlannedStep``): decided,
running, forwarded, then ended or abandoned, once, in that order, whatever the loop does
between forward and backward."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import ckptwrap
from ckptwrap.planner import PlannedStep

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

_VOCAB = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return ckptwrap.wrap_model(GPT(GPTConfig(vocab=_VOCAB, width=32, heads=2, layers=3, seq_len=64)).train(), "budget:50%")


def _batch(length: int):
    ids = torch.randint(_VOCAB, (2, length + 1), generator=torch.Generator().manual_seed(length))
    return ids[:, :-1], ids[:, 1:]


def _current(model: nn.Module) -> PlannedStep:
    hook = next(h for h in model._forward_pre_hooks.values() if hasattr(h, "planner"))
    return hook.current


def test_a_measured_step_is_forwarded_then_ended_by_its_backward_and_hands_in_its_profile():
    model = _model()
    loss = model(*_batch(32))
    step = _current(model)
    assert step.decision.measure and step.recorder is not None
    assert step.forwarded and not step.ended and step.learned is None
    loss.backward()
    assert step.ended and step.learned is not None and step.learned.step is not None
    # Taken in at the next forward: the same shape is now solved, not measured.
    model(*_batch(32)).backward()
    assert not _current(model).decision.measure and _current(model).ended


def test_a_step_whose_backward_never_comes_is_abandoned_by_the_next_training_forward():
    model = _model()
    model(*_batch(32))  # its backward never taken
    first = _current(model)
    assert first.forwarded and not first.ended
    model(*_batch(32)).backward()
    assert first.ended and first.learned is None  # abandoned: nothing learned from it
    second = _current(model)
    # That forward began while the first step's graph may have been alive: not measured.
    assert second is not first and not second.decision.measure and second.ended


def test_eval_and_no_grad_forwards_leave_the_step_alone():
    model = _model()
    loss = model(*_batch(32))
    step = _current(model)
    with torch.no_grad():
        model(*_batch(16))
    model.eval()
    model(*_batch(16))
    model.train()
    assert _current(model) is step and not step.ended
    loss.backward()
    assert step.ended and step.learned is not None

"""ckptwrap beside what else runs in a training process: a user's profiler, process-wide
state (file descriptors, logging, warning filters), another wrapping, and checkpoints of
the model's own with ``use_reentrant=True``."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import ckptwrap
from ckptwrap import unwrap_model, wrap_model

from ._models import TinyGPT, gpt_batch, gpt_loss, make, markings


def _model() -> nn.Module:
    return make(lambda: TinyGPT(layers=6)).train()


def _train_step(model: nn.Module) -> None:
    gpt_loss(model, gpt_batch()).backward()


def test_planning_inside_a_users_profiler_leaves_it_recording():
    model = wrap_model(_model(), "budget:85%")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as session:
        for step in range(2):
            with record_function(f"user-step-{step}"):
                _train_step(model)
    assert not model.ckptwrap_plan.pending, "the first step planned"
    names = [event.name for event in session.events()]
    for step in range(2):
        assert f"user-step-{step}" in names, "the user's session lost a step"
    assert any(name == "aten::addmm" for name in names)
    assert any(event.cpu_memory_usage for event in session.events()), "memory events kept"


def test_planning_touches_no_process_wide_state(monkeypatch):
    library = os.path.dirname(ckptwrap.__file__)
    duplicated = []

    def watched(original):
        def call(*args):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(library):
                duplicated.append((original.__name__, args, caller))
            return original(*args)
        return call

    monkeypatch.setattr(os, "dup", watched(os.dup))
    monkeypatch.setattr(os, "dup2", watched(os.dup2))
    loggers = {name: (lg.level, lg.propagate, list(lg.handlers), lg.disabled)
               for name, lg in [("", logging.getLogger()), ("ckptwrap", logging.getLogger("ckptwrap"))]}
    filters = list(warnings.filters)
    ids, _ = gpt_batch()
    wrap_model(_model(), "budget:85%", example_inputs=(ids,))
    lazy = wrap_model(_model(), "budget:85%")
    _train_step(lazy)
    assert not lazy.ckptwrap_plan.pending
    _train_step(lazy)
    assert duplicated == [], "ckptwrap redirected a file descriptor"
    assert list(warnings.filters) == filters
    for name, state in loggers.items():
        lg = logging.getLogger(name)
        assert (lg.level, lg.propagate, list(lg.handlers), lg.disabled) == state, name


@pytest.mark.parametrize("first, second", [
    ("blocks", "budget:85%"),
    ("every:2", "budget:90%"),
    ("budget:85%", "blocks"),
    ("budget:85%", "budget:90%"),
])
def test_a_budget_cannot_go_on_top_of_another_wrapping(first, second):
    model = wrap_model(_model(), first)
    before = markings(model)
    with pytest.raises(ckptwrap.CheckpointConfigError, match=r"(?s)already wrapped with.*unwrap_model.*one policy"):
        wrap_model(model, second)
    assert markings(model) == before, "the model is left as it was"
    # Unwrapped first, the budget plans from the un-checkpointed model.
    wrap_model(unwrap_model(model), second)
    _train_step(model)
    assert model.ckptwrap_plan.policy == second


def test_the_same_budget_twice_is_a_no_op_and_policy_none_is_no_wrapping():
    model = wrap_model(_model(), "budget:85%")
    wrap_model(model, "budget:85%")
    hooks = [h for h in model._forward_pre_hooks.values() if "PlanPerShape" in type(h).__name__]
    assert len(hooks) == 1
    wrap_model(wrap_model(_model(), "none"), "budget:85%")  # nothing to stack on


class _ReentrantInside(nn.Module):
    """A block that checkpoints its own first half with torch's re-entrant variant."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.out(torch_checkpoint.checkpoint(self.inner, x, use_reentrant=True)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ReentrantInside() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("lazy", [False, True], ids=["example-inputs", "first-forward"])
def test_planning_passes_re_entrant_checkpoints_of_the_model_and_keeps_its_grads(lazy):
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(8, 16, 32, requires_grad=True)
    model(x).sum().backward()  # gradients the user has accumulated: planning keeps them
    kept = {name: p.grad.clone() for name, p in model.named_parameters()}
    input_grad = x.grad.clone()
    if lazy:
        wrap_model(model, "budget:100%")
        model(x)  # the forward that measures; its backward is not taken
    else:
        wrap_model(model, "budget:100%", example_inputs=(x,))
    assert not model.ckptwrap_plan.pending
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, kept[name]), f"planning changed {name}.grad"
    assert torch.equal(x.grad, input_grad)

"""Checkpointing torch does for the user beside ckptwrap's: torch's ``CheckpointWrapper``
(``checkpoint_wrapper``, ``apply_activation_checkpointing``) is switched off by
``wrap_model`` like a library flag (the wrapper stays, no parameter is renamed, and it is
put back by ``unwrap_model``); a forward of the model's own that calls
``torch.utils.checkpoint`` is a checkpointed module to the plan (left to that code, with
one warning), unless the call sits under a flag that is off; the doctor names both.
"""

from __future__ import annotations

import copy
import warnings
from typing import Dict, List

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import ckptwrap
from ckptwrap.diagnostics import doctor


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.drop(torch.relu(self.a(x))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


class SelfCheckpointing(Stack):
    """Checkpoints its blocks itself, as much training code does, behind its own switch."""

    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        return self.head(x).sum()


def _runs(model: nn.Module) -> Dict[str, int]:
    """How often each block's first layer runs (a hook on the block itself runs once)."""
    counts: Dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, Block):
            module.a.register_forward_pre_hook(lambda m, a, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    return counts


def _grads_equal(model: nn.Module, plain: nn.Module) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_torch_checkpoint_wrappers_are_switched_off_kept_and_put_back(impl):
    torch.manual_seed(0)
    plain = Stack()
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, Block),
    )
    names = [name for name, _ in model.named_parameters()]
    functions = [m.checkpoint_fn for m in model.blocks]
    counts = _runs(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptwrap.wrap_model(model, "blocks")
        x = torch.randn(4, 16)
        torch.manual_seed(1)
        model(x).backward()
    said = [str(w.message) for w in caught if "own gradient checkpointing was on" in str(w.message)]
    assert len(said) == 1 and "torch's" in said[0] and "checkpoint_wrapper()" in said[0], said
    assert set(counts.values()) == {2} and len(counts) == 3, counts  # not three times
    assert [name for name, _ in model.named_parameters()] == names, "no parameter is renamed"
    torch.manual_seed(1)
    plain(x).backward()
    assert _grads_equal(model, plain)
    ckptwrap.unwrap_model(model)
    assert [m.checkpoint_fn for m in model.blocks] == functions, "unwrap_model puts torch's checkpointing back"
    if impl == CheckpointImpl.NO_REENTRANT:  # the re-entrant one recomputes only for inputs that need grad
        counts.clear()
        model(x).backward()
        assert set(counts.values()) == {2}, counts


def test_the_models_own_checkpoint_calls_are_left_to_it_and_said_once():
    torch.manual_seed(0)
    model = SelfCheckpointing(use_checkpoint=True)
    plain = copy.deepcopy(model)
    plain.use_checkpoint = False
    counts = _runs(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptwrap.wrap_model(model, "blocks")
    said = [str(w.message) for w in caught if "own code checkpoints" in str(w.message)]
    assert len(said) == 1 and "SelfCheckpointing.forward" in said[0], [str(w.message) for w in caught]
    assert list(model.ckptwrap_plan) == []
    assert {reason for _, reason in model.ckptwrap_plan.dropped} == {
        "already checkpointed by a checkpoint call in SelfCheckpointing.forward (the model)"}
    x = torch.randn(4, 16)
    torch.manual_seed(1)
    model(x).backward()
    assert set(counts.values()) == {2}, counts
    torch.manual_seed(1)
    plain(x).backward()
    assert _grads_equal(model, plain)


def test_a_checkpoint_call_behind_a_switch_that_is_off_does_not_count():
    model = ckptwrap.wrap_model(SelfCheckpointing(use_checkpoint=False), "blocks")
    assert list(model.ckptwrap_plan) == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_region_holding_modules_the_models_code_checkpoints_is_left_too():
    class Inner(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(checkpoint(self.a, x, use_reentrant=False))

    model = nn.Sequential(*[Inner() for _ in range(2)], nn.Linear(16, 1))
    plan = ckptwrap.plan(model, "type:Inner")
    assert list(plan) == []
    assert all("contains checkpointed" in reason for _, reason in plan.dropped), plan.dropped


def _selected_twice(report) -> List[str]:
    return [f.message for f in report.findings if f.check == "selected-twice"]


def test_the_doctor_names_torch_wrappers_and_the_models_own_checkpoint_calls():
    torch.manual_seed(0)
    stack = nn.Sequential(*[Block() for _ in range(2)])
    apply_activation_checkpointing(stack, check_fn=lambda m: isinstance(m, Block))
    wrapped = nn.Sequential(ckptwrap.CheckpointWrapper(stack), nn.Linear(16, 1))
    messages = _selected_twice(doctor(wrapped, example_inputs=(torch.randn(4, 16),)))
    assert any("torch's CheckpointWrapper is on" in m for m in messages), messages

    class Inner(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(checkpoint(self.a, x, use_reentrant=False))

    by_code = nn.Sequential(ckptwrap.CheckpointWrapper(nn.Sequential(Inner(), Inner())), nn.Linear(16, 1))
    messages = _selected_twice(doctor(by_code, example_inputs=(torch.randn(4, 16),)))
    assert any("the model's own code" in m and "three times" in m for m in messages), messages

"""A checkpointed region whose input is changed in place, by its own forward or by code
after it, cannot be recomputed from that input. Both engines say so in a
``CheckpointError`` that names the region (its module, and its name in the model where
``wrap_model`` marked it), says it is checkpointed and what to do, with ``module`` and
``fix`` set (the doctor reports them), instead of torch's words ("a leaf Variable ...
in-place", "modified by an inplace operation"), which name neither."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from ckptwrap import CheckpointError, CheckpointWrapper, checkpoint, checkpointed, doctor, wrap_model

ENGINES = pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])


class _ChangesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)  # runs un-checkpointed: its input is a Linear's output, never saved
        return self.fc(x)


class _Decorated(_ChangesItsInput):
    @checkpointed
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return self.fc(x)


class _DecoratedReentrant(_ChangesItsInput):
    @checkpointed(use_reentrant=True)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return self.fc(x)


class _Model(nn.Module):
    def __init__(self, layer: Callable[[], nn.Module] = _ChangesItsInput) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.layers = nn.ModuleList(layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _backward(model: Any) -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    model(x).square().sum().backward()


def _assert_names(error: CheckpointError, module: nn.Module, *fragments: str) -> None:
    message = str(error)
    assert type(module).__name__ in message, message
    assert "is checkpointed" in message and "in place" in message, message
    assert "clone" in message and "don't modify" in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    # Not torch's bare words, which name neither the region nor checkpointing.
    assert not message.startswith(("a leaf Variable", "one of the variables"))
    assert error.module is module
    assert error.fix and "clone" in error.fix


class _ChangesItsOwn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 1.0
        h.add_(1.0)  # its own intermediate, not its input: nothing to say
        return torch.tanh(h)


@ENGINES
def test_a_marked_module_that_changes_its_input_is_named_with_the_fix(use_reentrant):
    torch.manual_seed(0)
    plain, model = _Model(_ChangesItsOwn), wrap_model(_Model(_ChangesItsOwn), "blocks", use_reentrant=use_reentrant)
    model.load_state_dict(plain.state_dict())
    _backward(plain)
    _backward(model)
    for (name, param), expected in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, msg=name)

    model = _Model()
    _backward(model)  # the plain model trains
    wrap_model(model, "blocks", use_reentrant=use_reentrant)
    with pytest.raises(CheckpointError) as info:
        _backward(model)
    # The backward meets the last layer first.
    _assert_names(info.value, model.layers[1], "'layers.1'", "its forward changed its input", "shape (3, 8)")


@ENGINES
def test_a_wrapper_a_decorated_forward_and_a_function_are_named_too(use_reentrant):
    wrapped = _Model(lambda: CheckpointWrapper(_ChangesItsInput(), use_reentrant=use_reentrant))
    with pytest.raises(CheckpointError) as info:
        _backward(wrapped)
    _assert_names(info.value, wrapped.layers[1].wrapped_module, "its forward changed its input")

    decorated = _Model(_DecoratedReentrant if use_reentrant else _Decorated)
    with pytest.raises(CheckpointError) as info:
        _backward(decorated)
    _assert_names(info.value, decorated.layers[1], "its forward changed its input")

    def scale_in_place(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return x @ w

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"(?s)function .*scale_in_place is checkpointed.*clone") as info:
        checkpoint(scale_in_place, x * 1.0, w, use_reentrant=use_reentrant).sum().backward()
    assert info.value.module is None and "clone" in info.value.fix


@ENGINES
def test_an_input_changed_after_the_region_ran_is_named(use_reentrant):
    class Squash(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x * 2.0)  # saves tanh's output, computed from x, not x

    class Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(8, 8)
            self.block = Squash()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.pre(x)
            y = self.block(h)
            h.add_(1.0)  # after the checkpointed block ran: it would recompute from this h
            return y + h

    model = Caller()
    _backward(model)  # the plain model trains: nothing saved h itself
    wrap_model(model, "name:block", use_reentrant=use_reentrant)
    with pytest.raises(CheckpointError) as info:
        _backward(model)
    _assert_names(info.value, model.block, "'block'", "after it ran")


@ENGINES
def test_the_doctor_reports_the_region_and_the_fix(use_reentrant):
    model = wrap_model(_Model(), "blocks", use_reentrant=use_reentrant)
    report = doctor(model, torch.randn(3, 8))
    [finding] = [f for f in report.findings if f.check == "step-failed"]
    assert finding.module == "layers.1"
    assert "clone" in finding.fix and "the message names the cause" not in finding.fix
    assert "is checkpointed" in finding.message and "in place" in finding.message

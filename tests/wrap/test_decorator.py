"""``@checkpointed`` on forward methods and plain functions."""

from __future__ import annotations

import inspect
from typing import List

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckptwrap
from ckptwrap import checkpointed, disabled
from ckptwrap._errors import CheckpointConfigError

from ._models import Block, assert_same, grads


class Recorder(nn.Module):
    """A block that records ``is_recomputing()`` on every run of its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.seen: List[bool] = []

    @checkpointed
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Linear, dropout, tanh."""
        self.seen.append(ckptwrap.is_recomputing())
        return self.drop(self.lin(x)).tanh()


class CheckpointedBlock(Block):
    forward = checkpointed(Block.forward)


class ReentrantBlock(Block):
    forward = checkpointed(use_reentrant=True)(Block.forward)


def _input() -> torch.Tensor:
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)


def test_every_instance_of_a_decorated_forward_is_recomputed_in_backward():
    first, second = Recorder(), Recorder()
    x = torch.randn(3, 4, requires_grad=True)
    second(first(x)).sum().backward()
    assert first.seen == [False, True]
    assert second.seen == [False, True]


def test_a_decorated_plain_function_is_recomputed():
    seen: List[bool] = []

    @checkpointed
    def region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(ckptwrap.is_recomputing())
        return (x @ w).sin().cos()

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    region(x, w).sum().backward()
    assert seen == [False, True]

    expected = [t.detach().clone().requires_grad_() for t in (x, w)]
    (expected[0] @ expected[1]).sin().cos().sum().backward()
    assert torch.equal(x.grad, expected[0].grad)
    assert torch.equal(w.grad, expected[1].grad)


def test_options_reach_the_engine():
    seen: List[bool] = []

    @checkpointed(use_reentrant=True)
    def region(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        seen.append(ckptwrap.is_recomputing())
        return x.sin() * scale

    x = torch.randn(3, requires_grad=True)
    scale = torch.tensor(2.0, requires_grad=True)
    region(x, scale).sum().backward()
    assert seen == [False, True]
    # Only the re-entrant engine refuses torch.autograd.grad.
    with pytest.raises(ckptwrap.CheckpointError, match="use_reentrant=True"):
        torch.autograd.grad(region(x, scale).sum(), x)


def test_keyword_arguments_reach_a_decorated_function_in_both_variants():
    results = []
    for use_reentrant in (False, True):
        seen: List[bool] = []

        @checkpointed(use_reentrant=use_reentrant)
        def region(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
            seen.append(ckptwrap.is_recomputing())
            return x.sin() * scale

        x = torch.randn(3, generator=torch.Generator().manual_seed(0), requires_grad=True)
        scale = torch.tensor(2.0, requires_grad=True)
        region(x, scale=scale).sum().backward()
        assert seen == [False, True]
        results.append((x.grad, scale.grad))

    x = torch.randn(3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    scale = torch.tensor(2.0, requires_grad=True)
    (x.sin() * scale).sum().backward()
    for x_grad, scale_grad in results:
        assert torch.equal(x_grad, x.grad)
        assert torch.equal(scale_grad, scale.grad)


def test_name_docstring_and_signature_are_kept():
    def original(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        """Scale the sine."""
        return x.sin() * scale

    decorated = checkpointed(original)
    assert decorated.__name__ == "original"
    assert decorated.__qualname__ == original.__qualname__
    assert decorated.__doc__ == "Scale the sine."
    assert decorated.__module__ == __name__
    assert inspect.signature(decorated) == inspect.signature(original)
    assert inspect.getsource(decorated) == inspect.getsource(original)
    assert inspect.isfunction(decorated)

    assert Recorder.forward.__name__ == "forward"
    assert inspect.getdoc(Recorder.forward) == "Linear, dropout, tanh."
    assert list(inspect.signature(Recorder.forward).parameters) == ["self", "x"]
    bound = Recorder().forward
    assert inspect.ismethod(bound)
    assert list(inspect.signature(bound).parameters) == ["x"]


def test_enabled_false_returns_the_original_function():
    def original(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    assert checkpointed(enabled=False)(original) is original
    assert checkpointed(enabled=False, use_reentrant=True)(original) is original


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_nothing_is_checkpointed_with_autograd_off(mode):
    block = Recorder()
    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(1)
    with mode():
        out = block(x)
    assert block.seen == [False]
    assert not out.requires_grad
    torch.manual_seed(1)
    with torch.no_grad():
        assert torch.equal(out, block.drop(block.lin(x)).tanh())


def test_nothing_is_checkpointed_inside_disabled():
    block = Recorder()
    x = torch.randn(3, 4, requires_grad=True)
    with disabled():
        out = block(x)
    out.sum().backward()
    assert block.seen == [False]
    # and the switch is back on afterwards
    block(x).sum().backward()
    assert block.seen == [False, False, True]


@pytest.mark.parametrize("checkpointed_cls", [CheckpointedBlock, ReentrantBlock], ids=["non-reentrant", "reentrant"])
def test_gradients_equal_the_undecorated_module_with_dropout(checkpointed_cls):
    torch.manual_seed(0)
    plain = Block()
    decorated = checkpointed_cls()
    decorated.load_state_dict(plain.state_dict())

    results = []
    for model in (plain, decorated):
        x = _input()
        torch.manual_seed(1)
        out = model(x)
        out.pow(2).sum().backward()
        results.append((out.detach(), x.grad, grads(model)))

    (out_p, x_grad_p, grads_p), (out_c, x_grad_c, grads_c) = results
    assert torch.equal(out_c, out_p)
    assert torch.equal(x_grad_c, x_grad_p)
    assert_same(grads_c, grads_p, "parameter gradients")


def test_gradients_equal_torch_utils_checkpoint():
    torch.manual_seed(0)
    decorated = CheckpointedBlock()
    reference = Block()
    reference.load_state_dict(decorated.state_dict())

    x = _input()
    torch.manual_seed(1)
    decorated(x).sum().backward()
    x_ref = _input()
    torch.manual_seed(1)
    torch_checkpoint.checkpoint(reference, x_ref, use_reentrant=False).sum().backward()

    assert torch.equal(x.grad, x_ref.grad)
    assert_same(grads(decorated), grads(reference), "parameter gradients")


def test_unknown_option_is_an_error_naming_it():
    with pytest.raises(CheckpointConfigError, match=r"use_reentrnt.*allowed: use_reentrant"):
        checkpointed(use_reentrnt=True)
    with pytest.raises(ckptwrap.CheckpointError, match="use_reentrnt"):
        checkpointed(use_reentrnt=True)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"use_reentrant": "yes"}, "use_reentrant must be True or False, got 'yes'"),
        ({"determinism_check": "strict"}, "determinism_check must be one of .*'strict'"),
        ({"enabled": 1}, "enabled must be True or False, got 1"),
    ],
)
def test_bad_option_values_are_errors(options, match):
    with pytest.raises(CheckpointConfigError, match=match):
        checkpointed(**options)


def test_decorating_something_not_callable_is_an_error():
    with pytest.raises(CheckpointConfigError, match="got int"):
        checkpointed(3)


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)).relu()


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_batchnorm_statistics_of_a_decorated_forward_are_updated_once(use_reentrant):
    class Decorated(NormBlock):
        forward = checkpointed(use_reentrant=use_reentrant)(NormBlock.forward)

    torch.manual_seed(0)
    plain = NormBlock()
    decorated = Decorated()
    decorated.load_state_dict(plain.state_dict())
    for model in (plain, decorated):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
        (model(x) * torch.arange(4.0)).sum().backward()
    assert_same(dict(decorated.named_buffers()), dict(plain.named_buffers()), "statistics")
    assert_same(grads(decorated), grads(plain), "gradients")

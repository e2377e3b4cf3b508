"""``@ckptwrap.checkpointed`` forwards that close over variables under ``torch.compile``: a
class made inside a function whose forward calls a closure variable's ``forward``, one
that calls ``super()`` (a ``__class__`` cell), one that closes over a function and a
number. Each compiles (``fullgraph=True``: no break), its graph holds the checkpoint of
every decorated block (the region is not seen through), and outputs and gradients equal
those of the uncompiled, undecorated model.

The ``aot_eager`` backend traces, partitions and recomputes like the default one without
generating code (see tests/test_compile.py)."""

from __future__ import annotations

import functools
from typing import Any, Callable, List

import pytest
import torch
from torch import nn

import ckptwrap
from _compiling import Recorder, fresh_compiler  # noqa: F401 (an autouse fixture)


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


def _calling_base(decorate: Callable[[Any], Any]) -> type:
    base = _Base

    class Block(base):  # type: ignore[misc, valid-type]
        @decorate
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return base.forward(self, x) * 0.5

    return Block


def _calling_super(decorate: Callable[[Any], Any]) -> type:
    class Block(_Base):
        @decorate
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 0.5

    return Block


def _closing_over_values(decorate: Callable[[Any], Any]) -> type:
    scale, activation = 0.5, torch.sigmoid

    class Block(_Base):
        @decorate
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return activation(_Base.forward(self, x)) * scale

    return Block


def _plain(fn: Any) -> Any:
    """What the decorated forward does, undecorated: a functools.wraps decorator."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


class _Stack(nn.Module):
    def __init__(self, block: type, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


@pytest.mark.parametrize("make", [_calling_base, _calling_super, _closing_over_values],
                         ids=["closure-over-base", "super", "closure-over-values"])
@pytest.mark.parametrize("decorate", [ckptwrap.checkpointed, ckptwrap.checkpointed(use_reentrant=True)],
                         ids=["non-reentrant", "reentrant"])
def test_a_decorated_forward_with_a_closure_compiles_and_trains_like_the_plain_model(make, decorate):
    torch.manual_seed(0)
    reference = _Stack(make(_plain))
    model = _Stack(make(decorate))
    model.load_state_dict(reference.state_dict())
    # Eagerly, the region recomputes (its closure and all) with the same gradients.
    calls: List[bool] = []
    handle = model.blocks[0].fc.register_forward_hook(lambda *_: calls.append(ckptwrap.is_recomputing()))
    x = torch.randn(4, 8)
    model(x).backward()
    reference(x).backward()
    handle.remove()
    assert calls == [False, True]
    for (name, param), plain in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.grad, plain.grad), name
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)

    backend = Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        expected_x, x = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = reference(expected_x)
        actual = compiled(x)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        expected.backward()
        actual.backward()
        torch.testing.assert_close(x.grad, expected_x.grad, rtol=1e-5, atol=1e-6)
        for (name, param), plain in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, plain.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert len(backend.graphs) == 1, "the second step recompiled"
    assert backend.checkpoints() == len(model.blocks), "a decorated block was not checkpointed"


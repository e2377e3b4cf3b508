"""What stays alive: intermediates, the region's function, and state after an exception."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import ckptwrap

VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]


class _Boom(Exception):
    pass


def _assert_autograd_saves_normally():
    """A plain forward after the region saves real tensors and backward works."""
    x = torch.randn(4, requires_grad=True)
    y = x.sin()
    saved = y.grad_fn._saved_self
    assert isinstance(saved, torch.Tensor) and torch.equal(saved, x)
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())
    assert ckptwrap.is_recomputing() is False


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_exception_in_forward_propagates_unchanged(use_reentrant):
    error = _Boom("inside the region")

    def fn(x):
        torch.sin(x)
        raise error

    with pytest.raises(_Boom) as info:
        ckptwrap.checkpoint(fn, torch.randn(3, requires_grad=True), use_reentrant=use_reentrant)
    assert info.value is error
    _assert_autograd_saves_normally()


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_exception_during_recompute_propagates_and_leaves_no_state(use_reentrant):
    def fn(x):
        y = torch.sin(x)
        if ckptwrap.is_recomputing():
            raise _Boom("during recomputation")
        return torch.cos(y)

    out = ckptwrap.checkpoint(fn, torch.randn(3, requires_grad=True), use_reentrant=use_reentrant)
    with pytest.raises(_Boom, match="during recomputation"):
        out.sum().backward()
    _assert_autograd_saves_normally()


def test_exception_leaves_saved_tensor_hooks_stack_as_it_was():
    packed = []

    def pack(t):
        packed.append(t)
        return t

    def fails(x):
        torch.sin(x)
        raise _Boom()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with pytest.raises(_Boom):
            ckptwrap.checkpoint(fails, torch.randn(2, requires_grad=True))
        packed.clear()
        x = torch.randn(3, requires_grad=True)
        y = torch.exp(x)  # exp saves its result
    assert len(packed) == 1 and packed[0] is not None
    assert torch.equal(y.grad_fn._saved_result, y)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_intermediates_are_freed_after_forward(use_reentrant):
    """The point of checkpointing: an activation saved by the plain run is not kept."""
    alive = {}
    for how in ["plain", "ours"]:
        refs = []
        w = torch.randn(6, 6, requires_grad=True)

        def fn(x):
            h = torch.tanh(x @ w)  # h is saved by the next mm in a plain run
            refs.append(weakref.ref(h))
            return h @ w

        x = torch.randn(4, 6, requires_grad=True)
        out = fn(x) if how == "plain" else ckptwrap.checkpoint(fn, x, use_reentrant=use_reentrant)
        gc.collect()
        alive[how] = refs[0]() is not None
        del out
    assert alive == {"plain": True, "ours": False}


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_no_intermediate_alive_after_backward(use_reentrant):
    refs = []
    w1 = torch.randn(5, 5, requires_grad=True)
    w2 = torch.randn(5, 5, requires_grad=True)

    def fn(x):
        a = x @ w1
        b = torch.tanh(a)
        c = torch.sigmoid(b @ w2)
        refs.extend(weakref.ref(t) for t in (a, b, c))
        return c * x

    x = torch.randn(3, 5, requires_grad=True)
    out = ckptwrap.checkpoint(fn, x, use_reentrant=use_reentrant)
    out.sum().backward()
    assert len(refs) == 6, "forward and recomputation both ran"
    del out
    gc.collect()
    assert [r() for r in refs] == [None] * 6


def test_intermediates_freed_after_backward_with_early_stop_and_nesting():
    refs = []
    w = torch.randn(4, 4, requires_grad=True)

    def inner(h):
        t = torch.tanh(h @ w)
        refs.append(weakref.ref(t))
        return t

    def outer(x):
        h = torch.sin(x @ w)
        refs.append(weakref.ref(h))
        return ckptwrap.checkpoint(inner, h) * 2.0

    x = torch.randn(3, 4, requires_grad=True)
    out = ckptwrap.checkpoint(outer, x)
    out.sum().backward()
    del out
    gc.collect()
    assert refs and all(r() is None for r in refs)


@pytest.mark.parametrize("backward", [True, False], ids=["after_backward", "forward_only"])
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_region_function_is_released(use_reentrant, backward):
    class Region:
        def __init__(self):
            self.w = torch.randn(3, 3, requires_grad=True)

        def __call__(self, x):
            return torch.tanh(x @ self.w)

    region = Region()
    ref = weakref.ref(region)
    out = ckptwrap.checkpoint(region, torch.randn(2, 3, requires_grad=True), use_reentrant=use_reentrant)
    if backward:
        out.sum().backward()
    del region, out
    gc.collect()
    assert ref() is None

"""With autograd off, checkpoint just calls the function once."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ckptwrap

VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]
GRAD_OFF = [pytest.param(torch.no_grad, id="no_grad"), pytest.param(torch.inference_mode, id="inference_mode")]


@pytest.mark.parametrize("grad_off", GRAD_OFF)
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_calls_function_once_and_returns_plain_result(use_reentrant, grad_off):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4, requires_grad=True)
    calls = []

    def fn(x):
        calls.append(ckptwrap.is_recomputing())
        return model(x)

    with grad_off():
        out = ckptwrap.checkpoint(fn, x, use_reentrant=use_reentrant)
        expected = model(x)
    assert calls == [False]
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, expected)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_no_grad_keeps_nested_outputs_as_returned(use_reentrant):
    x = torch.randn(3)
    with torch.no_grad():
        out = ckptwrap.checkpoint(lambda t: (t.sin(), [t.cos()]), x, use_reentrant=use_reentrant)
    assert isinstance(out, tuple) and isinstance(out[1], list)
    assert torch.equal(out[0], x.sin()) and torch.equal(out[1][0], x.cos())


def test_no_grad_with_keyword_arguments():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = ckptwrap.checkpoint(lambda t, *, scale: t * scale, x, scale=3.0)
    assert out.grad_fn is None
    assert torch.equal(out, x.detach() * 3.0)

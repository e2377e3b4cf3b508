"""The non-re-entrant variant behaves like plain autograd wherever plain autograd works."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest
import torch
import torch.nn as nn

import ckptwrap
from _models import assert_same, call, grads_of, tensor_leaves, weighted_loss

HOWS = ["plain", "torch", "ours"]


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _leaves(block, x):
    named = {f"param:{k}": p for k, p in block.named_parameters()}
    named["input:x"] = x
    return named


def _check_against_plain_and_torch(results):
    assert_same(results["ours"], results["plain"], "ours vs plain")
    assert_same(results["ours"], results["torch"], "ours vs torch")


def test_autograd_grad():
    results = {}
    for how in HOWS:
        block = _block()
        x = torch.randn(5, 4, requires_grad=True)
        out = call(how, block, x)
        names, tensors = zip(*_leaves(block, x).items())
        grads = torch.autograd.grad(weighted_loss(out), tensors)
        results[how] = dict(zip(names, grads))
        assert all(t.grad is None for t in tensors), "autograd.grad must not touch .grad"
    _check_against_plain_and_torch(results)


def test_backward_with_inputs_only_fills_those():
    results = {}
    for how in HOWS:
        block = _block()
        x = torch.randn(5, 4, requires_grad=True)
        out = call(how, block, x)
        weighted_loss(out).backward(inputs=[x, block[0].weight])
        results[how] = grads_of(_leaves(block, x))
    _check_against_plain_and_torch(results)
    assert results["ours"]["param:2.weight"] is None
    assert results["ours"]["input:x"] is not None


def test_retain_graph_then_second_backward_accumulates_twice():
    results, once = {}, {}
    for how in HOWS:
        block = _block()
        x = torch.randn(5, 4, requires_grad=True)
        loss = weighted_loss(call(how, block, x))
        loss.backward(retain_graph=True)
        once[how] = grads_of(_leaves(block, x))
        loss.backward()
        results[how] = grads_of(_leaves(block, x))
    _check_against_plain_and_torch(results)
    assert_same(once["ours"], once["plain"], "first backward")
    doubled = {k: 2 * g for k, g in once["ours"].items()}
    assert_same(results["ours"], doubled, "second backward accumulates")


def _fn_with_inner_grad(x, w):
    y = torch.sin(x * w)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    return gx * y + torch.cos(y)


@pytest.mark.parametrize("early_stop", [True, False])
def test_backward_inside_checkpointed_function(early_stop):
    results = {}
    for how in HOWS:
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        out = call(how, _fn_with_inner_grad, x, w, **({} if how == "plain" else {"early_stop": early_stop}))
        weighted_loss(out).backward()
        results[how] = grads_of({"x": x, "w": w})
    _check_against_plain_and_torch(results)


def _fn_with_options(x, factor, label, *, weight, shift=0.0, squash=True):
    assert label == "tag"
    h = (x @ weight) * factor + shift
    return torch.tanh(h) if squash else h


@pytest.mark.parametrize("squash", [True, False])
def test_keyword_and_non_tensor_arguments(squash):
    results = {}
    for how in HOWS:
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=True)
        weight = torch.randn(3, 2, requires_grad=True)
        out = call(how, _fn_with_options, x, 1.5, "tag", weight=weight, shift=0.25, squash=squash)
        weighted_loss(out).backward()
        results[how] = grads_of({"x": x, "weight": weight}) | {"out": out.detach()}
    _check_against_plain_and_torch(results)


@dataclass
class Pair:
    first: torch.Tensor
    second: List[torch.Tensor]


def _nested_outputs(x, y):
    a = torch.sin(x)
    b = x * y
    return (a, [b, {"c": torch.exp(y), "d": Pair(a * b, [torch.cos(b)])}], {"e": (y.tanh(),)})


def test_outputs_nested_in_tuples_lists_dicts_dataclasses():
    results = {}
    for how in ["plain", "ours"]:
        torch.manual_seed(0)
        x = torch.randn(3, 2, requires_grad=True)
        y = torch.randn(3, 2, requires_grad=True)
        out = call(how, _nested_outputs, x, y)
        assert isinstance(out[1][1]["d"], Pair)
        assert all(t.requires_grad for t in tensor_leaves(out))
        weighted_loss(out).backward()
        results[how] = grads_of({"x": x, "y": y})
    assert_same(results["ours"], results["plain"])


def test_inputs_that_do_not_require_grad():
    results = {}
    for how in HOWS:
        block = _block()
        x = torch.randn(5, 4)  # does not require grad
        mask = torch.rand(5, 3) > 0.5
        scale = torch.randn(5, 3, requires_grad=True)

        def fn(x, mask, scale):
            return block(x).masked_fill(mask, 0.0) * scale

        out = call(how, fn, x, mask, scale)
        weighted_loss(out).backward()
        named = {f"param:{k}": p for k, p in block.named_parameters()}
        results[how] = grads_of(named | {"scale": scale})
        assert x.grad is None
    _check_against_plain_and_torch(results)


def test_no_input_requires_grad_but_parameters_do():
    results = {}
    for how in HOWS:
        block = _block()
        x = torch.randn(5, 4)
        weighted_loss(call(how, block, x)).backward()
        results[how] = grads_of({k: p for k, p in block.named_parameters()})
    _check_against_plain_and_torch(results)


def test_nothing_requires_grad():
    block = _block().requires_grad_(False)
    x = torch.randn(5, 4)
    calls = []
    out = ckptwrap.checkpoint(lambda t: (calls.append(1), block(t))[1], x)
    assert not out.requires_grad and out.grad_fn is None
    assert calls == [1]
    assert torch.equal(out, block(x))


def _two_outputs(x, w):
    h = torch.tanh(x @ w)
    return torch.sin(h), torch.exp(h) * x.sum()


def test_partial_backward_through_one_output_then_the_other():
    results = {}
    for how in HOWS:
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        a, b = call(how, _two_outputs, x, w)
        weighted_loss(a).backward(retain_graph=True)
        first = grads_of({"x": x, "w": w})
        weighted_loss(b).backward()
        results[how] = {f"first:{k}": v for k, v in first.items()} | grads_of({"x": x, "w": w})
    _check_against_plain_and_torch(results)


def test_double_backward_through_region():
    results = {}
    for how in HOWS:
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        out = call(how, lambda x, w: torch.sin(x @ w) * x.pow(2).sum(), x, w)
        gx, gw = torch.autograd.grad(weighted_loss(out), (x, w), create_graph=True)
        (gx.pow(2).sum() + gw.sin().sum()).backward()
        results[how] = grads_of({"x": x, "w": w}) | {"gx": gx.detach(), "gw": gw.detach()}
    _check_against_plain_and_torch(results)


def test_input_modified_in_place_after_forward_is_detected():
    """Like a plain run, backward refuses an input that was changed after the forward."""
    for how in HOWS:
        base = torch.randn(3, 4, requires_grad=True)
        x = base * 1.0
        w = torch.randn(4, 4, requires_grad=True)
        out = call(how, lambda x, w: torch.sin(x @ w), x, w)
        x.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_output_is_an_input_passed_through():
    results = {}
    for how in HOWS:
        torch.manual_seed(0)
        x = torch.randn(3, requires_grad=True)
        out = call(how, lambda x: (x, torch.sin(x)), x)
        weighted_loss(out).backward()
        results[how] = grads_of({"x": x})
    _check_against_plain_and_torch(results)


def test_retain_graph_recomputes_once_per_backward_like_torch():
    calls = {}
    for how in ["torch", "ours"]:
        calls[how] = []
        block = _block()
        x = torch.randn(5, 4, requires_grad=True)
        loss = weighted_loss(call(how, lambda t: (calls[how].append(1), block(t))[1], x))
        loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()
    assert len(calls["ours"]) == len(calls["torch"]) == 4


def test_reading_a_saved_tensor_outside_backward():
    """Unpacking by hand (grad_fn._saved_*) recomputes and gives the plain run's value."""
    results = {}
    for how in HOWS:
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        out = call(how, lambda x, w: torch.sin(torch.tanh(x @ w)), x, w)
        saved = out.grad_fn._saved_self.clone()  # the tanh output, recomputed on demand
        weighted_loss(out).backward()
        results[how] = grads_of({"x": x, "w": w}) | {"saved": saved}
    _check_against_plain_and_torch(results)


def test_graph_exec_group_shares_one_recomputation():
    from torch.utils.checkpoint import GraphExecGroup

    results, calls = {}, {}
    for how in HOWS:
        torch.manual_seed(0)
        x = torch.randn(3, requires_grad=True)
        y = torch.randn(3, requires_grad=True)
        calls[how] = []

        def separate_branches(x, y):
            calls[how].append(1)
            return torch.sin(x), torch.exp(y)

        a, b = call(how, separate_branches, x, y)
        with GraphExecGroup():
            (gx,) = torch.autograd.grad(a.sum(), x)
            (gy,) = torch.autograd.grad(b.sum(), y)
        results[how] = {"x": gx, "y": gy}
    _check_against_plain_and_torch(results)
    assert len(calls["ours"]) == len(calls["torch"]) == 2


def test_forward_receives_the_callers_container_arguments():
    aux, cache = [], {}
    seen = []

    def fn(x, aux, *, cache):
        if not ckptwrap.is_recomputing():
            seen.append((aux, cache))
            aux.append(x.sum().detach())
            cache["hits"] = cache.get("hits", 0) + 1
        return x * 2.0

    x = torch.randn(3, requires_grad=True)
    out = ckptwrap.checkpoint(fn, x, aux, cache=cache)
    assert seen[0][0] is aux and seen[0][1] is cache
    assert len(aux) == 1 and cache == {"hits": 1}
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))

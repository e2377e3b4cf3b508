"""The re-entrant variant: where it goes beyond torch's, and the errors it gives."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import ckptwrap
from _models import assert_same, call, grads_of, weighted_loss


def _frozen_embedding_model():
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 6).requires_grad_(False)  # frozen base, as in LoRA
    block = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))  # trainable
    head = nn.Linear(6, 2)  # trainable and not checkpointed, so backward has something to do
    return embedding, block, head


def _lora_step(how):
    embedding, block, head = _frozen_embedding_model()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    hidden = embedding(ids)
    assert not hidden.requires_grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = head(call(how, block, hidden, use_reentrant=True))
    weighted_loss(out).backward()
    named = {f"block.{k}": p for k, p in block.named_parameters()}
    named |= {f"head.{k}": p for k, p in head.named_parameters()}
    return grads_of(named), [str(w.message) for w in caught]


def test_frozen_embedding_trap_is_real_in_torch():
    grads, messages = _lora_step("torch")
    assert any("requires_grad" in m for m in messages)
    assert all(grads[k] is None for k in grads if k.startswith("block."))
    assert all(grads[k] is not None for k in grads if k.startswith("head."))


def test_frozen_embedding_trap_keeps_parameter_grads():
    plain, _ = _lora_step("plain")
    ours, _ = _lora_step("ours")
    assert all(g is not None for g in plain.values())
    assert_same(ours, plain)


@dataclass
class State:
    hidden: torch.Tensor
    scale: float


@dataclass
class Output:
    value: torch.Tensor
    parts: list


def _nested_fn(inputs, state):
    a = torch.tanh(inputs["x"] @ inputs["pair"][0])
    b = a * inputs["pair"][1] + state.hidden * state.scale
    return Output(value=torch.sin(b), parts=[a.exp(), {"b": b}])


def _nested_step(how):
    torch.manual_seed(0)
    x, w, v, h = (torch.randn(*s, requires_grad=True) for s in [(3, 4), (4, 5), (5,), (3, 5)])
    out = call(how, _nested_fn, {"x": x, "pair": [w, v]}, State(h, 0.5), use_reentrant=True)
    assert isinstance(out, Output)
    weighted_loss(out).backward()
    return grads_of({"x": x, "w": w, "v": v, "h": h})


def test_tensors_nested_in_arguments_and_outputs_take_part_in_autograd():
    plain = _nested_step("plain")
    ours = _nested_step("ours")
    assert all(g is not None for g in plain.values())
    assert_same(ours, plain)


def test_keyword_arguments_are_rejected_naming_them():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"(?s)(?=.*\bscale\b)(?=.*\bshift\b)") as info:
        ckptwrap.checkpoint(lambda x, scale, shift: x * scale + shift, x, use_reentrant=True, scale=2.0, shift=1.0)
    assert isinstance(info.value, ckptwrap.CheckpointError)


def test_keyword_arguments_error_calls_nothing():
    calls = []
    with pytest.raises(ValueError, match="bias"):
        ckptwrap.checkpoint(lambda x, bias: calls.append(1), torch.ones(1), use_reentrant=True, bias=None)
    assert calls == []


@pytest.mark.parametrize("how", ["grad", "backward_inputs"])
def test_autograd_grad_is_rejected_with_guidance(how):
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    out = ckptwrap.checkpoint(lambda x: torch.tanh(x @ w), x, use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"(?s)(?=.*\.backward\(\))(?=.*use_reentrant=False)"):
        if how == "grad":
            torch.autograd.grad(out.sum(), x)
        else:
            out.sum().backward(inputs=[x])


def test_non_tensor_positional_arguments():
    results = {}
    for how in ["plain", "torch", "ours"]:
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        out = call(how, lambda x, p, mode: x.pow(p).sum(1) if mode == "sum" else x, x, 3, "sum", use_reentrant=True)
        weighted_loss(out).backward()
        results[how] = grads_of({"x": x})
    assert_same(results["ours"], results["plain"])
    assert_same(results["ours"], results["torch"])


def _frozen_block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh()).requires_grad_(False)


@pytest.mark.parametrize(
    "make_fn",
    [
        pytest.param(lambda: _frozen_block(), id="frozen_module"),
        pytest.param(lambda: torch.sin, id="builtin_function"),
        pytest.param(lambda: (lambda x: torch.relu(x) * 2.0), id="function_without_parameters"),
        pytest.param(lambda: (lambda x, block=_frozen_block(): block(x)), id="function_over_frozen_module"),
    ],
)
def test_output_requires_grad_like_plain_when_nothing_requires_grad(make_fn):
    """The frozen-embedding fix must not make every output require grad: with nothing
    trainable inside, the output is a constant, as in the plain run and in torch's variant."""
    fn = make_fn()
    x = torch.randn(2, 3)
    plain = fn(x)
    ours = ckptwrap.checkpoint(fn, x, use_reentrant=True)
    assert torch.equal(ours, plain)
    assert ours.requires_grad == plain.requires_grad == False  # noqa: E712


def test_retain_graph_then_second_backward_recomputes_again():
    results = {}
    for how in ["plain", "torch", "ours"]:
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        loss = weighted_loss(call(how, lambda x: torch.tanh(x @ w), x, use_reentrant=True))
        loss.backward(retain_graph=True)
        loss.backward()
        results[how] = grads_of({"x": x, "w": w})
    assert_same(results["ours"], results["plain"])
    assert_same(results["ours"], results["torch"])


def _mixed_outputs(x):
    y = torch.sin(x)
    return y, None, 3, torch.argmax(y, dim=1), x, {"cos": torch.cos(y)}


def test_outputs_with_none_integers_and_passed_through_inputs():
    results = {}
    for how in ["plain", "ours"]:
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        out = call(how, _mixed_outputs, x, use_reentrant=True)
        assert out[1] is None and out[2] == 3
        assert out[3].dtype == torch.int64 and not out[3].requires_grad
        assert torch.equal(out[3], torch.argmax(torch.sin(x), dim=1))
        weighted_loss(out).backward()
        results[how] = grads_of({"x": x}) | {"out0": out[0].detach(), "out4": out[4].detach()}
    assert_same(results["ours"], results["plain"])


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
def test_keyword_arguments_are_rejected_with_autograd_off_too(grad_off):
    """As torch does: the same call must not be valid in evaluation and invalid in training."""
    with grad_off(), pytest.raises(ValueError, match="scale"):
        ckptwrap.checkpoint(lambda x, scale: x * scale, torch.ones(2), use_reentrant=True, scale=2.0)


@dataclass
class Settings:
    factor: float


def test_forward_receives_the_callers_container_arguments():
    """Like torch's variant, the forward gets the very objects passed in, so its side effects
    on them (aux-loss lists, caches) reach the caller."""
    aux, cache, settings = [], {}, Settings(2.0)
    seen = []

    def fn(x, aux, cache, settings):
        if not ckptwrap.is_recomputing():
            seen.append((aux, cache, settings))
            aux.append(x.sum().detach())
            cache["hits"] = cache.get("hits", 0) + 1
        return x * settings.factor

    x = torch.randn(3, requires_grad=True)
    out = ckptwrap.checkpoint(fn, x, aux, cache, settings, use_reentrant=True)
    assert seen[0][0] is aux and seen[0][1] is cache and seen[0][2] is settings
    assert len(aux) == 1 and cache == {"hits": 1}
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


class _ScaleFunction(torch.autograd.Function):
    """A custom kernel with a trainable weight, as fused layers often are."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum(dim=(0, 1))


@pytest.mark.parametrize("kind", ["closure_over_module", "bound_method", "custom_function"])
def test_frozen_embedding_trap_with_other_kinds_of_region(kind):
    """Parameters reached through a closure, a bound method or a custom autograd Function
    still get their gradients when no input requires grad."""
    results = {}
    for how in ["plain", "ours"]:
        embedding, block, head = _frozen_embedding_model()
        scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        if kind == "closure_over_module":
            region = lambda h: block(h) * 2.0  # noqa: E731
        elif kind == "bound_method":
            region = block.forward
        else:
            region = lambda h: _ScaleFunction.apply(h, scale)  # noqa: E731
        hidden = embedding(torch.tensor([[1, 2, 3], [4, 5, 6]]))
        out = head(call(how, region, hidden, use_reentrant=True))
        weighted_loss(out).backward()
        named = {f"block.{k}": p for k, p in block.named_parameters()} | {"scale": scale}
        results[how] = grads_of(named)
    assert any(g is not None for g in results["plain"].values())
    assert_same(results["ours"], results["plain"])


@pytest.mark.parametrize(
    "region",
    [
        pytest.param(lambda x, w: x * w.detach(), id="detached"),
        pytest.param(lambda x, w: x * w.data + w.shape[0], id="data_and_shape"),
    ],
)
def test_reading_a_trainable_tensor_without_using_it_keeps_outputs_constant(region):
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3)
    plain = region(x, w)
    ours = ckptwrap.checkpoint(lambda t: region(t, w), x, use_reentrant=True)
    assert torch.equal(ours, plain)
    assert ours.requires_grad is plain.requires_grad is False

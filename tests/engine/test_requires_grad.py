"""Which outputs require grad: exactly those of the un-checkpointed run, output by output.

A region may take tensors that require grad and still return outputs that do not depend
on them (an input passed through, a branch under ``torch.no_grad()``, an integer result).
Such outputs must stay constants, as they are without checkpointing, in both engines.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ckptwrap

from _models import assert_same, call, grads_of, tensor_leaves, weighted_loss

VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]


def _passthrough(a, b):
    return a


def _mixed(a, b):
    return a * 2.0, torch.sin(b) * a


def _nested(a, b):
    return {"const": [a.exp(), a, (a.argmax(),)], "dep": (torch.cos(b), {"sum": a + b})}


def _no_grad_branch(a, b):
    with torch.no_grad():
        scale = b.abs().max()
    return a * scale, b * scale


def _input_requiring_grad_passed_through(a, b):
    return b, a


REGIONS = [
    pytest.param(_passthrough, id="output_is_an_input_without_grad"),
    pytest.param(_mixed, id="one_dependent_one_not"),
    pytest.param(_nested, id="nested_containers"),
    pytest.param(_no_grad_branch, id="no_grad_inside"),
    pytest.param(_input_requiring_grad_passed_through, id="input_with_grad_passed_through"),
]


def _inputs():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, generator=generator)
    b = torch.randn(3, 4, generator=generator, requires_grad=True)
    return a, b


def _flags(out):
    return [t.requires_grad for t in tensor_leaves(out)]


@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("region", REGIONS)
def test_each_output_requires_grad_as_in_the_plain_run(region, use_reentrant):
    results = {}
    for how in ["plain", "ours"]:
        a, b = _inputs()
        out = call(how, region, a, b, use_reentrant=use_reentrant)
        flags = _flags(out)
        values = {f"out{i}": t.detach() for i, t in enumerate(tensor_leaves(out))}
        if any(flags):
            weighted_loss(out).backward()
        results[how] = (flags, values | grads_of({"a": a, "b": b}))
    assert results["ours"][0] == results["plain"][0]
    assert_same(results["ours"][1], results["plain"][1])


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_backward_through_an_output_without_grad_fails_as_in_the_plain_run(use_reentrant):
    for how in ["plain", "ours"]:
        a, b = _inputs()
        out = call(how, _passthrough, a, b, use_reentrant=use_reentrant)
        with pytest.raises(RuntimeError, match="does not require grad"):
            out.sum().backward()


def _frozen_input_step(how, use_reentrant):
    """No input requires grad; one output uses a trainable layer, the other does not."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    out = call(how, lambda h: (h * 2.0, {"y": layer(h)}), x, use_reentrant=use_reentrant)
    flags = _flags(out)
    weighted_loss(out).backward()
    return flags, grads_of(dict(layer.named_parameters()))


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_frozen_input_keeps_parameter_grads_and_marks_only_their_outputs(use_reentrant):
    plain_flags, plain = _frozen_input_step("plain", use_reentrant)
    our_flags, ours = _frozen_input_step("ours", use_reentrant)
    assert our_flags == plain_flags == [False, True]
    assert all(g is not None for g in plain.values())
    assert_same(ours, plain)


def test_reentrant_forward_runs_in_the_grad_mode_of_the_plain_run():
    """The forward sees autograd on, as the plain run and the recomputation do, so code that
    branches on ``torch.is_grad_enabled()`` takes the same branch all three times."""
    seen = []

    def region(x):
        seen.append(torch.is_grad_enabled())
        return x * 2.0

    ckptwrap.checkpoint(region, torch.randn(3, requires_grad=True), use_reentrant=True).sum().backward()
    assert seen == [True, True]


def test_tensor_leaving_a_reentrant_region_by_side_effect_fails_clearly():
    """Only the outputs of a re-entrant region are differentiable (its forward keeps no
    activations). A tensor that leaves another way fails loudly when backward reaches
    what it would have needed, rather than silently getting no gradient."""
    stash = []
    w = torch.randn(4, 4, requires_grad=True)

    def region(x):
        h = torch.tanh(x @ w)
        stash.append((h * h).sum())  # an auxiliary loss kept on the side
        return h

    x = torch.randn(2, 4, requires_grad=True)
    out = ckptwrap.checkpoint(region, x, use_reentrant=True)
    with pytest.raises(ckptwrap.CheckpointError, match=r"(?s)use_reentrant=True.*Return the tensor.*use_reentrant=False"):
        (out.sum() + stash[0]).backward()

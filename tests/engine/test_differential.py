"""Outputs and every gradient of the corpus equal the un-checkpointed run and torch's checkpoint."""

from __future__ import annotations

import pytest
import torch

from _models import CORPUS, assert_close_to_rounding, assert_same, call, run_case, weighted_loss

VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]
CASES = [pytest.param(case, id=case.name) for case in CORPUS]


def test_corpus_is_broad_enough():
    assert len(CORPUS) >= 6


@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_equal_to_plain_run(case, use_reentrant):
    if use_reentrant and not case.reentrant:
        pytest.skip("keyword arguments are not supported by the re-entrant variant")
    plain = run_case(case, "plain")
    ours = run_case(case, "ours", use_reentrant=use_reentrant)
    assert ours.structure == plain.structure
    assert_same(ours.outputs, plain.outputs, "outputs")
    assert_same(ours.grads, plain.grads, "gradients")
    assert all(g is not None for g in ours.grads.values()), "every parameter and input gets a gradient"


@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_equal_to_torch_checkpoint(case, use_reentrant):
    if use_reentrant and not case.torch_reentrant:
        pytest.skip("torch's re-entrant variant does not support this case")
    reference = run_case(case, "torch", use_reentrant=use_reentrant)
    ours = run_case(case, "ours", use_reentrant=use_reentrant)
    assert ours.structure == reference.structure
    assert_same(ours.outputs, reference.outputs, "outputs")
    assert_same(ours.grads, reference.grads, "gradients")
    # BatchNorm running statistics are updated again by the recomputation, in torch and
    # in ours alike, so they are compared with torch's checkpoint and not with the plain run.
    assert_same(ours.buffers, reference.buffers, "buffers")



def _tied_weight_step(how, use_reentrant):
    """A weight used inside the checkpointed region and outside it (tied embeddings)."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def region(h):
        return torch.tanh(h @ w) @ w

    h = torch.sin(x @ w)
    h = region(h) if how == "plain" else call(how, region, h, use_reentrant=use_reentrant)
    ((h @ w).sum() + (h * h).sum()).backward()
    return {"w": w.grad, "x": x.grad}


def test_weight_shared_with_outside_non_reentrant_is_bit_exact():
    assert_same(_tied_weight_step("ours", False), _tied_weight_step("plain", False))
    assert_same(_tied_weight_step("ours", False), _tied_weight_step("torch", False))


def test_weight_shared_with_outside_reentrant():
    """The re-entrant variant accumulates the region's share of a shared weight's gradient in
    its own backward call, so the summation order differs from the plain run (torch's too):
    equal to torch's bit for bit, and to the plain run up to rounding."""
    ours = _tied_weight_step("ours", True)
    assert_same(ours, _tied_weight_step("torch", True))
    assert_close_to_rounding(ours, _tied_weight_step("plain", True))


def _residual_step(how, use_reentrant):
    """A residual input used twice inside the checkpointed region and once outside it."""
    torch.manual_seed(0)
    w1 = torch.randn(8, 8, requires_grad=True)
    w2 = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def body(h):
        return torch.tanh(h @ w1) @ w2 + torch.sin(h)

    h = torch.layer_norm(x, (8,))
    out = body(h) if how == "plain" else call(how, body, h, use_reentrant=use_reentrant)
    weighted_loss(torch.tanh(h + out)).backward()
    return {"x": x.grad, "w1": w1.grad, "w2": w2.grad}


def test_residual_input_used_inside_and_outside_reentrant_region_equals_torch():
    """The region's input gets gradient from inside (twice) and outside: the re-entrant
    engine sums those parts as torch's re-entrant variant does, bit for bit."""
    ours = _residual_step("ours", True)
    assert_same(ours, _residual_step("torch", True))
    assert_close_to_rounding(ours, _residual_step("plain", True))


def test_residual_input_used_inside_and_outside_non_reentrant_region_is_bit_exact():
    assert_same(_residual_step("ours", False), _residual_step("plain", False))


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_inside_users_saved_tensor_hooks(use_reentrant):
    """A region inside torch.autograd.graph.save_on_cpu (offloading) still gives plain gradients."""
    case = next(c for c in CORPUS if c.name == "transformer_dropout")
    with torch.autograd.graph.save_on_cpu():
        plain = run_case(case, "plain")
        ours = run_case(case, "ours", use_reentrant=use_reentrant)
    assert_same(ours.grads, plain.grads)

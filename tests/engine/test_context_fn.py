"""context_fn: torch's selective activation checkpointing contexts work with ckptwrap."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ckptwrap
from _models import OpLog, assert_same, grads_of, weighted_loss


def _fn(x, w1, w2):
    h = torch.relu(x @ w1)
    return torch.sin(h @ w2) * 2.0


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(*s, requires_grad=True) for s in [(3, 4), (4, 6), (6, 2)]]


def _save_mm():
    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])


def _step(how, **options):
    tensors = _inputs()
    if how == "plain":
        out = _fn(*tensors)
    elif how == "torch":
        out = torch.utils.checkpoint.checkpoint(_fn, *tensors, use_reentrant=False, **options)
    else:
        out = ckptwrap.checkpoint(_fn, *tensors, **options)
    log = OpLog()
    with log:
        weighted_loss(out).backward()
    return log, grads_of(dict(zip(["x", "w1", "w2"], tensors)))


def test_selective_checkpoint_gradients_equal_plain_and_torch():
    _, plain = _step("plain")
    _, reference = _step("torch", context_fn=_save_mm)
    _, ours = _step("ours", context_fn=_save_mm)
    assert_same(ours, plain)
    assert_same(ours, reference)


def test_saved_ops_are_not_recomputed():
    log, _ = _step("ours", context_fn=_save_mm, early_stop=False)
    assert log.recompute_count("mm") == 0, log.recompute
    assert log.recompute_count("relu") == 1 and log.recompute_count("sin") == 1, log.recompute


def test_without_policy_mm_is_recomputed():
    """Guards the test above: the count does see recomputed mm ops."""
    log, _ = _step("ours", early_stop=False)
    assert log.recompute_count("mm") == 2, log.recompute

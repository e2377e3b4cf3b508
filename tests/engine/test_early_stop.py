"""Early stop: the recomputation ends once every tensor backward needs has been rebuilt."""

from __future__ import annotations

import contextlib

import pytest
import torch

import ckptwrap
from _models import OpLog, assert_same, grads_of, weighted_loss

TAIL_OPS = {"neg", "add", "mul"}  # the ops after the last saved tensor in _tail_fn


def _tail_fn(x, w1, w2):
    """Saving ops first (mm, tanh, mm), then a tail of ops that save nothing."""
    h = torch.tanh(x @ w1)
    y = h @ w2
    return (y + 1.0).neg() * 3.0


def _extra_outputs_fn(x, w1, w2):
    """The last saved tensor comes before outputs that need nothing for backward."""
    h = torch.tanh(x @ w1)
    y = h @ w2
    return y, y.neg(), y + 2.0


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(*s, requires_grad=True) for s in [(3, 4), (4, 5), (5, 2)]]


def _step(fn, context=contextlib.nullcontext(), **options):
    """Checkpointed forward (inside ``context``) and backward; the ops recomputed and grads."""
    tensors = _inputs()
    log = OpLog()
    with context:
        out = ckptwrap.checkpoint(fn, *tensors, **options)
    with log:
        weighted_loss(out).backward()
    return log, grads_of(dict(zip("abc", tensors)))


def _plain_grads(fn):
    tensors = _inputs()
    weighted_loss(fn(*tensors)).backward()
    return grads_of(dict(zip("abc", tensors)))


@pytest.mark.parametrize("fn", [_tail_fn, _extra_outputs_fn])
def test_per_call_early_stop_runs_fewer_ops(fn):
    stopped, stopped_grads = _step(fn, early_stop=True)
    full, full_grads = _step(fn, early_stop=False)
    assert len(stopped.recompute) < len(full.recompute), (stopped.recompute, full.recompute)
    assert "neg" in full.recompute and "neg" not in stopped.recompute
    assert "tanh" in stopped.recompute, "early stop must still rebuild the saved tensors"
    assert full.recompute_count("mm") == 2
    plain = _plain_grads(fn)
    assert_same(stopped_grads, plain)
    assert_same(full_grads, plain)


def test_default_is_early_stop():
    default, _ = _step(_tail_fn)
    stopped, _ = _step(_tail_fn, early_stop=True)
    assert default.recompute == stopped.recompute


def test_without_early_stop_the_whole_function_is_recomputed():
    full, _ = _step(_tail_fn, early_stop=False)
    assert TAIL_OPS <= set(full.recompute)


@pytest.mark.parametrize("fn", [_tail_fn, _extra_outputs_fn])
def test_context_manager_disables_early_stop(fn):
    stopped, _ = _step(fn)
    full, full_grads = _step(fn, context=ckptwrap.set_checkpoint_early_stop(False))
    assert len(stopped.recompute) < len(full.recompute)
    assert "neg" in full.recompute
    assert_same(full_grads, _plain_grads(fn))


def test_context_manager_enables_early_stop():
    stopped, _ = _step(_tail_fn, context=ckptwrap.set_checkpoint_early_stop(True))
    full, _ = _step(_tail_fn, early_stop=False)
    assert len(stopped.recompute) < len(full.recompute)


def test_explicit_argument_wins_over_context():
    off_ctx_on_arg, _ = _step(_tail_fn, context=ckptwrap.set_checkpoint_early_stop(False), early_stop=True)
    on_ctx_off_arg, _ = _step(_tail_fn, context=ckptwrap.set_checkpoint_early_stop(True), early_stop=False)
    stopped, _ = _step(_tail_fn, early_stop=True)
    full, _ = _step(_tail_fn, early_stop=False)
    assert off_ctx_on_arg.recompute == stopped.recompute
    assert on_ctx_off_arg.recompute == full.recompute


def test_context_applies_where_the_forward_ran():
    """The setting is taken when the forward runs; a context around backward changes nothing."""
    tensors = _inputs()
    out = ckptwrap.checkpoint(_tail_fn, *tensors)  # forward with the default (early stop)
    log = OpLog()
    with ckptwrap.set_checkpoint_early_stop(False), log:
        weighted_loss(out).backward()
    stopped, _ = _step(_tail_fn, early_stop=True)
    assert log.recompute == stopped.recompute


def test_context_is_restored_on_exit_and_on_error():
    with ckptwrap.set_checkpoint_early_stop(False):
        pass
    after_exit, _ = _step(_tail_fn)
    with pytest.raises(KeyError):
        with ckptwrap.set_checkpoint_early_stop(False):
            raise KeyError("boom")
    after_error, _ = _step(_tail_fn)
    stopped, _ = _step(_tail_fn, early_stop=True)
    assert after_exit.recompute == stopped.recompute
    assert after_error.recompute == stopped.recompute


def test_nested_contexts():
    with ckptwrap.set_checkpoint_early_stop(False):
        with ckptwrap.set_checkpoint_early_stop(True):
            inner, _ = _step(_tail_fn)
        outer, _ = _step(_tail_fn)
    stopped, _ = _step(_tail_fn, early_stop=True)
    full, _ = _step(_tail_fn, early_stop=False)
    assert inner.recompute == stopped.recompute
    assert outer.recompute == full.recompute

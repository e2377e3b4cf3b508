"""State around a region: RNG, autocast, the early-stop context variable, is_recomputing()."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptwrap
from _models import OpLog, assert_same, call, grads_of, weighted_loss

VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --------------------------------------------------------------------------- RNG


def _dropout_model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.GELU(), nn.Linear(16, 4), nn.Dropout(0.3)).to(device)


def _dropout_step(how, use_reentrant=False, device="cpu", **options):
    model = _dropout_model(device)
    x = torch.randn(8, 6, device=device, requires_grad=True)
    torch.manual_seed(123)
    out = call(how, model, x, use_reentrant=use_reentrant, **options)
    weighted_loss(out).backward()
    named = {f"param:{k}": p for k, p in model.named_parameters()} | {"input:x": x}
    return grads_of(named)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_dropout_gradients_bit_identical_when_rng_preserved(use_reentrant):
    plain = _dropout_step("plain")
    ours = _dropout_step("ours", use_reentrant, preserve_rng_state=True)
    assert_same(ours, plain)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_dropout_gradients_differ_without_rng_preservation(use_reentrant):
    """Shows the test above can fail: without preserved RNG the recomputed masks differ."""
    plain = _dropout_step("plain")
    ours = _dropout_step("ours", use_reentrant, preserve_rng_state=False)
    assert any(not torch.equal(ours[k], plain[k]) for k in plain)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_surrounding_rng_state_is_left_as_by_plain_run(use_reentrant):
    states = {}
    for how in ["plain", "ours"]:
        _dropout_step(how, use_reentrant)
        states[how] = torch.get_rng_state()
        states[how + "_next"] = torch.rand(4)
    assert torch.equal(states["ours"], states["plain"])
    assert torch.equal(states["ours_next"], states["plain_next"])


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _autocast_step(how, use_reentrant, forward_ctx=_bf16, backward_ctx=contextlib.nullcontext):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    with forward_ctx():
        out = call(how, model, x, use_reentrant=use_reentrant)
    # backward runs outside the forward's autocast: the recomputation must restore it
    with backward_ctx():
        weighted_loss(out).backward()
    named = {f"param:{k}": p for k, p in model.named_parameters()} | {"input:x": x}
    return out.dtype, grads_of(named)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_autocast_state_is_restored_for_recompute(use_reentrant):
    plain_dtype, plain = _autocast_step("plain", use_reentrant)
    our_dtype, ours = _autocast_step("ours", use_reentrant)
    _, reference = _autocast_step("torch", use_reentrant)
    assert plain_dtype == our_dtype == torch.bfloat16
    assert_same(ours, plain)
    assert_same(ours, reference)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_autocast_entered_only_around_backward_is_not_applied_to_recompute(use_reentrant):
    """The recomputation uses the forward's autocast state, not the one active in backward."""
    options = {"forward_ctx": contextlib.nullcontext, "backward_ctx": _bf16}
    plain_dtype, plain = _autocast_step("plain", use_reentrant, **options)
    our_dtype, ours = _autocast_step("ours", use_reentrant, **options)
    assert plain_dtype == our_dtype == torch.float32
    assert_same(ours, plain)


def test_cpu_checkpoint_does_not_initialize_cuda():
    """Run in a fresh interpreter so that no other test's CUDA use can hide a regression."""
    script = textwrap.dedent(
        """
        import torch, ckptwrap
        lin = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        for reentrant in (False, True):
            ckptwrap.checkpoint(lin, x, use_reentrant=reentrant).sum().backward()
        ckptwrap.checkpoint_sequential([lin, torch.nn.Dropout(0.1), lin], 2, x).sum().backward()
        print("initialized", torch.cuda.is_initialized())
        """
    )
    # The child must import the same ckptwrap as this process, installed or not.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(ckptwrap.__file__)))
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "initialized False" in result.stdout


@requires_cuda
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_cuda_dropout_gradients_bit_identical(use_reentrant):
    plain = _dropout_step("plain", device="cuda")
    ours = _dropout_step("ours", use_reentrant, device="cuda")
    assert_same(ours, plain)


@requires_cuda
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_cuda_rng_state_left_as_by_plain_run(use_reentrant):
    states = {}
    for how in ["plain", "ours"]:
        _dropout_step(how, use_reentrant, device="cuda")
        states[how] = torch.cuda.get_rng_state()
    assert torch.equal(states["ours"], states["plain"])


@requires_cuda
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_cuda_autocast_state_is_restored(use_reentrant):
    results = {}
    for how in ["plain", "ours"]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).cuda()
        x = torch.randn(5, 8, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = call(how, model, x, use_reentrant=use_reentrant)
        weighted_loss(out).backward()
        results[how] = grads_of({k: p for k, p in model.named_parameters()} | {"x": x})
    assert_same(results["ours"], results["plain"])


# --------------------------------------------------------------------------- early-stop context


def _tail_fn(x, w):
    y = torch.tanh(x @ w)
    return (y * 2.0).neg() + 1.0


def _recompute_ops():
    """Forward under the caller's context, then backward; the ops that were recomputed."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    out = ckptwrap.checkpoint(_tail_fn, x, w)
    log = OpLog()
    with log:
        out.sum().backward()
    return log.recompute


def test_threads_do_not_share_the_early_stop_setting():
    barrier = threading.Barrier(2, timeout=30)
    results, errors = {}, []

    def worker(name, disable):
        try:
            if disable:
                with ckptwrap.set_checkpoint_early_stop(False):
                    barrier.wait()  # both threads are now inside their contexts
                    results[name] = _recompute_ops()
                    barrier.wait()  # the other thread ran its forward while this context was active
            else:
                barrier.wait()
                results[name] = _recompute_ops()
                barrier.wait()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=("off", True)), threading.Thread(target=worker, args=("default", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert "neg" in results["off"]
    assert "neg" not in results["default"]
    assert len(results["default"]) < len(results["off"])


def test_new_thread_sees_the_default():
    results = {}
    with ckptwrap.set_checkpoint_early_stop(False):
        results["main"] = _recompute_ops()
        thread = threading.Thread(target=lambda: results.__setitem__("thread", _recompute_ops()))
        thread.start()
        thread.join(timeout=60)
    assert "neg" in results["main"]
    assert "neg" not in results["thread"]


def test_asyncio_tasks_do_not_share_the_early_stop_setting():
    async def main():
        entered = asyncio.Event()
        other_done = asyncio.Event()
        results = {}

        async def disabled():
            with ckptwrap.set_checkpoint_early_stop(False):
                entered.set()
                await other_done.wait()  # the other task runs while this context is active
                results["off"] = _recompute_ops()

        async def default():
            await entered.wait()
            results["default"] = _recompute_ops()
            other_done.set()

        await asyncio.wait_for(asyncio.gather(disabled(), default()), timeout=60)
        return results

    results = asyncio.run(main())
    assert "neg" in results["off"]
    assert "neg" not in results["default"]


# --------------------------------------------------------------------------- is_recomputing


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_is_recomputing_only_during_recomputation(use_reentrant):
    seen = []

    def fn(x):
        seen.append(ckptwrap.is_recomputing())
        return torch.sin(x).exp()

    x = torch.randn(3, requires_grad=True)
    assert ckptwrap.is_recomputing() is False
    out = ckptwrap.checkpoint(fn, x, use_reentrant=use_reentrant)
    assert seen == [False]
    assert ckptwrap.is_recomputing() is False
    out.sum().backward()
    assert seen == [False, True]
    assert ckptwrap.is_recomputing() is False


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_is_recomputing_in_nested_regions(use_reentrant):
    seen = {"outer": [], "inner": []}

    def inner(h):
        seen["inner"].append(ckptwrap.is_recomputing())
        return torch.sin(h)

    def outer(x):
        seen["outer"].append(ckptwrap.is_recomputing())
        return torch.cos(ckptwrap.checkpoint(inner, torch.exp(x), use_reentrant=use_reentrant))

    x = torch.randn(3, requires_grad=True)
    out = ckptwrap.checkpoint(outer, x, use_reentrant=use_reentrant)
    assert seen == {"outer": [False], "inner": [False]}
    out.sum().backward()
    assert seen["outer"] == [False, True]
    assert seen["inner"][0] is False and all(seen["inner"][1:]) and len(seen["inner"]) >= 2
    assert ckptwrap.is_recomputing() is False


def test_is_recomputing_false_in_plain_backward_hooks():
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = torch.sin(x)
    y.register_hook(lambda g: seen.append(ckptwrap.is_recomputing()))
    ckptwrap.checkpoint(torch.cos, y).sum().backward()
    assert seen == [False]


def test_side_effects_can_be_skipped_during_recompute():
    """The use the spec names: user code skips side effects while recomputing."""
    updates = []

    def fn(x):
        if not ckptwrap.is_recomputing():
            updates.append(1)
        return F.gelu(x) * x

    x = torch.randn(4, requires_grad=True)
    ckptwrap.checkpoint(fn, x).sum().backward()
    assert updates == [1]


def test_is_recomputing_is_not_seen_by_other_threads():
    """While one thread recomputes, another thread's code is not recomputing."""
    inside_recompute = threading.Event()
    other_checked = threading.Event()
    seen = {}

    def fn(x):
        if ckptwrap.is_recomputing():
            inside_recompute.set()
            other_checked.wait(timeout=30)
        return torch.sin(x)

    def observer():
        inside_recompute.wait(timeout=30)
        seen["other_thread"] = ckptwrap.is_recomputing()
        other_checked.set()

    thread = threading.Thread(target=observer)
    thread.start()
    ckptwrap.checkpoint(fn, torch.randn(3, requires_grad=True)).sum().backward()
    thread.join(timeout=60)
    assert inside_recompute.is_set()
    assert seen == {"other_thread": False}


def _model_and_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2))
    return model, torch.randn(8, 6, requires_grad=True)


def _training_steps(model, x, use_reentrant, checkpointed, barrier=None):
    if barrier is not None:
        barrier.wait()
    for _ in range(5):
        out = ckptwrap.checkpoint(model, x, use_reentrant=use_reentrant) if checkpointed else model(x)
        weighted_loss(out).backward()
    return grads_of({k: p for k, p in model.named_parameters()} | {"x": x})


def test_concurrent_training_steps_in_two_threads():
    """Two threads checkpointing and backpropagating at the same time get plain gradients.

    Models are built in this thread: the global RNG is shared, so seeding in each thread races.
    """
    barrier = threading.Barrier(2, timeout=30)
    results, errors = {}, []
    setups = {flag: _model_and_input() for flag in (False, True)}

    def worker(use_reentrant):
        try:
            results[use_reentrant] = _training_steps(*setups[use_reentrant], use_reentrant, True, barrier)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(flag,)) for flag in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    plain = _training_steps(*_model_and_input(), False, False)
    assert_same(results[False], plain, "non-reentrant thread")
    assert_same(results[True], plain, "reentrant thread")

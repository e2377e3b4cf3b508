"""The core engine on CUDA: RNG replay, autocast, nesting, and CPU regions leaving CUDA alone.

Each test compares ckptwrap with the plain run and with torch.utils.checkpoint on the
same inputs. Without CUDA every test here is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckptwrap
from _cuda_helpers import VARIANTS, assert_same, grads, requires_cuda, run, weighted_sum

pytestmark = requires_cuda


def _dropout_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.5), nn.GELU(), nn.Linear(256, 64), nn.Dropout(0.3)).cuda()


def _dropout_grads(how, use_reentrant):
    net = _dropout_net()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    torch.manual_seed(123)  # also seeds CUDA
    out = run(how, net, x, use_reentrant=use_reentrant)
    weighted_sum(out).backward()
    return grads({**{f"param:{k}": p for k, p in net.named_parameters()}, "input": x}), torch.cuda.get_rng_state()


def test_plain_cuda_runs_are_reproducible():
    """The ground the other tests stand on: two plain runs agree bit for bit."""
    first, _ = _dropout_grads("plain", False)
    second, _ = _dropout_grads("plain", False)
    assert_same(second, first, "two plain runs")


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_dropout_gradients_bit_identical_with_cuda_rng_replay(use_reentrant):
    plain, plain_rng = _dropout_grads("plain", use_reentrant)
    ours, our_rng = _dropout_grads("ours", use_reentrant)
    theirs, _ = _dropout_grads("torch", use_reentrant)
    assert_same(ours, plain, "ckptwrap vs plain")
    assert_same(ours, theirs, "ckptwrap vs torch.utils.checkpoint")
    assert torch.equal(our_rng, plain_rng), "the CUDA generator is left where the plain run leaves it"


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_nested_checkpoints_replay_cuda_dropout(use_reentrant):
    def run_all(how):
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.4), nn.Tanh()).cuda()
        outer_lin = nn.Linear(64, 64).cuda()
        x = torch.randn(16, 64, device="cuda", requires_grad=True)

        def outer(h):
            h = F.dropout(outer_lin(h), 0.3, training=True)
            return run(how, inner, h, use_reentrant=use_reentrant).exp()

        torch.manual_seed(7)
        weighted_sum(run(how, outer, x, use_reentrant=use_reentrant)).backward()
        named = {**{f"inner.{k}": p for k, p in inner.named_parameters()}, "outer.weight": outer_lin.weight, "x": x}
        return grads(named)

    plain = run_all("plain")
    assert_same(run_all("ours"), plain, "nested ckptwrap vs plain")
    assert_same(run_all("torch"), plain, "nested torch vs plain")


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_region_with_cpu_and_cuda_inputs_replays_both_generators(use_reentrant):
    def run_all(how):
        torch.manual_seed(0)
        a = torch.randn(8, 32, requires_grad=True)
        b = torch.randn(8, 32, device="cuda", requires_grad=True)

        def fn(cpu, gpu):
            # One dropout draws from the CPU generator, the other from the CUDA one.
            return F.dropout(cpu, 0.5, training=True).cuda() * F.dropout(gpu, 0.5, training=True).sin()

        torch.manual_seed(3)
        weighted_sum(run(how, fn, a, b, use_reentrant=use_reentrant)).backward()
        return grads({"cpu": a, "cuda": b})

    plain = run_all("plain")
    assert_same(run_all("ours"), plain, "ckptwrap vs plain")
    assert_same(run_all("torch"), plain, "torch vs plain")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_recomputation_runs_under_the_forward_autocast(use_reentrant, dtype):
    def run_all(how):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.LayerNorm(128), nn.Linear(128, 16)).cuda()
        x = torch.randn(32, 64, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=dtype):
            out = run(how, net, x, use_reentrant=use_reentrant)
        # Backward outside autocast: a recomputation that forgot it would run in float32
        # and hand float32 tensors to backward formulas that expect `dtype`.
        weighted_sum(out).backward()
        return out.dtype, grads({**{f"param:{k}": p for k, p in net.named_parameters()}, "x": x})

    plain_dtype, plain = run_all("plain")
    our_dtype, ours = run_all("ours")
    _, theirs = run_all("torch")
    assert plain_dtype == our_dtype == dtype
    assert_same(ours, theirs, "ckptwrap vs torch.utils.checkpoint")
    assert_same(ours, plain, "ckptwrap vs plain")


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_autocast_entered_only_for_backward_does_not_reach_the_recomputation(use_reentrant):
    def run_all(how):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda()
        x = torch.randn(16, 32, device="cuda", requires_grad=True)
        out = run(how, net, x, use_reentrant=use_reentrant)
        with torch.autocast("cuda", dtype=torch.float16):
            weighted_sum(out).backward()
        return grads({**{k: p for k, p in net.named_parameters()}, "x": x})

    assert_same(run_all("ours"), run_all("plain"), "ckptwrap vs plain")


def test_cpu_only_work_never_initializes_cuda():
    """In a fresh interpreter, on a machine that has CUDA: checkpoints, wrap_model (blocks,
    offload, a budget plan) and the CPU meter on CPU tensors leave CUDA uninitialised."""
    script = textwrap.dedent(
        """
        import sys, torch, ckptwrap
        from ckptwrap.measure import measure_peak
        sys.path.insert(0, sys.argv[1])
        from gpt import GPT, GPTConfig, synthetic_batch
        lin = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        for reentrant in (False, True):
            ckptwrap.checkpoint(lin, x, use_reentrant=reentrant).sum().backward()
        ckptwrap.checkpoint_sequential([lin, torch.nn.Dropout(0.1), lin], 2, x).sum().backward()
        config = GPTConfig(width=32, heads=2, layers=4, seq_len=16, vocab=64)
        batch = synthetic_batch(config, 2)
        for policy in ("blocks", "blocks;offload", "blocks;selective"):
            model = ckptwrap.wrap_model(GPT(config), policy)
            with measure_peak("cpu"):
                model(*batch).backward()
        model = ckptwrap.wrap_model(GPT(config), "budget:90%", example_inputs=batch)
        model(*batch).backward()
        print("initialized", torch.cuda.is_initialized())
        """
    )
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(ckptwrap.__file__)))
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path)
    result = subprocess.run(
        [sys.executable, "-c", script, examples], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "initialized False" in result.stdout

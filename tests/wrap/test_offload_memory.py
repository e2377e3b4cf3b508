"""What the offload tier holds, on the CPU (``_offload_lanes``): the host pool stays
bounded while shapes change step after step; parameters cast by autocast stay on the
device instead of crossing the link twice a step; a nested FSDP unit is refused.
Gradients always equal the plain model's, bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import CheckpointConfigError
from ckptwrap.wrap import _offload
from ckptwrap.wrap._offload import HostPool
from ._offload_lanes import cpu_offloader

from ._models import assert_same
from .test_offload_passes import _blocks, _forward, _grads, _input

_LENGTHS = [4 + (7 * step) % 29 for step in range(30)]  # every length from 4 to 32, shuffled


def _train(offloader, lengths):
    """Steps at the given sequence lengths; after each, what the pool holds and the bytes
    the step offloaded."""
    blocks = _blocks()
    seen = []
    for step, seq in enumerate(lengths):
        x = _input(seq=seq, seed=step)
        _forward(blocks, x).backward()
        expected = _grads(blocks, x)
        before = offloader.stats.bytes_offloaded
        _forward(blocks, x, offloader).backward()
        assert_same(_grads(blocks, x), expected, f"gradients at length {seq}")
        pool = offloader.pool
        assert pool.lent == 0  # every buffer came back when the graph was freed
        seen.append((pool.idle_bytes, offloader.stats.bytes_offloaded - before))
    return seen


def test_changing_lengths_over_thirty_steps_keep_the_pool_bounded():
    # Tensors of 1 KiB and more, so that size classes round up by at most a quarter.
    offloader = cpu_offloader(min_bytes=1024)
    seen = _train(offloader, _LENGTHS)
    pool, largest_step = offloader.pool, max(step for _, step in seen)
    # Idle buffers never exceed what one step had lent at once, and a step lends at most
    # 2.5x its bytes (a class is at most 1.25x a request, a reused buffer at most twice
    # its class), however many lengths came before.
    assert all(idle <= pool.peak_lent_bytes for idle, _ in seen)
    assert pool.peak_lent_bytes <= 2.5 * largest_step
    assert pool.evictions > 0  # the bound was reached and held
    # A pool keyed by exact sizes, never evicting, would hold every length's buffers.
    assert pool.idle_bytes < sum(step for _, step in seen) / 4


def test_a_cap_on_idle_bytes_holds_while_lengths_change():
    cap = 64 * 1024
    offloader = cpu_offloader(min_bytes=1024, pool=HostPool(max_idle_bytes=cap))
    seen = _train(offloader, _LENGTHS)
    assert all(idle <= cap for idle, _ in seen)
    assert max(step for _, step in seen) > cap  # the cap is below a step's needs


def test_nearby_lengths_reuse_the_buffers_of_one_size_class():
    offloader = cpu_offloader(min_bytes=1024)
    _train(offloader, [32])
    allocations = offloader.pool.allocations
    _train(offloader, [31, 30, 29, 32, 30])  # every tensor within a class of length 32's
    assert offloader.pool.allocations == allocations


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen_first_layer"])
def test_parameters_cast_by_autocast_stay_on_the_device(frozen):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    block[0].requires_grad_(not frozen)
    # Activations shaped like the weights: only their history tells them apart.
    x = torch.randn(64, 64, requires_grad=True)

    def run(offloader=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with offloader.region(block) if offloader is not None else contextlib.nullcontext():
                out = block(x)
        out.float().sum().backward()
        found = {k: p.grad.clone() for k, p in block.named_parameters() if p.grad is not None}
        block.zero_grad(set_to_none=True)
        x.grad = None
        return found

    expected = run()
    offloader = cpu_offloader(min_bytes=1024)
    assert_same(run(offloader), expected, "gradients under autocast")
    # Saved for backward: the first layer's input cast to bf16 (only when its weight
    # trains), GELU's input, the second layer's input, and both cast weights, which stay.
    assert offloader.stats.tensors_offloaded == (2 if frozen else 3)
    assert offloader.stats.bytes_offloaded == offloader.stats.tensors_offloaded * 64 * 64 * 2


def test_an_explicit_cast_of_a_parameter_stays_on_the_device():
    class HalfWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            return x @ self.weight.to(torch.float64)  # matmul saves both: x and the cast

    torch.manual_seed(0)
    module, x = HalfWeight(), torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    offloader = cpu_offloader(min_bytes=1024)
    with offloader.region(module):
        out = module(x)
    out.sum().backward()
    assert offloader.stats.tensors_offloaded == 1 and offloader.stats.bytes_offloaded == x.nbytes


def _as_fsdp_unit(module: nn.Module) -> nn.Module:
    """``module`` with the class FSDP2's fully_shard gives it (no process group needed
    to tell it apart)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    unit = getattr(fsdp, "FSDPModule", None)
    if unit is None:
        pytest.skip("this torch has no torch.distributed.fsdp.FSDPModule")
    module.__class__ = type(f"FSDP{type(module).__name__}", (unit, type(module)), {})
    return module


def test_a_nested_fsdp_unit_in_an_offloaded_block_is_refused(monkeypatch):
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    _as_fsdp_unit(block[2])
    offloader = cpu_offloader()
    with pytest.raises(CheckpointConfigError, match=r"submodule '2' \(FSDPLinear\) is an FSDP unit of its own"):
        with offloader.region(block):
            pass
    monkeypatch.setattr(_offload, "_DEFAULT", offloader)
    model = ckptwrap.wrap_model(nn.Sequential(block), "all;offload")
    with pytest.raises(CheckpointConfigError, match="Apply fully_shard to Sequential itself"):
        model(torch.randn(2, 8, requires_grad=True))


def test_an_offloaded_block_that_is_an_fsdp_unit_itself_is_served():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    x = torch.randn(4, 8, requires_grad=True)
    block(x).sum().backward()
    expected = {k: p.grad.clone() for k, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    _as_fsdp_unit(block)
    offloader = cpu_offloader()
    with offloader.region(block):
        out = block(x)
    out.sum().backward()
    assert_same({k: p.grad for k, p in block.named_parameters()}, expected, "gradients")
    assert offloader.stats.tensors_offloaded > 0

"""The offload tier on CUDA: side-stream copies into pooled pinned buffers, prefetch.

Results must equal the plain run bit for bit (copies are exact), over many steps with
asynchronous launches, also when the copies are held back on their streams so that any
missing synchronisation would read freed or unfinished memory. Without CUDA every test
here is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap.wrap import _offload
from ckptwrap.wrap._offload import Offloader
from _cuda_helpers import assert_same, gpt_step, requires_cuda, small_gpt

pytestmark = requires_cuda

_MIB = 1 << 20


@pytest.fixture
def offloader(monkeypatch):
    """A fresh offloader behind the offload tier, so counts start at zero."""
    fresh = Offloader()
    monkeypatch.setattr(_offload, "_DEFAULT", fresh)
    return fresh


def _gpt(layers=4):
    # Activations of 8 x 128 x 512 float32 are 2 MiB: above the small-tensor threshold.
    return small_gpt(layers=layers, width=512, seq=128)


def _batch(model, config, batch=8):
    from _cuda_helpers import gpt_module

    return gpt_module().synthetic_batch(config, batch, seed=0, device="cuda")


def test_offloaded_gradients_equal_the_plain_run(offloader):
    plain, config = _gpt()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks;offload")
    batch = _batch(plain, config)
    assert_same(gpt_step(model, batch), gpt_step(plain, batch), "offload vs plain")
    assert offloader.stats.tensors_offloaded > 0
    assert offloader.stats.bytes_fetched == offloader.stats.bytes_offloaded


def test_fifty_training_steps_equal_the_plain_run(offloader):
    plain, config = _gpt()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks;offload")
    batch = _batch(plain, config)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (plain, model)]
    for step in range(50):
        for net, optimizer in zip((plain, model), optimizers):
            gpt_step(net, batch, seed=step)
            optimizer.step()
    torch.cuda.synchronize()
    assert_same(dict(model.named_parameters()), dict(plain.named_parameters()), "parameters after 50 steps")


@pytest.mark.parametrize("stream", ["d2h", "h2d", "compute"])
def test_delayed_streams_do_not_change_results(offloader, stream):
    """Hold one stream back for tens of milliseconds each step and scribble over freed
    memory: a copy that read a freed source, a buffer reused too early or a fetched tensor
    used before its copy finished would change the gradients."""
    plain, config = _gpt()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks;offload")
    batch = _batch(plain, config)
    expected = gpt_step(plain, batch)
    device = torch.device("cuda", torch.cuda.current_device())
    lanes = offloader._lanes_of(device)
    target = {"d2h": lanes.d2h, "h2d": lanes.h2d, "compute": torch.cuda.current_stream(device)}[stream]
    for _ in range(3):
        with torch.cuda.stream(target):
            torch.cuda._sleep(50_000_000)
        tokens, targets = batch
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = model(tokens, targets)
        junk = [torch.full((2 * _MIB,), float("nan"), device=device) for _ in range(32)]
        del junk
        loss.backward()
        got = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        assert_same(got, expected, f"offload with the {stream} stream held back")


def test_device_memory_freed_equals_the_bytes_offloaded(offloader):
    torch.manual_seed(0)
    width = 1024
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(4)).cuda()
    x = torch.randn(512, width, device="cuda", requires_grad=True)  # 2 MiB activations

    def forward(offloaded):
        h = x * 1.0  # so that the first block's saved input is not the caller's x
        for block in blocks:
            if offloaded:
                with offloader.region(block):
                    h = block(h)
            else:
                h = block(h)
        return h

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    out = forward(False)
    torch.cuda.synchronize()
    plain_bytes = torch.cuda.memory_allocated() - start
    del out
    offloader.reset_stats()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    out = forward(True)
    torch.cuda.synchronize()
    offloader.release_finished(wait=True)
    offload_bytes = torch.cuda.memory_allocated() - start
    freed = plain_bytes - offload_bytes
    offloaded = offloader.stats.bytes_offloaded
    # Each tensor's device block is rounded up to 512 bytes by the allocator.
    slack = 512 * offloader.stats.tensors_offloaded
    assert offloader.stats.tensors_offloaded == 3 * len(blocks)
    assert abs(freed - offloaded) <= slack, f"freed {freed} bytes, offloaded {offloaded}"
    out.sum().backward()


def test_pinned_buffers_stop_growing_after_the_first_step(offloader):
    plain, config = _gpt()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks;offload")
    batch = _batch(plain, config)
    gpt_step(model, batch)
    first = offloader.pool.allocations
    assert first > 0 and offloader.pool.lent == 0
    for step in range(5):
        gpt_step(model, batch, seed=step)
    assert offloader.pool.allocations == first
    assert offloader.pool.lent == 0
    assert all(buffer.is_pinned() for free in offloader.pool._free.values() for buffer, _ in free)


def test_small_tensors_and_parameters_stay_on_the_device(offloader):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 64), nn.GELU()).cuda()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    with offloader.region(block):
        y = block(x)
    y.sum().backward()
    assert offloader.stats.tensors_offloaded == 0 and offloader.pool.allocations == 0

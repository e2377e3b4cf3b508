"""The offload tier on CUDA: side-stream copies into pooled pinned buffers, prefetch.

Results must equal the plain run bit for bit (copies are exact), over many steps with
asynchronous launches, also when the copies are held back on their streams so that any
missing synchronisation would read freed or unfinished memory; on Llama-style blocks whose
inputs are saved several times, over retained graphs, partial backward passes, gradient
accumulation, changing shapes and bf16 autocast. Copies must overlap compute. Without CUDA
every test here is skipped; their bookkeeping is tested on the CPU in tests/wrap.
"""

from __future__ import annotations

import contextlib
import copy
import statistics

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap.wrap import _offload
from ckptwrap.wrap._offload import SMALL_TENSOR_BYTES, Offloader
from _cuda_helpers import (
    assert_same, gpt_step, grads, llama, llama_input, llama_loss, requires_cuda, small_gpt, step_grads,
)

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


def _offloaded(model):
    return ckptwrap.wrap_model(copy.deepcopy(model), "blocks;offload")


def _device_copies(offloader) -> int:
    """Device copies the offloader still holds (fetched and not let go of)."""
    regions = [ref() for ref in offloader._regions]
    return sum(
        1 for region in regions if region is not None
        for ref in region.stored if ref() is not None and ref().device_copy is not None
    )


def _assert_each_copy_came_back_once(stats, passes=1):
    # Fetched from the host, or handed out from the device source still held there.
    assert stats.bytes_fetched + stats.bytes_resident == passes * stats.bytes_offloaded
    assert stats.tensors_fetched <= passes * stats.tensors_offloaded


def test_offloaded_gradients_equal_the_plain_run(offloader):
    plain, config = _gpt()
    model = _offloaded(plain)
    batch = _batch(plain, config)
    assert_same(gpt_step(model, batch), gpt_step(plain, batch), "offload vs plain")
    assert offloader.stats.tensors_offloaded > 0
    _assert_each_copy_came_back_once(offloader.stats)


def test_fifty_training_steps_equal_the_plain_run(offloader):
    plain, config = _gpt()
    model = _offloaded(plain)
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
    model = _offloaded(plain)
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


def test_llama_inputs_saved_several_times_come_back_once_per_backward(offloader):
    plain = llama()
    model, x = _offloaded(plain), llama_input()
    assert_same(step_grads(model, x), step_grads(plain, x), "offload vs plain")
    assert offloader.stats.tensors_offloaded > 0
    _assert_each_copy_came_back_once(offloader.stats)
    assert _device_copies(offloader) == 0


def test_retained_graph_and_partial_backward_equal_the_plain_run(offloader):
    plain = llama()
    model, x = _offloaded(plain), llama_input()

    def run(net):
        net.zero_grad(set_to_none=True)
        x.grad = None
        outputs = []
        hook = net.layers[1].register_forward_hook(lambda module, args, out: outputs.append(out))
        loss = llama_loss(net, x)
        hook.remove()
        (partial,) = torch.autograd.grad(loss, outputs[0], retain_graph=True)  # layers 2 and 3
        if net is model:
            assert _device_copies(offloader) == 0  # layer 1, fetched ahead, was let go
        loss.backward(retain_graph=True)
        loss.backward()
        return grads(dict(net.named_parameters()) | {"input": x}) | {"partial": partial}

    assert_same(run(model), run(plain), "a partial backward, then two full ones")
    assert offloader.stats.tensors_fetched > 0 and _device_copies(offloader) == 0


def test_gradient_accumulation_equals_the_plain_run(offloader):
    plain = llama()
    model = _offloaded(plain)
    inputs = [llama_input(seed=seed) for seed in range(4)]
    for net in (plain, model):
        net.zero_grad(set_to_none=True)
        for step, x in enumerate(inputs):
            llama_loss(net, x, seed=step).backward()
    assert_same(grads(dict(model.named_parameters())), grads(dict(plain.named_parameters())), "accumulated")
    _assert_each_copy_came_back_once(offloader.stats)


def test_changing_lengths_keep_the_pinned_pool_bounded(offloader):
    plain = llama(layers=2)
    model = _offloaded(plain)
    for step, seq in enumerate([128, 192, 256, 160, 224, 96, 256, 128, 200, 64]):
        x = llama_input(seq=seq, seed=step)
        assert_same(step_grads(model, x, seed=step), step_grads(plain, x, seed=step), f"length {seq}")
        pool = offloader.pool
        assert pool.lent == 0 and pool.idle_bytes <= pool.peak_lent_bytes
    assert all(buffer.is_pinned() for idle in offloader.pool._free.values() for _, buffer, _ in idle)


def test_bf16_autocast_keeps_cast_weights_on_the_device(offloader, monkeypatch):
    plain = llama()
    model, x = _offloaded(plain), llama_input()
    params = {id(p) for p in model.parameters()}
    crossed = []
    offload = Offloader._offload

    def spy(self, lanes, region, tensor, extent):
        root = tensor._base if tensor._base is not None else tensor
        node = root.grad_fn
        leaf = getattr(node.next_functions[0][0], "variable", None) if node is not None and node.next_functions else None
        if type(node).__name__ == "ToCopyBackward0" and id(leaf) in params:
            crossed.append(tuple(tensor.shape))
        return offload(self, lanes, region, tensor, extent)

    monkeypatch.setattr(Offloader, "_offload", spy)
    assert_same(step_grads(model, x, autocast=True), step_grads(plain, x, autocast=True), "offload vs plain, bf16")
    assert offloader.stats.tensors_offloaded > 0
    assert not crossed, f"bf16 casts of parameters were offloaded: {crossed}"


def test_blocks_on_two_streams_equal_the_plain_run(offloader):
    """Blocks alternate between two streams, so a block's copies, fetched ahead while the
    block after it runs backward on one stream, are consumed on the other."""
    plain = llama()
    model, x = _offloaded(plain), llama_input()
    side = torch.cuda.Stream()

    def run(net):
        net.zero_grad(set_to_none=True)
        x.grad = None
        main = torch.cuda.current_stream()
        torch.manual_seed(1)
        h, previous = x, main
        for index, layer in enumerate(net.layers):
            stream = side if index % 2 else main
            stream.wait_stream(previous)
            with torch.cuda.stream(stream):
                h = layer(h)
            previous = stream
        main.wait_stream(previous)
        loss = (h.float() * torch.linspace(-1.0, 2.0, h.numel(), device="cuda").reshape(h.shape)).sum()
        junk = [torch.full((2 * _MIB,), float("nan"), device="cuda") for _ in range(32)]
        del junk
        loss.backward()
        torch.cuda.synchronize()
        return grads(dict(net.named_parameters()) | {"input": x})

    assert_same(run(model), run(plain), "blocks on two streams")


def test_device_memory_freed_equals_the_bytes_offloaded(offloader):
    torch.manual_seed(0)
    width = 1024
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(4)).cuda()
    x = torch.randn(512, width, device="cuda", requires_grad=True)  # 2 MiB activations

    def forward(offloaded):
        h = x * 1.0  # so that the first block's saved input is not the caller's x
        for block in blocks:
            with offloader.region(block) if offloaded else contextlib.nullcontext():
                h = block(h)
        return h

    for offloaded in (False, True):  # warm-up: cuBLAS's workspace, the pinned pool
        forward(offloaded).sum().backward()
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
    model = _offloaded(plain)
    batch = _batch(plain, config)
    gpt_step(model, batch)
    first = offloader.pool.allocations
    assert first > 0 and offloader.pool.lent == 0
    for step in range(5):
        gpt_step(model, batch, seed=step)
    assert offloader.pool.allocations == first
    assert offloader.pool.lent == 0
    assert all(buffer.is_pinned() for idle in offloader.pool._free.values() for _, buffer, _ in idle)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16_autocast"])
def test_small_tensors_and_parameters_stay_on_the_device(offloader, autocast):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(1024, 1024), nn.GELU()).cuda()
    # The weight (4 MiB, 2 MiB once cast to bf16) is above the threshold; activations of
    # 8 x 1024 are far below it.
    assert block[0].weight.nbytes // (2 if autocast else 1) > SMALL_TENSOR_BYTES
    x = torch.randn(8, 1024, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        with offloader.region(block):
            y = block(x)
    y.float().sum().backward()
    assert offloader.stats.tensors_offloaded == 0 and offloader.pool.allocations == 0
    assert offloader.stats.tensors_kept > 0


def _median_ms(step, repeats=5):
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def test_copies_overlap_compute(offloader):
    """Timed with CUDA events: the offloaded step hides part of its copies behind compute.
    Without overlap it would take the plain step's time plus the copies'; with full
    overlap, the longer of the two. At least a quarter of the shorter must be hidden."""
    plain = llama(layers=4, width=2048, heads=16, hidden=4096, dropout=0.0)
    model = _offloaded(plain)
    x = llama_input(batch=4, seq=512, width=2048)

    def step(net):
        return lambda: llama_loss(net, x).backward()

    for net in (plain, model):  # warm-up: workspaces, allocator, pinned pool
        for _ in range(2):
            step(net)()
    plain_ms = _median_ms(step(plain))
    offloader.reset_stats()
    step(model)()
    nbytes = offloader.stats.bytes_offloaded  # one step's, each way
    offload_ms = _median_ms(step(model))
    # The same bytes each way in one copy per direction: the link's best case.
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copies():
        host.copy_(device, non_blocking=True)
        device.copy_(host, non_blocking=True)

    copies()
    copy_ms = _median_ms(copies)
    hidden = plain_ms + copy_ms - offload_ms
    report = (
        f"plain {plain_ms:.1f} ms, offloaded {offload_ms:.1f} ms, copies {copy_ms:.1f} ms "
        f"({2 * nbytes / copy_ms / 1e6:.1f} GB/s for {nbytes / 2**30:.2f} GiB each way), hidden {hidden:.1f} ms"
    )
    print(report)
    assert nbytes > 0
    assert hidden >= 0.25 * min(plain_ms, copy_ms), report

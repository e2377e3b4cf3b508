"""The offload tier's hooks, host pool and prefetch bookkeeping, on the CPU.

CPU tensors are never moved by default; to exercise the device path here, the offloader is
given stand-in streams for the CPU (``_offload_lanes``: copies are synchronous, events are
done at once) and a threshold of zero bytes. Every comparison is against the plain model on
the same inputs. Repeated saves, views, backward passes and the pool's bound are in
``test_offload_passes`` and ``test_offload_memory``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap.wrap import _offload
from ckptwrap.wrap._offload import HostPool, Keep, Offloader, Saved, size_class
from ._offload_lanes import CpuLanes, cpu_offloader

from ._models import assert_same


class _Logged(Offloader):
    """Records which region each fetch and each unpack belongs to."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.events = []

    def _fetch(self, stored, key, lanes=None):
        self.events.append(("fetch", stored.region.index))
        super()._fetch(stored, key, lanes)

    def _unpack(self, packed):
        if isinstance(packed, Saved):
            self.events.append(("unpack", packed.stored.region.index))
        return super()._unpack(packed)


def _blocks(layers=4):
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8)) for _ in range(layers)
    )


def _step(blocks, x, offloader=None, *, retain_graph=False, backwards=1):
    """One forward and backward from a fixed seed; each block is a region when offloading."""
    torch.manual_seed(1)
    h = x
    for block in blocks:
        context = offloader.region(block) if offloader is not None else contextlib.nullcontext()
        with context:
            h = block(h)
    # A transposed view and a broadcast, saved inside a region: strides must survive.
    with offloader.region() if offloader is not None else contextlib.nullcontext():
        loss = (h.t().exp() * torch.linspace(0, 1, h.shape[0]).expand(8, -1)).sum()
    for _ in range(backwards):
        loss.backward(retain_graph=retain_graph)
    return {f"param:{k}": p.grad.clone() for k, p in blocks.named_parameters()} | {"input": x.grad.clone()}


def _input():
    torch.manual_seed(2)
    return torch.randn(6, 8, requires_grad=True)


def test_cpu_tensors_are_left_in_place_by_default():
    offloader = Offloader()
    x = torch.randn(512, 1024, requires_grad=True)  # 2 MiB, above the threshold
    with offloader.region():
        y = x.exp()
    assert offloader.stats.tensors_offloaded == 0 and offloader.pool.allocations == 0
    assert torch.equal(y.grad_fn._saved_result, y)
    y.sum().backward()
    assert torch.equal(x.grad, x.exp())


def test_gradients_through_offloaded_regions_equal_the_plain_run():
    x = _input()
    plain = _step(_blocks(), x)
    x.grad = None
    offloader = cpu_offloader()
    ours = _step(_blocks(), x, offloader)
    assert_same(ours, plain, "gradients")
    assert offloader.stats.tensors_offloaded > 0
    assert offloader.stats.tensors_kept > 0  # the blocks' own weights stay where they are


def test_retained_graph_is_unpacked_again_and_buffers_return_only_when_freed():
    x = _input()
    plain = _step(_blocks(), x, retain_graph=True, backwards=2)
    x.grad = None
    offloader = cpu_offloader()
    ours = _step(_blocks(), x, offloader, retain_graph=True, backwards=2)
    assert_same(ours, plain, "gradients after two backward passes")
    assert offloader.stats.bytes_fetched == 2 * offloader.stats.bytes_offloaded


def test_host_buffers_are_reused_from_the_second_step_on():
    blocks, x = _blocks(), _input()
    offloader = cpu_offloader()
    _step(blocks, x, offloader)
    after_first = offloader.pool.allocations
    assert after_first > 0 and offloader.pool.free_buffers() == after_first
    assert offloader.pool.lent == 0  # every buffer came back when the graph was freed
    for _ in range(3):
        _step(blocks, x, offloader)
    assert offloader.pool.allocations == after_first
    assert offloader.pool.lent == 0


def test_graph_kept_alive_keeps_its_buffers_lent():
    offloader = cpu_offloader()
    x = torch.randn(4, 4, requires_grad=True)
    with offloader.region():
        y = x.exp().tanh()  # both save their result
    assert offloader.pool.lent == 2
    y.sum().backward(retain_graph=True)
    assert offloader.pool.free_buffers() == 0 and offloader.pool.lent == 2
    del y
    assert offloader.pool.free_buffers() == 2 and offloader.pool.lent == 0


def test_backward_fetches_the_previous_region_before_it_is_reached():
    offloader = _Logged(lanes_for=CpuLanes(), min_bytes=0)
    blocks, x = _blocks(layers=4), _input()
    _step(blocks, x, offloader)
    events = offloader.events
    first_unpack = {}
    for position, (kind, region) in enumerate(events):
        if kind == "unpack":
            first_unpack.setdefault(region, position)
    regions = sorted(first_unpack)
    assert len(regions) == 5  # four blocks and the loss
    for later, earlier in zip(regions[1:], regions[:-1]):
        fetches = [p for p, (kind, r) in enumerate(events) if kind == "fetch" and r == earlier]
        assert fetches, f"region {earlier} was never fetched"
        # Issued while the later region's backward runs, before the earlier one is reached.
        assert first_unpack[later] < min(fetches) and max(fetches) < first_unpack[earlier]


def test_copies_wait_for_the_compute_stream_and_for_the_buffer_last_reader():
    offloader = cpu_offloader()
    log = offloader._lanes_for.log
    blocks, x = _blocks(layers=1), _input()
    _step(blocks, x, offloader)
    log.clear()
    _step(blocks, x, offloader)  # reuses the buffers the first step's fetches read
    assert ("d2h", "wait_stream", "compute") in log
    assert ("d2h", "wait_event", "h2d") in log
    assert ("h2d", "wait_event", "d2h") in log  # a fetch waits for its host data
    assert ("compute", "wait_event", "h2d") in log  # compute waits for the fetch


def test_a_tensor_saved_twice_is_copied_once():
    offloader = cpu_offloader()
    x = torch.randn(8, 8, requires_grad=True)
    with offloader.region():
        h = x.exp()  # saves its result, h
        y = h * h  # saves both operands: h twice more
    y.sum().backward()
    assert offloader.stats.tensors_offloaded == 1
    assert torch.equal(x.grad, 2 * x.exp() * x.exp())


def test_tensors_below_the_threshold_stay():
    offloader = cpu_offloader(min_bytes=1 << 20)
    x = _input()
    plain = _step(_blocks(), x)
    x.grad = None
    assert_same(_step(_blocks(), x, offloader), plain, "gradients")
    assert offloader.stats.tensors_offloaded == 0 and offloader.pool.allocations == 0


def test_pool_hands_back_a_buffer_of_its_size_class_with_its_last_reader():
    pool = HostPool()
    first, reader = pool.take(5000, pin=False)
    assert reader is None and first.numel() == size_class(5000) >= 5000 and pool.lent == 1
    pool.give(first, False, "event")
    again, reader = pool.take(4900, pin=False)  # another size in the same class
    assert again is first and reader == "event" and pool.allocations == 1
    other, _ = pool.take(9000, pin=False)
    assert other.numel() == size_class(9000) and pool.allocations == 2
    assert pool.allocated_bytes == first.numel() + other.numel()
    pool.give(again, False)
    pool.give(other, False)
    assert pool.free_buffers() == 2 and pool.lent == 0
    pool.clear()
    assert pool.free_buffers() == 0 and pool.idle_bytes == 0


@pytest.mark.parametrize("nbytes", [1, 511, 512, 513, 1000, 4097, 10**6, 3 * 2**20 + 7])
def test_size_classes_waste_at_most_a_quarter(nbytes):
    size = size_class(nbytes)
    assert nbytes <= size and (size <= 512 or size <= 1.25 * nbytes)
    assert size_class(size) == size  # a class is its own class


def test_pool_reuses_a_larger_idle_buffer_up_to_twice_the_size():
    pool = HostPool()
    big, _ = pool.take(8192, pin=False)
    pool.give(big, False)
    reused, _ = pool.take(4500, pin=False)  # 8192 is under twice 4500's class
    assert reused is big and pool.allocations == 1
    pool.give(reused, False)
    small, _ = pool.take(3000, pin=False)  # but more than twice 3000's: a new buffer
    assert small is not big and pool.allocations == 2


def test_pool_drops_the_least_recently_returned_beyond_its_cap():
    pool = HostPool(max_idle_bytes=3 * 4096)
    buffers = [pool.take(4096, pin=False)[0] for _ in range(5)]
    for buffer in buffers:
        pool.give(buffer, False)
    assert pool.idle_bytes == 3 * 4096 and pool.evictions == 2
    kept = [pool.take(4096, pin=False)[0] for _ in range(3)]
    assert {id(b) for b in kept} == {id(b) for b in buffers[2:]}  # the first two went
    with pytest.raises(ValueError, match="max_idle_bytes must be None or >= 0, got -1"):
        HostPool(max_idle_bytes=-1)


def test_pool_keeps_idle_at_most_what_it_ever_lent_at_once():
    pool = HostPool()
    for size in (4096, 8192, 16384):  # each step's buffers in a class of their own
        taken = [pool.take(size, pin=False)[0] for _ in range(4)]
        for buffer in taken:
            pool.give(buffer, False)
        assert pool.idle_bytes <= pool.peak_lent_bytes == 4 * size


def test_offload_tier_uses_the_offloader_and_keeps_gradients(monkeypatch):
    offloader = cpu_offloader()
    monkeypatch.setattr(_offload, "_DEFAULT", offloader)
    plain, model = _blocks(), _blocks()
    ckptwrap.wrap_model(model, "all;offload")
    x = _input()
    h = x
    torch.manual_seed(1)
    for block in plain:
        h = block(h)
    h.pow(2).sum().backward()
    expected = {k: p.grad.clone() for k, p in plain.named_parameters()}
    torch.manual_seed(1)
    h = x
    for block in model:
        h = block(h)
    h.pow(2).sum().backward()
    assert_same({k: p.grad for k, p in model.named_parameters()}, expected, "gradients")
    assert offloader.stats.tensors_offloaded > 0


def test_regions_that_never_ran_backward_do_not_pile_up():
    offloader = cpu_offloader()
    x = torch.randn(4, 4, requires_grad=True)
    for _ in range(5):
        with offloader.region():
            y = x.exp()
        del y  # graph dropped without backward
    with offloader.region():
        pass
    assert len(offloader._regions) == 1  # the dead regions were pruned on entry
    assert offloader.pool.lent == 0 and offloader.pool.allocations == 1


@pytest.mark.parametrize("shape, make", [
    ((6, 4), lambda t: t.t()),
    ((1, 8), lambda t: t.expand(5, 8)),
    ((4, 6), lambda t: t[:, 1:4]),
    ((4, 6), lambda t: t[1:3, 2:]),
    ((3, 8), lambda t: t.view(torch.int32)[:, 3:]),
])
def test_views_come_back_with_their_strides(shape, make):
    offloader = cpu_offloader()
    base = torch.randn(*shape)
    view = make(base)
    packed = offloader._pack(_offload._Region(0, Keep(None)), view)
    back = offloader._unpack(packed)
    assert back.stride() == view.stride() and back.shape == view.shape and back.dtype == view.dtype
    assert torch.equal(back, view)


def test_a_small_view_of_a_large_storage_copies_only_its_span():
    offloader = cpu_offloader()
    region = _offload._Region(0, Keep(None))
    base = torch.randn(64, 64)
    row, rows = base[10], base[:40]
    back = [offloader._unpack(offloader._pack(region, t)) for t in (row, rows, base[20, 3:9])]
    assert [torch.equal(b, t) for b, t in zip(back, (row, rows, base[20, 3:9]))] == [True] * 3
    # The row alone; then the first 40 rows, more than half, as the whole storage, which
    # also serves the last view.
    assert offloader.stats.tensors_offloaded == 2
    assert offloader.stats.bytes_offloaded == row.nbytes + base.nbytes

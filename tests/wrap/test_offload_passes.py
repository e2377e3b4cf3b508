"""The offload tier's copies per backward pass, on the CPU (``_offload_lanes``).

A storage saved several times (q, k and v reading one input; gate and up; views split from
one fused projection) is copied to the host once and fetched once per backward pass; every
backward pass (``retain_graph=True``, a partial ``torch.autograd.grad``) prefetches and
leaves nothing behind; sources still on the device are handed out, not fetched; a consumer
on another stream is recorded. Gradients always equal the plain model's, bit for bit; the
byte counts expected are read from what the plain run saves, in the same process.
"""

from __future__ import annotations

import collections
import contextlib
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ckptwrap import _torch_private
from ckptwrap.wrap._offload import Offloader
from ckptwrap.wrap._offload import Saved
from ._offload_lanes import CpuLanes, FakeStream, cpu_offloader

from ._models import assert_same


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class LlamaBlock(nn.Module):
    """Attention whose q, k and v projections read one normed input, and a gated MLP whose
    gate and up projections read one normed input: each input is saved three or two times."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).reshape(batch, seq, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        weights = self.drop((q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1))
        x = x + self.o((weights @ v).transpose(1, 2).reshape(batch, seq, width))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class FusedGate(nn.Module):
    """q, k and v split from one projection, and saved as those views (as attention
    kernels that take strided inputs save them)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        return q * k * v


class Logged(Offloader):
    """Records each fetch (and of which host copy) and each unpack, by region."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.events = []

    def _fetch(self, stored, key, lanes=None):
        self.events.append(("fetch", stored.region.index, id(stored)))
        super()._fetch(stored, key, lanes)

    def _unpack(self, packed):
        if isinstance(packed, Saved):
            self.events.append(("unpack", packed.stored.region.index, id(packed.stored)))
        return super()._unpack(packed)


def _blocks(layers: int = 3, block=LlamaBlock) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(block() for _ in range(layers))


def _input(batch: int = 2, seq: int = 6, seed: int = 2) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(batch, seq, 32, requires_grad=True)


def _forward(blocks, x, offloader=None, *, keep=None):
    """The blocks' loss from a fixed dropout seed; each block is a region when offloading.
    ``keep`` collects each block's output."""
    torch.manual_seed(1)
    h = x
    for block in blocks:
        with offloader.region(block) if offloader is not None else contextlib.nullcontext():
            h = block(h)
        if keep is not None:
            keep.append(h)
    return (h * torch.linspace(-1, 1, h.shape[-1])).sum()


def _grads(blocks, x):
    found = {f"param:{k}": p.grad.clone() for k, p in blocks.named_parameters()} | {"input": x.grad.clone()}
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    return found


def _saved_bytes(blocks, x) -> int:
    """Bytes of the distinct storages the blocks save for backward in a plain forward,
    parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    storages = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params:
            storages[(pointer, tensor._version)] = tensor.untyped_storage().nbytes()
        return tensor

    class Recorder:
        def region(self, block):
            return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    loss = _forward(blocks, x, Recorder())
    del loss
    return sum(storages.values())


def _device_copies(offloader) -> int:
    """Device copies the offloader still holds."""
    regions = [ref() for ref in offloader._regions]
    return sum(
        1 for region in regions if region is not None
        for ref in region.stored if ref() is not None and ref().device_copy is not None
    )


def _events_by_pass(events):
    passes, current = [], []
    for event in events:
        if event == ("pass",):
            passes.append(current)
            current = []
        else:
            current.append(event)
    return passes + [current]


def _assert_prefetched(events, regions):
    """Each region's host copies are fetched while the region after it runs its backward,
    before the region itself is reached, once each; ``regions`` are those the pass reached."""
    first_unpack = {}
    for position, (kind, region, _) in enumerate(events):
        if kind == "unpack":
            first_unpack.setdefault(region, position)
    assert sorted(first_unpack) == regions
    for later, earlier in zip(regions[1:], regions[:-1]):
        fetches = [p for p, (kind, r, _) in enumerate(events) if kind == "fetch" and r == earlier]
        assert fetches and first_unpack[later] < min(fetches) and max(fetches) < first_unpack[earlier]
    per_copy = collections.Counter(stored for kind, _, stored in events if kind == "fetch")
    assert set(per_copy.values()) == {1}, "a host copy was fetched more than once in one pass"


def test_a_tensor_saved_by_several_operators_is_fetched_once_per_backward():
    blocks, x = _blocks(), _input()
    plain = _forward(blocks, x)
    plain.backward()
    expected = _grads(blocks, x)
    offloader = Logged(lanes_for=CpuLanes(), min_bytes=0)
    _forward(blocks, x, offloader).backward()
    assert_same(_grads(blocks, x), expected, "gradients")
    stats = offloader.stats
    assert stats.bytes_offloaded == _saved_bytes(blocks, x)
    assert stats.tensors_fetched == stats.tensors_offloaded and stats.bytes_fetched == stats.bytes_offloaded
    unpacks = sum(1 for kind, *_ in offloader.events if kind == "unpack")
    assert unpacks > stats.tensors_offloaded  # the shared inputs were unpacked more than once
    _assert_prefetched(offloader.events, [0, 1, 2])
    assert _device_copies(offloader) == 0


def test_views_of_one_projection_share_one_host_copy():
    blocks, x = _blocks(layers=1, block=FusedGate), _input()
    _forward(blocks, x).backward()
    expected = _grads(blocks, x)
    offloader = cpu_offloader()
    _forward(blocks, x, offloader).backward()
    assert_same(_grads(blocks, x), expected, "gradients")
    # x, the projection's whole storage once (not once per view), and q * k.
    assert offloader.stats.tensors_offloaded == 3
    assert offloader.stats.bytes_offloaded == _saved_bytes(blocks, x) == 5 * x.nbytes
    assert offloader.stats.bytes_fetched == offloader.stats.bytes_offloaded


@pytest.fixture(params=["graph_task_id", "final_callback"])
def pass_keys(request, monkeypatch):
    """Backward passes told apart by the engine's graph task id, or, on a torch without
    it (``_torch_private``'s fallback), by a final callback of the offloader's own."""
    if request.param == "final_callback":
        monkeypatch.setattr(_torch_private, "graph_task_id", lambda: -1)


def test_every_backward_of_a_retained_graph_prefetches(pass_keys):
    blocks, x = _blocks(), _input()
    loss = _forward(blocks, x)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = _grads(blocks, x)
    offloader = Logged(lanes_for=CpuLanes(), min_bytes=0)
    loss = _forward(blocks, x, offloader)
    loss.backward(retain_graph=True)
    assert _device_copies(offloader) == 0
    offloader.events.append(("pass",))
    loss.backward()
    assert_same(_grads(blocks, x), expected, "gradients after two backward passes")
    for events in _events_by_pass(offloader.events):
        _assert_prefetched(events, [0, 1, 2])
    stats = offloader.stats
    assert stats.tensors_fetched == 2 * stats.tensors_offloaded and stats.bytes_fetched == 2 * stats.bytes_offloaded


def test_a_partial_backward_prefetches_and_leaves_nothing_on_the_device(pass_keys):
    blocks, x = _blocks(layers=4), _input()

    def run(offloader=None):
        outputs = []
        loss = _forward(blocks, x, offloader, keep=outputs)
        (partial,) = torch.autograd.grad(loss, outputs[1], retain_graph=True)  # blocks 2 and 3 only
        if offloader is not None:
            assert _device_copies(offloader) == 0  # block 1, fetched ahead, was let go
            offloader.events.append(("pass",))
        loss.backward()
        return {"partial": partial} | _grads(blocks, x)

    expected = run()
    offloader = Logged(lanes_for=CpuLanes(), min_bytes=0)
    assert_same(run(offloader), expected, "gradients of a partial, then a full backward")
    partial, full = _events_by_pass(offloader.events)
    _assert_prefetched(partial, [2, 3])
    _assert_prefetched(full, [0, 1, 2, 3])
    assert _device_copies(offloader) == 0


def test_gradient_accumulation_over_micro_batches_equals_the_plain_run():
    blocks = _blocks()
    inputs = [_input(seed=seed) for seed in range(3)]
    for x in inputs:
        _forward(blocks, x).backward()
    expected = {f"param:{k}": p.grad.clone() for k, p in blocks.named_parameters()}
    blocks.zero_grad(set_to_none=True)
    offloader = cpu_offloader()
    for x in inputs:
        _forward(blocks, x, offloader).backward()
        if x is inputs[0]:
            after_first = offloader.pool.allocations
    assert_same({f"param:{k}": p.grad for k, p in blocks.named_parameters()}, expected, "accumulated gradients")
    assert offloader.stats.bytes_fetched == offloader.stats.bytes_offloaded
    assert offloader.pool.allocations == after_first and offloader.pool.lent == 0


def test_sources_still_on_the_device_are_handed_out_and_the_host_never_waits():
    blocks, x = _blocks(layers=4), _input()
    _forward(blocks, x).backward()
    expected = _grads(blocks, x)
    offloader = cpu_offloader(copies_finish=False)  # copies to the host lag behind
    log = offloader._lanes_for.log
    _forward(blocks, x, offloader).backward()
    assert_same(_grads(blocks, x), expected, "gradients")
    stats = offloader.stats
    # The last blocks' sources were still held: handed out as they are, not fetched.
    assert 0 < stats.bytes_resident < stats.bytes_offloaded
    assert stats.bytes_fetched + stats.bytes_resident == stats.bytes_offloaded
    assert not [entry for entry in log if entry[0] == "host"], "the host waited for a copy"
    assert ("compute", "wait_event", "d2h") in log  # the compute stream waits instead
    assert not any(stored.source is not None for stored in offloader._pending)


def test_a_copy_consumed_on_another_stream_is_recorded_on_it():
    blocks, x = _blocks(layers=4), _input()
    _forward(blocks, x).backward()
    expected = _grads(blocks, x)
    lanes = CpuLanes()
    offloader = Offloader(lanes_for=lanes, min_bytes=0)
    outputs = []
    loss = _forward(blocks, x, offloader, keep=outputs)
    other = FakeStream("other", lanes.log)
    # After block 3's backward, whose start fetched block 2's copies on the compute
    # stream, the rest of backward runs on another stream.
    outputs[2].register_hook(lambda grad: setattr(lanes, "stream", other))
    loss.backward()
    assert_same(_grads(blocks, x), expected, "gradients")
    assert ("other", "wait_event", "h2d") in lanes.log
    recorded = [entry for entry in lanes.log if entry[1] == "record_stream"]
    assert recorded and {stream for stream, *_ in recorded} == {"other"}


@pytest.mark.parametrize("second", ["backward", "grad"])
def test_bytes_fetched_per_pass_equal_the_bytes_offloaded(second):
    blocks, x = _blocks(), _input()
    offloader = cpu_offloader()
    loss = _forward(blocks, x, offloader)
    loss.backward(retain_graph=True)
    if second == "backward":
        loss.backward()
    else:
        torch.autograd.grad(loss, [x])
    assert offloader.stats.bytes_fetched == 2 * offloader.stats.bytes_offloaded
    assert offloader.stats.tensors_fetched == 2 * offloader.stats.tensors_offloaded


def test_without_the_engine_callbacks_every_unpack_is_a_copy_of_its_own(monkeypatch):
    """On a torch without the engine's final callbacks (``_torch_private``'s fallback),
    passes cannot be told apart: nothing is prefetched or kept, the gradients are the same."""
    monkeypatch.setattr(_torch_private, "graph_task_id", lambda: -1)
    monkeypatch.setattr(_torch_private, "queue_callback", None)
    blocks, x = _blocks(), _input()
    loss = _forward(blocks, x)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = _grads(blocks, x)
    offloader = cpu_offloader()
    loss = _forward(blocks, x, offloader)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_same(_grads(blocks, x), expected, "gradients after two backward passes")
    assert offloader.stats.bytes_fetched > 2 * offloader.stats.bytes_offloaded  # no sharing
    assert _device_copies(offloader) == 0

"""Offloading a region's saved tensors to host memory, with copies that overlap compute.

The ``offload`` tier keeps the tensors a region saves for backward in pinned host memory.
Copies run on side streams so that they overlap the model's kernels: device-to-host as the
forward saves each tensor, host-to-device for a whole region when backward reaches it, and
ahead of time for the region before it (regions are entered in forward order and their
backward runs in reverse). Host buffers come from a pool and are reused step after step.

CPU tensors are kept as they are (moving them to the CPU moves nothing), and so are tensors
below :data:`SMALL_TENSOR_BYTES` and the region's own parameters and buffers, which stay
alive anyway. Accelerators without streams get plain synchronous copies.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
import weakref
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._host import HostPool, Lanes, device_lanes

__all__ = ["SMALL_TENSOR_BYTES", "HostPool", "Lanes", "Offloader", "default_offloader"]

SMALL_TENSOR_BYTES = 1 << 20
"""Saved tensors smaller than this stay on the device: their copy would cost more in
launch overhead than the memory it frees."""


@dataclasses.dataclass
class OffloadStats:
    """Counts since the offloader was made (or :meth:`Offloader.reset_stats`)."""

    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    """Bytes copied to the host (each tensor's span in its storage)."""
    tensors_kept: int = 0
    """Saved tensors left on the device: small ones, parameters and buffers."""
    bytes_fetched: int = 0


class _Saved:
    """One offloaded tensor, as autograd holds it between forward and backward.

    Its host buffer goes back to the pool when autograd drops it (the graph is freed,
    after the last backward that could need it), never when it is merely unpacked:
    ``retain_graph=True`` may unpack it again.
    """

    __slots__ = (
        "region", "host", "pinned", "size", "stride", "dtype", "device", "span",
        "copied", "fetched", "device_copy", "compute", "pool", "__weakref__",
    )

    def __del__(self) -> None:
        try:
            if self.device_copy is not None and self.compute is not None:
                # Fetched ahead but never used: the compute stream must not reuse this
                # memory before the copy into it is done.
                self.compute.wait_event(self.fetched)
            last = self.fetched if self.fetched is not None else self.copied
            self.pool.give(self.host, self.pinned, last)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to return to
            pass


class _Region:
    """The tensors one region's forward offloaded, in order."""

    __slots__ = ("offloader", "index", "keep", "saved", "seen", "started", "fetched", "__weakref__")

    def __init__(self, offloader: "Offloader", index: int, keep: Set[int]) -> None:
        self.offloader = offloader
        self.index = index
        self.keep = keep  # storages of the region's parameters and buffers
        self.saved: List["weakref.ref[_Saved]"] = []
        self.seen: Dict[Tuple[Any, ...], Tuple["weakref.ref[_Saved]", StorageWeakRef]] = {}
        self.started = False  # backward has unpacked one of its tensors
        self.fetched = False  # every tensor's host-to-device copy has been issued

    def pack(self, tensor: torch.Tensor) -> Any:
        return self.offloader._pack(self, tensor)

    def unpack(self, packed: Any) -> torch.Tensor:
        return self.offloader._unpack(packed)


class Offloader:
    """Saved-tensor hooks for offloaded regions, with their streams, pool and bookkeeping.

    Args:
        lanes_for: Streams for a device, or None to copy synchronously (CPU tensors are
            never offloaded unless this returns lanes for them, which tests do).
        min_bytes: Tensors smaller than this stay where they are.
        pool: Host buffers; a new pool if None.
    """

    def __init__(
        self,
        *,
        lanes_for: Callable[[torch.device], Optional[Lanes]] = device_lanes,
        min_bytes: int = SMALL_TENSOR_BYTES,
        pool: Optional[HostPool] = None,
    ) -> None:
        self._lanes_for = lanes_for
        self._lanes: Dict[torch.device, Optional[Lanes]] = {}
        self.min_bytes = min_bytes
        self.pool = pool if pool is not None else HostPool()
        self.stats = OffloadStats()
        self._regions: List["weakref.ref[_Region]"] = []
        self._counter = itertools.count()
        # Device-to-host copies in flight: (event, source, region index). The source is held
        # until its copy is done, so its memory cannot be reused under the copy.
        self._pending: Deque[Tuple[Any, torch.Tensor, int]] = collections.deque()
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def region(self, owner: Optional[torch.nn.Module] = None) -> Iterator[None]:
        """Offload the tensors saved for backward inside the block, as one region."""
        keep = set()
        if owner is not None:
            for tensor in itertools.chain(owner.parameters(), owner.buffers()):
                with contextlib.suppress(RuntimeError, NotImplementedError):  # lazy, subclasses
                    keep.add(tensor.untyped_storage().data_ptr())
        with self._lock:
            self._regions = [ref for ref in self._regions if ref() is not None]
            region = _Region(self, next(self._counter), keep)
            self._regions.append(weakref.ref(region))
        try:
            with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
                yield
        finally:
            self._bound_pending(region.index)

    def release_finished(self, *, wait: bool = False) -> None:
        """Let go of the sources whose device-to-host copy is done (all of them, waiting
        for each, if ``wait``)."""
        with self._lock:
            while self._pending and (wait or self._pending[0][0].query()):
                event, _, _ = self._pending.popleft()
                if wait:
                    event.synchronize()

    def reset_stats(self) -> None:
        """Start counting :attr:`stats` from zero."""
        self.stats = OffloadStats()

    # ------------------------------------------------------------------ hooks

    def _pack(self, region: _Region, tensor: torch.Tensor) -> Any:
        device = tensor.device
        if not self._movable(region, tensor):
            self.stats.tensors_kept += 1
            return tensor
        lanes = self._lanes_of(device)
        if lanes is None:
            if device.type == "cpu":
                return tensor
            # No streams to overlap with: a plain copy, as torch's save_on_cpu makes.
            self.stats.tensors_offloaded += 1
            self.stats.bytes_offloaded += tensor.nbytes
            return (device, tensor.cpu())
        span = _span(tensor)
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride(), tensor.dtype, tensor._version)
        known = region.seen.get(key)
        if known is not None and not known[1].expired() and known[0]() is not None:
            return known[0]()  # the same tensor saved again by another operator: copy it once
        self.release_finished()
        saved = self._offload(lanes, tensor, span, region.index)
        saved.region = region
        region.saved.append(weakref.ref(saved))
        # Keyed by address, which a later tensor may reuse once this one is freed: the
        # entry holds only while the storage it names is alive.
        region.seen[key] = (weakref.ref(saved), StorageWeakRef(tensor.untyped_storage()))
        return saved

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device)
        region = packed.region
        self.release_finished()
        if not region.started:
            # Backward has reached this region: fetch all of it now, then the region
            # before it, whose copies overlap this region's backward.
            region.started = True
            self._fetch_region(region)
            previous = self._previous(region)
            if previous is not None and not previous.started:
                self._fetch_region(previous)
        if packed.device_copy is None:
            self._fetch(packed)  # unpacked again (retain_graph), or saved after the fetch
        lanes = self._lanes_of(packed.device)
        lanes.current().wait_event(packed.fetched)
        # Handed to autograd, which frees it when done; a second backward fetches anew.
        result, packed.device_copy, packed.compute = packed.device_copy, None, None
        return result

    # ------------------------------------------------------------------ copies

    def _movable(self, region: _Region, tensor: torch.Tensor) -> bool:
        if tensor.device.type in ("cpu", "meta") and self._lanes_of(tensor.device) is None:
            return False
        if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if _span(tensor) * tensor.element_size() < self.min_bytes:
            return False
        return tensor.untyped_storage().data_ptr() not in region.keep

    def _offload(self, lanes: Lanes, tensor: torch.Tensor, span: int, index: int) -> _Saved:
        nbytes = span * tensor.element_size()
        host, last_reader = self.pool.take(nbytes, pin=lanes.pin)
        compute = lanes.current()
        # The side stream starts after the kernels that wrote the tensor, and after the
        # last copy that read this buffer.
        lanes.d2h.wait_stream(compute)
        if last_reader is not None:
            lanes.d2h.wait_event(last_reader)
        with lanes.use(lanes.d2h):
            # The tensor's whole span in its storage, so any strides come back as they were.
            flat = tensor.as_strided((span,), (1,))
            host.view(tensor.dtype).copy_(flat, non_blocking=True)
        copied = lanes.d2h.record_event()
        with self._lock:
            self._pending.append((copied, tensor, index))
        saved = _Saved.__new__(_Saved)
        saved.host, saved.pinned, saved.span = host, lanes.pin, span
        saved.size, saved.stride, saved.dtype, saved.device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        saved.copied, saved.fetched, saved.device_copy, saved.compute = copied, None, None, None
        saved.pool = self.pool
        self.stats.tensors_offloaded += 1
        self.stats.bytes_offloaded += nbytes
        return saved

    def _fetch(self, saved: _Saved) -> None:
        lanes = self._lanes_of(saved.device)
        compute = lanes.current()
        # Allocated on the compute stream, which owns it afterwards; the side stream waits
        # for the compute stream's earlier use of that memory, and for the host data.
        flat = torch.empty(saved.span, dtype=saved.dtype, device=saved.device)
        lanes.h2d.wait_stream(compute)
        lanes.h2d.wait_event(saved.copied)
        with lanes.use(lanes.h2d):
            flat.copy_(saved.host.view(saved.dtype), non_blocking=True)
        saved.fetched = lanes.h2d.record_event()
        saved.device_copy = flat.as_strided(saved.size, saved.stride, 0)
        saved.compute = compute
        self.stats.bytes_fetched += saved.span * flat.element_size()

    def _fetch_region(self, region: _Region) -> None:
        if region.fetched:
            return
        region.fetched = True
        for ref in region.saved:
            saved = ref()
            if saved is not None and saved.device_copy is None:
                self._fetch(saved)

    def _previous(self, region: _Region) -> Optional[_Region]:
        """The live region entered last before ``region``."""
        with self._lock:
            earlier = [r for r in (ref() for ref in self._regions) if r is not None and r.index < region.index]
        return max(earlier, key=lambda r: r.index) if earlier else None

    def _bound_pending(self, index: int) -> None:
        """At the end of a region's forward, wait for copies of regions before the
        previous one: their sources would otherwise stay on the device."""
        with self._lock:
            while self._pending and self._pending[0][2] < index - 1:
                self._pending.popleft()[0].synchronize()
        self.release_finished()

    def _lanes_of(self, device: torch.device) -> Optional[Lanes]:
        if device not in self._lanes:
            with self._lock:
                if device not in self._lanes:
                    self._lanes[device] = self._lanes_for(device)
        return self._lanes[device]


def _span(tensor: torch.Tensor) -> int:
    """Elements of the storage from the tensor's first to its last element."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


_DEFAULT: Optional[Offloader] = None
_DEFAULT_LOCK = threading.Lock()


def default_offloader() -> Offloader:
    """The process's offloader, made on first use (so importing touches no device)."""
    global _DEFAULT
    if _DEFAULT is None:
        with _DEFAULT_LOCK:
            if _DEFAULT is None:
                _DEFAULT = Offloader()
    return _DEFAULT

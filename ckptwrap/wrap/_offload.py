"""Offloading a region's saved tensors to host memory, with copies that overlap compute.

The ``offload`` tier keeps the tensors a region saves for backward in pinned host memory.
Copies run on side streams so that they overlap the model's kernels: device-to-host as the
forward saves each tensor, host-to-device for a whole region when a backward pass reaches
it, and ahead of time for the region before it (regions are entered in forward order and
their backward runs in reverse). Each storage is copied once however many of its views are
saved, and fetched once per backward pass however many operators unpack it. Host buffers
come from a bounded pool and are reused step after step.

CPU tensors are kept as they are (moving them to the CPU moves nothing), and so are tensors
below :data:`SMALL_TENSOR_BYTES` and what :class:`~._offload_keep.Keep` keeps (the
region's parameters, buffers and their casts). Accelerators without streams get plain
synchronous copies. ``_offload_testing`` runs all of this on the CPU, for tests.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
import weakref
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._host import HostPool, Lanes, device_lanes
from ._offload_keep import Keep
from ._offload_pass import PassClock
from ._offload_saved import Saved, Stored, span

__all__ = ["SMALL_TENSOR_BYTES", "HostPool", "Lanes", "OffloadStats", "Offloader", "default_offloader"]

SMALL_TENSOR_BYTES = 1 << 20
"""Saved tensors smaller than this stay on the device: their copy would cost more in
launch overhead than the memory it frees."""


@dataclasses.dataclass
class OffloadStats:
    """Counts since the offloader was made (or :meth:`Offloader.reset_stats`)."""

    tensors_offloaded: int = 0
    """Copies to the host: one per storage a region saved (or per part of one, for a small
    view of a large storage), however many of its views were saved and how often."""
    bytes_offloaded: int = 0
    """Bytes copied to the host."""
    tensors_kept: int = 0
    """Saved tensors left on the device: small ones, parameters, buffers and their casts."""
    tensors_fetched: int = 0
    """Copies back to the device: one per host copy per backward pass that needs it."""
    bytes_fetched: int = 0
    """Bytes copied back to the device."""
    bytes_resident: int = 0
    """Bytes handed to backward from the device source itself, still there because its
    copy to the host had not been let go of yet: nothing fetched."""


class _Region:
    """The host copies one region's forward made, in order, and per backward pass whether
    they were fetched and whether the pass reached the region."""

    __slots__ = ("offloader", "index", "keep", "stored", "seen", "started", "fetched", "__weakref__")

    def __init__(self, offloader: "Offloader", index: int, keep: Keep) -> None:
        self.offloader = offloader
        self.index = index
        self.keep = keep
        self.stored: List["weakref.ref[Stored]"] = []
        # (storage address, version) -> its host copies. Keyed by address, which a later
        # storage may reuse once this one is freed: an entry holds while its storage lives.
        self.seen: Dict[Tuple[int, int], List[Tuple["weakref.ref[Stored]", StorageWeakRef]]] = {}
        self.started: Optional[int] = None  # the backward pass that last unpacked here
        self.fetched: Optional[int] = None  # the backward pass that last fetched it all

    def pack(self, tensor: torch.Tensor) -> Any:
        return self.offloader._pack(self, tensor)

    def unpack(self, packed: Any) -> torch.Tensor:
        return self.offloader._unpack(packed)

    def find(self, key: Tuple[int, int], start: int, stop: int, itemsize: int) -> Optional[Stored]:
        """A host copy of this storage version that holds bytes ``start:stop``."""
        for ref, storage in self.seen.get(key, ()):
            stored = ref()
            if stored is not None and not storage.expired() and stored.holds(start, stop, itemsize):
                return stored
        return None


class Offloader:
    """Saved-tensor hooks for offloaded regions, with their streams, pool and bookkeeping.

    Args:
        lanes_for: Streams for a device, or None to copy synchronously (CPU tensors are
            never offloaded unless this returns lanes for them, which tests do: see
            ``_offload_testing``).
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
        # Host copies whose device-to-host copy may still read their source, which is held
        # so that its memory cannot be reused under the copy, in the order they were made.
        self._pending: Deque[Stored] = collections.deque()
        # Per backward pass, the host copies it fetched: what it did not use goes at its end.
        self._fetched: Dict[int, List["weakref.ref[Stored]"]] = {}
        self._passes = PassClock(self._end_pass)
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def region(self, owner: Optional[torch.nn.Module] = None) -> Iterator[None]:
        """Offload the tensors saved for backward inside the block, as one region.

        Raises:
            CheckpointConfigError: ``owner`` holds a nested FSDP unit.
        """
        keep = Keep(owner)
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
        for each on the host, if ``wait``)."""
        with self._lock:
            while self._pending:
                stored = self._pending[0]
                if stored.source is not None and not wait and not stored.copied.query():
                    break
                self._pending.popleft()
                if stored.source is not None and wait:
                    stored.copied.synchronize()
                stored.source = None

    def reset_stats(self) -> None:
        """Start counting :attr:`stats` from zero."""
        self.stats = OffloadStats()

    # ------------------------------------------------------------------ hooks

    def _pack(self, region: _Region, tensor: torch.Tensor) -> Any:
        if not self._movable(region, tensor):
            self.stats.tensors_kept += 1
            return tensor
        device = tensor.device
        lanes = self._lanes_of(device)
        if lanes is None:
            # No streams to overlap with: a plain copy, as torch's save_on_cpu makes.
            self.stats.tensors_offloaded += 1
            self.stats.bytes_offloaded += tensor.nbytes
            return (device, tensor.cpu())
        storage = tensor.untyped_storage()
        itemsize = tensor.element_size()
        start = tensor.storage_offset() * itemsize
        stop = start + span(tensor) * itemsize
        key = (storage.data_ptr(), tensor._version)
        stored = region.find(key, start, stop, itemsize)
        if stored is None:
            self.release_finished()
            stored = self._offload(lanes, region, tensor, self._extent(storage.nbytes(), start, stop, itemsize))
            region.stored.append(weakref.ref(stored))
            region.seen.setdefault(key, []).append((weakref.ref(stored), StorageWeakRef(storage)))
        stored.packs += 1
        return Saved(stored, tensor, start)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device)
        stored = packed.stored
        lanes = self._lanes_of(stored.device)
        key = self._passes.current()
        if key is None:
            # Read outside backward (``grad_fn._saved_...``): a copy of its own, kept nowhere.
            flat, ready, home = self._bring(stored, lanes)
            return packed.view(self._hand_out(lanes, flat, ready, home))
        region = stored.region
        if region.started != key:
            # Backward has reached this region: fetch all of it now, then the region
            # before it, whose copies overlap this region's backward.
            region.started = key
            self._fetch_region(region, key)
            previous = self._previous(region)
            if previous is not None:
                self._fetch_region(previous, key)
        if stored.pass_key != key or stored.device_copy is None:
            self._fetch(stored, key, lanes)  # saved after the region's fetch, or used up
        flat = self._hand_out(lanes, stored.device_copy, stored.ready, stored.home)
        stored.handed = True
        stored.unpacks += 1
        if stored.unpacks >= stored.packs:
            # Every view of it has been unpacked in this pass: autograd holds what it needs.
            self._drop(stored)
        return packed.view(flat)

    # ------------------------------------------------------------------ copies

    def _movable(self, region: _Region, tensor: torch.Tensor) -> bool:
        if tensor.device.type in ("cpu", "meta") and self._lanes_of(tensor.device) is None:
            return False
        if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if tensor.numel() == 0 or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
            return False
        if span(tensor) * tensor.element_size() < self.min_bytes:
            return False
        return not region.keep.holds(tensor, tensor.untyped_storage().data_ptr())

    @staticmethod
    def _extent(nbytes: int, start: int, stop: int, itemsize: int) -> Tuple[int, int]:
        """The bytes of a storage to copy for a view spanning ``start:stop``: all of them
        when the view spans at least half (its sibling views, such as q, k and v split from
        one projection, then share the copy), else the view's own span."""
        if 2 * (stop - start) >= nbytes and nbytes % itemsize == 0:
            return 0, nbytes
        return start, stop

    def _offload(self, lanes: Lanes, region: _Region, tensor: torch.Tensor, extent: Tuple[int, int]) -> Stored:
        lo, hi = extent
        itemsize = tensor.element_size()
        host, last_reader = self.pool.take(hi - lo, pin=lanes.pin)
        compute = lanes.current()
        # The side stream starts after the kernels that wrote the tensor, and after the
        # last copy that read this buffer.
        lanes.d2h.wait_stream(compute)
        if last_reader is not None:
            lanes.d2h.wait_event(last_reader)
        # The storage's bytes lo:hi, as one flat run of bytes.
        source = tensor.detach().as_strided(((hi - lo) // itemsize,), (1,), lo // itemsize).view(torch.uint8)
        with lanes.use(lanes.d2h):
            host[: hi - lo].copy_(source, non_blocking=True)
        stored = Stored(region, self.pool, host, lanes.pin, lo, hi, tensor)
        stored.copied, stored.stream, stored.source = lanes.d2h.record_event(), compute, source
        with self._lock:
            self._pending.append(stored)
        self.stats.tensors_offloaded += 1
        self.stats.bytes_offloaded += hi - lo
        return stored

    def _bring(self, stored: Stored, lanes: Lanes) -> Tuple[torch.Tensor, Any, Any]:
        """The stored bytes on the device: (flat bytes, event to wait for or None, stream
        the memory belongs to). The source itself while it is still held there."""
        source = stored.source
        if source is not None and source._version == stored.version:
            self.stats.bytes_resident += stored.nbytes
            return source, None, stored.stream
        compute = lanes.current()
        # Allocated on the compute stream, which owns it afterwards; the side stream waits
        # for the compute stream's earlier use of that memory, and for the host data.
        flat = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
        lanes.h2d.wait_stream(compute)
        lanes.h2d.wait_event(stored.copied)
        with lanes.use(lanes.h2d):
            flat.copy_(stored.host[: stored.nbytes], non_blocking=True)
        ready = stored.last_read = lanes.h2d.record_event()
        self.stats.tensors_fetched += 1
        self.stats.bytes_fetched += stored.nbytes
        return flat, ready, compute

    @staticmethod
    def _hand_out(lanes: Lanes, flat: torch.Tensor, ready: Any, home: Any) -> torch.Tensor:
        consumer = lanes.current()
        if ready is not None:
            consumer.wait_event(ready)
        if consumer != home:
            # Allocated on another stream: its memory must not be reused before this
            # stream's work on it is done.
            lanes.record(flat, consumer)
        return flat

    def _fetch(self, stored: Stored, key: int, lanes: Optional[Lanes] = None) -> None:
        self._drop(stored)
        lanes = lanes if lanes is not None else self._lanes_of(stored.device)
        stored.device_copy, stored.ready, stored.home = self._bring(stored, lanes)
        stored.pass_key, stored.unpacks, stored.handed = key, 0, False
        with self._lock:
            self._fetched.setdefault(key, []).append(weakref.ref(stored))

    def _fetch_region(self, region: _Region, key: int) -> None:
        if region.fetched == key:
            return
        region.fetched = key
        for ref in region.stored:
            stored = ref()
            if stored is not None and stored.pass_key != key:
                self._fetch(stored, key)

    def _drop(self, stored: Stored) -> None:
        """Let go of ``stored``'s device copy (and of its source, once it was handed out)."""
        if stored.device_copy is None:
            return
        if stored.ready is not None and not stored.handed:
            # Fetched and never used: the stream that owns this memory must not reuse it
            # before the copy into it is done.
            stored.home.wait_event(stored.ready)
        if stored.ready is None and stored.source is not None:
            # The resident source, used up: free it once its copy to the host is done,
            # without waiting on the host (the host copy serves any later pass).
            stored.stream.wait_event(stored.copied)
            stored.source = None
        stored.device_copy = stored.ready = stored.home = None

    def _end_pass(self, key: int) -> None:
        """A backward pass ended: drop what it fetched and did not use, and let go of the
        sources still held for it."""
        with self._lock:
            fetched = self._fetched.pop(key, [])
            for other in [k for k in self._fetched if not self._passes.is_open(k)]:
                del self._fetched[other]  # passes that raised: their callback never came
        for ref in fetched:
            stored = ref()
            if stored is not None and stored.pass_key == key:
                self._drop(stored)
        self._settle_pending(lambda stored: True)

    def _previous(self, region: _Region) -> Optional[_Region]:
        """The live region entered last before ``region``."""
        with self._lock:
            earlier = [r for r in (ref() for ref in self._regions) if r is not None and r.index < region.index]
        return max(earlier, key=lambda r: r.index) if earlier else None

    def _bound_pending(self, index: int) -> None:
        """At the end of a region's forward, let go of the sources of regions before the
        previous one: the compute stream waits for their copies (the host does not)."""
        self._settle_pending(lambda stored: stored.region.index < index - 1)
        self.release_finished()

    def _settle_pending(self, due: Callable[[Stored], bool]) -> None:
        with self._lock:
            while self._pending and due(self._pending[0]):
                stored = self._pending.popleft()
                if stored.source is not None:
                    # Its memory is reused only after the copy reading it is done.
                    stored.stream.wait_event(stored.copied)
                    stored.source = None

    def _lanes_of(self, device: torch.device) -> Optional[Lanes]:
        if device not in self._lanes:
            with self._lock:
                if device not in self._lanes:
                    self._lanes[device] = self._lanes_for(device)
        return self._lanes[device]


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

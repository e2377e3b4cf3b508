"""Offloading a region's saved tensors to host memory, with copies that overlap compute.

The ``offload`` tier keeps the tensors a region saves for backward in pinned host memory.
Copies run on side streams so that they overlap the model's kernels: device-to-host as the
forward saves each tensor, host-to-device for a whole region when a backward pass reaches
it, and ahead of time for the region before it (regions are entered in forward order and
their backward runs in reverse). Each storage is copied once however many of its views are
saved (what autograd holds is a :class:`Saved` view of a :class:`Stored` host copy), and
fetched once per backward pass however many operators unpack it (``retain_graph=True``, a
second ``backward``, a partial ``torch.autograd.grad`` are each a pass of their own: the
copies a pass fetched and did not use are dropped when it ends). Host buffers come from a
bounded pool and are reused step after step.

CPU tensors are kept as they are (moving them to the CPU moves nothing), and so are tensors
below :data:`SMALL_TENSOR_BYTES` and what :class:`Keep` keeps: the region's parameters,
buffers and their casts (autocast's bf16 copies of fp32 weights, a model's own
``weight.to(dtype)``), which the plain run holds anyway. Nested FSDP units are refused: FSDP
frees their gathered parameters under the copy. Accelerators without streams get plain
synchronous copies. Tests run all of this on the CPU, through stand-in streams.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import sys
import threading
import weakref
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _torch_private
from .._errors import CheckpointConfigError

__all__ = [
    "Lanes",
    "Offloader",
    "default_offloader",
]


_SMALLEST_CLASS = 512


def size_class(nbytes: int) -> int:
    """The buffer size ``nbytes`` is rounded up to: four classes per power of two (5/8,
    6/8, 7/8 and 8/8 of it), so a buffer is at most 25% larger than asked for and a
    sequence length that changes a little lands in a class already pooled."""
    if nbytes <= _SMALLEST_CLASS:
        return _SMALLEST_CLASS
    step = (1 << (nbytes - 1).bit_length()) // 8
    return -(-nbytes // step) * step


class HostPool:
    """Host buffers (flat ``uint8``) reused across steps, in size classes, with a bound on
    the bytes kept idle.

    A request takes an idle buffer of its size class, or one of the next classes up to
    twice its size; otherwise a new one is allocated. When more than ``max_idle_bytes``
    sit idle, the least recently returned buffers are dropped (pinned ones go back to
    torch's own pinned-memory cache, which reuses them by size).

    A buffer comes back with the event of the last copy that read it; whoever takes it next
    makes its own copy wait on that event, so a buffer is never overwritten while an earlier
    host-to-device copy still reads it. Buffers are given back from finalizers, possibly on
    another thread or in the middle of a garbage collection, so giving back only appends to
    a deque (atomic) and taking drains that deque under a lock.

    Args:
        max_idle_bytes: Most bytes kept idle. None: the most bytes ever lent at once, so
            the pool holds at most one more step's worth of buffers than the largest step
            needed, however often shapes change.
    """

    def __init__(self, *, max_idle_bytes: Optional[int] = None) -> None:
        if max_idle_bytes is not None and max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be None or >= 0, got {max_idle_bytes!r}")
        self.max_idle_bytes = max_idle_bytes
        # Idle buffers by (size, pinned), oldest on the left, and every idle buffer's
        # sequence number in the order it came back, for eviction.
        self._free: Dict[Tuple[int, bool], Deque[Tuple[int, torch.Tensor, Any]]] = {}
        self._order: "collections.OrderedDict[int, Tuple[int, bool]]" = collections.OrderedDict()
        self._sequence = itertools.count()
        self._returned: Deque[Tuple[torch.Tensor, bool, Any]] = collections.deque()
        self._lock = threading.Lock()
        self.allocations = 0
        """Buffers allocated so far (not reused)."""
        self.allocated_bytes = 0
        """Bytes of all buffers allocated so far."""
        self.evictions = 0
        """Idle buffers dropped to keep within the bound."""
        self.peak_lent_bytes = 0
        """The most bytes lent at once so far."""
        self._lent = 0
        self._lent_bytes = 0
        self._idle_bytes = 0

    def take(self, nbytes: int, *, pin: bool) -> Tuple[torch.Tensor, Any]:
        """A buffer of at least ``nbytes`` bytes, and the event its last reader recorded
        (None for a new buffer). Give the whole buffer back, not a slice of it."""
        size = size_class(nbytes)
        with self._lock:
            self._drain()
            found = self._pop(size, pin)
            if found is None:
                self.allocations += 1
                self.allocated_bytes += size
            else:
                size = found[0].numel()
            self._lent += 1
            self._lent_bytes += size
            self.peak_lent_bytes = max(self.peak_lent_bytes, self._lent_bytes)
        if found is not None:
            return found
        return torch.empty(size, dtype=torch.uint8, pin_memory=pin), None

    def give(self, buffer: torch.Tensor, pinned: bool, last_use: Any = None) -> None:
        """Return ``buffer``; ``last_use`` is the event after which nothing reads it."""
        self._returned.append((buffer, pinned, last_use))

    @property
    def lent(self) -> int:
        """Buffers taken and not given back yet."""
        with self._lock:
            self._drain()
            return self._lent

    @property
    def idle_bytes(self) -> int:
        """Bytes of the buffers waiting in the pool to be reused."""
        with self._lock:
            self._drain()
            return self._idle_bytes

    def free_buffers(self) -> int:
        """Buffers waiting in the pool to be reused."""
        with self._lock:
            self._drain()
            return len(self._order)

    def clear(self) -> None:
        """Drop every idle buffer (those lent out come back later as usual)."""
        with self._lock:
            self._drain()
            self._free.clear()
            self._order.clear()
            self._idle_bytes = 0

    def _pop(self, size: int, pin: bool) -> Optional[Tuple[torch.Tensor, Any]]:
        candidate = size
        while candidate <= 2 * size:
            idle = self._free.get((candidate, pin))
            if idle:
                sequence, buffer, last_use = idle.pop()  # the most recent: likeliest warm
                del self._order[sequence]
                self._idle_bytes -= candidate
                return buffer, last_use
            candidate = size_class(candidate + 1)
        return None

    def _drain(self) -> None:
        while self._returned:
            buffer, pinned, last_use = self._returned.popleft()  # in the order given back
            size = buffer.numel()
            self._lent -= 1
            self._lent_bytes -= size
            sequence = next(self._sequence)
            self._free.setdefault((size, pinned), collections.deque()).append((sequence, buffer, last_use))
            self._order[sequence] = (size, pinned)
            self._idle_bytes += size
        bound = self.max_idle_bytes if self.max_idle_bytes is not None else self.peak_lent_bytes
        while self._idle_bytes > bound:
            sequence, key = self._order.popitem(last=False)
            oldest = self._free[key].popleft()  # a class's oldest is on its left
            assert oldest[0] == sequence
            self._idle_bytes -= key[0]
            self.evictions += 1


@dataclasses.dataclass
class Lanes:
    """The streams of one device: the compute stream is whatever is current; copies run on
    two side streams of their own.

    Attributes:
        d2h: Side stream for device-to-host copies.
        h2d: Side stream for host-to-device copies.
        current: Returns the device's current (compute) stream.
        use: Context manager factory that makes a stream current.
        pin: Whether host buffers for this device are pinned.
        record_stream: Tells the allocator that a tensor is used on a stream other than
            the one it was allocated on (keeps its memory from reuse until that stream's
            work queued so far is done).
    """

    d2h: Any
    h2d: Any
    current: Callable[[], Any]
    use: Callable[[Any], Any]
    pin: bool = True
    record_stream: Callable[[torch.Tensor, Any], None] = torch.Tensor.record_stream


def device_lanes(device: torch.device) -> Optional[Lanes]:
    """Streams for ``device``; None for the CPU and for devices without streams."""
    if device.type in ("cpu", "meta"):
        return None
    if device.type == "cuda":
        return Lanes(
            d2h=torch.cuda.Stream(device),
            h2d=torch.cuda.Stream(device),
            current=lambda: torch.cuda.current_stream(device),
            use=torch.cuda.stream,
        )
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None or accelerator.type != device.type or not hasattr(torch.Stream, "__enter__"):
        return None
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    try:
        return Lanes(
            d2h=torch.Stream(device=torch.device(device.type, index)),
            h2d=torch.Stream(device=torch.device(device.type, index)),
            current=lambda: torch.accelerator.current_stream(index),
            use=lambda stream: stream,
        )
    except (RuntimeError, NotImplementedError):  # a backend without stream support
        return None


# Where FSDP's module classes live, by torch version (FSDP2 public from 2.6, composable
# before; FSDP1). Only modules already imported are consulted: a model cannot hold an FSDP
# unit unless FSDP was imported. The check walks the owner's submodules at each entry.
_FSDP_CLASSES = (
    ("torch.distributed.fsdp", "FSDPModule"),
    ("torch.distributed._composable.fsdp", "FSDPModule"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel"),
)


def _fsdp_types() -> Tuple[type, ...]:
    found = []
    for module_name, attribute in _FSDP_CLASSES:
        cls = getattr(sys.modules.get(module_name), attribute, None)
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


def _refuse_nested_fsdp(owner: torch.nn.Module) -> None:
    types = _fsdp_types()
    nested = next((m for m in owner.modules() if m is not owner and isinstance(m, types)), None) if types else None
    if nested is None:
        return
    name = next(name for name, module in owner.named_modules() if module is nested)
    kind = type(owner).__name__
    raise CheckpointConfigError(
        f"{kind} is offloaded (the 'offload' tier) but its submodule {name!r} "
        f"({type(nested).__name__}) is an FSDP unit of its own: FSDP frees that unit's "
        f"gathered parameters after its forward, while the offload tier may still be "
        f"copying them to host memory. Apply fully_shard to {kind} itself or to a module "
        f"above it, not inside it, or leave {kind} out of the offload policy."
    )


def _autocast_dtypes(device_types: Set[str]) -> Dict[str, torch.dtype]:
    found = {}
    for device in device_types:
        with contextlib.suppress(RuntimeError, TypeError):  # a device type autocast does not know
            if torch.is_autocast_enabled(device):
                found[device] = torch.get_autocast_dtype(device)
    return found


def _storage(tensor: torch.Tensor) -> Optional[int]:
    with contextlib.suppress(RuntimeError, NotImplementedError):  # lazy tensors, subclasses
        return tensor.untyped_storage().data_ptr()
    return None


class Keep:
    """The storages one region keeps on the device, from its owner.

    During the owner's forward its parameters are the ones it computes with (FSDP2 has
    swapped in the gathered, unsharded ones by then), so their storages are known at
    entry. Casts are recognised as they are saved: a tensor (or a view of one) made by
    ``_to_copy`` straight from one of those parameters; under autocast (on at entry), also
    a cast of a frozen parameter, which has no autograd history: a tensor that does not
    require grad, in autocast's dtype, shaped like a frozen parameter of the owner. That
    last rule can keep an activation of the same shape too: it costs memory, never
    correctness.

    Args:
        owner: The region's module, or None for a plain function (nothing kept).

    Raises:
        CheckpointConfigError: ``owner`` holds an FSDP unit of its own below it.
    """

    __slots__ = ("storages", "frozen", "autocast")

    def __init__(self, owner: Optional[torch.nn.Module]) -> None:
        self.storages: Set[int] = set()
        self.frozen: Set[Tuple[int, ...]] = set()
        self.autocast: Dict[str, torch.dtype] = {}  # device type -> dtype, where enabled
        if owner is None:
            return
        _refuse_nested_fsdp(owner)
        for tensor in itertools.chain(owner.parameters(), owner.buffers()):
            pointer = _storage(tensor)
            if pointer is not None:
                self.storages.add(pointer)
        frozen = [p for p in owner.parameters() if not p.requires_grad]
        if frozen:
            self.frozen = {tuple(p.shape) for p in frozen}
            # Read here, not as tensors are saved: inside an operator autocast redispatches
            # to, torch.is_autocast_enabled() is False.
            self.autocast = _autocast_dtypes({p.device.type for p in frozen})

    def holds(self, tensor: torch.Tensor, pointer: int) -> bool:
        """Whether ``tensor`` (whose storage is at ``pointer``) stays on the device."""
        if pointer in self.storages:
            return True
        if self._is_cast(tensor):
            self.storages.add(pointer)  # its other views, saved later, are decided at once
            return True
        return False

    def _is_cast(self, tensor: torch.Tensor) -> bool:
        root = tensor._base if tensor._base is not None else tensor
        node = root.grad_fn
        if node is not None:
            if type(node).__name__ != "ToCopyBackward0" or not node.next_functions:
                return False
            variable = getattr(node.next_functions[0][0], "variable", None)  # AccumulateGrad's leaf
            return variable is not None and _storage(variable) in self.storages
        if root.requires_grad or self.autocast.get(root.device.type) != root.dtype:
            return False
        return tuple(root.shape) in self.frozen


def _queue_callback(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the current backward pass ends; False outside backward (or
    on a torch without the engine's callbacks)."""
    queue = _torch_private.queue_callback
    if queue is None:
        return False
    try:
        queue(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


class PassClock:
    """Keys for backward passes: one per pass, None outside backward.

    A pass is keyed by the autograd engine's graph task id (``_torch_private``: present in
    the torch 2.11 of the GPU machine and the 2.13 here). Where that reads -1 (outside
    backward, or a torch without it), a final callback of our own tells whether a backward
    runs and keys it until it ends; it cannot tell a backward nested in another from the
    outer one, which then share copies: still correct, fetched on demand. Without the
    engine's callbacks every unpack counts as outside backward: a copy of its own each
    time, the same gradients, no prefetch.

    Args:
        on_end: Called with a pass's key when that pass ends (not when it raises).
    """

    def __init__(self, on_end: Callable[[int], None]) -> None:
        self._on_end = on_end
        self._open: Set[int] = set()
        self._lock = threading.Lock()
        self._fallback: Optional[int] = None
        self._fallback_ids = itertools.count(start=-2, step=-1)  # apart from task ids (>= 0)

    def current(self) -> Optional[int]:
        """The key of the backward pass running now, or None outside backward."""
        task = _torch_private.graph_task_id()
        with self._lock:
            if task < 0 and self._fallback is not None:
                return self._fallback
            if task in self._open:
                return task
        key = task if task >= 0 else next(self._fallback_ids)
        if not _queue_callback(lambda: self._close(key)):
            return None
        with self._lock:
            self._open.add(key)
            if task < 0:
                self._fallback = key
        return key

    def is_open(self, key: int) -> bool:
        """Whether the pass ``key`` has begun and not ended yet."""
        with self._lock:
            return key in self._open

    def _close(self, key: int) -> None:
        with self._lock:
            self._open.discard(key)
            if self._fallback == key:
                self._fallback = None
        self._on_end(key)


def span(tensor: torch.Tensor) -> int:
    """Elements of the storage from the tensor's first to its last element."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


class Stored:
    """Bytes ``lo:hi`` of one storage, copied to a host buffer, and their device copy for
    the backward pass that needs them now.

    Its host buffer goes back to the pool when autograd drops the last view of it (the
    graph is freed, after the last backward that could need it), never when it is merely
    unpacked: ``retain_graph=True`` may unpack it again.
    """

    __slots__ = (
        "region", "pool", "host", "pinned", "lo", "hi", "device", "version",
        "copied", "stream", "source", "packs",
        "pass_key", "unpacks", "handed", "device_copy", "ready", "home", "last_read",
        "__weakref__",
    )

    def __init__(self, region: Any, pool: "HostPool", host: torch.Tensor, pinned: bool, lo: int, hi: int,
                 tensor: torch.Tensor) -> None:
        self.region = region
        self.pool, self.host, self.pinned = pool, host, pinned
        self.lo, self.hi = lo, hi
        self.device, self.version = tensor.device, tensor._version
        self.copied: Any = None  # event: the device-to-host copy is done
        self.stream: Any = None  # the compute stream at the copy, which the source belongs to
        self.source: Optional[torch.Tensor] = None  # the device bytes, held until copied
        self.packs = 0  # views handed to autograd: unpacks to expect per backward pass
        self.pass_key: Optional[int] = None  # the backward pass the device copy is for
        self.unpacks = 0  # in that pass
        self.handed = False  # the device copy was handed to autograd in that pass
        self.device_copy: Optional[torch.Tensor] = None
        self.ready: Any = None  # event: the host-to-device copy is done (None: the source)
        self.home: Any = None  # the stream the device copy's memory belongs to
        self.last_read: Any = None  # event of the last copy that read the host buffer

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    def holds(self, start: int, stop: int, itemsize: int) -> bool:
        """Whether a view spanning bytes ``start:stop`` of the storage, in elements of
        ``itemsize`` bytes, can be read from this copy."""
        return (
            self.lo <= start and stop <= self.hi
            and self.lo % itemsize == 0 and self.nbytes % itemsize == 0 and (start - self.lo) % itemsize == 0
        )

    def __del__(self) -> None:
        try:
            if self.device_copy is not None and self.ready is not None and not self.handed:
                # Fetched ahead but never used: the stream that owns this memory must not
                # reuse it before the copy into it is done.
                self.home.wait_event(self.ready)
            last = self.last_read if self.last_read is not None else self.copied
            self.pool.give(self.host, self.pinned, last)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to return to
            pass


class Saved:
    """One saved tensor: its place in a :class:`Stored` copy."""

    __slots__ = ("stored", "size", "stride", "offset", "dtype")

    def __init__(self, stored: Stored, tensor: torch.Tensor, start: int) -> None:
        self.stored = stored
        self.size, self.stride, self.dtype = tensor.shape, tensor.stride(), tensor.dtype
        self.offset = (start - stored.lo) // tensor.element_size()  # in elements, from lo

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor, read from ``flat``, the stored bytes on the device."""
        typed = flat.view(self.dtype)
        return typed.as_strided(self.size, self.stride, typed.storage_offset() + self.offset)


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

    __slots__ = ("index", "keep", "stored", "seen", "started", "fetched", "__weakref__")

    def __init__(self, index: int, keep: Keep) -> None:
        self.index = index
        self.keep = keep
        self.stored: List["weakref.ref[Stored]"] = []
        # (storage address, version) -> its host copies. Keyed by address, which a later
        # storage may reuse once this one is freed: an entry holds while its storage lives.
        self.seen: Dict[Tuple[int, int], List[Tuple["weakref.ref[Stored]", StorageWeakRef]]] = {}
        self.started: Optional[int] = None  # the backward pass that last unpacked here
        self.fetched: Optional[int] = None  # the backward pass that last fetched it all

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
            region = _Region(next(self._counter), keep)
            self._regions.append(weakref.ref(region))
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, region), self._unpack):
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
            lanes.record_stream(flat, consumer)
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

"""Host memory and streams for offloading: a bounded pool of (pinned) host buffers reused
step after step, and the side streams one device copies on.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any, Callable, Deque, Dict, Optional, Tuple

import torch

__all__ = ["HostPool", "Lanes", "device_lanes", "size_class"]

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
    def lent_bytes(self) -> int:
        """Bytes of the buffers taken and not given back yet."""
        with self._lock:
            self._drain()
            return self._lent_bytes

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
            the one it was allocated on; None: ``Tensor.record_stream``.
    """

    d2h: Any
    h2d: Any
    current: Callable[[], Any]
    use: Callable[[Any], Any]
    pin: bool = True
    record_stream: Optional[Callable[[torch.Tensor, Any], None]] = None

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s work queued so far is done."""
        if self.record_stream is None:
            tensor.record_stream(stream)
        else:
            self.record_stream(tensor, stream)


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

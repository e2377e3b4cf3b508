"""Host memory and streams for offloading: a pool of (pinned) host buffers reused step
after step, and the side streams one device copies on.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["HostPool", "Lanes", "device_lanes"]


class HostPool:
    """Host buffers (flat ``uint8``) reused by byte size.

    A buffer comes back with the event of the last copy that read it; whoever takes it next
    makes its own copy wait on that event, so a buffer is never overwritten while an earlier
    host-to-device copy still reads it. Buffers are given back from finalizers, possibly on
    another thread or in the middle of a garbage collection, so giving back only appends to
    a list (atomic) and taking drains that list under a lock.
    """

    def __init__(self) -> None:
        self._free: Dict[Tuple[int, bool], List[Tuple[torch.Tensor, Any]]] = collections.defaultdict(list)
        self._returned: List[Tuple[torch.Tensor, bool, Any]] = []
        self._lock = threading.Lock()
        self.allocations = 0
        """Buffers allocated so far (not reused)."""
        self.allocated_bytes = 0
        """Bytes of all buffers allocated so far."""
        self._lent = 0

    def take(self, nbytes: int, *, pin: bool) -> Tuple[torch.Tensor, Any]:
        """A buffer of exactly ``nbytes`` bytes, and the event its last reader recorded (or None)."""
        with self._lock:
            self._drain()
            free = self._free.get((nbytes, pin))
            self._lent += 1
            if free:
                return free.pop()
            self.allocations += 1
            self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin), None

    def give(self, buffer: torch.Tensor, pinned: bool, last_use: Any = None) -> None:
        """Return ``buffer``; ``last_use`` is the event after which nothing reads it."""
        self._returned.append((buffer, pinned, last_use))

    @property
    def lent(self) -> int:
        """Buffers taken and not given back yet."""
        with self._lock:
            self._drain()
            return self._lent

    def free_buffers(self) -> int:
        """Buffers waiting in the pool to be reused."""
        with self._lock:
            self._drain()
            return sum(len(free) for free in self._free.values())

    def clear(self) -> None:
        """Drop every free buffer (those lent out come back later as usual)."""
        with self._lock:
            self._drain()
            self._free.clear()

    def _drain(self) -> None:
        while self._returned:
            buffer, pinned, last_use = self._returned.pop()
            self._lent -= 1
            self._free[(buffer.numel(), pinned)].append((buffer, last_use))


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
    """

    d2h: Any
    h2d: Any
    current: Callable[[], Any]
    use: Callable[[Any], Any]
    pin: bool = True


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

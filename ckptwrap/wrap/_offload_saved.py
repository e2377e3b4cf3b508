"""What autograd holds for an offloaded tensor between forward and backward: a view
(:class:`Saved`, one per pack) of a host copy of its storage's bytes (:class:`Stored`, one
per storage version, shared by every view of it a region saved).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from ._host import HostPool

__all__ = ["Saved", "Stored", "span"]


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

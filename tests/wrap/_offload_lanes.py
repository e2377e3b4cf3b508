"""The offload tier on the CPU: CPU tensors are treated as device tensors.

``Offloader(lanes_for=CpuLanes(), min_bytes=0)`` (or :func:`cpu_offloader`) copies every
saved CPU tensor into unpinned host-pool buffers and back, synchronously, through the same
bookkeeping the device path uses: deduplication of repeated saves and views, prefetch per
backward pass, the pool's bound, byte counts. The streams and events stand in for a
device's, do nothing, and log what the device would have been asked to do.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch

from ckptwrap.wrap._offload import Lanes, Offloader

__all__ = ["CpuLanes", "FakeEvent", "FakeStream", "cpu_offloader"]

Entry = Tuple[str, ...]


class FakeEvent:
    """An event recorded on a :class:`FakeStream`; done at once unless its lanes say
    copies never finish, and then only once the host waits for it."""

    def __init__(self, stream: "FakeStream", done: bool) -> None:
        self.stream, self.done = stream, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.stream.log.append(("host", "synchronize", self.stream.name))
        self.done = True


class FakeStream:
    """A stream that runs nothing and logs ``(stream, what, other stream)``."""

    def __init__(self, name: str, log: List[Entry], *, finishes: bool = True) -> None:
        self.name, self.log, self.finishes = name, log, finishes

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append((self.name, "wait_stream", other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append((self.name, "wait_event", event.stream.name))

    def record_event(self) -> FakeEvent:
        return FakeEvent(self, self.finishes)

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r})"


class CpuLanes:
    """``lanes_for`` that gives CPU tensors stand-in streams, so that they are offloaded.

    Args:
        copies_finish: Whether device-to-host copies count as done at once. False keeps
            their sources held until the compute stream is made to wait for them, as on a
            device whose copies lag behind, so that backward finds them still resident.

    Attributes:
        log: What the streams were asked to do, in order.
        compute: The compute stream.
        stream: The stream current now: ``compute`` unless a test assigns another, to
            consume on a different stream (or uses :meth:`current`).
    """

    def __init__(self, *, copies_finish: bool = True) -> None:
        self.log: List[Entry] = []
        self.compute = FakeStream("compute", self.log)
        self.stream = self.compute
        self.lanes = Lanes(
            d2h=FakeStream("d2h", self.log, finishes=copies_finish),
            h2d=FakeStream("h2d", self.log),
            current=lambda: self.stream,
            use=self.current,
            pin=False,
            record_stream=self._record_stream,
        )

    def __call__(self, device: torch.device) -> Optional[Lanes]:
        return self.lanes if device.type == "cpu" else None

    @contextlib.contextmanager
    def current(self, stream: FakeStream) -> Iterator[FakeStream]:
        """Make ``stream`` the compute stream inside the block."""
        before, self.stream = self.stream, stream
        try:
            yield stream
        finally:
            self.stream = before

    def _record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append((stream.name, "record_stream", "tensor"))


def cpu_offloader(*, copies_finish: bool = True, min_bytes: int = 0, **options: Any) -> Offloader:
    """An :class:`Offloader` that offloads CPU tensors (of any size, by default); its lanes
    are ``offloader._lanes_for``."""
    return Offloader(lanes_for=CpuLanes(copies_finish=copies_finish), min_bytes=min_bytes, **options)

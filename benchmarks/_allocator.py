"""The allocator-level step meter the benchmarks share: the peak of the bytes a block of
code allocates on one device above what was allocated before it, from ``torch.profiler``'s
memory events (every allocation and free, operators' own workspaces and compiled code's
included). It is independent of ckptwrap's own meters, which the benchmarks judge.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocator_peak"]


def allocator_peak(step: Callable[[], None], device: str = "cpu") -> int:
    """Peak bytes ``step()`` allocates on ``device`` above what was live before it: the
    running sum of the allocator's events, in time order."""
    kind = torch.device(device).type
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == "cuda" else [])
    device_type = getattr(torch.autograd.DeviceType, kind.upper())
    if kind != "cpu":
        torch.accelerator.synchronize()
    with _quiet_stderr(), profile(activities=activities, profile_memory=True) as prof:
        step()
        if kind != "cpu":
            torch.accelerator.synchronize()
    events = [
        event for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == device_type
    ]
    live = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Hide the profiler library's start/stop lines, which it writes to file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)

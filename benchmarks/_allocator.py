"""The allocator-level step meter the benchmarks share: the peak of the bytes a block of
code allocates on one device above what was allocated before it, from ``torch.profiler``'s
memory events (every allocation and free, operators' own workspaces and compiled code's
included). It is independent of ckptwrap's own meters, which the benchmarks judge.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Dict, Iterator, List

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocator_peak", "events_peak"]


def allocator_peak(step: Callable[[], None], device: str = "cpu") -> int:
    """Peak bytes ``step()`` allocates on ``device`` above what was live before it: the
    running sum of the allocator's events, in time order (see :func:`events_peak`)."""
    kind = torch.device(device).type
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == "cuda" else [])
    if kind != "cpu":
        torch.accelerator.synchronize()
    with _quiet_stderr(), profile(activities=activities, profile_memory=True) as prof:
        step()
        if kind != "cpu":
            torch.accelerator.synchronize()
    return events_peak(prof, device)


def events_peak(prof: profile, device: str = "cpu") -> int:
    """The peak of the running sum of the allocations ``prof`` recorded on ``device`` and of
    the frees of those same blocks, in time order.

    A free of a block allocated before the profiled span is left out: the allocator reports
    it whenever an earlier profiled span saw the allocation, and such a free (an object of
    an earlier test collected by Python's garbage collector halfway through the step) would
    lower the step's own peak by bytes the step never held.
    """
    kind = torch.device(device).type
    allocations = []
    nodes: List[Any] = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == kind:
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    held: Dict[int, int] = {}
    live = peak = 0
    for _, pointer, size in sorted(allocations, key=lambda allocation: allocation[0]):
        if size > 0:
            held[pointer] = size
            live += size
            peak = max(peak, live)
        elif pointer in held:
            live -= held.pop(pointer)
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

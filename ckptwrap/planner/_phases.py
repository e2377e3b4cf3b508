"""A meter that cuts a stretch of work into phases and keeps, per phase, its peak, its
moments (the points at which its memory can peak) and its duration.

Peaks are read at the allocator, so memory that operators allocate inside themselves (a
convolution's workspace, on any thread) and memory no operator makes (the RNG state a
checkpoint keeps) count too: on accelerators from its peak statistics, on the CPU from
``torch.profiler``'s memory events, each cut a marker in the same trace. Moments are
counted at operators' outputs through a dispatch mode, in the order the program makes
them, so that the same code at another shape gives as many, in the same order. While a
profiler of the caller's is running on the CPU, none is started inside it (that would end
the caller's session): peaks are then the moments' highest. Some torch builds' profiler
library writes a line to stderr as a session starts and stops; they are left to go where
the process sends stderr, since hiding them would redirect the whole process's.
"""

from __future__ import annotations

import time
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from .. import _torch_private
from ..measure import StorageCounter

__all__ = ["Phase", "PhaseMeter", "profiler_running"]

_CUT = "ckptwrap::phase"


class Phase(NamedTuple):
    """One phase as the meter saw it; bytes are above what was allocated when the meter
    started."""

    label: str
    peak: int
    """The most bytes allocated at one time during the phase."""
    moments: Tuple[int, ...]
    """Bytes allocated at the phase's start and after each allocation in it: the points
    at which it can reach its peak, in order. Runs of the same code at other sizes give
    as many, in the same order."""
    seconds: float


def profiler_running() -> bool:
    """Whether a torch profiler (``torch.profiler`` or ``torch.autograd.profiler``) is
    recording in this thread."""
    return bool(_torch_private.profiler_enabled())


class PhaseMeter:
    """Cuts the work inside ``with`` into phases: call :meth:`cut` with the next phase's
    label at each boundary; :attr:`phases` is filled when the block exits (the first
    phase is labelled ``head``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: List[Phase] = []
        self._labels = ["head"]
        self._times: List[float] = []
        self._profiler: Any = None
        self._counter: Optional[_PhaseCounter] = None
        self._module = None if device.type == "cpu" else torch.get_device_module(device.type)
        self._counted: List[Tuple[int, Tuple[int, ...]]] = []

    @property
    def at_allocator(self) -> bool:
        """Whether the peaks are the allocator's (else operators' outputs only)."""
        return self._profiler is not None or self._module is not None

    def __enter__(self) -> "PhaseMeter":
        if self._module is not None:
            self._module.synchronize(self.device)
            self._start = self._module.memory_allocated(self.device)
            self._module.reset_peak_memory_stats(self.device)
        elif not profiler_running():
            self._profiler = _memory_profiler()
            self._profiler.__enter__()
        self._counter = _PhaseCounter(self.device.type).__enter__()
        self._times.append(time.perf_counter())
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cut("")
        assert self._counter is not None
        self._counter.__exit__(*exc)
        found = self._counted
        if self._profiler is not None:
            self._profiler.__exit__(*exc)
            peaks = _profiled_peaks(self._profiler, len(found))
            found = [(max(peak, at), moments) for (peak, moments), at in zip(found, peaks)]
        seconds = [b - a for a, b in zip(self._times, self._times[1:])]
        self.phases = [
            Phase(label, peak, moments, spent)
            for label, (peak, moments), spent in zip(self._labels, found, seconds)
        ]

    def cut(self, label: str) -> None:
        """End the phase in progress and begin ``label``."""
        if self._module is not None:
            self._module.synchronize(self.device)
        if self._profiler is not None:
            with torch.profiler.record_function(_CUT):
                pass
        assert self._counter is not None
        peak, moments = self._counter.cut()
        if self._module is not None:
            peak = max(peak, self._module.max_memory_allocated(self.device) - self._start)
            self._module.reset_peak_memory_stats(self.device)
        self._counted.append((max(0, peak), moments))
        self._times.append(time.perf_counter())
        self._labels.append(label)


def _memory_profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)


def _profiled_peaks(profiler: Any, phases: int) -> List[int]:
    """Per phase, the highest running total of the CPU allocator's events, cut at the
    markers."""
    events = profiler.profiler.kineto_results.events()
    cpu = torch.autograd.DeviceType.CPU
    timeline = []
    for event in events:
        if event.name() == _CUT:
            timeline.append((event.start_ns(), 1, 0))
        elif event.name() == "[memory]" and event.device_type() == cpu:
            timeline.append((event.start_ns(), 0, event.nbytes()))
    timeline.sort(key=lambda entry: (entry[0], entry[1]))
    peaks, live, peak = [], 0, 0
    for _, is_cut, nbytes in timeline:
        if is_cut:
            peaks.append(max(0, peak))
            peak = live
            continue
        live += nbytes
        peak = max(peak, live)
    return (peaks + [0] * phases)[:phases]


class _PhaseCounter(StorageCounter):
    """The storage counter, with the moments of the phase in progress."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, trace=True)
        self._phase_peak = 0
        self._phase_start = 0

    def _add(self, nbytes: int) -> None:
        super()._add(nbytes)
        self._phase_peak = max(self._phase_peak, self._live)

    def cut(self) -> Tuple[int, Tuple[int, ...]]:
        with self._lock:
            while self._freed:
                self._live -= self._freed.pop()
            moments = (self._phase_start, *self.moments)
            peak = max(self._phase_peak, self._phase_start)
            self.moments.clear()
            self._phase_peak = self._phase_start = self._live
        return peak, moments

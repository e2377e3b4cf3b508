"""A meter that cuts a training step into phases and keeps, per phase, its peak, its
moments (the points at which its memory can peak) and its duration.

Moments are counted in the order the program makes them, so that the same code at
another shape gives as many, in the same order: in the forward and in each recomputation
at operators' outputs, through a dispatch mode (``measure``'s storage counter); in the
backward, which runs with no dispatch mode (one would make autograd accumulate gradients
out of place), one per node of the graph, at the most it held (``measure``'s
``StepSpan``). On accelerators each phase's peak is also read at the allocator (its peak
statistics, reset at each cut), so that memory no operator returns (a kernel's
workspace) counts too; the matrix libraries' own workspaces, which the device keeps from
their first use to the end of the process, are made before the meter starts
(``measure``'s ``ready_libraries``), so that a process's first measured step does not
count them as its own. On the CPU, which keeps no such statistics, the peak is the
moments' highest: a node's moment is read from the allocator's events on the calling
thread (torch's legacy profiler, which starts no profiler library), and where a profiler
of the caller's records there, it is what the node received and returned;
``torch.profiler`` is never started, so that a meter inside a training step neither
disturbs the caller's profiler nor another thread's.

A step the meter follows may be the user's own: started in the forward's pre-hook, left
when the forward returns, carried through the backward node by node, cut by the
candidates as they run and are recomputed, and finished where the backward ends, inside
autograd's engine.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from .. import _torch_private
from ..measure import StepSpan, StorageCounter, ready_libraries

__all__ = ["Phase", "PhaseMeter", "Window", "profiler_running"]

_LOSS_OUTSIDE = 2
"""A loss made outside the model's forward is not counted as it is made; it is taken to
have held this many times the gradient it hands the model (a cross entropy's log-softmax
and the gradient of it, beside the gradient itself)."""


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


class Window(NamedTuple):
    """What one stretch inside a phase (a candidate's recomputation) created and held."""

    peak: int
    """The most bytes its own allocations held at once, above its start."""
    moments: Tuple[int, ...]
    """Its moments, above its start."""
    seconds: float
    ops: int
    """How many operators ran in it (the meter's own cost grows with them)."""


def profiler_running() -> bool:
    """Whether a torch profiler (``torch.profiler`` or ``torch.autograd.profiler``) is
    recording in this thread."""
    return bool(_torch_private.profiler_enabled())


class PhaseMeter:
    """Cuts the work between :meth:`start` and :meth:`finish` into phases: call
    :meth:`cut` with the next phase's label at each boundary; :attr:`phases` is filled by
    :meth:`finish` (the first phase is labelled ``head``). Between them, :meth:`leave`
    and :meth:`follow` carry it from the forward into the backward (``StepSpan``). As a
    context manager it counts the block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: List[Phase] = []
        self._labels = ["head"]
        self._times: List[float] = []
        self._counter: Optional[_PhaseCounter] = None
        self._span: Optional[StepSpan] = None
        self._module = None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)
        self._counted: List[Tuple[int, Tuple[int, ...]]] = []
        self._start = 0
        self.finished = False

    @property
    def at_allocator(self) -> bool:
        """Whether the peaks are the allocator's (else operators' outputs only)."""
        return self._module is not None

    def start(self) -> "PhaseMeter":
        if self._module is not None:
            ready_libraries(self.device)
            self._module.synchronize(self.device)
            self._start = self._module.memory_allocated(self.device)
            self._module.reset_peak_memory_stats(self.device)
        self._counter = _PhaseCounter(self.device.type)
        self._span = StepSpan(self._counter)
        self._span.enter()
        self._times.append(time.perf_counter())
        return self

    def __enter__(self) -> "PhaseMeter":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.finish()

    def leave(self) -> None:
        """The forward returned (or raised): off the caller's mode stack."""
        if self._span is not None:
            self._span.leave()

    def inside(self) -> Any:
        """Count a block of the caller's own between forward and backward."""
        assert self._span is not None
        return self._span.inside()

    def follow(self, roots: Any) -> None:
        """Count the backward from ``roots`` node by node."""
        if self._span is not None and not self.finished:
            self._span.follow(roots)

    def counting(self) -> Any:
        """Count a forward run inside the backward (a region's recomputation) operator by
        operator, as the forward was (``StepSpan.counting``)."""
        if self._span is None or self.finished:
            return contextlib.nullcontext()
        return self._span.counting()

    def loss_outside(self, grad: torch.Tensor) -> None:
        """The backward reached the model with ``grad`` from a loss made outside it: count
        the gradient from now on, and what the loss is taken to have held at its highest."""
        if self._span is not None and not self.finished:
            self._span.loss_outside(grad, _LOSS_OUTSIDE)

    def finish(self) -> None:
        """End the last phase and stop counting; nothing stays on any mode stack."""
        if self.finished or self._counter is None:
            return
        self.cut("")
        self.finished = True
        assert self._span is not None
        self._span.close()
        seconds = [b - a for a, b in zip(self._times, self._times[1:])]
        self.phases = [
            Phase(label, peak, moments, spent)
            for label, (peak, moments), spent in zip(self._labels, self._counted, seconds)
        ]

    def cut(self, label: str) -> None:
        """End the phase in progress and begin ``label``."""
        if self.finished or self._counter is None:
            return
        if self._module is not None:
            self._module.synchronize(self.device)
        assert self._span is not None
        self._span.settle()  # what the node in progress held so far is this phase's
        peak, moments = self._counter.cut()
        if self._module is not None:
            peak = max(peak, self._module.max_memory_allocated(self.device) - self._start)
            self._module.reset_peak_memory_stats(self.device)
        self._counted.append((max(0, peak), moments))
        self._times.append(time.perf_counter())
        self._labels.append(label)

    def adopt(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage from now until it is freed, as if an operator had
        made it (a tensor made outside the dispatcher: the generator state a region keeps)."""
        if self._counter is not None and not self.finished:
            self._counter.adopt(tensor)

    def window(self) -> "_OpenWindow":
        """Start following a stretch of the phase in progress; close the returned window
        where it ends."""
        assert self._counter is not None and self._span is not None
        return _OpenWindow(self._counter, self._span)


class _OpenWindow:
    def __init__(self, counter: "_PhaseCounter", span: StepSpan) -> None:
        self._counter = counter
        self._span = span
        self._start = counter.live_bytes
        self._ops = counter.ops
        self._moments: List[int] = []
        self._time = time.perf_counter()
        counter.windows.append(self)

    def close(self) -> Window:
        seconds = time.perf_counter() - self._time
        counter = self._counter
        if self in counter.windows:
            self._span.settle()  # what the allocator held inside it, beyond the outputs
        with counter._lock:
            if self in counter.windows:
                counter.windows.remove(self)
        start = self._start
        moments = tuple(max(0, m - start) for m in self._moments)
        return Window(max(moments, default=0), moments, seconds, counter.ops - self._ops)


class _PhaseCounter(StorageCounter):
    """The storage counter, with the moments of the phase in progress and of any open
    windows."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, trace=True, workspaces=device_type == "cpu")
        self._phase_peak = 0
        self._phase_start = 0
        self.windows: List[_OpenWindow] = []

    def _add(self, nbytes: int) -> None:
        # Once per storage an operator makes: kept to plain statements.
        StorageCounter._add(self, nbytes)
        live = self._live
        if live > self._phase_peak:
            self._phase_peak = live
        for window in self.windows:
            window._moments.append(live)

    def _peak_at(self, nbytes: int) -> None:
        super()._peak_at(nbytes)
        self._phase_peak = max(self._phase_peak, nbytes)
        for window in self.windows:
            window._moments.append(nbytes)

    def cut(self) -> Tuple[int, Tuple[int, ...]]:
        with self._lock:
            while self._freed:
                self._live -= self._freed.pop()
            moments = (self._phase_start, *self.moments)
            peak = max(self._phase_peak, self._phase_start)
            self.moments.clear()
            self._phase_peak = self._phase_start = self._live
        return peak, moments

"""The whole training step's memory, phase by phase, for the planner's step-peak model.

One step runs with every outermost candidate checkpointed, the plan that holds the least
between forward and backward, and a meter cuts the step into phases: the forward with
everything up to the first recomputation (the loss, the output's gradient, the backward
of the code after the last candidate), then per candidate its recomputation and its
backward proper. What each phase reached beyond the activations the planner accounts for
is the same under any plan: gradients flowing through, backward temporaries, parameter
gradients accumulated so far. The planner adds those to its activation terms
(``wrap/_step_terms``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from .._hf import cache_free_arguments, fresh_caches
from ..engine import checkpoint, is_recomputing
from ..measure import StorageCounter, differentiable, tensors
from ._timing import RngState

__all__ = ["StepPeaks", "measure_step"]


@dataclasses.dataclass(frozen=True)
class StepPeaks:
    """Bytes a training step with every candidate checkpointed reached in each phase, above
    what was allocated before the step.

    The step backpropagates from the model's loss: a scalar output, or the ``loss`` of
    an output that has one (a Hugging Face ``ModelOutput`` given labels); otherwise from
    every floating-point output that requires grad, with gradients of ones, as a loss
    computed outside the model would hand back a gradient of each output's size.
    Parameter gradients are taken as fresh (``zero_grad(set_to_none=True)``): they are
    allocated during the backward.
    """

    forward: Dict[str, int]
    """Per candidate: the highest point of the forward from the end of the candidate
    before it (the start of the step, for the first) to the end of its own forward."""
    end: int
    """The highest point from the end of the last candidate's forward to the first
    recomputation: the rest of the forward, the loss, and the backward of the code after
    the last candidate."""
    recompute: Dict[str, int]
    """Per candidate: the highest point while its recomputation ran."""
    backward: Dict[str, int]
    """Per candidate: the highest point from the end of its recomputation until the next
    recomputation began (or the step ended): its backward, and that of any code between
    it and the candidate before it."""
    total: int
    """The step's peak."""

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)


class _Phases:
    """Cuts a step into phases and keeps each phase's peak, in bytes above the step's start.

    On the CPU the allocator's own events are read (``torch.profiler`` with
    ``profile_memory``), so memory that operators allocate inside themselves, such as a
    convolution's workspace, counts too; each cut is a marker in the same trace. If the
    profiler cannot start (another one runs), storages are counted through a dispatch
    mode, which sees operator outputs only. Accelerators use their allocator statistics.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: List[Tuple[str, int]] = []
        self._labels = ["head"]
        self._profiler: Any = None
        self._counter: Optional[_PhaseCounter] = None
        self._module = None if device.type == "cpu" else torch.get_device_module(device.type)

    def __enter__(self) -> "_Phases":
        if self._module is not None:
            self._module.synchronize(self.device)
            self._start = self._module.memory_allocated(self.device)
            self._module.reset_peak_memory_stats(self.device)
            return self
        try:
            self._profiler = _quiet_profiler()
            with _stderr_silenced():
                self._profiler.__enter__()
        except RuntimeError:
            self._profiler = None
            self._counter = _PhaseCounter(self.device.type)
            self._counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cut("")
        if self._counter is not None:
            self._counter.__exit__(*exc)
        if self._profiler is not None:
            with _stderr_silenced():
                self._profiler.__exit__(*exc)
            self.peaks = list(zip(self._labels, _profiled_peaks(self._profiler, len(self._labels))))

    def cut(self, label: str) -> None:
        """End the phase in progress and begin ``label``."""
        if self._profiler is not None:
            with torch.profiler.record_function(_CUT):
                pass
        elif self._counter is not None:
            self.peaks.append((self._labels[-1], self._counter.cut()))
        else:
            self._module.synchronize(self.device)
            peak = self._module.max_memory_allocated(self.device) - self._start
            self._module.reset_peak_memory_stats(self.device)
            self.peaks.append((self._labels[-1], max(0, peak)))
        self._labels.append(label)


_CUT = "ckptwrap::phase"


def _quiet_profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Hide the lines the profiler library writes to file descriptor 2 as it starts and
    stops; nothing else runs meanwhile."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real descriptor 2 (an embedded interpreter)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _profiled_peaks(profiler: Any, phases: int) -> List[int]:
    """Per phase, the highest running sum of the CPU allocator's events, cut at the markers."""
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
    """The CPU storage counter, with the peak of the phase in progress as well."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type)
        self._phase_peak = 0

    def _add(self, nbytes: int) -> None:
        super()._add(nbytes)
        self._phase_peak = max(self._phase_peak, self._live)

    def cut(self) -> int:
        with self._lock:
            while self._freed:
                self._live -= self._freed.pop()
            peak, self._phase_peak = self._phase_peak, self._live
        return peak


class _Marked:
    """A candidate's forward that starts and ends its phases, in the forward and when it
    is recomputed."""

    def __init__(self, forward: Any, name: str, phases: _Phases) -> None:
        self.forward, self.name, self.phases = forward, name, phases

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_recomputing():
            self.phases.cut(f"forward:{self.name}")
            output = self.forward(*args, **kwargs)
            self.phases.cut(f"after:{self.name}")
            return output
        self.phases.cut(f"recompute:{self.name}")
        output = self.forward(*args, **kwargs)
        self.phases.cut(f"backward:{self.name}")
        return output


def measure_step(
    model: nn.Module,
    targets: Sequence[Tuple[str, nn.Module]],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    device: torch.device,
    loss_fn: Optional[Any] = None,
    save_policy: Optional[Any] = None,
) -> StepPeaks:
    """Run one training step of ``model`` with each of ``targets`` checkpointed (the
    non-re-entrant engine, recomputing each whole forward) and measure its phases.

    ``loss_fn(output)`` gives the loss to backpropagate from; without it, see
    :class:`StepPeaks`. With ``save_policy`` (the selective tier's), the targets are
    checkpointed selectively, as the plan would run them. ``targets`` must not nest.
    Parameter gradients are returned by ``autograd.grad``, not accumulated, so the model's
    ``.grad`` fields are left as they were; the RNG states are put back, and the caller
    restores buffers and training flags.
    """
    phases = _Phases(device)
    context_fn = None
    if save_policy is not None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, save_policy)
    originals: List[Tuple[nn.Module, Any]] = []
    devices = [device] if device.type != "cpu" else []
    try:
        for name, module in targets:
            originals.append((module, module.__dict__.get("forward")))
            marked = _Marked(module.forward, name, phases)
            module.forward = functools.partial(_checkpointed, module, marked, context_fn)
        with RngState(devices).kept():
            call_args, call_kwargs = fresh_caches(args, kwargs)
            with phases, torch.enable_grad():
                output = model(*call_args, **call_kwargs)
                roots, grads = _loss(output if loss_fn is None else loss_fn(output))
                del output
                wanted = [p for p in model.parameters() if p.requires_grad]
                if roots and wanted:
                    # Returned, not accumulated: the caller's .grad fields stay as they were.
                    torch.autograd.grad(roots, wanted, grads, allow_unused=True)
                del roots, grads
    finally:
        for module, forward in originals:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
    return _by_phase(phases.peaks)


def _by_phase(peaks: List[Tuple[str, int]]) -> StepPeaks:
    """Phase peaks, as cut in time order, gathered per candidate (a candidate called
    several times keeps the highest of its calls)."""
    tables: Dict[str, Dict[str, int]] = {"forward": {}, "recompute": {}, "backward": {}}
    pending = 0  # the peak since the last candidate's forward ended, not yet assigned
    end = 0
    for label, peak in peaks:
        kind, _, name = label.partition(":")
        if not kind:
            continue  # the label after the last cut: no phase
        if kind in ("head", "after"):
            pending = max(pending, peak)
            continue
        if kind == "forward":
            peak, pending = max(peak, pending), 0
        else:  # the first recomputation closes the forward
            end, pending = max(end, pending), 0
        table = tables[kind]
        table[name] = max(table.get(name, 0), peak)
    end = max(end, pending)
    total = max([end, *(v for table in tables.values() for v in table.values())])
    return StepPeaks(tables["forward"], end, tables["recompute"], tables["backward"], total)


def _checkpointed(
    module: nn.Module, forward: _Marked, context_fn: Optional[Any], *args: Any, **kwargs: Any
) -> Any:
    """One checkpointed call, with KV-cache writes off as in a checkpointed training call."""
    rewritten = cache_free_arguments(module, args, kwargs)
    if rewritten is not None:
        args, kwargs = rewritten
    # Without early stop, each recomputation runs to its end, where the phase is cut.
    return checkpoint(forward, *args, early_stop=False, context_fn=context_fn, **kwargs)


def _loss(output: Any) -> Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]:
    """What the step backpropagates from, and the gradients it starts with."""
    loss = output if isinstance(output, torch.Tensor) else _loss_attribute(output)
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
        return [loss], [None]
    roots = [t for t in tensors(output) if t.requires_grad and differentiable(t)]
    return roots, [torch.ones_like(t) for t in roots]


def _loss_attribute(output: Any) -> Any:
    if isinstance(output, dict) or hasattr(output, "keys"):
        try:
            return output.get("loss")
        except (AttributeError, TypeError):
            return None
    return getattr(output, "loss", None)

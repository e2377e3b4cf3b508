"""The whole training step's memory, phase by phase, for the planner's step-peak model.

A step measured with every outermost candidate checkpointed (the plan that holds the
least between forward and backward) is cut into phases (``_phases``): each candidate's
forward (with the code before it), the end of the forward (the rest of the forward, the
loss, the output's gradient, the backward of the code after the last candidate), then
per candidate its recomputation and its backward proper. What each phase reached beyond
the activations the planner accounts for is the same under any plan: gradients flowing
through, backward temporaries, parameter gradients accumulated so far, and whatever the
caller keeps alive through the backward (``_peak_model.step_terms`` takes them out). Each
phase keeps its moments too, so that the cost model can follow each of them across input
shapes rather than only their maximum.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Tuple

import torch

from ._phases import Phase

__all__ = ["END", "StepPeaks", "by_phase", "region_bytes"]

END = "end"
"""The key of the end of the forward in :attr:`StepPeaks.moments` and ``seconds``."""


@dataclasses.dataclass(frozen=True)
class StepPeaks:
    """Bytes a training step with every candidate checkpointed reached in each phase, above
    what was allocated before the step.

    A step of the caller's own backpropagates from whatever the caller does with the
    output; one run on example inputs (``profile_modules``), from the model's loss: a
    scalar output, the ``loss`` of an output that has one (a Hugging Face ``ModelOutput``
    given labels), else every floating-point output with gradients of ones. Parameter
    gradients are taken as fresh (``zero_grad(set_to_none=True)``): a step that
    accumulated into existing ones is read as if they had been allocated in it.

    A candidate called several times keeps the highest of its calls' peaks, the sum of
    their seconds, and their moments as runs: calls whose phases had as many moments (the
    same code) share a run, the highest of each moment.
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
    moments: Dict[str, Tuple[Tuple[int, ...], ...]] = dataclasses.field(default_factory=dict)
    """Per phase, keyed ``forward:NAME``, ``recompute:NAME``, ``backward:NAME`` or
    ``end``: the bytes at each point where the phase can peak (see ``_phases.Phase``), in
    runs of as many moments, shortest first (one run but for candidates called several
    times)."""
    seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    """Per phase, keyed as ``moments``: how long it took."""
    at_allocator: bool = True
    """Whether the peaks were read at the allocator (else operators' outputs only)."""

    def __post_init__(self) -> None:
        # From JSON (``to_dict``), the moments come back as lists.
        moments = {
            key: tuple(tuple(int(v) for v in run) for run in runs) for key, runs in self.moments.items()
        }
        object.__setattr__(self, "moments", moments)

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def by_phase(phases: List[Phase], at_allocator: bool) -> StepPeaks:
    """Phases, as cut in time order, gathered per candidate: the gaps between candidates'
    forwards go to the forward after them, or to the end of the forward."""
    merged: Dict[str, List[Phase]] = {}
    pending: List[Phase] = []  # since the last candidate's forward ended, not yet assigned
    for phase in phases:
        kind, _, name = phase.label.partition(":")
        if not kind:
            continue  # the label after the last cut: no phase
        if kind in ("head", "after"):
            pending.append(phase)
            continue
        if kind == "forward":
            phase, pending = _joined(phase.label, [*pending, phase]), []
        elif pending:  # the first recomputation closes the forward
            merged.setdefault(END, []).append(_joined(END, pending))
            pending = []
        merged.setdefault(phase.label, []).append(phase)
    if pending:
        merged.setdefault(END, []).append(_joined(END, pending))
    tables: Dict[str, Dict[str, int]] = {"forward": {}, "recompute": {}, "backward": {}}
    for key, calls in merged.items():
        kind, _, name = key.partition(":")
        if name:
            tables[kind][name] = max(phase.peak for phase in calls)
    end = max((phase.peak for phase in merged.get(END, ())), default=0)
    total = max([end, *(v for table in tables.values() for v in table.values())])
    return StepPeaks(
        tables["forward"], end, tables["recompute"], tables["backward"], total,
        moments={key: _runs(calls) for key, calls in merged.items()},
        seconds={key: sum(phase.seconds for phase in calls) for key, calls in merged.items()},
        at_allocator=at_allocator,
    )


def _joined(label: str, parts: List[Phase]) -> Phase:
    """Consecutive phases as one."""
    return Phase(
        label,
        max(part.peak for part in parts),
        tuple(moment for part in parts for moment in part.moments),
        sum(part.seconds for part in parts),
    )


def _runs(calls: List[Phase]) -> Tuple[Tuple[int, ...], ...]:
    """The moments of the calls of one phase, those of as many moments as one run of the
    highest of each."""
    runs: Dict[int, Tuple[int, ...]] = {}
    for phase in calls:
        known = runs.get(len(phase.moments))
        moments = phase.moments if known is None else tuple(map(max, known, phase.moments))
        runs[len(phase.moments)] = moments
    return tuple(runs[length] for length in sorted(runs))


def region_bytes(device: torch.device, preserve_rng_state: bool = True) -> int:
    """What the engine keeps per checkpointed call besides its inputs, in the memory the
    budget caps of a step on ``device``: on the CPU, the generator state it replays (an
    accelerator's is kept in host memory)."""
    if not preserve_rng_state or device.type != "cpu":
        return 0
    return _generator_state_bytes()


@functools.lru_cache(maxsize=1)
def _generator_state_bytes() -> int:
    return torch.get_rng_state().untyped_storage().nbytes()

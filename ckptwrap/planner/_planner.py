"""The planner of one model and policy (:class:`ShapePlanner`): what to do at each
training forward, learned from the training steps themselves.

Each training forward is a :class:`Decision`. Where the costs at its shape are known (a
step measured at that shape, a trusted fit that stands for it, or a bound from a shape
measured, ``LayoutCosts``), it is a solve: the plan of least recompute time whose
predicted peak fits the budget, less the margin the closed loop added, and some of those
steps are checked against their prediction. Where they are not, or a bound puts every
plan over the budget, or learning may spend the time, the step runs under the plan of
least memory (every candidate checkpointed) and is measured as it runs. Either way the
step that follows the forward to its end is a :class:`PlannedStep`, whose docstring lists
its states; it hands its profile or its check back at the end of its backward. Example
inputs are real inputs too: :meth:`ShapePlanner.choose` measures one step on them at once.

A budget in bytes is the same at every shape. ``budget:NN%`` is NN% of the predicted
un-checkpointed step peak at the largest shape planned so far (largest by that peak),
turned into bytes. A shape that no plan fits gets its plan of least memory, said (a
``UserWarning`` naming the shape, the budget and the peak) at its first step after a step
at another shape, measured steps included (``strict`` raises instead: at wrap time with
example inputs).

In this module, in order:

1. **Which steps are metered** (:class:`CheckSchedule`). Each check costs a metered step
   (on the CPU every operator goes through a counting dispatch mode; on an accelerator,
   reading the allocator's statistics is free). A check is due after a step is measured
   (one the planner could not do without: a step measured to learn was a test of the
   costs already) and after a check that missed, then after 1, 2, 4, then every 8 solved
   steps while they hit. On the CPU checks are spaced further, so that the time they add
   beyond unmetered steps stays within ``SHARE`` of the training time of the steps
   between them; there the check due after a measurement or a miss waits for a step no
   larger than the steps so far on average (or for the credit to pay for a larger one).
   Also here: when a step may be measured to learn where a bound from the shapes measured
   already would do (``may_learn``). Those the planner cannot do without (a layout's first
   shape, a shape no bound fits the budget at, a shape whose plan missed) are always
   taken; those it takes to learn more (to find a fit it can trust, for plans closer to
   the budget) add at most ``LEARN_SHARE`` of the training time, counted as checks are.
   What a metered step adds grows with the step: each step comes with its *size* (the
   product of its shape variables, a measure of its work known before it runs).
   Unmetered steps give a line through the shortest step timed and their running means
   of seconds and size (a small model's steps take about the same at any size: the
   operators' launch, not their work), and a metered step what it adds as a share of the
   time an unmetered step of its size takes: a check learned on a short batch is not
   taken as the price of a long one.
2. **From a profile at one shape to a plan's choice** (:func:`choose`, :class:`Choice`):
   the solver's items with the step's terms, the un-checkpointed peak, and, for a budget,
   the plan of least recompute time that fits it (or, where none does, the plan of least
   memory).
3. **The plans solved** (:class:`PlanCache`, :class:`NothingNeeded`): the plans by the
   profile, budget and margin they were solved under, the shapes' un-checkpointed peaks,
   and the shapes the un-checkpointed step fitted at (a shape no larger in any shape
   variable needs no plan: the step's costs grow with every variable, so its forward runs
   with nothing checkpointed without evaluating a fit or solving).
4. **The budget in bytes at each shape** (:class:`BudgetReading`): an amount, the same at
   every shape; a share of the largest un-checkpointed peak planned for so far (or
   predicted at the declared largest shapes); or a device's memory less what the model
   holds there.
5. **The decisions** (:class:`Decision`, :class:`ShapePlanner`) and **the step that
   follows one** (:class:`PlannedStep`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import pickle
import time
import weakref
from typing import Any, Callable, ContextManager, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .. import _torch_private
from .._errors import CheckpointConfigError
from .._warn import debugging, note, note_step, warn
from ..measure import (
    ModelProfile,
    SpanPeak,
    StepRecorder,
    dispatch_cost,
    measure_inputs,
    outside_fake,
    recording_cost,
    region_bytes,
    resolve_targets,
    selective_cost,
    step_device,
    tensors,
)
from ._device_memory import DeviceMemory, DeviceTerms
from ._peak_model import CostItem, Level, predicted_peak, step_items
from ._plan import BOUNDS, PlanEntry
from ._shapes import LayoutCosts, Layouts, PlanSettings
from ._solver import BudgetSolution, lowest_plan, resolve_budget, solve_budget

__all__ = [
    "Choice",
    "Decision",
    "PlannedStep",
    "ShapePlanner",
]


SHARE = 0.03
"""The most of the training time the CPU's checks may add."""
LEARN_SHARE = 0.05
"""The most of the training time measuring to learn may add, beyond the measured steps
that cannot be done without."""
_LONGEST = 8
"""After checks that hit, the next is at most this many steps later."""
_WEIGHT = 0.3
"""How much one step's time moves the running means."""


class CheckSchedule:
    """When to check (see the module)."""

    def __init__(self) -> None:
        self._steps = 0
        self._next = 0
        self._interval = 1
        self._urgent = True
        self._credit = 0.0  # seconds of checking the time trained so far allows
        self._seconds_mean = 0.0  # running mean of the unmetered steps' seconds
        self._size = 0.0  # running mean of their sizes
        self._shortest = (0.0, 0)  # the shortest of them (seconds, size): what any step takes
        self._cost = 0.0  # running mean of what a check adds, per second of its step
        self._learn_credit = 0.0  # seconds of measuring to learn the time so far allows
        self._learn_cost = 0.0  # running mean of what a measured step adds, per second of its step
        # Metered before any step was timed unmetered: (seconds, size, kind), told once one is.
        self._unsettled: List[Tuple[float, int, str]] = []

    def step(self) -> None:
        """A training step begins."""
        self._steps += 1

    def due(self, *, cheap: bool, size: int) -> bool:
        """Whether the solved step beginning now, of ``size``, is checked; ``cheap``:
        metering costs nothing."""
        if cheap:
            return True
        if self._steps < self._next:
            return False
        if self._urgent and (not self._size or size <= self._size * (1 + 1e-9)):
            return True  # no larger than the steps so far, on average (or the first)
        # Before any check was timed, a measured step's share stands for a check's (a
        # check meters less: it costs at most as much).
        cost = self._cost or self._learn_cost
        return self._credit >= cost * self._seconds(size)

    def soon(self) -> None:
        """Check the next solved step (costs were learned, or a check missed)."""
        self._next, self._interval, self._urgent = self._steps + 1, 1, True

    def hit(self) -> None:
        """A check found the step within its prediction."""
        self._interval = min(_LONGEST, 2 * self._interval)
        self._next = self._steps + self._interval
        self._urgent = False

    def inconclusive(self) -> None:
        """A check could not tell (an accelerator's peak not reset): the next one decides."""
        self._next = self._steps + 1

    def timed(self, seconds: float, *, checked: bool, size: int) -> None:
        """A solved step of ``size`` took ``seconds``, metered (``checked``) or not."""
        if checked:
            self._metered(seconds, size, "check")
            return
        if not self._shortest[0] or seconds < self._shortest[0]:
            self._shortest = (seconds, size)
        self._seconds_mean = seconds if not self._seconds_mean else (1 - _WEIGHT) * self._seconds_mean + _WEIGHT * seconds
        self._size = size if not self._size else (1 - _WEIGHT) * self._size + _WEIGHT * size
        self._credit += SHARE * seconds
        self._learn_credit += LEARN_SHARE * seconds
        unsettled, self._unsettled = self._unsettled, []
        for each in unsettled:
            self._metered(*each)

    def may_learn(self, size: int) -> bool:
        """Whether a step of ``size`` whose costs a bound gives may be measured instead."""
        return self._shortest[0] > 0 and self._learn_credit > 0 and self._learn_credit >= self._learn_cost * self._seconds(size)

    def measured(self, seconds: float, *, size: int, learning: bool = False) -> None:
        """A measured step of ``size`` took ``seconds``: what it added beyond an unmetered
        step is what the next would add, in proportion; one measured to learn
        (``learning``) draws it from what learning may spend."""
        self._metered(seconds, size, "learn" if learning else "measure")

    def _seconds(self, size: int) -> float:
        """What an unmetered step of ``size`` is expected to take: the shortest step timed
        (what any step takes: the operators' launch, most of a small model's step) and a
        part in proportion to its size (their work)."""
        shortest, at = self._shortest
        rate = max(0.0, self._seconds_mean - shortest) / max(self._size - at, 1.0)
        return shortest + rate * max(0, size - at)

    def _metered(self, seconds: float, size: int, kind: str) -> None:
        expected = self._seconds(size)
        if not expected:
            self._unsettled.append((seconds, size, kind))
            return
        added = max(0.0, seconds - expected)
        share = added / expected
        if kind == "check":
            self._cost = share if not self._cost else (1 - _WEIGHT) * self._cost + _WEIGHT * share
            self._credit -= added
            return
        self._learn_cost = share if not self._learn_cost else (1 - _WEIGHT) * self._learn_cost + _WEIGHT * share
        if kind == "learn":
            self._learn_credit -= added


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which candidates a plan checkpoints, and how, with the predictions behind it."""

    entries: Tuple[PlanEntry, ...]
    """The chosen candidates, in the order they were given."""
    dropped: Tuple[Tuple[str, str], ...]
    """(name, reason) for candidates left out."""
    budget: Optional[int]
    """The budget solved for, in bytes; None without a budget."""
    predicted_peak: int
    """The predicted training-step peak of this choice, in bytes."""
    plain_peak: int
    """The predicted peak of the same step with nothing checkpointed."""
    activation_bytes: int
    """What the un-checkpointed forward saves for backward."""
    profile: ModelProfile
    """The profile the choice was made from."""
    reachable: bool = True
    """False when no plan fits the budget and this is the plan of least memory."""
    memory: Optional[DeviceMemory] = None
    """What the device holds besides the step, where a budget in its terms or an
    optimizer was given."""


def plain_peak(profile: ModelProfile, names: Sequence[str], *, region_bytes: int = 0) -> int:
    """The predicted peak of the training step with none of ``names`` checkpointed."""
    ordered, _, tail = step_items(profile, names, segments=False, levels=False, region_bytes=region_bytes)
    return predicted_peak([item for _, item in ordered], (), base=profile.base_bytes, tail=tail)


def choose(
    profile: ModelProfile,
    candidates: Sequence[Tuple[str, str]],
    budget: Optional[int],
    *,
    describe: str = "the budget",
    segments: bool = False,
    levels: bool = False,
    recompute: bool = True,
    region_bytes: int = 0,
    strict: bool = True,
    settle: bool = True,
) -> Choice:
    """Choose among ``candidates`` (``(name, class name)``) from ``profile``.

    With a ``budget`` in bytes: the plan of least recompute time whose predicted peak fits
    it, where with ``segments`` consecutive candidates may share one region and with
    ``levels`` a candidate may be checkpointed at a selective level. Where no plan fits,
    ``strict`` raises the solver's error (which states the smallest reachable peak); else
    the plan of least memory is chosen, marked not ``reachable``. Without a budget: every
    candidate, each in its own region, with its predictions (modules profiled beside the
    candidates stay as they are). ``recompute`` (the plain tier) labels each entry with
    how it is checkpointed. Without ``settle`` (``solve_budget``'s), a budget the search
    within it finds no plan for raises at once, ``strict`` or not.
    """
    names = [name for name, _ in candidates]
    solving = budget is not None
    ordered, levels_of, tail = step_items(
        profile, names if solving else [cost.name for cost in profile.modules],
        segments=segments and solving, levels=levels and solving, region_bytes=region_bytes,
    )
    items = [item for _, item in ordered]
    base = profile.base_bytes
    plain = predicted_peak(items, (), base=base, tail=tail)
    reachable = True
    if budget is None:
        picked = set(names)
        selected = [i for i, (name, _) in enumerate(ordered) if name in picked]
        solution = BudgetSolution(tuple(selected), 0, 0.0, 0, 1, (), (0,) * len(selected))
        peak = predicted_peak(items, selected, base=base, tail=tail)
        dropped: List[Tuple[str, str]] = []
    else:
        try:
            # Not strict, the solve runs inside the step it plans: every search's arrays
            # stay within a share of the budget, the ones without a budget too.
            solution = solve_budget(items, budget, base=base, tail=tail, settle=settle, bounded=not strict)
        except CheckpointConfigError:
            if strict or not settle:
                raise
            solution, reachable = lowest_plan(items, base=base, tail=tail, within=budget), False
        peak = solution.predicted_peak
        picked = {ordered[i][0] for i in solution.selected}
        reason = f"not needed to fit {describe}" if reachable else "not needed for the least memory"
        dropped = [(name, reason) for name in names if name not in picked]
    entries = _entries(candidates, ordered, levels_of, solution, picked, recompute)
    return Choice(
        entries, tuple(dropped), budget, peak, plain, profile.total_activation_bytes, profile, reachable
    )


def _entries(
    candidates: Sequence[Tuple[str, str]],
    ordered: Sequence[Tuple[str, CostItem]],
    levels_of: Dict[str, Tuple[Level, ...]],
    solution: BudgetSolution,
    picked: Set[str],
    recompute: bool,
) -> Tuple[PlanEntry, ...]:
    """The plan entries of the chosen candidates, each with how it is checkpointed and
    what that is predicted to save and cost."""
    joins: Dict[str, str] = {}
    in_segments: Set[str] = set()
    for segment in solution.segments:
        joins.update((ordered[i][0], ordered[i - 1][0]) for i in segment[1:])
        in_segments.update(ordered[i][0] for i in segment)
    chosen_levels: Dict[str, Level] = {}
    for index, option in zip(solution.selected, solution.options):
        if option:
            name = ordered[index][0]
            chosen_levels[name] = levels_of[name][option - 1]
    by_name = dict(ordered)
    entries = []
    for name, kind in candidates:
        if name not in picked:
            continue
        item, level = by_name[name], chosen_levels.get(name)
        if level is not None:
            entries.append(PlanEntry(
                name, kind, saved_bytes=item.kept - level.option.inputs, recompute_time=level.option.time,
                option=level.option.label, saved_ops=level.instances,
            ))
            continue
        option = None
        if recompute:
            option = "segment" if name in in_segments else "recompute"
        # In a segment after its first module it saves all it keeps and its input;
        # otherwise what it keeps beyond what its region keeps.
        saved = item.kept + (item.joins or 0) if name in joins else item.kept - item.inputs
        entries.append(PlanEntry(
            name, kind, saved_bytes=saved, recompute_time=item.time, joins=joins.get(name), option=option,
        ))
    return tuple(entries)


_CACHED = 64
"""Plans (and plain peaks) kept per planner, the most recently used."""

Sizes = Tuple[int, ...]

_KEPT = 8
"""Shapes kept per layout: the largest, none within another."""


class _Fitted(NamedTuple):
    sizes: Sizes
    budget: int
    margin: float
    choice: Choice


class NothingNeeded:
    """Per layout's costs (by ``id``) and engine region size: the shapes whose plan
    checkpointed nothing, with the budget and margin it was solved under. Plain data
    between calls; cleared when the costs change (:meth:`forget`) or are copied."""

    def __init__(self) -> None:
        self._found: Dict[Tuple[int, int], List[_Fitted]] = {}

    def find(
        self, key: Tuple[int, int], sizes: Sizes, budget: Callable[[], Optional[int]], margin: float
    ) -> Optional[Choice]:
        """The plan of a shape at least as large as ``sizes`` in every variable that
        checkpointed nothing under a budget no larger than ``budget()`` (read only where
        there is such a shape to compare with) and the same margin, if any: its
        predictions bound this shape's."""
        found = self._found.get(key)
        if not found:
            return None
        now = budget()
        if now is None:
            return None
        for fitted in found:
            if (
                fitted.margin == margin
                and fitted.budget <= now
                and len(fitted.sizes) == len(sizes)  # a layout widened since has more variables
                and all(size <= most for size, most in zip(sizes, fitted.sizes))
            ):
                return fitted.choice
        return None

    def add(self, key: Tuple[int, int], sizes: Sizes, budget: Optional[int], margin: float, choice: Choice) -> None:
        """Keep ``choice`` (solved at ``sizes``) if it checkpoints nothing and fits."""
        if budget is None or choice.entries or not choice.reachable:
            return
        found = [
            fitted for fitted in self._found.get(key, ())
            if not (fitted.margin == margin and fitted.budget >= budget and len(fitted.sizes) == len(sizes)
                    and all(a <= b for a, b in zip(fitted.sizes, sizes)))
        ]
        found.insert(0, _Fitted(sizes, int(budget), margin, choice))
        self._found[key] = found[:_KEPT]

    def forget(self, costs_id: int) -> None:
        for key in [key for key in self._found if key[0] == costs_id]:
            del self._found[key]


class PlanCache:
    """The plans a planner solved (see the module); plain data, emptied when copied."""

    def __init__(self) -> None:
        self.plans: "collections.OrderedDict[Tuple[Any, ...], Choice]" = collections.OrderedDict()
        self.plain: Dict[Tuple[Any, ...], int] = {}  # un-checkpointed peaks, by costs, sizes, region
        self.nothing = NothingNeeded()

    def plan(self, key: Tuple[Any, ...], profile: Any) -> Optional[Choice]:
        """The plan under ``key`` if it was solved on ``profile`` itself."""
        found = self.plans.get(key)
        if found is None or found.profile is not profile:
            return None
        self.plans.move_to_end(key)
        return found

    def keep(self, key: Tuple[Any, ...], choice: Choice) -> None:
        self.plans[key] = choice
        while len(self.plans) > _CACHED:
            self.plans.popitem(last=False)

    def keep_plain(self, key: Tuple[Any, ...], plain: int) -> None:
        """The un-checkpointed peak of a shape (kept as long as the most recent others:
        a loop meets new shapes at most steps, many of them under one plan)."""
        self.plain[key] = plain
        while len(self.plain) > _CACHED:
            del self.plain[next(iter(self.plain))]

    def forget(self, costs_id: int) -> None:
        """Everything solved from these costs (they changed)."""
        self.nothing.forget(costs_id)
        for table in (self.plans, self.plain):
            for key in [key for key in table if key[0] == costs_id]:
                del table[key]


class BudgetReading:
    """One planner's budget term read in bytes (see the module). Plain data."""

    def __init__(self, settings: Any, max_shapes: Optional[Dict[Any, Sequence[int]]]) -> None:
        self.budget = settings.budget
        self.names = settings.names
        self.max_shapes = max_shapes
        self.reference = 0
        """The largest un-checkpointed peak planned for so far."""
        self.device = DeviceTerms(settings)
        """A budget in a device's terms, and what the device holds besides the step."""
        self._declared: Optional[Tuple[ModelProfile, int]] = None  # the last, with its plain peak

    @property
    def percent(self) -> bool:
        """Whether the budget is a share of the un-checkpointed peak."""
        return self.budget is not None and self.budget.parsed()[0] is not None

    def at(self, plain: int, costs: LayoutCosts, *, reference: bool = True) -> Optional[int]:
        """The budget in bytes at a shape whose plain peak is ``plain`` (which counts for
        the largest so far, with ``reference``); with ``max_shapes`` and trusted costs,
        also the plain peak predicted there."""
        if self.budget is None:
            return None
        if reference:
            self.reference = max(self.reference, plain)
        if self.max_shapes and costs.fit is not None and costs.trusted:
            try:
                declared = costs.layout.declared(self.max_shapes)
            except CheckpointConfigError:
                pass
            else:
                self.reference = max(self.reference, self._plain_at(costs.profile_at(declared)))
        if self.device.in_terms:
            return self.device.step_budget()
        return resolve_budget(self.budget, self.reference)

    def now(self, costs: LayoutCosts) -> Optional[int]:
        """The budget in bytes as it stands, at a shape no larger than one planned."""
        budget = self.at(0, costs, reference=False)
        return None if budget is None else int(budget)

    def _plain_at(self, profile: ModelProfile) -> int:
        # Read at every plan and every nothing-needed lookup: the same profile while the
        # fit stands, so its plain peak is worked out once.
        if self._declared is None or self._declared[0] is not profile:
            self._declared = (profile, plain_peak(profile, self.names))
        return self._declared[1]


@dataclasses.dataclass
class Decision:
    """What one training forward runs under."""

    costs: Optional[LayoutCosts]
    sizes: Sizes
    measure: bool
    """Run under the plan of least memory and measure the step."""
    choice: Optional[Choice] = None
    """The plan solved for, when not measuring; None with ``measure`` or where the layout
    is no longer measured (then the plan of least memory runs unmeasured)."""
    source: str = ""
    """Where the costs came from: ``measured``, ``fitted``, ``bounded`` or ``scaled``
    (``LayoutCosts.source_at``)."""
    check: bool = False
    """Whether to meter the step and compare it with ``choice.predicted_peak``."""
    metered: bool = False
    """Whether that check costs time (a counting dispatch mode; an accelerator's
    statistics cost nothing)."""
    learn: bool = False
    """With ``measure``: measured to learn, where a bound would have done."""
    reset: bool = False
    """Whether that meter resets an accelerator's peak statistics (an earlier reading
    without a reset could not tell)."""
    region: int = 0
    """Bytes the engine keeps per checkpointed call besides its inputs (``region_bytes``)."""
    margin: float = 0.0
    """The share of the un-checkpointed peak the plan kept free beyond its prediction."""
    seconds: float = 0.0
    """With ``measure``: how long the step took, forward to end of backward, once it has."""

    def describe(self) -> str:
        if self.costs is None:
            return "these inputs"
        return self.costs.layout.describe(self.sizes)


_MISS = 0.01
"""A checked step above its prediction by more than this share of the un-checkpointed
peak is a miss."""


class ShapePlanner:
    """Plans for one model and policy at any shape of its inputs (see the module).

    Plain data between calls (costs and fits, no model), so it pickles and deep-copies
    with a wrapped model.

    Args:
        settings: The candidates, the budget and how plans may checkpoint them.
        max_shapes: The largest shapes the model's inputs will take, as a mapping from an
            input's name (a keyword argument) or position (an int) to its shape; a
            percentage budget is read against the plain peak at those shapes once the
            costs over shapes are trusted.
    """

    def __init__(self, settings: PlanSettings, *, max_shapes: Optional[Dict[Any, Sequence[int]]] = None) -> None:
        # What a measuring dispatch mode costs per operator, read now, outside any step
        # (reading it inside one would count its own tensors).
        dispatch_cost()
        recording_cost()
        if settings.levels or settings.save_policy is not None:
            selective_cost()
        self.settings = settings
        self.reading = BudgetReading(settings, max_shapes)
        self._layouts = Layouts(self._forget_plans)
        self._cache = PlanCache()
        self._schedule = CheckSchedule()
        self._reset = False
        self._previous: Optional[Tuple[int, Sizes]] = None
        """The layout and shape of the last training forward."""
        self._said: Optional[Tuple[int, Sizes]] = None
        """Where a budget out of reach was last said, until a step at another shape."""
        # Steps measured whose profiles are taken in at the next plan: fitting allocates,
        # and the end of a backward is inside the caller's step, often at its peak.
        self._learned: List[Tuple[Decision, Optional[ModelProfile], Optional[str]]] = []
        self.device = self.reading.device
        self.watch_base = True
        """Whether a measured step follows what the forward saves outside the candidates
        through saved-tensor hooks (off after a measured step whose backward never came:
        a graph dropped unused keeps what such hooks hold)."""

    def __getstate__(self) -> Dict[str, Any]:
        # A loss function often cannot pickle: left out, the steps measured on example
        # inputs after unpickling use the default loss.
        self._take_in()
        state = dict(self.__dict__)
        state["_cache"] = PlanCache()  # keyed by the costs' identity, which a copy changes
        try:
            pickle.dumps(self.settings.loss_fn)
        except Exception:  # noqa: BLE001 - whatever stops it pickling, leave it out
            state["settings"] = dataclasses.replace(self.settings, loss_fn=None)
        return state

    # ------------------------------------------------------------------ training steps

    def begin(
        self,
        model: nn.Module,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        *,
        device: torch.device,
        fresh: Callable[[], bool] = lambda: True,
        overlapping: bool = False,
        on_measured: Optional[Callable[[ModelProfile, Optional[int], int], None]] = None,
    ) -> "PlannedStep":
        """A training forward on these inputs begins: what it runs under (:meth:`decide`)
        and what follows it, as a :class:`PlannedStep` to mark by and then start. A
        forward that began while another's backward was pending (``overlapping``: that
        step's graph may still hold its activations) is neither measured nor checked.
        ``on_measured(profile, budget, plain_peak)`` is told what a measured step gave, at
        its end, with the budget in bytes and the un-checkpointed peak at its shape."""
        decision = self.decide(model, args, kwargs, device=device, fresh=fresh)
        if decision.measure and overlapping:
            decision = dataclasses.replace(decision, measure=False)
        recorder = meter = None
        if decision.measure:
            modules = dict(model.named_modules())
            targets = [(name, modules[name]) for name in self.settings.names if name in modules]
            recorder = StepRecorder(
                model, targets, device, save_policy=self.settings.save_policy, watch_base=self.watch_base,
            )
        elif decision.choice is not None and decision.check and not overlapping:
            meter = SpanPeak(device, reset=decision.reset)
        return PlannedStep(model, self, decision, recorder, meter, on_measured)

    def decide(
        self,
        model: nn.Module,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        *,
        device: torch.device,
        fresh: Callable[[], bool] = lambda: True,
    ) -> Decision:
        """What the training forward on these inputs runs under, on ``device`` (where the
        step allocates). ``fresh()``: the step starts from no parameter gradients (only
        such a step is checked). Metering a step on an accelerator costs nothing (its peak
        statistics): every one is checked there."""
        self._schedule.step()
        self._take_in()
        self.device.before_step(model, device, fresh, args, kwargs)
        costs, sizes = self._layouts.of(args, kwargs)
        if self._previous != (id(costs), sizes):
            self._previous, self._said = (id(costs), sizes), None
        region = region_bytes(device, self.settings.preserve_rng_state)
        if costs.given_up:
            return Decision(costs, sizes, measure=False, region=region)
        cheap = device.type not in ("cpu", "meta")
        covered = self._cache.nothing.find(
            (id(costs), region), sizes, functools.partial(self.reading.now, costs), costs.margin
        )
        if covered is not None and sizes not in costs.remeasure and not costs.fits(sizes):
            # No plan needed: what bounds this shape's step fits with nothing checkpointed
            # (a shape a trusted fit stands for gets its own predictions instead).
            return self._solved(costs, sizes, covered, "bounded", region, cheap, fresh)
        source = costs.source_at(sizes)
        bounded = source in BOUNDS
        # A share of the plain peak at a shape larger than any measured: that peak is
        # known only by measuring it.
        if source is None or (source == "scaled" and self.reading.percent):
            return Decision(costs, sizes, measure=True, region=region)
        if bounded and not costs.fits(sizes) and self._schedule.may_learn(math.prod(sizes)):
            return Decision(costs, sizes, measure=True, region=region, learn=True)
        choice = self._choice(costs, sizes, region, strict=False, model=model, bounded=bounded)
        if choice is None:
            # Out of reach under a bound, perhaps not under the costs themselves: measured
            # (the plan of least memory is not solved for, whose arrays the budget does
            # not bound).
            return Decision(costs, sizes, measure=True, region=region)
        self._cache.nothing.add((id(costs), region), sizes, choice.budget, costs.margin, choice)
        return self._solved(costs, sizes, choice, source, region, cheap, fresh)

    def _solved(
        self, costs: LayoutCosts, sizes: Sizes, choice: Choice, source: str, region: int, cheap: bool,
        fresh: Callable[[], bool],
    ) -> Decision:
        """The decision to run ``choice``, checked against its prediction when due."""
        check = self._schedule.due(cheap=cheap, size=math.prod(sizes)) and fresh()
        reset, self._reset = self._reset and check, self._reset and not check
        return Decision(
            costs, sizes, measure=False, choice=choice, source=source, check=check, reset=reset,
            region=region, margin=costs.margin, metered=check and not cheap,
        )

    def _step_measured(self, decision: Decision, profile: Optional[ModelProfile], failure: Optional[str] = None) -> None:
        """The step of a measuring ``decision`` has ended, with this profile (None: the
        recording failed, ``failure`` says why); taken in before the next plan."""
        self._learned.append((decision, profile, failure))

    def _take_in(self) -> None:
        learned, self._learned = self._learned, []
        for decision, profile, failure in learned:
            self._learn(decision, profile, failure)

    def _learn(self, decision: Decision, profile: Optional[ModelProfile], failure: Optional[str]) -> None:
        costs = decision.costs
        if costs is None:
            return
        if profile is None:
            costs.failures += 1
            if costs.given_up:
                warn(
                    f"ckptwrap could not measure a training step at inputs of {decision.describe()} "
                    f"{costs.failures} times ({failure}); inputs of this layout now run under the "
                    f"plan of least memory, unmeasured."
                )
            return
        said = costs.learn(decision.sizes, profile)
        if decision.seconds:
            self._schedule.measured(decision.seconds, size=math.prod(decision.sizes), learning=decision.learn)
        self._forget_plans(costs)
        if not decision.learn:  # a step measured to learn was itself the fit's test
            self._schedule.soon()
        message = (
            f"ckptwrap measured a training step at inputs of {decision.describe()} "
            f"({_mib(profile.step.total if profile.step else 0)} under the plan of least memory): {said}."
        )
        note(
            message, event="measured", inputs=decision.describe(), sizes=tuple(decision.sizes),
            peak=profile.step.total if profile.step else None,
        )

    def _measured_plan(self, decision: Decision, profile: ModelProfile) -> Tuple[Optional[int], int]:
        """The budget and the un-checkpointed peak at the shape of a measured step."""
        costs = decision.costs
        assert costs is not None
        plain = plain_peak(profile, self.settings.names, region_bytes=decision.region)
        return self.reading.at(plain, costs), plain

    def _step_said(self, decision: Decision, profile: Optional[ModelProfile], model: nn.Module) -> None:
        """A measured step (under the plan of least memory) that peaked above the budget
        at its shape: said at its end, as a solved step out of reach is said."""
        costs = decision.costs
        if costs is None or profile is None or profile.step is None or self.settings.budget is None:
            return
        budget, _ = self._measured_plan(decision, profile)
        key = (id(costs), decision.sizes)
        if budget is None or profile.step.total <= budget or self._said == key:
            return
        self._said = key
        warn(
            f"{type(model).__name__}: a training step at inputs of {decision.describe()} peaked at "
            f"{_mib(profile.step.total)} under the plan of least memory (every candidate checkpointed, "
            f"measured), above {self.settings.budget.describe()} ({_mib(int(budget))}) there. "
            f"Said at the first step at a shape after a step at another.",
            repeat=True,
        )

    def _step_timed(self, decision: Decision, seconds: float) -> None:
        """The step of ``decision`` took ``seconds``, forward to end of backward."""
        if decision.measure:
            decision.seconds = seconds  # told with the profile (its size), when taken in
        elif decision.choice is not None:
            self._schedule.timed(seconds, checked=decision.metered, size=math.prod(decision.sizes))

    def _step_checked(self, decision: Decision, peak: int, exact: bool = True) -> None:
        """The step of ``decision`` peaked at ``peak`` bytes (its meter's reading; an upper
        bound of it where not ``exact``)."""
        choice, costs = decision.choice, decision.costs
        if choice is None or costs is None:
            return
        # Above the prediction, beyond what the plan kept free for such misses, as a share
        # of the largest un-checkpointed peak planned for: a miss at a short batch, far
        # below the budget, is not taken as that share of every longer batch.
        plain = max(choice.plain_peak, self.reading.reference, 1)
        share = (peak - choice.predicted_peak - decision.margin * choice.plain_peak) / plain
        if not exact and share > _MISS:
            # An accelerator's peak not raised by the step, and above the prediction: the
            # next check resets the statistics to tell.
            self._reset = True
            self._schedule.inconclusive()
            return
        fields = dict(
            event="checked", inputs=decision.describe(), sizes=tuple(decision.sizes), peak=peak,
            predicted_peak=choice.predicted_peak, missed=share > _MISS,
        )
        if share <= _MISS:
            self._schedule.hit()
            if debugging():
                note_step(
                    f"ckptwrap checked a training step at inputs of {decision.describe()}: it peaked at "
                    f"{_mib(peak)}, {_mib(choice.predicted_peak)} predicted",
                    **fields,
                )
            return
        costs.missed(decision.sizes, share + decision.margin * choice.plain_peak / plain, decision.source)
        self._forget_plans(costs)
        self._schedule.soon()
        note(
            f"ckptwrap's plan at inputs of {decision.describe()} peaked {share:.1%} of the "
            f"un-checkpointed peak above its prediction ({decision.source} costs); plans of these "
            f"inputs now keep {costs.margin:.1%} free.",
            **fields,
        )

    # ------------------------------------------------------------------ given inputs

    def choose(
        self,
        model: nn.Module,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        *,
        strict: bool,
        around: Optional[Callable[[], ContextManager[Any]]] = None,
    ) -> Choice:
        """The plan for these inputs, measuring one step on them first if their shape's
        costs are not known; each time the model runs to be measured, it runs inside
        ``around()`` (the caller takes its own marks off the model there, say). The next
        training step is checked against the plan's prediction.

        Raises:
            CheckpointConfigError: With ``strict``, when no plan fits the budget at these
                shapes.
        """
        with outside_fake():  # the step runs in its own fake mode; the arithmetic outside
            self._take_in()
            costs, sizes = self._layouts.of(args, kwargs)
            if sizes not in costs.profiles:
                settings = self.settings
                with around() if around is not None else contextlib.nullcontext():
                    profile = measure_inputs(
                        model, resolve_targets(model, settings.names), args, kwargs,
                        run_region=settings.run_region, loss_fn=settings.loss_fn, save_policy=settings.save_policy,
                        preserve_rng_state=settings.preserve_rng_state, rates=settings.rates,
                        fake=settings.fake,
                    )
                costs.learn(sizes, profile)
            device = step_device(model, args, kwargs)
            self.device.before_example(model, device, args, kwargs)
            region = region_bytes(device, self.settings.preserve_rng_state)
            choice = self._choice(costs, sizes, region, strict=strict, model=model)
            self._schedule.soon()
            return choice

    def seed(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], profile: ModelProfile) -> None:
        """Take ``profile``, measured on these inputs, as their costs."""
        costs, sizes = self._layouts.of(args, kwargs)
        costs.learn(sizes, profile)

    # ------------------------------------------------------------------ internals

    def _choice(
        self,
        costs: LayoutCosts,
        sizes: Sizes,
        region: int,
        *,
        strict: bool,
        model: nn.Module,
        bounded: bool = False,
    ) -> Optional[Choice]:
        """The plan at ``sizes``, whose costs ``costs`` knows (solved once per shape,
        budget and margin; the profile is evaluated only to solve). ``strict``: a budget
        out of reach raises rather than giving the plan of least memory. ``bounded``: the
        costs are a bound (their plain peak is no reference for a share), and a budget out
        of reach under them gives None."""
        settings = self.settings
        profile = costs.profile_at(sizes)
        plain = self._cache.plain.get((id(costs), sizes, region))
        if plain is None and (self.reading.percent or costs.margin or self.reading.max_shapes):
            plain = plain_peak(profile, settings.names, region_bytes=region)
            self._cache.keep_plain((id(costs), sizes, region), plain)
        # Otherwise the solve gives the plain peak (the budget and the margin need none).
        budget = self.reading.at(plain or 0, costs, reference=not bounded)
        kept_free = int(costs.margin * (plain or 0))
        # A batch of one names its operators otherwise than other batches: whole modules.
        levels = settings.levels and not costs.layout.single(sizes)
        # Solved once per profile: the shapes a measured shape bounds (or one scaled bound)
        # share theirs, and with it their plan.
        key = (id(costs), id(profile), levels, region, bounded, None if budget is None else int(budget), kept_free)
        found = self._cache.plan(key, profile)
        if found is not None:
            self._solved_at(found, plain, costs, sizes, region, bounded)
            self._say_unreachable(found, costs, sizes, model)
            return found
        target = budget if budget is None or not kept_free else max(0, int(budget) - kept_free)
        try:
            choice = choose(
                profile, settings.candidates, target,
                describe=settings.budget.describe() if settings.budget is not None else "the budget",
                segments=settings.segments, levels=levels, recompute=settings.recompute,
                region_bytes=region, strict=strict, settle=not bounded,
            )
        except CheckpointConfigError as error:
            if bounded:
                # No plan under a bound: the caller measures. Returned from here, the
                # error goes at once, and with it the solver's arrays its frames hold
                # (raised on, a cycle would keep them to the next garbage collection:
                # inside the step).
                return None
            said = CheckpointConfigError(f"at inputs of {costs.layout.describe(sizes)}: {error}")
            said.needed, said.offered = error.needed, error.offered
            raise said from None
        choice = dataclasses.replace(choice, budget=budget, memory=self.device.memory)
        self._solved_at(choice, plain, costs, sizes, region, bounded)
        self.device.check_optimizer(model, strict=strict)
        self._say_unreachable(choice, costs, sizes, model)
        self._cache.keep(key, choice)
        return choice

    def _say_unreachable(self, choice: Choice, costs: LayoutCosts, sizes: Sizes, model: nn.Module) -> None:
        """A plan of least memory where no plan fits: said at the first step at a shape
        after a step at another (or at the example inputs)."""
        if choice.reachable or self._said == (id(costs), sizes):
            return
        self._said = (id(costs), sizes)
        warn(
            f"{type(model).__name__}: no plan fits {self.settings.budget.describe()} "  # type: ignore[union-attr]
            f"({_mib(int(choice.budget or 0))}) at inputs of {costs.layout.describe(sizes)}; this "
            f"forward runs under the plan of least memory ({_mib(choice.predicted_peak)} "
            f"predicted). Said at the first step at a shape after a step at another.",
            repeat=True,
        )

    def _solved_at(
        self, choice: Choice, plain: Optional[int], costs: LayoutCosts, sizes: Sizes, region: int, bounded: bool
    ) -> None:
        """``choice`` at ``sizes``: its plain peak kept as the shape's, and as a reference."""
        if plain is None:
            self._cache.keep_plain((id(costs), sizes, region), choice.plain_peak)
            if not bounded:
                self.reading.reference = max(self.reading.reference, choice.plain_peak)

    def _forget_plans(self, costs: LayoutCosts) -> None:
        self._cache.forget(id(costs))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class PlannedStep:
    """One training step of a lazy budget, from its forward's pre-hook to the end of its
    backward: what the planner decided for it and what meters it.

    Its states, in order: *decided* (made by :meth:`ShapePlanner.begin`; the marking
    layer marks the model by its ``decision``, with its ``recorder`` as the regions'
    observer on a measured step), *running* (:meth:`start`: its recorder or meter
    counts), *forwarded* (:meth:`forward_done`: the output's tensors that require grad
    are watched for the backward to reach them), then *ended* (:meth:`end`, queued on
    autograd's engine once the backward reaches an output: the planner takes the step's
    time, and what it measured or how it peaked) or *abandoned* (:meth:`abandon`: no
    backward came before the next training forward, or the forward raised; nothing is
    learned from it). ``end`` and ``abandon`` happen once, whichever comes first.
    """

    def __init__(
        self,
        model: nn.Module,
        planner: ShapePlanner,
        decision: Decision,
        recorder: Optional[StepRecorder] = None,
        meter: Optional[SpanPeak] = None,
        on_measured: Optional[Callable[[ModelProfile, Optional[int], int], None]] = None,
    ) -> None:
        self.model = weakref.ref(model)
        self.planner, self.decision = planner, decision
        self.recorder, self.meter = recorder, meter
        self.on_measured = on_measured
        self.started = time.perf_counter()
        self.forwarded = False
        self.queued = False
        self.ended = False
        self.learned: Optional[ModelProfile] = None
        """The profile a measured step gave, once it has ended."""

    def start(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """The marks are set: start counting (the recorder of a measured step, the meter of
        a checked one)."""
        if self.recorder is not None:
            self.recorder.begin(args, kwargs)
        elif self.meter is not None:
            self.meter.start()

    def forward_done(self, output: Any) -> bool:
        """The forward returned: carry the meter into the backward from the output.
        False if the output holds nothing to follow the backward from (the step is then
        abandoned)."""
        self.forwarded = True
        roots = [t for t in tensors(output) if t.requires_grad]
        if self.recorder is not None:
            self.recorder.forward_done(output)
        elif self.meter is not None:
            self.meter.leave(roots)
        if not roots or _torch_private.queue_callback is None:
            self.abandon("the forward gave nothing to backpropagate")
            return False
        reached = functools.partial(_reached, weakref.ref(self))
        for tensor in roots:
            tensor.register_hook(functools.partial(reached, tensor.numel() == 1))
        return True

    def reached(self, scalar: bool, grad: Any) -> None:
        """The backward reached an output of the step: have it tell the step when it
        ends. Reached first at an output other than a scalar, the loss was made outside
        the model, where no meter counted it: the meter takes it in from here."""
        if self.queued or self.ended:
            return
        self.queued = True
        meter = self.recorder.phases if self.recorder is not None else self.meter
        if not scalar and isinstance(grad, torch.Tensor) and meter is not None and meter.span is not None:
            meter.span.loss_outside(grad)
        _torch_private.queue_callback(self.end)  # type: ignore[misc]

    def end(self) -> None:
        """The backward has ended (called by autograd's engine): hand the planner what
        was measured. Never raises into the backward."""
        if self.ended:
            return
        self.ended = True
        planner, decision = self.planner, self.decision
        try:
            planner._step_timed(decision, time.perf_counter() - self.started)
            if self.recorder is not None:
                self.learned = self.recorder.finish()
                planner._step_measured(decision, self.learned, self.recorder.failed)
                if self.learned is not None and self.on_measured is not None:
                    self.on_measured(self.learned, *planner._measured_plan(decision, self.learned))
                model = self.model()
                if model is not None:
                    planner._step_said(decision, self.learned, model)
            elif self.meter is not None:
                peak = self.meter.stop()
                planner._step_checked(decision, peak, self.meter.exact)
        except Exception as error:  # noqa: BLE001 - the caller's backward must go on
            note(f"ckptwrap could not take in a step it followed: {type(error).__name__}: {error}")

    def abandon(self, why: str) -> None:
        """The step ends without a backward: nothing is learned from it."""
        if self.ended:
            return
        self.ended = True
        if self.recorder is not None:
            self.recorder.abandon(why)
            self.planner.watch_base = False
        elif self.meter is not None:
            self.meter.stop()


def _reached(step_ref: "weakref.ref[PlannedStep]", scalar: bool, grad: Any) -> None:
    step = step_ref()
    if step is not None:
        step.reached(scalar, grad)
    return None

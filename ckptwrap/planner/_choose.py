"""From a profile at one shape to a plan's choice: the solver's items with the step's
terms, the un-checkpointed peak, and, for a budget, the plan of least recompute time that
fits it (or, where none does, the plan of least memory).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .._errors import CheckpointConfigError
from ._device_memory import DeviceMemory
from ._peak_model import CostItem
from ._items import forward_levels, saving, with_step_terms
from ._levels import Level
from ._plan import PlanEntry
from ._module_costs import ModelProfile
from ._solver import BudgetSolution, lowest_plan, predicted_peak, solve_budget

__all__ = ["Choice", "choose", "plain_peak", "step_items"]


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


def step_items(
    profile: ModelProfile,
    names: Sequence[str],
    *,
    segments: bool = False,
    levels: bool = False,
    region_bytes: int = 0,
) -> Tuple[List[Tuple[str, CostItem]], Dict[str, Tuple[Level, ...]], int]:
    """The solver's items for ``names`` in forward order with the step's terms, the
    selective levels behind each one's options, and the solver's tail: what a plan is
    solved on (see :func:`~ckptwrap.planner.forward_levels` for the arguments)."""
    found = forward_levels(
        profile, names, segments=segments, levels=levels, region_bytes=region_bytes
    )
    ordered, tail = with_step_terms([(name, item) for name, item, _ in found], profile)
    return ordered, {name: ours for name, _, ours in found}, tail


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
    if budget is None:
        ordered, levels_of, tail = step_items(
            profile, [cost.name for cost in profile.modules], segments=False, levels=False,
            region_bytes=region_bytes,
        )
    else:
        ordered, levels_of, tail = step_items(
            profile, names, segments=segments, levels=levels, region_bytes=region_bytes
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
    return tuple(
        _entry(name, kind, by_name[name], joins, in_segments, chosen_levels.get(name), recompute)
        for name, kind in candidates
        if name in picked
    )


def _entry(
    name: str,
    kind: str,
    item: CostItem,
    joins: Dict[str, str],
    in_segments: Set[str],
    level: Optional[Level],
    recompute: bool,
) -> PlanEntry:
    """The plan entry of a chosen candidate, with how it is checkpointed and what that
    is predicted to save and cost."""
    if level is not None:
        return PlanEntry(
            name,
            kind,
            saved_bytes=item.kept - level.option.inputs,
            recompute_time=level.option.time,
            option=level.option.label,
            saved_ops=level.instances,
        )
    option = None
    if recompute:
        option = "segment" if name in in_segments else "recompute"
    return PlanEntry(
        name,
        kind,
        saved_bytes=saving(item, name in joins),
        recompute_time=item.time,
        joins=joins.get(name),
        option=option,
    )

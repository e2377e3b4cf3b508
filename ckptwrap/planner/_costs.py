"""Measured plans: profile the candidates, then solve a budget or predict the peak.

Kept apart from selection so that a plan without ``budget:`` or example inputs never
runs the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..policy import Budget
from ._levels import Level, pooled_levels
from ._profile import ModelProfile, profile_modules
from ._solver import CostItem, PercentBudget, predicted_peak, solve_budget
from ._plan import PlanEntry
from ._step_terms import with_step_terms

__all__ = [
    "MeasuredChoice", "measure_and_choose", "as_example", "cost_item", "forward_items", "forward_levels",
]


class MeasuredChoice:
    """Which candidates to checkpoint, with the predictions that justify it."""

    def __init__(
        self,
        entries: List[PlanEntry],
        dropped: List[Tuple[str, str]],
        budget: Optional[int],
        profile: ModelProfile,
        peak: int,
        plain_peak: int,
    ) -> None:
        self.entries = entries
        self.plain_peak = plain_peak
        self.dropped = dropped
        self.budget = budget
        self.activation_bytes = profile.total_activation_bytes
        self.predicted_peak = peak
        self.profile = profile


def cost_item(cost: Any, *, segments: bool = False) -> CostItem:
    """The solver's view of one measured module.

    A checkpoint keeps the module's inputs; the part of them the module saves itself is
    already counted in the profile's base bytes (it stays alive either way), so only the
    rest is extra. Likewise its saved outputs that the code after it saves too are in the
    base, not freed by the checkpoint, yet rebuilt by its recomputation, which at its
    highest also holds the forward's temporaries. With ``segments``, a module that takes
    the previous candidate's output as its only input may run in one region with it.
    Measured with a save policy (the selective tier), the checkpoint also
    keeps the outputs the policy saves, and its recomputation rebuilds, and costs, only
    the rest.
    """
    extra_inputs = max(0, int(cost.input_bytes) - int(cost.self_saved_input_bytes))
    time = cost.forward_time if cost.recompute_time is None else cost.recompute_time
    return CostItem(
        cost.name,
        int(cost.kept_bytes) - int(cost.handed_over_bytes),
        extra_inputs + int(cost.policy_saved_bytes),
        float(time),
        rebuilt=max(
            int(cost.kept_bytes) - int(cost.policy_saved_kept_bytes),
            int(cost.forward_peak_bytes) - int(cost.policy_saved_bytes),
            0,
        ),
        before=cost.base_before_bytes,
        joins=int(cost.self_saved_input_bytes) if segments and cost.joins_previous else None,
        saved=int(cost.policy_saved_kept_bytes),
    )


def _saving(item: CostItem, joined: bool) -> int:
    """What checkpointing the candidate saves: in a segment after its first module, all it
    keeps and its input; otherwise what it keeps beyond what its region keeps."""
    return item.kept + (item.joins or 0) if joined else item.kept - item.inputs


def forward_items(
    profile: ModelProfile, names: Sequence[str], *, segments: bool = False, levels: bool = False
) -> List[Tuple[str, CostItem]]:
    """The solver's items for ``names``, in the order the profiled forward called them.

    Candidates never called outside another candidate's call come last, in the given order.
    With ``segments``, a candidate may join the one before it only if that one is among
    ``names`` and just before it in this order. With ``levels``, each item carries its
    selective levels as ``options`` (see :func:`forward_levels`).
    """
    found = forward_levels(profile, names, segments=segments, levels=levels)
    return [(name, item) for name, item, _ in found]


def forward_levels(
    profile: ModelProfile, names: Sequence[str], *, segments: bool = False, levels: bool = True
) -> List[Tuple[str, CostItem, Tuple[Level, ...]]]:
    """:func:`forward_items`, with the selective levels behind each item's ``options``
    (none without ``levels``)."""
    costs = [profile[name] for name in names]
    order = sorted(range(len(costs)), key=lambda i: (costs[i].position < 0, costs[i].position, i))
    pairs = []
    for rank, i in enumerate(order):
        follows = rank > 0 and costs[order[rank - 1]].position == costs[i].position - 1
        pairs.append((costs[i], cost_item(costs[i], segments=segments and follows)))
    found = pooled_levels(pairs) if levels else [()] * len(pairs)
    return [
        (names[i], dataclasses.replace(item, options=tuple(level.option for level in ours)), ours)
        for i, (_, item), ours in zip(order, pairs, found)
    ]


def resolve_budget(budget: Budget, plain_peak: int) -> int:
    """``budget`` in bytes, given the predicted peak of the un-checkpointed training step
    (above what was allocated before it), which a percentage is a share of.

    A percentage resolves to a :class:`PercentBudget`, an int that remembers it, so that a
    budget below reach is reported in percent too.
    """
    fraction, amount = budget.parsed()
    if fraction is None:
        return int(amount)  # type: ignore[arg-type]
    return PercentBudget(fraction, plain_peak, of="the un-checkpointed step's peak")


def as_example(example_inputs: Any, example_kwargs: Optional[Mapping[str, Any]]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Positional and keyword example inputs in a uniform shape."""
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise CheckpointConfigError(
            f"example_kwargs must be a mapping of keyword arguments, got {type(example_kwargs).__name__}."
        )
    if example_inputs is None:
        args: Tuple[Any, ...] = ()
    elif isinstance(example_inputs, tuple):
        args = example_inputs
    elif isinstance(example_inputs, list):
        args = tuple(example_inputs)
    else:
        args = (example_inputs,)
    return args, dict(example_kwargs or {})


def measure_and_choose(
    model: nn.Module,
    candidates: Sequence[PlanEntry],
    budget: Optional[Budget],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    *,
    save_policy: Optional[Callable[..., Any]] = None,
    segments: bool = False,
    levels: bool = False,
    tier: str = "recompute",
    profile: Optional[ModelProfile] = None,
    loss_fn: Optional[Callable[[Any], Any]] = None,
) -> MeasuredChoice:
    """Profile ``candidates`` on the example inputs and choose among them.

    With a budget, the cheapest set in recompute time whose predicted peak fits it, where
    with ``segments`` consecutive candidates may share one region, and with ``levels`` a
    candidate may instead be checkpointed at one of its selective levels (saving some
    operators' outputs); without a budget, all candidates, each in its own region, with
    their predictions. ``save_policy`` is the selective tier's policy, if the candidates
    are to be checkpointed selectively. Each entry's ``option`` says how its module is
    checkpointed: ``recompute`` (all of it), a level's label, or ``segment``; it is None
    for the other tiers (``tier`` says how those are checkpointed).

    Peaks are those of the whole training step (see ``_step_terms``): the profile runs
    one step with every candidate checkpointed, its loss from ``loss_fn``, and a
    percentage budget is a share of the predicted un-checkpointed step's peak.

    ``profile``, made on the same inputs without a save policy, is used instead of
    profiling again when it serves: it must cover the candidates, and, for a budget, no
    more than them (its other modules are counted as kept without a budget).
    """
    names = [entry.name for entry in candidates]
    if not _serves(profile, names, budget, save_policy):
        with torch.random.fork_rng(devices=[]):
            profile = profile_modules(
                model, names, args, kwargs, save_policy=save_policy, step=True, loss_fn=loss_fn
            )
    assert profile is not None
    if budget is None:
        # Modules profiled beside the candidates stay as they are: kept, in the prediction.
        ordered = forward_items(profile, [cost.name for cost in profile.modules])
    else:
        found = forward_levels(profile, names, segments=segments, levels=levels)
        ordered = [(name, item) for name, item, _ in found]
        levels_of = {name: ours for name, _, ours in found}
    ordered, tail = with_step_terms(ordered, profile)
    items = [item for _, item in ordered]
    plain_peak = predicted_peak(items, (), base=profile.base_bytes, tail=tail)
    dropped: List[Tuple[str, str]] = []
    budget_bytes = None
    joins: Dict[str, str] = {}
    chosen_levels: Dict[str, Level] = {}
    in_segments: set = set()
    if budget is not None:
        budget_bytes = resolve_budget(budget, plain_peak)
        solution = solve_budget(items, budget_bytes, base=profile.base_bytes, tail=tail)
        picked = {ordered[i][0] for i in solution.selected}
        for segment in solution.segments:
            joins.update((ordered[i][0], ordered[i - 1][0]) for i in segment[1:])
            in_segments.update(ordered[i][0] for i in segment)
        for index, option in zip(solution.selected, solution.options):
            if option:
                name = ordered[index][0]
                chosen_levels[name] = levels_of[name][option - 1]
        peak = solution.predicted_peak
        dropped = [
            (name, f"not needed to fit {budget.describe()}") for name in names if name not in picked
        ]
    else:
        picked = set(names)
        chosen = [i for i, (name, _) in enumerate(ordered) if name in picked]
        peak = predicted_peak(items, chosen, base=profile.base_bytes, tail=tail)
    by_name = dict(ordered)
    entries = [
        _entry(entry, by_name[entry.name], joins, in_segments, chosen_levels, tier == "recompute")
        for entry in candidates
        if entry.name in picked
    ]
    return MeasuredChoice(entries, dropped, budget_bytes, profile, peak, plain_peak)


def _entry(
    entry: PlanEntry,
    item: CostItem,
    joins: Dict[str, str],
    in_segments: set,
    chosen_levels: Dict[str, Level],
    recompute: bool,
) -> PlanEntry:
    """The plan entry of a chosen candidate, with how it is checkpointed and what that
    is predicted to save and cost."""
    level = chosen_levels.get(entry.name)
    if level is not None:
        return PlanEntry(
            entry.name,
            entry.kind,
            saved_bytes=item.kept - level.option.inputs,
            recompute_time=level.option.time,
            option=level.option.label,
            saved_ops=level.instances,
        )
    option = None
    if recompute:
        option = "segment" if entry.name in in_segments else "recompute"
    return PlanEntry(
        entry.name,
        entry.kind,
        saved_bytes=_saving(item, entry.name in joins),
        recompute_time=item.time,
        joins=joins.get(entry.name),
        option=option,
    )


def _serves(
    profile: Optional[ModelProfile],
    names: Sequence[str],
    budget: Optional[Budget],
    save_policy: Optional[Callable[..., Any]],
) -> bool:
    """Whether a given profile can stand for profiling ``names`` here."""
    if profile is None or save_policy is not None or profile.step is None:
        return False
    profiled = {cost.name for cost in profile.modules}
    return set(names) <= profiled and (budget is None or profiled == set(names))

"""Measured plans: profile the candidates, then solve a budget or predict the peak.

Kept apart from selection so that a plan without ``budget:`` or example inputs never
runs the model.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..measure import ModelProfile, profile_modules
from ..policy import Budget
from ..policy._solver import CostItem, predicted_peak, solve_budget
from ._plan import PlanEntry

__all__ = ["MeasuredChoice", "measure_and_choose", "as_example", "cost_item"]


class MeasuredChoice:
    """Which candidates to checkpoint, with the predictions that justify it."""

    def __init__(
        self,
        entries: List[PlanEntry],
        dropped: List[Tuple[str, str]],
        budget: Optional[int],
        profile: ModelProfile,
        peak: int,
    ) -> None:
        self.entries = entries
        self.dropped = dropped
        self.budget = budget
        self.activation_bytes = profile.total_activation_bytes
        self.predicted_peak = peak


def cost_item(cost: Any) -> CostItem:
    """The solver's view of one measured module.

    A checkpoint keeps the module's inputs; the part of them the module saves itself is
    already counted in the profile's base bytes (it stays alive either way), so only the
    rest is extra.
    """
    extra_inputs = max(0, int(cost.input_bytes) - int(cost.self_saved_input_bytes))
    return CostItem(cost.name, int(cost.kept_bytes), extra_inputs, float(cost.forward_time))


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
) -> MeasuredChoice:
    """Profile ``candidates`` on the example inputs and choose among them.

    With a budget, the cheapest set in recompute time whose predicted peak fits it;
    without, all candidates, with their predictions.
    """
    names = [entry.name for entry in candidates]
    with torch.random.fork_rng(devices=[]):
        profile = profile_modules(model, names, args, kwargs)
    items = [cost_item(profile[name]) for name in names]
    dropped: List[Tuple[str, str]] = []
    budget_bytes = None
    if budget is not None:
        budget_bytes = budget.resolve(profile.total_activation_bytes)
        solution = solve_budget(items, budget_bytes, base=profile.base_bytes)
        chosen = list(solution.selected)
        peak = solution.predicted_peak
        picked = set(chosen)
        dropped = [
            (names[i], f"not needed to fit {budget.describe()}")
            for i in range(len(names))
            if i not in picked
        ]
    else:
        chosen = list(range(len(items)))
        peak = predicted_peak(items, chosen, base=profile.base_bytes)
    entries = [
        PlanEntry(
            candidates[i].name,
            candidates[i].kind,
            saved_bytes=items[i].kept - items[i].inputs,
            recompute_time=items[i].time,
        )
        for i in chosen
    ]
    return MeasuredChoice(entries, dropped, budget_bytes, profile, peak)

"""What a planner keeps of the plans it solved: the plans by the profile, budget and
margin they were solved under, the shapes' un-checkpointed peaks, and the shapes the
un-checkpointed step fitted at (a shape no larger in any shape variable needs no plan:
the step's costs grow with every variable, so its forward runs with nothing checkpointed
without evaluating a fit or solving).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from ._choose import Choice

__all__ = ["NothingNeeded", "PlanCache"]

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

    def clear(self) -> None:
        self._found.clear()


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

"""Pricing the removal of one region from a plan, for the solver's refinement on a coarse
axis: the moments of a plan, and the peak with one region's members plain instead.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Sequence

from ._cost_model import CostItem, Group
from ._moments import _before, _carried, _held, _moments, _plain_moment

__all__ = ["_Terms"]


class _Terms:
    """The moments of a plan, to price turning one region plain in O(its length + log n):
    that adds the same amount to the end of the forward and to every later moment,
    removes the region's own moment and adds its members' plain backward moments."""

    def __init__(
        self,
        items: Sequence[CostItem],
        groups: List[Group],
        base: int,
        tail: int,
        options: Dict[int, int],
    ) -> None:
        self.items, self.options = items, options
        joined = list(itertools.accumulate(_carried(item) for item in items))
        self.ahead = [_before(item, base) - joined[i] for i, item in enumerate(items)]
        terms, self.where, self.end = _moments(items, groups, base, tail, options)
        self.before_max = list(itertools.accumulate(terms, max, initial=-1))
        self.after_max = list(itertools.accumulate(reversed(terms), max, initial=-1))[::-1]

    def peak_without(self, group: Group) -> int:
        """The peak with ``group``'s members plain instead."""
        items = self.items
        k, held = self.where[group]
        x, own = held, -1
        for i in group:
            own = max(own, self.ahead[i] + x + _plain_moment(items[i]))
            x += _held(items[i], None)
        growth = x - held - _held(items[group[0]], self.options.get(group[0], 0))
        later = self.after_max[k + 1]
        return max(self.end + growth, self.before_max[k], own, later + growth if later >= 0 else -1)

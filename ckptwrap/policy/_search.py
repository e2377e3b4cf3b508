"""The dynamic program behind the budget solver: the best selection of candidates on a
discretised axis of held memory, traced back into groups, and refined on a coarse axis.

It prices plans with the peak model of ``_cost_model``; ``_solver`` wraps it for callers.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .._errors import CheckpointConfigError
from ._cost_model import (
    CostItem,
    Group,
    _before,
    _carried,
    _peak,
    _rebuilt,
    _Terms,
    format_bytes,
)

__all__ = ["_Search"]

# The exact (gcd) axis is used when it has at most _EXACT_STEPS steps; otherwise a coarser
# unit trades exactness (never feasibility) for speed. The axis stays within torch's
# parallel grain size (32768 elements): above it every elementwise op forks threads,
# which on a busy machine makes each of them hundreds of times slower.
_EXACT_STEPS = (1 << 15) - 1
_APPROX_STEPS = 1 << 14
# Work bound (items x steps) of the coarse axis, for the solver-time targets.
_APPROX_CELLS = 1 << 24
# Memory bound (items x steps) of the choice bits kept for reconstruction.
_MAX_CELLS = 1 << 26
# Segments are at most this long, and shorter when n x steps x length would pass the bound.
_LONGEST_SEGMENT = 64
_SEGMENT_CELLS = 1 << 24
_NEVER = 1 << 62  # an unreachable entry's key


class _Search:
    """A dynamic program over the forward, on a discretised axis of held memory.

    Going through the candidates in forward order, the state is ``x``: the bytes that the
    candidates so far hold until their backward (``kept``, or ``inputs`` if checkpointed,
    plus the input each one carries when it starts a region of its own). A recomputation's
    peak depends only on ``x`` before it, and the end-of-forward peak only on the final
    ``x``, so for each position and ``x`` it is enough to keep the best partial plan:
    least time, then least peak so far (every later step preserves this order, so time
    and peak are exact), then fewest members and regions (a tie-break only: a partial plan
    with a higher peak so far and fewer members can end at the same peak). From each position a step
    covers one candidate, plain or checkpointed (if it saves memory: ``kept > inputs``),
    or a segment of several.

    Exact ties (equal time, peak, members and regions) go to the partial plan merged
    first, and merges follow model order: at each position, leaving the candidate before
    it plain is merged before checkpointing it. So equal inputs always give the same plan,
    and a tie between alike candidates goes to the earlier ones (of eight equal blocks,
    four are checkpointed as blocks 0 to 3).

    With ``budget`` None it finds the lowest peak instead: every time counts as zero, and
    no recomputation is ruled out. ``times`` are the seconds the program weighs, one per
    item (the solver passes pooled times, see ``_solver``); None means each ``item.time``.
    """

    def __init__(
        self,
        items: Sequence[CostItem],
        base: int,
        budget: Optional[int],
        times: Optional[Sequence[float]] = None,
    ) -> None:
        self.items, self.base, self.budget = items, base, budget
        self.times = [item.time for item in items] if times is None else list(times)
        self.n = len(items)
        self.useful = [item.kept > item.inputs for item in items]
        # run[i]: how many candidates from i on can form one segment.
        self.run_length = [1] * self.n
        for i in range(self.n - 2, -1, -1):
            if items[i + 1].joins is not None:
                self.run_length[i] = self.run_length[i + 1] + 1
        joined = list(itertools.accumulate(_carried(item) for item in items))
        self.floor = base - (joined[-1] if joined else 0)  # base without the joined inputs
        self.ahead = [_before(item, base) - joined[i] for i, item in enumerate(items)]
        self.unit, self.exact = self._unit()
        cells = max(1, self.n) * (self._length() + 1)
        self.longest = max(2, min(_LONGEST_SEGMENT, _SEGMENT_CELLS // cells))

    def _unit(self) -> Tuple[int, bool]:
        """The gcd of the sizes on the axis if it is short enough, else a coarser unit.

        Sizes are rounded up to the unit, so with a coarse one the program sees more held
        memory than there is: its plans fit, but may not be the cheapest.
        """
        items = self.items
        sizes = [_carried(item) + item.kept for item in items]
        sizes += [
            _carried(item) + item.inputs
            for i, item in enumerate(items)
            if self.useful[i] or self.run_length[i] > 1
        ]
        span = sum(_carried(item) + item.kept for item in items)
        if self.budget is not None:
            span = max(0, min(span, self.budget - self.floor))
        grain = math.gcd(*sizes) or 1
        n = max(1, self.n)
        if -(-span // grain) <= min(_EXACT_STEPS, max(1024, _MAX_CELLS // n)):
            return grain, True
        steps = min(_APPROX_STEPS, max(1024, _APPROX_CELLS // n))
        unit = max(grain, -(-span // steps))
        return unit, all(size % unit == 0 for size in sizes)

    def _length(self) -> int:
        """Entries on the axis; those beyond the budget can never fit again."""
        total = sum(-(-(_carried(item) + item.kept) // self.unit) for item in self.items)
        if self.budget is None:
            return total + 1
        return min(total, (self.budget - self.floor) // self.unit) + 1

    def _units(self, nbytes: int) -> int:
        return -(-nbytes // self.unit)

    def _steps(self, i: int) -> Iterator[Tuple[int, int, int, int, float, int]]:
        """The steps from position ``i``: (code, length, held bytes, recompute bytes or -1,
        time, members recomputed). Code 0 is the plain candidate, 1 the candidate
        checkpointed alone, k >= 2 a segment of k candidates."""
        items = self.items
        item = items[i]
        carried = _carried(item)
        yield 0, 1, carried + item.kept, -1, 0.0, 0
        if self.useful[i]:
            yield 1, 1, carried + item.inputs, _rebuilt(items, (i,)), self.times[i], 1
        for size in range(2, min(self.run_length[i], self.longest) + 1):
            group = tuple(range(i, i + size))
            time = math.fsum(self.times[j] for j in group)
            yield size, size, carried + item.inputs, _rebuilt(items, group), time, size

    def run(self) -> Optional[List[Group]]:
        """The best plan as groups of candidates, or None if nothing fits the budget."""
        items, unit, budget = self.items, self.unit, self.budget
        if budget is not None and budget < self.floor:
            return None
        length = self._length()
        radix = self.n + 1
        ceiling = self.base + sum(
            _carried(item) + max(item.kept, item.inputs) + item.rebuilt + unit for item in items
        )
        if (ceiling + 1) * radix * radix >= _NEVER:
            raise CheckpointConfigError(
                f"the candidates' sizes ({format_bytes(ceiling)} in all) are too large for "
                f"the budget solver"
            )
        x = torch.arange(length, dtype=torch.int64) * unit
        start_cost = torch.full((length,), math.inf, dtype=torch.float64)
        start_cost[0] = 0.0
        # key = (peak so far * radix + members) * radix + regions: smaller is better on
        # equal time.
        start_key = torch.full((length,), _NEVER, dtype=torch.int64)
        start_key[0] = 0
        # Per position, the best plans of the candidates before it, and by which step each
        # entry was reached (for tracing the plan back).
        pending: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {0: (start_cost, start_key)}
        self.codes: Dict[int, torch.Tensor] = {}
        for i in range(self.n):
            cost, key = pending.pop(i)
            reachable = key < _NEVER
            for code, size, held, rebuilt, time, members in self._steps(i):
                if rebuilt < 0:
                    cost2, key2 = cost, key
                else:
                    recompute = self.ahead[i] + _carried(items[i]) + items[i].inputs + rebuilt + x
                    allowed = reachable if budget is None else reachable & (recompute <= budget)
                    cost2 = torch.where(allowed, cost + (0.0 if budget is None else time), math.inf)
                    peak = torch.maximum(key // (radix * radix), recompute)
                    tally = key % (radix * radix) + members * radix + 1
                    key2 = torch.where(allowed, peak * radix * radix + tally, _NEVER)
                shift = self._units(held)
                cost2, key2 = _shift(cost2, shift, math.inf), _shift(key2, shift, _NEVER)
                self._merge(pending, i + size, cost2, key2, code)
        cost, key = pending.pop(self.n)
        # At the end of the forward, everything held is alive at once.
        reachable = key < _NEVER
        if not bool(reachable.any()):
            return None
        top = radix * radix
        final = torch.maximum(key // top, self.floor + x) * top + key % top
        low = cost.masked_fill(~reachable, math.inf).min()
        end = int(final.masked_fill(~reachable | (cost != low), _NEVER).argmin().item())
        return self.refine(self._trace(end))

    def _merge(
        self,
        pending: Dict[int, Tuple[torch.Tensor, torch.Tensor]],
        target: int,
        cost2: torch.Tensor,
        key2: torch.Tensor,
        code: int,
    ) -> None:
        """Keep, per entry at position ``target``, the better of what is there and a step."""
        if target not in pending:
            pending[target] = (cost2, key2)
            self.codes[target] = torch.full(cost2.shape, code, dtype=torch.int8)
            return
        cost1, key1 = pending[target]
        better = (cost2 < cost1) | ((cost2 == cost1) & (key2 < key1))
        pending[target] = (torch.where(better, cost2, cost1), torch.where(better, key2, key1))
        self.codes[target] = torch.where(better, code, self.codes[target]).to(torch.int8)

    def _trace(self, end: int) -> List[Group]:
        groups: List[Group] = []
        position, x = self.n, end
        while position > 0:
            code = int(self.codes[position][x])
            size = max(1, code)
            start = position - size
            item = self.items[start]
            if code == 0:
                x -= self._units(_carried(item) + item.kept)
            else:
                x -= self._units(_carried(item) + item.inputs)
                groups.append(tuple(range(start, position)))
            position = start
        return sorted(groups)

    def refine(self, groups: List[Group]) -> List[Group]:
        """On a coarse axis, drop the costliest regions the exact peak does not need.

        Passes repeat until none drops a region: dropping a later region can leave an
        earlier one, kept only to lower the later one's recomputation, unneeded.
        """
        if self.exact or not groups:
            return groups
        items, base = self.items, self.base
        limit = self.budget if self.budget is not None else _peak(items, groups, base)
        times = self.times
        cost = lambda g: (-math.fsum(times[i] for i in g), -sum(items[i].kept for i in g), g)  # noqa: E731
        kept, dropped = sorted(groups), True
        while dropped:
            dropped = False
            terms = _Terms(items, kept, base)
            for group in sorted(kept, key=cost):
                if terms.peak_without(group) <= limit:
                    kept = [other for other in kept if other != group]
                    terms, dropped = _Terms(items, kept, base), True
        return kept



def _shift(values: torch.Tensor, by: int, fill: float) -> torch.Tensor:
    """``values`` moved ``by`` places up the axis, ``fill`` below; what falls off is lost."""
    if by == 0:
        return values
    if by >= len(values):
        return torch.full_like(values, fill)
    return torch.cat((values.new_full((by,), fill), values[: len(values) - by]))

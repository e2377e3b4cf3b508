"""The dynamic program behind the budget solver: the best plan (each candidate plain,
checkpointed alone with one of its options, or in a segment) on a discretised axis of
held memory, traced back into regions, and refined on a coarse axis.

It prices plans with the peak model of ``_cost_model``; ``_solver`` wraps it for callers.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._errors import CheckpointConfigError
from ._cost_model import CostItem, Group, format_bytes
from ._refine import _Terms
from ._moments import (
    _alone_moment,
    _before,
    _carried,
    _held,
    _peak,
    _plain_forward,
    _plain_moment,
    _segment_moment,
)

__all__ = ["_Search"]

# The exact (gcd) axis is used when it has at most _EXACT_STEPS steps; otherwise a coarser
# unit trades exactness (never feasibility) for speed. The axis stays within torch's
# parallel grain size (32768 elements): above it every elementwise op forks threads,
# which on a busy machine makes each of them hundreds of times slower.
_EXACT_STEPS = (1 << 15) - 1
_APPROX_STEPS = 1 << 14
# Work bounds of the coarse axis, for the solver-time targets: items x steps, and
# options beyond one way to checkpoint a candidate x steps.
_APPROX_CELLS = 1 << 24
_APPROX_OPTION_CELLS = 1 << 22
# Memory bound (items x steps) of the choice codes kept for reconstruction.
_MAX_CELLS = 1 << 26
# And of all the arrays, against the budget: an entry of the axis takes about
# _ENTRY_BYTES (its offset, scaled offset, and the cost and key of the positions open at
# once) plus a byte or more per candidate (the codes); the arrays stay within
# 1/_BUDGET_SHARE of the budget, on an axis of at least 1024 entries.
_ENTRY_BYTES = 64
_BUDGET_SHARE = 8
# Segments are at most this long, and shorter when n x steps x length would pass the bound.
_LONGEST_SEGMENT = 64
_SEGMENT_CELLS = 1 << 24
_NEVER = 1 << 62  # an unreachable entry's key
_NO_MOMENT = -(1 << 62)  # the moment of a step that adds none that can bind

# A plan: its regions (sorted groups of consecutive indices) and, by first index, the
# option of each region checkpointed with one (absent: the full recomputation).
_Plan = Tuple[List[Group], Dict[int, int]]


class _Row(NamedTuple):
    """One step from a position: the candidate plain, checkpointed alone, or a segment."""

    code: int
    """0 plain, 1 alone in full, -k alone with option k, k >= 2 a segment of k."""
    size: int
    """Candidates it covers."""
    held: int
    """Bytes it holds until its backward."""
    moment: int
    """Its moment less ``x`` before it; _NO_MOMENT if none can bind."""
    time: float
    """Seconds it adds."""
    tally: int
    """What it adds to a key's members and regions."""


class _Search:
    """A dynamic program over the forward, on a discretised axis of held memory.

    Going through the candidates in forward order, the state is ``x``: the bytes that the
    candidates so far hold until their backward (see ``predicted_peak``). Every moment of
    the peak model depends only on ``x`` before the candidate or region it belongs to,
    and the end of the forward only on the final ``x``, so for each position and ``x`` it
    is enough to keep the best partial plan: least time, then least peak so far (every
    later step preserves this order, so time and peak are exact), then fewest members and
    regions (a tie-break only: a partial plan with a higher peak so far and fewer members
    can end at the same peak). From each position a step covers one candidate, plain,
    checkpointed alone in full or with one of its options (each only if it holds less
    than the plain candidate, or reaches less at its own moment: otherwise it is no better
    in memory and costs time), or a segment of several.

    Exact ties (equal time, peak, members and regions) go to the partial plan merged
    first, and merges follow model order: at each position, segments that end there come
    first, then leaving the candidate before it plain, then checkpointing it in full, then
    with its options in their order. So equal inputs always give the same plan, and a tie
    between alike candidates goes to the earlier ones (of eight equal blocks, four are
    checkpointed as blocks 0 to 3).

    With ``budget`` None it finds the lowest peak instead: every time counts as zero, and
    no recomputation is ruled out; ``within`` then bounds its arrays as a budget would (a
    coarser axis: the peak found is one a plan reaches, perhaps not the lowest). ``times``
    are the seconds the program weighs, per item those of the full recomputation and then
    of each option (the solver passes pooled times, see ``_solver``); None means the
    items' own.
    """

    def __init__(
        self,
        items: Sequence[CostItem],
        base: int,
        budget: Optional[int],
        times: Optional[Sequence[Sequence[float]]] = None,
        *,
        tail: int = 0,
        within: Optional[int] = None,
    ) -> None:
        self.items, self.base, self.budget, self.tail = items, base, budget, tail
        # The bytes the arrays stay within a share of: the budget, or for the lowest-peak
        # search run for a budget out of reach inside the step, that budget (``within``).
        self._cap = budget if budget is not None else within
        if times is None:
            times = [(item.time, *(option.time for option in item.options)) for item in items]
        self.times = [list(row) for row in times]
        self.n = len(items)
        # Per candidate, the ways to checkpoint it alone that hold less than it plain, or
        # reach less at its own moment (a candidate called several times, whose backward
        # holds one call's share of what it keeps plain): 0 for the full recomputation, k
        # for its option k.
        self.alone = [
            [
                k for k in range(len(item.options) + 1)
                if _held(item, k) < _held(item, None) or _alone_moment(item, k) < _plain_moment(item)
            ]
            for item in items
        ]
        # run_length[i]: how many candidates from i on can form one segment.
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

    def _room(self) -> Optional[int]:
        """Bytes the candidates may hold at the end of the forward; None: no limit."""
        if self.budget is None:
            return None
        return self.budget - self.floor - self.tail

    def _unit(self) -> Tuple[int, bool]:
        """The gcd of the sizes on the axis if it is short enough, else a coarser unit.

        Sizes are rounded up to the unit, so with a coarse one the program sees more held
        memory than there is: its plans fit, but may not be the cheapest.
        """
        items = self.items
        sizes = [_held(item, None) for item in items]
        sizes += [_held(item, k) for i, item in enumerate(items) for k in self.alone[i]]
        sizes += [_held(item, 0) for i, item in enumerate(items) if self.run_length[i] > 1]
        span = sum(self._most(i) for i in range(self.n))
        room = self._room()
        if room is not None:
            span = max(0, min(span, room))
        grain = math.gcd(*sizes) or 1
        n = max(1, self.n)
        # The solve runs inside the step it plans (a training forward's pre-hook), on the
        # CPU in the memory the budget caps: its arrays stay within a share of the budget.
        held = _NEVER if self._cap is None else max(1024, self._cap // (_BUDGET_SHARE * (_ENTRY_BYTES + n)))
        if -(-span // grain) <= min(_EXACT_STEPS, max(1024, _MAX_CELLS // n), held):
            return grain, True
        extra = max(1, sum(max(0, len(ways) - 1) for ways in self.alone))
        bound = min(_APPROX_CELLS // n, _APPROX_OPTION_CELLS // extra)
        steps = min(_APPROX_STEPS, max(1024, bound), held)
        unit = max(grain, -(-span // steps))
        return unit, all(size % unit == 0 for size in sizes)

    def _length(self) -> int:
        """Entries on the axis; those beyond the budget can never fit again."""
        total = sum(self._units(self._most(i)) for i in range(self.n))
        room = self._room()
        if room is None:
            return total + 1
        return min(total, room // self.unit) + 1

    def _most(self, i: int) -> int:
        """The most candidate ``i`` can hold until its backward, over its choices."""
        item = self.items[i]
        return max([_held(item, None)] + [_held(item, k) for k in self.alone[i]])

    def _units(self, nbytes: int) -> int:
        return -(-nbytes // self.unit)

    def _rows(self, i: int, radix: int) -> List[_Row]:
        """The steps from position ``i``, in the order they are merged (see the class):
        its segments (code k for k candidates), then candidate ``i`` plain (code 0),
        checkpointed in full (code 1) or with its option k (code -k)."""
        item, ahead, times = self.items[i], self.ahead[i], self.times[i]
        rows = []
        for size in range(2, min(self.run_length[i], self.longest) + 1):
            group = tuple(range(i, i + size))
            moment = ahead + _segment_moment(self.items, group)
            time = math.fsum(self.times[j][0] for j in group)
            rows.append(_Row(size, size, _held(item, 0), moment, time, size * radix + 1))
        # A plain backward moment binds only if it can pass the end of the forward, which
        # holds at least floor + tail + x + what the candidate holds.
        binds = ahead + max(item.grads, _plain_forward(item) - item.call_kept) > self.floor + self.tail
        plain = ahead + _plain_moment(item) if binds else _NO_MOMENT
        rows.append(_Row(0, 1, _held(item, None), plain, 0.0, 0))
        for k in self.alone[i]:
            moment = ahead + _alone_moment(item, k)
            rows.append(_Row(-k if k else 1, 1, _held(item, k), moment, times[k], radix + 1))
        return rows

    def _code_dtype(self) -> torch.dtype:
        low = -max((len(item.options) for item in self.items), default=0)
        for dtype in (torch.int8, torch.int16, torch.int32):
            if torch.iinfo(dtype).min <= low and self.longest <= torch.iinfo(dtype).max:
                return dtype
        return torch.int64

    def run(self) -> Optional[_Plan]:
        """The best plan, or None if nothing fits the budget."""
        items, unit = self.items, self.unit
        room = self._room()
        if room is not None and room < 0:
            return None
        self.length = self._length()
        radix = self.n + 1
        self.top = radix * radix
        ceiling = self.base + self.tail + sum(
            _carried(item)
            + max([item.kept, item.inputs] + [option.inputs for option in item.options])
            + max([item.rebuilt] + [option.rebuilt for option in item.options])  # type: ignore[list-item]
            + item.kept
            + item.grads
            + item.recompute_grads
            + unit
            for item in items
        )
        if (ceiling + 1) * self.top * 2 >= _NEVER:
            raise CheckpointConfigError(
                f"the candidates' sizes ({format_bytes(ceiling)} in all) are too large for "
                f"the budget solver"
            )
        self.dtype = self._code_dtype()
        # least[i]: the fewest units the candidates from i on can add to x; an entry that
        # leaves them no room before the end of the axis can never fit.
        fewest = [
            0 if item.joins is not None else min(
                [self._units(_held(item, None))] + [self._units(_held(item, k)) for k in self.alone[i]]
            )
            for i, item in enumerate(items)
        ]
        self.least = list(itertools.accumulate(reversed(fewest), initial=0))[::-1]
        self.x = torch.arange(self.length, dtype=torch.int64) * unit
        self.x_top = self.x * self.top
        # Per position: the best plans of the candidates before it per entry of the axis
        # (cost: time, inf where unreachable; key = (peak so far * radix + members) *
        # radix + regions, smaller is better on equal time), by which step each entry was
        # reached (for tracing the plan back), and the window of entries that may be
        # reached: the work is done on it alone.
        self.pending: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.codes: Dict[int, torch.Tensor] = {}
        self.window: Dict[int, Tuple[int, int]] = {}
        self._open(0)
        self.pending[0][0][0], self.pending[0][1][0], self.window[0] = 0.0, 0, (0, 0)
        for i in range(self.n):
            if i in self.pending:  # else no plan reaches it within the budget
                self._step_from(i, radix)
        if self.n not in self.pending:
            return None
        cost, key = self.pending.pop(self.n)
        lo, hi = self.window.pop(self.n)
        cost, key = cost[lo : hi + 1], key[lo : hi + 1]
        # At the end of the forward, everything held is alive at once.
        reachable = cost < math.inf
        if not bool(reachable.any()):
            return None
        top = self.top
        final = torch.maximum(key // top, self.floor + self.tail + self.x[lo : hi + 1]) * top + key % top
        low = cost.min()
        end = lo + int(final.masked_fill(cost != low, _NEVER).argmin().item())
        return self.refine(self._trace(end))

    def _open(self, position: int) -> None:
        self.pending[position] = (
            torch.full((self.length,), math.inf, dtype=torch.float64),
            torch.full((self.length,), _NEVER, dtype=torch.int64),
        )
        self.codes[position] = torch.zeros(self.length, dtype=self.dtype)

    def _step_from(self, i: int, radix: int) -> None:
        """Merge every step from position ``i`` into the positions it reaches."""
        cost, key = self.pending.pop(i)
        lo, hi = self.window.pop(i)
        cost, key = cost[lo : hi + 1], key[lo : hi + 1]
        top = self.top
        # key with x + m as the peak so far, for a moment m: (x + m) * top + tally.
        lifted = self.x_top[lo : hi + 1] + key % top
        checkpointed = radix + 1
        key_ck, lifted_ck = key + checkpointed, lifted + checkpointed
        for row in self._rows(i, radix):
            shift = self._units(row.held)
            last = min(hi, self.length - 1 - shift - self.least[i + row.size])
            if row.moment != _NO_MOMENT and self.budget is not None:
                # The moment is x + row.moment, and x is the entry times the unit.
                last = min(last, (self.budget - row.moment) // self.unit)
            if last < lo:
                continue
            m = last - lo + 1
            cost2 = cost[:m] if self.budget is None or row.time == 0 else cost[:m] + row.time
            if row.tally == checkpointed:
                key2 = torch.maximum(key_ck[:m], lifted_ck[:m] + row.moment * top)
            elif row.moment == _NO_MOMENT:
                key2 = key[:m] + row.tally if row.tally else key[:m]
            else:
                key2 = torch.maximum(key[:m], lifted[:m] + row.moment * top) + row.tally
            self._merge(i + row.size, lo + shift, cost2, key2, row.code)

    def _merge(self, target: int, start: int, cost2: torch.Tensor, key2: torch.Tensor, code: int) -> None:
        """Keep, per entry at position ``target`` from ``start`` on, the better of what is
        there and a step."""
        end = start + len(cost2)
        if target not in self.pending:
            self._open(target)
            self.pending[target][0][start:end] = cost2
            self.pending[target][1][start:end] = key2
            self.codes[target][start:end] = code
            self.window[target] = (start, end - 1)
            return
        lo, hi = self.window[target]
        self.window[target] = (min(lo, start), max(hi, end - 1))
        cost1 = self.pending[target][0][start:end]
        key1 = self.pending[target][1][start:end]
        better = torch.where(cost2 == cost1, key2 < key1, cost2 < cost1)
        torch.where(better, cost2, cost1, out=cost1)
        torch.where(better, key2, key1, out=key1)
        self.codes[target][start:end].masked_fill_(better, code)

    def _trace(self, end: int) -> _Plan:
        groups: List[Group] = []
        options: Dict[int, int] = {}
        position, x = self.n, end
        while position > 0:
            code = int(self.codes[position][x])
            start = position - max(1, code)
            item = self.items[start]
            if code == 0:
                x -= self._units(_held(item, None))
            else:
                option = -code if code < 0 else 0
                x -= self._units(_held(item, option))
                groups.append(tuple(range(start, position)))
                if option:
                    options[start] = option
            position = start
        return sorted(groups), options

    def _time(self, group: Group, option: int) -> float:
        return math.fsum(self.times[i][option] for i in group)

    def refine(self, plan: _Plan) -> _Plan:
        """On a coarse axis, turn plain the costliest regions the exact peak does not need.

        Passes repeat until none is dropped: dropping a later region can leave an earlier
        one, kept only to lower the later one's moments, unneeded.
        """
        groups, options = plan
        if self.exact or not groups:
            return plan
        items, base, tail = self.items, self.base, self.tail
        limit = self.budget if self.budget is not None else _peak(items, groups, base, tail, options)

        def cost(group: Group) -> Tuple[float, int, Group]:
            option = options.get(group[0], 0)
            return -self._time(group, option), -sum(items[i].kept for i in group), group

        kept, options, dropped = sorted(groups), dict(options), True
        while dropped:
            dropped = False
            terms = _Terms(items, kept, base, tail, options)
            for group in sorted(kept, key=cost):
                if terms.peak_without(group) <= limit:
                    kept = [other for other in kept if other != group]
                    options.pop(group[0], None)
                    terms, dropped = _Terms(items, kept, base, tail, options), True
        return kept, options

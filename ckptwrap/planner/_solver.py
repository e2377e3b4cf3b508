"""The budget solver: which candidates to checkpoint so that the predicted activation peak
fits a budget at the least recompute time.

It knows nothing of modules; the planner hands it one :class:`CostItem` per candidate, in
the order the forward runs them, and prices plans with the peak model of
``_peak_model``. Three parts, in this order: pricing the removal of one region from a
plan (for the refinement on a coarse axis); the dynamic program (the best plan, each
candidate plain, checkpointed alone with one of its options, or in a segment, on a
discretised axis of held memory, traced back into regions and refined); and the entry
points with their messages.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._errors import CheckpointConfigError
from ._device_memory import StepBudget
from ._peak_model import (
    CostItem,
    Group,
    alone_moment,
    check_bytes,
    check_items,
    format_bytes,
    item_before,
    item_carried,
    item_held,
    moment_peak,
    plain_forward,
    plain_moment,
    plan_moments,
    segment_moment,
)

if TYPE_CHECKING:
    from ..policy import Budget

__all__ = [
    "BudgetSolution",
    "PercentBudget",
    "lowest_plan",
    "pooled_times",
    "resolve_budget",
    "smallest_reachable_peak",
    "solve_budget",
]


# ------------------------------------------- removing one region from a plan


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
        joined = list(itertools.accumulate(item_carried(item) for item in items))
        self.ahead = [item_before(item, base) - joined[i] for i, item in enumerate(items)]
        terms, self.where, self.end = plan_moments(items, groups, base, tail, options)
        self.before_max = list(itertools.accumulate(terms, max, initial=-1))
        self.after_max = list(itertools.accumulate(reversed(terms), max, initial=-1))[::-1]

    def peak_without(self, group: Group) -> int:
        """The peak with ``group``'s members plain instead."""
        items = self.items
        k, held = self.where[group]
        x, own = held, -1
        for i in group:
            own = max(own, self.ahead[i] + x + plain_moment(items[i]))
            x += item_held(items[i], None)
        growth = x - held - item_held(items[group[0]], self.options.get(group[0], 0))
        later = self.after_max[k + 1]
        return max(self.end + growth, self.before_max[k], own, later + growth if later >= 0 else -1)


# ------------------------------------------------------- the dynamic program

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
                if item_held(item, k) < item_held(item, None) or alone_moment(item, k) < plain_moment(item)
            ]
            for item in items
        ]
        # run_length[i]: how many candidates from i on can form one segment.
        self.run_length = [1] * self.n
        for i in range(self.n - 2, -1, -1):
            if items[i + 1].joins is not None:
                self.run_length[i] = self.run_length[i + 1] + 1
        joined = list(itertools.accumulate(item_carried(item) for item in items))
        self.floor = base - (joined[-1] if joined else 0)  # base without the joined inputs
        self.ahead = [item_before(item, base) - joined[i] for i, item in enumerate(items)]
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
        sizes = [item_held(item, None) for item in items]
        sizes += [item_held(item, k) for i, item in enumerate(items) for k in self.alone[i]]
        sizes += [item_held(item, 0) for i, item in enumerate(items) if self.run_length[i] > 1]
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
        return max([item_held(item, None)] + [item_held(item, k) for k in self.alone[i]])

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
            moment = ahead + segment_moment(self.items, group)
            time = math.fsum(self.times[j][0] for j in group)
            rows.append(_Row(size, size, item_held(item, 0), moment, time, size * radix + 1))
        # A plain backward moment binds only if it can pass the end of the forward, which
        # holds at least floor + tail + x + what the candidate holds.
        binds = ahead + max(item.grads, plain_forward(item) - item.call_kept) > self.floor + self.tail
        plain = ahead + plain_moment(item) if binds else _NO_MOMENT
        rows.append(_Row(0, 1, item_held(item, None), plain, 0.0, 0))
        for k in self.alone[i]:
            moment = ahead + alone_moment(item, k)
            rows.append(_Row(-k if k else 1, 1, item_held(item, k), moment, times[k], radix + 1))
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
            item_carried(item)
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
                [self._units(item_held(item, None))] + [self._units(item_held(item, k)) for k in self.alone[i]]
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
                x -= self._units(item_held(item, None))
            else:
                option = -code if code < 0 else 0
                x -= self._units(item_held(item, option))
                groups.append(tuple(range(start, position)))
                if option:
                    options[start] = option
            position = start
        return sorted(groups), options

    def refine(self, plan: _Plan) -> _Plan:
        """On a coarse axis, turn plain the costliest regions the exact peak does not need.

        Passes repeat until none is dropped: dropping a later region can leave an earlier
        one, kept only to lower the later one's moments, unneeded.
        """
        groups, options = plan
        if self.exact or not groups:
            return plan
        items, base, tail = self.items, self.base, self.tail
        limit = self.budget if self.budget is not None else moment_peak(items, groups, base, tail, options)

        def cost(group: Group) -> Tuple[float, int, Group]:
            option = options.get(group[0], 0)
            return -math.fsum(self.times[i][option] for i in group), -sum(items[i].kept for i in group), group

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


# ------------------------------------------------------------ entry points


class PercentBudget(int):
    """A budget in bytes that was written as a share of a reference amount.

    Wherever bytes are expected it is the int it resolves to, ``int(fraction *
    reference)``; the solver reads ``fraction`` and ``reference`` to state a budget it
    cannot reach in the terms it was given in.

    Example:
        >>> budget = PercentBudget(0.1, 1000, of="the un-checkpointed activation memory")
        >>> budget, budget.percent
        (100, 10.0)
    """

    fraction: float
    """The share of ``reference``, e.g. 0.4 for ``budget:40%``."""
    reference: int
    """Bytes the percentage refers to."""
    of: str
    """What ``reference`` is, for messages."""

    def __new__(cls, fraction: float, reference: int, *, of: str = "the reference") -> PercentBudget:
        self = super().__new__(cls, int(fraction * reference))
        self.fraction, self.reference, self.of = float(fraction), int(reference), of
        return self

    @property
    def percent(self) -> float:
        """The share as a percentage."""
        return 100 * self.fraction

    def __reduce__(self) -> Tuple[object, ...]:
        # Pickled as its parts: int's own reduction would lose them.
        return (_percent_budget, (self.fraction, self.reference, self.of))


def resolve_budget(budget: Budget, reference: int) -> int:
    """``budget`` in bytes: its amount, or its share of ``reference`` (the predicted
    un-checkpointed step peak it is read against) as a :class:`PercentBudget`, an int that
    remembers its percentage, so that a budget below reach is reported in percent too."""
    fraction, amount = budget.parsed()
    if fraction is None:
        return int(amount)  # type: ignore[arg-type]
    return PercentBudget(
        fraction, reference,
        of="the un-checkpointed step's peak at the largest shape planned so far",
    )


def _percent_budget(fraction: float, reference: int, of: str) -> PercentBudget:
    return PercentBudget(fraction, reference, of=of)


@dataclasses.dataclass(frozen=True)
class BudgetSolution:
    """The solver's plan.

    When ``unit`` divides every candidate's ``kept`` and the ``inputs`` of those that save
    memory (of each option too), as it does when the total ``kept`` spans at most ~32k units, the plan is
    optimal for the pooled times (see :func:`pooled_times`). Otherwise sizes were rounded
    up to ``unit``: the plan still fits the budget, but may recompute more than the optimum.
    """

    selected: Tuple[int, ...]
    """Indices of the candidates to checkpoint, ascending."""
    predicted_peak: int
    """Predicted activation peak of the plan, in bytes (exact, not rounded)."""
    recompute_time: float
    """Seconds of recomputation the plan adds: the summed ``time`` of ``selected``, or of
    the option each is checkpointed with."""
    budget: int
    """The budget it was solved for, in bytes."""
    unit: int
    """Memory unit, in bytes, of the discretised axis the solver worked on."""
    segments: Tuple[Tuple[int, ...], ...] = ()
    """Runs of two or more consecutive selected candidates checkpointed as one region
    (only candidates with ``joins`` set can continue a run); every other selected
    candidate is checkpointed alone."""
    options: Tuple[int, ...] = ()
    """How each of ``selected`` (in the same order) is checkpointed: 0 recomputes all of
    it, k >= 1 uses its ``options[k - 1]``; members of segments always recompute all."""


def pooled_times(items: Sequence[CostItem]) -> List[float]:
    """The times the solver weighs for recomputing each candidate in full: each
    candidate's ``time``, except that candidates with the same own costs (``kept``,
    ``inputs``, ``rebuilt`` and the sizes of their ``options``) all get the median of
    their times. Their options are pooled alike, each with the same option of the others.

    Such candidates are, in practice, the same computation (the repeated blocks a budget
    chooses among) timed several times, so their measured times differ only by noise,
    which on a busy machine easily reaches several times the time itself. Left as they are,
    that noise would decide which of them a plan takes, and every call would plan
    differently. Pooled, they tie exactly, the program breaks the tie by model order, and
    the median of the group is a better estimate of each member than its own
    measurement. ``before``, ``joins``, ``grads`` and ``recompute_grads`` say where a
    candidate sits (what was saved or accumulated before it), not what it costs, so they
    do not split a group. Candidates that differ in any own cost keep their times, and
    the solver stays exact for them.

    Example:
        >>> items = [CostItem(f"h.{i}", kept=8, inputs=1, time=t) for i, t in enumerate([1.0, 9.0, 2.0])]
        >>> pooled_times(items)
        [2.0, 2.0, 2.0]
    """
    return [times[0] for times in _pooled(items)]


def _pooled(items: Sequence[CostItem]) -> List[List[float]]:
    """Per candidate, the pooled times of its full recomputation and of each option."""
    groups: Dict[Tuple[object, ...], List[int]] = {}
    for index, item in enumerate(items):
        sizes = tuple((option.inputs, option.rebuilt) for option in item.options)
        groups.setdefault((item.kept, item.inputs, item.rebuilt, sizes), []).append(index)
    times = [[item.time, *(option.time for option in item.options)] for item in items]
    for members in groups.values():
        if len(members) > 1:
            for k in range(len(times[members[0]])):
                typical = statistics.median(times[i][k] for i in members)
                for i in members:
                    times[i][k] = typical
    return times


def smallest_reachable_peak(
    items: Sequence[CostItem], *, base: int, tail: int = 0, within: Optional[int] = None
) -> int:
    """The least predicted peak of any plan for ``items`` (segments and options
    included), in bytes.

    Exact on the same condition as :func:`solve_budget`'s plans; otherwise an upper bound
    that a plan reaches. ``within``: the search's arrays stay within a share of these
    bytes, as a budgeted search's do within its budget (for a solve inside the step it
    plans, where a budget is out of reach); the peak is then more often a bound.

    Raises:
        CheckpointConfigError: On a bad item, ``base`` or ``tail``.
    """
    base = check_items(items, base)
    tail = check_bytes(tail, "tail")
    groups, options = _Search(items, base, None, tail=tail, within=within).run()  # type: ignore[misc]
    return moment_peak(items, groups, base, tail, options)


def lowest_plan(
    items: Sequence[CostItem], *, base: int, tail: int = 0, within: Optional[int] = None
) -> BudgetSolution:
    """The plan of least predicted peak (segments and options included), at the least
    recompute time among those; what a budget no plan reaches falls back to. Its
    ``budget`` is that peak; ``within`` as for :func:`smallest_reachable_peak`.

    Raises:
        CheckpointConfigError: On a bad item, ``base`` or ``tail``.
    """
    lowest = smallest_reachable_peak(items, base=base, tail=tail, within=within)
    return solve_budget(items, lowest, base=base, tail=tail, bounded=within is not None)


def solve_budget(
    items: Sequence[CostItem], budget: int, *, base: int, tail: int = 0, settle: bool = True,
    bounded: bool = False,
) -> BudgetSolution:
    """The plan of least recompute time whose predicted peak fits ``budget``.

    Each candidate stays plain, is checkpointed alone (recomputing all of it, or with one
    of its ``options``), or, if it has ``joins`` set, in one segment with those before it.
    Times are weighed as :func:`pooled_times` gives them, so that candidates with the same
    own costs, whose measured times differ only by noise, tie exactly. Ties in time go to
    the smaller peak; among those, the program prefers fewer candidates and fewer regions,
    though a tie it cannot tell apart may keep more; a tie that remains goes by model
    order, and for one candidate to the full recomputation, then to its options in their
    order (see ``_Search``), so equal costs always give the same plan. A budget that the
    un-checkpointed model already meets selects nothing. The peak is that of
    :func:`predicted_peak`.

    Args:
        items: The candidates, in forward order.
        budget: Bytes the predicted peak may reach; a :class:`PercentBudget` has an
            unreachable budget reported in percent too.
        base: Bytes of activations outside every candidate.
        tail: Bytes the end of the forward and the backward of the code after the last
            candidate hold besides (see :func:`predicted_peak`).
        settle: Where the search within the budget finds no plan, search again without
            one, to tell a budget below reach (with the least peak) from one that a
            coarse axis hid a plan for. Without, raise at once (that search's arrays are
            not bounded by the budget, which matters where the solve runs inside the
            step it plans and a plan is not needed).
        bounded: The settling search's arrays, too, stay within a share of the budget
            (see :func:`smallest_reachable_peak`'s ``within``): for a solve inside the
            step it plans.

    Returns:
        The plan; see :class:`BudgetSolution`.

    Raises:
        CheckpointConfigError: If ``budget`` is below :func:`smallest_reachable_peak`, or on
            a bad item, ``budget``, ``base`` or ``tail``.

    Example:
        >>> items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0) for i in range(4)]
        >>> solve_budget(items, 250, base=0)
        BudgetSolution(selected=(0, 1), predicted_peak=220, recompute_time=2.0, budget=250, unit=10, segments=(), options=(0, 0))
    """
    base = check_items(items, base)
    given = budget
    budget = check_bytes(budget, "budget")
    tail = check_bytes(tail, "tail")
    empty = moment_peak(items, (), base, tail)
    if empty <= budget:
        return BudgetSolution((), empty, 0.0, budget, 1)
    search = _Search(items, base, budget, _pooled(items), tail=tail)
    plan = search.run()
    # Raised, the error's traceback holds this frame in a cycle until the next garbage
    # collection (inside the step, where the solve runs in the step it plans): the
    # search's arrays are let go first.
    if plan is None and not settle:
        del search
        raise CheckpointConfigError(f"no plan was found within the budget of {format_bytes(budget)}")
    if plan is None:
        lowest_plan = _Search(items, base, None, tail=tail, within=budget if bounded else None).run()
        assert lowest_plan is not None  # without a budget every plan is allowed
        lowest = moment_peak(items, lowest_plan[0], base, tail, lowest_plan[1])
        if lowest > budget:
            lowest_set = [i for group in lowest_plan[0] for i in group]
            error = CheckpointConfigError(_below_reach(items, given, lowest, lowest_set))
            error.needed = _least_budget(given, lowest)
            error.offered = given.memory.total if isinstance(given, StepBudget) else int(given)
            del search
            raise error
        # On a coarse axis rounding can hide plans that fit; the lowest-peak one does.
        plan = search.refine(lowest_plan)
    groups, chosen = plan
    selected = tuple(sorted(i for group in groups for i in group))
    options = tuple(chosen.get(i, 0) for i in selected)
    return BudgetSolution(
        selected,
        moment_peak(items, groups, base, tail, chosen),
        math.fsum(_time(items[i], option) for i, option in zip(selected, options)),
        budget,
        search.unit,
        tuple(sorted(group for group in groups if len(group) > 1)),
        options,
    )


def _time(item: CostItem, option: int) -> float:
    return item.time if option == 0 else item.options[option - 1].time


# --------------------------------------------------------------------------- messages


def _below_reach(items: Sequence[CostItem], budget: object, lowest: int, lowest_set: List[int]) -> str:
    reached = _describe(items, lowest_set)
    if isinstance(budget, StepBudget):
        return (
            f"{budget.describe_parts()}, below the smallest reachable step peak "
            f"{_exact_bytes(lowest)}, {reached}; the device needs at least "
            f"{format_bytes(_least_budget(budget, lowest))} for this model and optimizer "
            f"at these inputs (offer more candidates, or shard the model or its optimizer state)"
        )
    if not isinstance(budget, PercentBudget) or budget.reference <= 0:
        return (
            f"budget {_exact_bytes(int(budget))} is below the smallest reachable peak "  # type: ignore[call-overload]
            f"{_exact_bytes(lowest)}, {reached}; raise the budget to at least "
            f"{format_bytes(lowest)} or offer more candidates"
        )
    reference = budget.reference
    share = 100 * lowest / reference
    least = _least_percent(lowest, reference)
    fix = f"budget:{least:g}%" if least is not None else f"budget:{lowest}B"
    return (
        f"budget {budget.percent:g}% of {budget.of} ({_exact_bytes(reference)}), that is "
        f"{_exact_bytes(int(budget))}, is below the smallest reachable peak "
        f"{_exact_bytes(lowest)}, {share:.2f}% of {budget.of}, {reached}; raise the budget "
        f"to at least {fix} or offer more candidates"
    )


def _least_budget(budget: object, lowest: int) -> int:
    """The least budget that reaches a step peak of ``lowest``: a device's whole memory
    for a budget in its terms, else the step's bytes."""
    if isinstance(budget, StepBudget):
        return budget.memory.whole_peak(lowest)
    return lowest


def _least_percent(lowest: int, reference: int) -> Optional[float]:
    """The least percentage with one decimal whose budget reaches ``lowest``; None if
    it would pass 100%."""
    tenths = math.ceil(lowest * 1000 / reference)
    # As budget:P% resolves it (P / 100 of the reference); float rounding may land a
    # byte short, so step up past it.
    while tenths <= 1000 and int(tenths / 10 / 100 * reference) < lowest:
        tenths += 1
    return tenths / 10 if tenths <= 1000 else None


def _exact_bytes(n: int) -> str:
    # Rounded units alone could show a budget and a peak that differ as equal.
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n} bytes)"


def _describe(items: Sequence[CostItem], selected: Sequence[int]) -> str:
    if not items:
        return "with no candidates to checkpoint"
    if not selected:
        return "reached with nothing checkpointed (no selection of the candidates lowers it)"
    names = [items[i].name for i in sorted(selected)]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"reached by checkpointing {len(names)} of {len(items)} candidates ({shown})"

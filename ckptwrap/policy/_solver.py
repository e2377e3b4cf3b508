"""The exact solver behind the budget planner: which candidates to checkpoint so that the
predicted activation peak fits a budget at the least recompute time.

It knows nothing of modules; the planner hands it one :class:`CostItem` per candidate, in
the order the forward runs them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch

from .._errors import CheckpointConfigError

__all__ = [
    "BudgetSolution",
    "CostItem",
    "format_bytes",
    "predicted_peak",
    "smallest_reachable_peak",
    "solve_budget",
]

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
_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
_NEVER = 1 << 62  # an unreachable entry's key


def format_bytes(n: int) -> str:
    """A byte count in human units: ``512 B``, ``1.5 KiB``, ``12.5 MiB``, ``2.0 GiB``."""
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in _BYTE_UNITS[:-1]:
        # Compare the rounded value, so 1048575 bytes reads "1.0 MiB", not "1024.0 KiB".
        if abs(round(value, 1)) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {_BYTE_UNITS[-1]}"


@dataclasses.dataclass(frozen=True)
class CostItem:
    """What one candidate costs, as the solver sees it.

    Example:
        >>> CostItem("layers.0", kept=8 << 20, inputs=1 << 20, time=0.002)
        CostItem(name='layers.0', kept=8388608, inputs=1048576, time=0.002, rebuilt=8388608, before=None, joins=None)
    """

    name: str
    """Qualified name of the candidate, for messages."""
    kept: int
    """Bytes its forward keeps for backward when it is not checkpointed."""
    inputs: int
    """Bytes a checkpoint of it keeps from its forward to its backward instead: its inputs,
    and whatever a selective policy saves."""
    time: float
    """Seconds its recomputation takes."""
    rebuilt: Optional[int] = None
    """Bytes its recomputation creates and holds until its backward; ``None`` means
    ``kept`` (a full recomputation rebuilds all of it)."""
    before: Optional[int] = None
    """Bytes of the activations outside every candidate (the solver's ``base``) that the
    forward saved before this candidate ran, and so are still alive when backward reaches
    it; ``None`` means all of ``base``, the safe assumption."""
    joins: Optional[int] = None
    """Set when this candidate's only input is the previous candidate's output, so that
    both can run as one checkpointed segment: the bytes of ``base`` (and of ``before``)
    that this input takes because this candidate saves it. A segment through both frees
    them. ``None``: it cannot join the previous candidate."""

    def __post_init__(self) -> None:
        if self.rebuilt is None:
            object.__setattr__(self, "rebuilt", self.kept)
        for field in ("kept", "inputs", "rebuilt", "before", "joins"):
            value = getattr(self, field)
            if field in ("before", "joins") and value is None:
                continue
            if not _is_int(value) or value < 0:
                raise CheckpointConfigError(
                    f"cost item {self.name!r}: {field} must be a non-negative integer number "
                    f"of bytes; got {value!r}"
                )
            object.__setattr__(self, field, int(value))
        if (
            not isinstance(self.time, numbers.Real)
            or isinstance(self.time, bool)
            or not math.isfinite(self.time)
            or self.time < 0
        ):
            raise CheckpointConfigError(
                f"cost item {self.name!r}: time must be a finite, non-negative number of "
                f"seconds; got {self.time!r}"
            )
        object.__setattr__(self, "time", float(self.time))


@dataclasses.dataclass(frozen=True)
class BudgetSolution:
    """The solver's plan.

    When ``unit`` divides every candidate's ``kept`` and the ``inputs`` of those that save
    memory, as it does when the total ``kept`` spans at most ~32k units, the plan is
    optimal. Otherwise sizes were rounded up to ``unit``: the plan still fits the budget,
    but may recompute more than the optimum.
    """

    selected: Tuple[int, ...]
    """Indices of the candidates to checkpoint, ascending."""
    predicted_peak: int
    """Predicted activation peak of the plan, in bytes (exact, not rounded)."""
    recompute_time: float
    """Seconds of recomputation the plan adds: the summed times of ``selected``."""
    budget: int
    """The budget it was solved for, in bytes."""
    unit: int
    """Memory unit, in bytes, of the discretised axis the solver worked on."""
    segments: Tuple[Tuple[int, ...], ...] = ()
    """Runs of two or more consecutive selected candidates checkpointed as one region
    (only candidates with ``joins`` set can continue a run); every other selected
    candidate is checkpointed alone."""


Group = Tuple[int, ...]


def predicted_peak(
    items: Sequence[CostItem], selected: Iterable[Union[int, Sequence[int]]], *, base: int
) -> int:
    """Predicted activation peak, in bytes, when the candidates ``selected`` are checkpointed.

    ``items`` are in forward order, so backward reaches them last to first. The peak is
    the larger of two moments:

    - the end of the forward: ``base`` + ``kept`` of every other candidate + ``inputs`` of
      every selected one;
    - each selected candidate's recomputation, when backward has freed everything saved
      after it: its ``before`` + what the candidates ahead of it hold (``kept``, or
      ``inputs`` if selected) + its own ``inputs`` + ``rebuilt``.

    A segment (consecutive candidates checkpointed as one region, each after the first
    with ``joins`` set) holds only its first member's ``inputs``, frees its members'
    ``joins`` from ``base``, and is recomputed at once: ``rebuilt`` of its last member on
    top of ``kept`` and ``joins`` of the others.

    Args:
        items: The candidates, in forward order.
        selected: Indices into ``items`` of the checkpointed candidates; a tuple of
            consecutive indices stands for a segment.
        base: Bytes of activations outside every candidate.

    Raises:
        CheckpointConfigError: On a bad item, index, segment or ``base``.

    Example:
        >>> items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0) for i in range(3)]
        >>> predicted_peak(items, [0, 1], base=5)  # end of forward: 5 + 10 + 10 + 100
        125
    """
    base = _check(items, base)
    return _peak(items, _groups(items, selected), base)


def smallest_reachable_peak(items: Sequence[CostItem], *, base: int) -> int:
    """The least predicted peak of any selection of ``items``, segments included, in bytes.

    Exact on the same condition as :func:`solve_budget`'s plans; otherwise an upper bound
    that a selection reaches.

    Raises:
        CheckpointConfigError: On a bad item or ``base``.
    """
    base = _check(items, base)
    return _peak(items, _Search(items, base, None).run(), base)


def solve_budget(items: Sequence[CostItem], budget: int, *, base: int) -> BudgetSolution:
    """The selection of least recompute time whose predicted peak fits ``budget``.

    Ties in time go to the smaller peak; among those, the program prefers fewer candidates
    and fewer regions, though a tie it cannot tell apart may keep more.
    A budget that the un-checkpointed model already meets selects nothing. The peak is
    that of :func:`predicted_peak`; candidates with ``joins`` set may be checkpointed in
    one segment with those before them.

    Args:
        items: The candidates, in forward order.
        budget: Bytes the predicted activation peak may reach.
        base: Bytes of activations outside every candidate.

    Returns:
        The plan; see :class:`BudgetSolution`.

    Raises:
        CheckpointConfigError: If ``budget`` is below :func:`smallest_reachable_peak`, or on
            a bad item, ``budget`` or ``base``.

    Example:
        >>> items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0) for i in range(4)]
        >>> solve_budget(items, 250, base=0)
        BudgetSolution(selected=(0, 1), predicted_peak=220, recompute_time=2.0, budget=250, unit=10, segments=())
    """
    base = _check(items, base)
    budget = _check_bytes(budget, "budget")
    if _peak(items, (), base) <= budget:
        return BudgetSolution((), _peak(items, (), base), 0.0, budget, 1)
    search = _Search(items, base, budget)
    groups = search.run()
    if groups is None:
        lowest_groups = _Search(items, base, None).run()
        lowest = _peak(items, lowest_groups, base)
    if groups is None and lowest <= budget:
        # On a coarse axis rounding can hide plans that fit; the lowest-peak one does.
        groups = search.refine(lowest_groups)
    elif groups is None:
        lowest_set = [i for group in lowest_groups for i in group]
        raise CheckpointConfigError(
            f"budget {_exact_bytes(budget)} is below the smallest reachable peak "
            f"{_exact_bytes(lowest)}, {_describe(items, lowest_set)}; raise the budget to at "
            f"least {format_bytes(lowest)} or offer more candidates"
        )
    selected = tuple(sorted(i for group in groups for i in group))
    return BudgetSolution(
        selected,
        _peak(items, groups, base),
        math.fsum(items[i].time for i in selected),
        budget,
        search.unit,
        tuple(sorted(group for group in groups if len(group) > 1)),
    )


# --------------------------------------------------------------------------- helpers


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_bytes(value: object, what: str) -> int:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise CheckpointConfigError(
            f"{what} must be a non-negative integer number of bytes; got {value!r}"
        )
    return int(value)  # type: ignore[arg-type]


def _check(items: Sequence[CostItem], base: object) -> int:
    """Check the items and ``base``; return ``base`` as an int."""
    base = _check_bytes(base, "base")
    joined = 0
    for index, item in enumerate(items):
        if not isinstance(item, CostItem):
            raise CheckpointConfigError(
                f"candidate {index} is a {type(item).__name__}; expected a CostItem"
            )
        if item.before is not None and item.before > base:
            raise CheckpointConfigError(
                f"cost item {item.name!r}: before ({item.before} bytes) cannot exceed base "
                f"({base} bytes), of which it is a part"
            )
        if item.joins is not None:
            if index == 0:
                raise CheckpointConfigError(
                    f"cost item {item.name!r}: joins is set on the first candidate, which "
                    f"has no previous candidate to join"
                )
            joined += item.joins
            if joined > _before(item, base):
                raise CheckpointConfigError(
                    f"cost item {item.name!r}: the joins of the candidates up to it "
                    f"({joined} bytes) exceed its before ({_before(item, base)} bytes), "
                    f"of which they are a part"
                )
    return base


def _groups(items: Sequence[CostItem], selected: Iterable[Union[int, Sequence[int]]]) -> List[Group]:
    """``selected`` as checked groups of consecutive indices."""
    groups: List[Group] = []
    taken: Set[int] = set()
    for entry in selected:
        group = (entry,) if _is_int(entry) else tuple(entry)  # type: ignore[arg-type]
        for index in group:
            if not _is_int(index) or not 0 <= index < len(items):
                raise CheckpointConfigError(
                    f"selected index {index!r} is not a candidate index in [0, {len(items)})"
                )
            if index in taken:
                raise CheckpointConfigError(f"candidate index {index} is selected twice")
            taken.add(int(index))
        if not group:
            raise CheckpointConfigError("a selected segment is empty")
        for previous, index in zip(group, group[1:]):
            if index != previous + 1 or items[index].joins is None:
                raise CheckpointConfigError(
                    f"segment {group}: {items[index].name!r} cannot follow "
                    f"{items[previous].name!r} in one segment; a segment runs over "
                    f"consecutive candidates, each after the first with joins set"
                )
        groups.append(tuple(int(index) for index in group))
    return groups


def _before(item: CostItem, base: int) -> int:
    return base if item.before is None else item.before


def _carried(item: CostItem) -> int:
    return 0 if item.joins is None else item.joins


def _peak(items: Sequence[CostItem], groups: Iterable[Group], base: int) -> int:
    terms = _Terms(items, sorted(groups), base)
    return max(terms.end, terms.before_max[-1])


def _rebuilt(items: Sequence[CostItem], group: Group) -> int:
    """What recomputing a group holds at its highest: the members before the last keep
    their saved tensors and pass on their outputs while the last one runs."""
    *first, last = group
    return sum(items[i].kept + _carried(items[i + 1]) for i in first) + items[last].rebuilt


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

    With ``budget`` None it finds the lowest peak instead: every time counts as zero, and
    no recomputation is ruled out.
    """

    def __init__(self, items: Sequence[CostItem], base: int, budget: Optional[int]) -> None:
        self.items, self.base, self.budget = items, base, budget
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
            yield 1, 1, carried + item.inputs, _rebuilt(items, (i,)), item.time, 1
        for size in range(2, min(self.run_length[i], self.longest) + 1):
            group = tuple(range(i, i + size))
            time = math.fsum(items[j].time for j in group)
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
        cost = lambda g: (-math.fsum(items[i].time for i in g), -sum(items[i].kept for i in g), g)  # noqa: E731
        kept, dropped = sorted(groups), True
        while dropped:
            dropped = False
            terms = _Terms(items, kept, base)
            for group in sorted(kept, key=cost):
                if terms.peak_without(group) <= limit:
                    kept = [other for other in kept if other != group]
                    terms, dropped = _Terms(items, kept, base), True
        return kept


class _Terms:
    """The peak's terms for ``groups`` (sorted), to price dropping one group in O(log n):
    dropping it adds the same amount to the end of the forward and to every later
    recomputation, and removes its own."""

    def __init__(self, items: Sequence[CostItem], groups: List[Group], base: int) -> None:
        self.items = items
        self.starts = [group[0] for group in groups]
        self.index = {group: k for k, group in enumerate(groups)}
        joined = list(itertools.accumulate(_carried(item) for item in items))
        starts = {group[0]: group for group in groups}
        inside = {i for group in groups for i in group[1:]}
        held, terms = 0, []
        for i, item in enumerate(items):
            if i in inside:
                continue
            group = starts.get(i)
            if group is None:
                held += _carried(item) + item.kept
                continue
            terms.append(
                _before(item, base) - joined[i] + held + _carried(item) + item.inputs
                + _rebuilt(items, group)
            )
            held += _carried(item) + item.inputs
        self.end = base - (joined[-1] if joined else 0) + held
        self.before_max = list(itertools.accumulate(terms, max, initial=-1))
        self.after_max = list(itertools.accumulate(reversed(terms), max, initial=-1))[::-1]

    def peak_without(self, group: Group) -> int:
        items, k = self.items, self.index[group]
        growth = sum(_carried(items[i]) + items[i].kept for i in group) - (
            _carried(items[group[0]]) + items[group[0]].inputs
        )
        later = self.after_max[k + 1]
        return max(self.end + growth, self.before_max[k], later + growth if later >= 0 else -1)


def _shift(values: torch.Tensor, by: int, fill: float) -> torch.Tensor:
    """``values`` moved ``by`` places up the axis, ``fill`` below; what falls off is lost."""
    if by == 0:
        return values
    if by >= len(values):
        return torch.full_like(values, fill)
    return torch.cat((values.new_full((by,), fill), values[: len(values) - by]))

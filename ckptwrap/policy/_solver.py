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
from typing import Iterable, List, Optional, Sequence, Set, Tuple

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
        CostItem(name='layers.0', kept=8388608, inputs=1048576, time=0.002, rebuilt=8388608, before=None)
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

    def __post_init__(self) -> None:
        if self.rebuilt is None:
            object.__setattr__(self, "rebuilt", self.kept)
        for field in ("kept", "inputs", "rebuilt", "before"):
            value = getattr(self, field)
            if field == "before" and value is None:
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


def predicted_peak(items: Sequence[CostItem], selected: Iterable[int], *, base: int) -> int:
    """Predicted activation peak, in bytes, when the candidates ``selected`` are checkpointed.

    ``items`` are in forward order, so backward reaches them last to first. The peak is
    the larger of two moments:

    - the end of the forward: ``base`` + ``kept`` of every other candidate + ``inputs`` of
      every selected one;
    - each selected candidate's recomputation, when backward has freed everything saved
      after it: its ``before`` + what the candidates ahead of it hold (``kept``, or
      ``inputs`` if selected) + its own ``inputs`` + ``rebuilt``.

    Args:
        items: The candidates, in forward order.
        selected: Indices into ``items`` of the checkpointed candidates.
        base: Bytes of activations outside every candidate.

    Raises:
        CheckpointConfigError: On a bad item, index or ``base``.

    Example:
        >>> items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0) for i in range(3)]
        >>> predicted_peak(items, [0, 1], base=5)  # end of forward: 5 + 100 + 10 + 10
        125
    """
    base = _check(items, base)
    chosen = set()
    for index in selected:
        if not _is_int(index) or not 0 <= index < len(items):
            raise CheckpointConfigError(
                f"selected index {index!r} is not a candidate index in [0, {len(items)})"
            )
        chosen.add(int(index))
    return _peak(items, chosen, base)


def smallest_reachable_peak(items: Sequence[CostItem], *, base: int) -> int:
    """The least predicted peak of any selection of ``items``, in bytes.

    Exact on the same condition as :func:`solve_budget`'s plans; otherwise an upper bound
    that a selection reaches.

    Raises:
        CheckpointConfigError: On a bad item or ``base``.
    """
    base = _check(items, base)
    return _peak(items, _Search(items, base, None).run(), base)


def solve_budget(items: Sequence[CostItem], budget: int, *, base: int) -> BudgetSolution:
    """The selection of least recompute time whose predicted peak fits ``budget``.

    Ties in time go to the smaller peak, then to fewer candidates. A budget that the
    un-checkpointed model already meets selects nothing. The peak is that of
    :func:`predicted_peak`.

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
        BudgetSolution(selected=(0, 1), predicted_peak=220, recompute_time=2.0, budget=250, unit=10)
    """
    base = _check(items, base)
    budget = _check_bytes(budget, "budget")
    if _peak(items, (), base) <= budget:
        return BudgetSolution((), _peak(items, (), base), 0.0, budget, 1)
    search = _Search(items, base, budget)
    selected = search.run()
    if selected is None:
        lowest_set = _Search(items, base, None).run()
        lowest = _peak(items, lowest_set, base)
    if selected is None and lowest <= budget:
        # On a coarse axis rounding can hide plans that fit; the lowest-peak one does.
        selected = search.refine(lowest_set)
    elif selected is None:
        raise CheckpointConfigError(
            f"budget {_exact_bytes(budget)} is below the smallest reachable peak "
            f"{_exact_bytes(lowest)}, {_describe(items, lowest_set)}; raise the budget to at "
            f"least {format_bytes(lowest)} or offer more candidates"
        )
    return BudgetSolution(
        tuple(sorted(selected)),
        _peak(items, selected, base),
        math.fsum(items[i].time for i in selected),
        budget,
        search.unit,
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
    return base


def _before(item: CostItem, base: int) -> int:
    return base if item.before is None else item.before


def _peak(items: Sequence[CostItem], chosen: Iterable[int], base: int) -> int:
    chosen = set(chosen)
    held = [item.inputs if i in chosen else item.kept for i, item in enumerate(items)]
    ahead = itertools.accumulate(held, initial=0)  # what the candidates before i hold
    peak = base + sum(held)
    for i, (item, prefix) in enumerate(zip(items, ahead)):
        if i in chosen:
            peak = max(peak, _before(item, base) + prefix + item.inputs + item.rebuilt)
    return peak


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
    candidates so far hold until their backward (``kept``, or ``inputs`` if checkpointed).
    A checkpointed candidate's recomputation peak depends only on ``x`` before it, and the
    end-of-forward peak only on the final ``x``, so for each ``x`` it is enough to keep the
    best partial selection: least time, then least peak so far, then fewest members (this
    order is preserved by every later step, so the program is exact). Only candidates that
    save memory (``kept > inputs``) are ever worth checkpointing.

    With ``budget`` None it finds the lowest peak instead: every time counts as zero, and
    no recomputation is ruled out.
    """

    def __init__(self, items: Sequence[CostItem], base: int, budget: Optional[int]) -> None:
        self.items, self.base, self.budget = items, base, budget
        self.useful = [item.kept > item.inputs for item in items]
        self.unit, self.exact = self._unit()

    def _unit(self) -> Tuple[int, bool]:
        """The gcd of the sizes on the axis if it is short enough, else a coarser unit.

        Sizes are rounded up to the unit, so with a coarse one the program sees more held
        memory than there is: its plans fit, but may not be the cheapest.
        """
        sizes = [item.kept for item in self.items]
        sizes += [item.inputs for item, useful in zip(self.items, self.useful) if useful]
        span = sum(item.kept for item in self.items)
        if self.budget is not None:
            span = min(span, self.budget - self.base)
        grain = math.gcd(*sizes) or 1
        n = max(1, len(self.items))
        if -(-span // grain) <= min(_EXACT_STEPS, max(1024, _MAX_CELLS // n)):
            return grain, True
        steps = min(_APPROX_STEPS, max(1024, _APPROX_CELLS // n))
        unit = max(grain, -(-span // steps))
        return unit, all(size % unit == 0 for size in sizes)

    def run(self) -> Optional[List[int]]:
        """The best selection, or None if nothing fits the budget."""
        items, unit, base, budget = self.items, self.unit, self.base, self.budget
        if budget is not None and budget < base:
            return None
        # Entries beyond the budget can never fit again: held memory only grows.
        total = sum(-(-item.kept // unit) for item in items)
        length = total + 1 if budget is None else min(total, (budget - base) // unit) + 1
        radix = len(items) + 1
        ceiling = base + sum(max(item.kept, item.inputs) + item.rebuilt + unit for item in items)
        if (ceiling + 1) * radix >= _NEVER:
            raise CheckpointConfigError(
                f"the candidates' sizes ({format_bytes(ceiling)} in all) are too large for "
                f"the budget solver"
            )
        x = torch.arange(length, dtype=torch.int64) * unit
        cost = torch.full((length,), math.inf, dtype=torch.float64)
        cost[0] = 0.0
        # key = peak so far * radix + members: smaller is better on equal time.
        key = torch.full((length,), _NEVER, dtype=torch.int64)
        key[0] = 0
        bits: List[Optional[torch.Tensor]] = []
        for item, useful in zip(items, self.useful):
            keep = -(-item.kept // unit)
            cost1, key1 = _shift(cost, keep, math.inf), _shift(key, keep, _NEVER)
            if not useful:
                cost, key = cost1, key1
                bits.append(None)
                continue
            recompute = _before(item, base) + item.inputs + item.rebuilt + x
            allowed = key < _NEVER
            if budget is not None:
                allowed &= recompute <= budget
            time = 0.0 if budget is None else item.time
            cost2 = torch.where(allowed, cost + time, math.inf)
            peak = torch.maximum(key // radix, recompute)
            key2 = torch.where(allowed, peak * radix + key % radix + 1, _NEVER)
            hold = -(-item.inputs // unit)
            cost2, key2 = _shift(cost2, hold, math.inf), _shift(key2, hold, _NEVER)
            better = (cost2 < cost1) | ((cost2 == cost1) & (key2 < key1))
            cost = torch.where(better, cost2, cost1)
            key = torch.where(better, key2, key1)
            bits.append(better)
        # At the end of the forward, everything held is alive at once.
        final = torch.maximum(key // radix, base + x) * radix + key % radix
        reachable = key < _NEVER
        if not bool(reachable.any()):
            return None
        low = cost.masked_fill(~reachable, math.inf).min()
        end = int(final.masked_fill(~reachable | (cost != low), _NEVER).argmin().item())
        return self._trace(bits, end)

    def _trace(self, bits: Sequence[Optional[torch.Tensor]], end: int) -> List[int]:
        selected, position = [], end
        for index in range(len(self.items) - 1, -1, -1):
            item = self.items[index]
            if bits[index] is not None and bool(bits[index][position]):
                selected.append(index)
                position -= -(-item.inputs // self.unit)
            else:
                position -= -(-item.kept // self.unit)
        return self.refine(sorted(selected))

    def refine(self, selected: List[int]) -> List[int]:
        """On a coarse axis, drop the costliest members the exact peak does not need."""
        if self.exact or not selected:
            return selected
        items, base = self.items, self.base
        limit = self.budget if self.budget is not None else _peak(items, selected, base)
        chosen: Set[int] = set(selected)
        for i in sorted(selected, key=lambda i: (-items[i].time, -items[i].kept, i)):
            chosen.discard(i)
            if _peak(items, chosen, base) > limit:
                chosen.add(i)
        return sorted(chosen)


def _shift(values: torch.Tensor, by: int, fill: float) -> torch.Tensor:
    """``values`` moved ``by`` places up the axis, ``fill`` below; what falls off is lost."""
    if by == 0:
        return values
    if by >= len(values):
        return torch.full_like(values, fill)
    return torch.cat((values.new_full((by,), fill), values[: len(values) - by]))

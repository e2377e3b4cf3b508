"""The exact solver behind the budget planner: which candidates to checkpoint so that the
predicted activation peak fits a budget at the least recompute time.

It knows nothing of modules; the planner hands it one :class:`CostItem` per candidate.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterable, List, Optional, Sequence, Tuple

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
        CostItem(name='layers.0', kept=8388608, inputs=1048576, time=0.002)
    """

    name: str
    """Qualified name of the candidate, for messages."""
    kept: int
    """Bytes its forward keeps for backward when it is not checkpointed."""
    inputs: int
    """Bytes of its inputs, which stay alive when it is checkpointed."""
    time: float
    """Seconds its forward takes, i.e. what recomputing it costs."""

    def __post_init__(self) -> None:
        for field in ("kept", "inputs"):
            value = getattr(self, field)
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

    When ``unit`` divides what each useful candidate saves (``kept - inputs``), as it does
    when those savings span at most ~32k units, the plan is optimal. Otherwise savings were
    rounded down to ``unit``: the plan still fits the budget, but may recompute more than
    the optimum.
    """

    selected: Tuple[int, ...]
    """Indices of the candidates to checkpoint, ascending."""
    predicted_peak: int
    """Predicted activation peak of the plan, in bytes (exact, not rounded)."""
    recompute_time: float
    """Seconds of recomputation the plan adds: the summed forward times of ``selected``."""
    budget: int
    """The budget it was solved for, in bytes."""
    unit: int
    """Memory unit, in bytes, of the discretised axis the solver worked on."""


def predicted_peak(items: Sequence[CostItem], selected: Iterable[int], *, base: int) -> int:
    """Predicted activation peak, in bytes, when the candidates ``selected`` are checkpointed.

    It is ``base`` + ``kept`` of every other candidate + ``inputs`` of every selected one
    + the largest ``kept`` among the selected (recomputed during backward, one at a time).

    Args:
        items: The candidates, in model order.
        selected: Indices into ``items`` of the checkpointed candidates.
        base: Bytes of activations outside every candidate.

    Raises:
        CheckpointConfigError: On a bad item, index or ``base``.
    """
    _check_items(items)
    base = _check_bytes(base, "base")
    chosen = set()
    for index in selected:
        if not _is_int(index) or not 0 <= index < len(items):
            raise CheckpointConfigError(
                f"selected index {index!r} is not a candidate index in [0, {len(items)})"
            )
        chosen.add(int(index))
    return _peak(items, chosen, base)


def smallest_reachable_peak(items: Sequence[CostItem], *, base: int) -> int:
    """The least predicted peak of any selection of ``items``, in bytes (exact).

    Raises:
        CheckpointConfigError: On a bad item or ``base``.
    """
    _check_items(items)
    return _lowest_peak(items, _check_bytes(base, "base"))[0]


def solve_budget(items: Sequence[CostItem], budget: int, *, base: int) -> BudgetSolution:
    """The selection of least recompute time whose predicted peak fits ``budget``.

    Ties in time go to the smaller peak, then to fewer candidates. A budget that the
    un-checkpointed model already meets selects nothing.

    Args:
        items: The candidates, in model order.
        budget: Bytes the predicted activation peak may reach.
        base: Bytes of activations outside every candidate.

    Returns:
        The plan; see :class:`BudgetSolution`.

    Raises:
        CheckpointConfigError: If ``budget`` is below :func:`smallest_reachable_peak`, or on
            a bad item, ``budget`` or ``base``.

    Example:
        >>> items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0) for i in range(4)]
        >>> solve_budget(items, 350, base=0)
        BudgetSolution(selected=(0, 1), predicted_peak=320, recompute_time=2.0, budget=350, unit=90)
    """
    _check_items(items)
    budget = _check_bytes(budget, "budget")
    base = _check_bytes(base, "base")
    if base + sum(item.kept for item in items) <= budget:
        return BudgetSolution((), _peak(items, (), base), 0.0, budget, 1)
    lowest, lowest_set = _lowest_peak(items, base)
    if budget < lowest:
        raise CheckpointConfigError(
            f"budget {_exact_bytes(budget)} is below the smallest reachable peak "
            f"{_exact_bytes(lowest)}, {_describe(items, lowest_set)}; raise the budget to at "
            f"least {format_bytes(lowest)} or offer more candidates"
        )
    selected, unit = _Search(items, budget, base).run()
    return BudgetSolution(
        tuple(sorted(selected)),
        _peak(items, selected, base),
        math.fsum(items[i].time for i in selected),
        budget,
        unit,
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


def _check_items(items: Sequence[CostItem]) -> None:
    for index, item in enumerate(items):
        if not isinstance(item, CostItem):
            raise CheckpointConfigError(
                f"candidate {index} is a {type(item).__name__}; expected a CostItem"
            )


def _peak(items: Sequence[CostItem], selected: Iterable[int], base: int) -> int:
    chosen = set(selected)
    kept = sum(item.kept for i, item in enumerate(items) if i not in chosen)
    inputs = sum(items[i].inputs for i in chosen)
    return base + kept + inputs + max((items[i].kept for i in chosen), default=0)


def _useful(items: Sequence[CostItem]) -> List[int]:
    """Candidates that save memory (``kept > inputs``), by ascending ``kept``, then index.

    Only these can be in an optimal plan: dropping one that saves nothing never raises
    the peak (if it was the largest, the recomputed maximum can only shrink) nor the time.
    """
    return sorted(
        (i for i, item in enumerate(items) if item.kept > item.inputs),
        key=lambda i: (items[i].kept, i),
    )


def _lowest_peak(items: Sequence[CostItem], base: int) -> Tuple[int, List[int]]:
    """The least peak and a selection reaching it.

    If candidate m is the largest selected, every other useful candidate below it in the
    ``_useful`` order only lowers the peak, so the best selection with that m takes them all.
    """
    best, best_set = base + sum(item.kept for item in items), []
    total = best
    saved = 0  # savings of the useful candidates before position p
    order = _useful(items)
    for p, m in enumerate(order):
        peak = total + items[m].inputs - saved
        if peak < best:
            best, best_set = peak, order[: p + 1]
        saved += items[m].kept - items[m].inputs
    return best, best_set


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
    """A covering knapsack over a discretised savings axis, one pass in ``_useful`` order.

    Checkpointing S saves ``kept - inputs`` per member and adds back the largest member's
    ``kept``; with m that member, S fits iff the others' savings reach
    ``excess + inputs[m]`` (``excess`` = un-checkpointed peak - budget). Every S has exactly
    one m, and the others precede m in the order, so the least (time, peak, count) over
    all S is the least over m of ``time[m]`` + the best subset of the items before m that
    covers m's requirement: the knapsack state just before m is added.

    Entry r of the state holds, among the subsets whose discretised savings reach r units,
    the least (time, -savings, count); both tie-breaks are packed in one integer ``key``
    (larger is better). This order is compatible with adding an item, so the recurrence
    ``best(r) = min(best_without(r), item + best_without(r - item))`` is exact.
    """

    def __init__(self, items: Sequence[CostItem], budget: int, base: int) -> None:
        self.items, self.budget, self.base = items, budget, base
        self.order = _useful(items)
        self.excess = base + sum(item.kept for item in items) - budget
        self.saves = [items[m].kept - items[m].inputs for m in self.order]
        self.needs = [self.excess + items[m].inputs for m in self.order]

    def run(self) -> Tuple[List[int], int]:
        """The best selection found and the memory unit used.

        The caller has checked that the budget is reachable and not already met, so
        ``order`` is not empty and the lowest-peak selection fits.
        """
        # Savings are stored in units of their gcd and packed with the count in one int64.
        self.grain = math.gcd(*self.saves)
        unit, exact = self._unit()
        self.unit = unit
        self.sigma = [s // unit for s in self.saves]
        self.length = length = min(max(-(-r // unit) for r in self.needs), sum(self.sigma)) + 1
        self.radix = len(self.order) + 1
        if (sum(self.saves) // self.grain + 1) * self.radix >= 1 << 62:
            raise CheckpointConfigError(
                f"the candidates' sizes (savings {format_bytes(sum(self.saves))} in steps of "
                f"{self.grain} bytes) are too large for the budget solver"
            )
        self.cost = torch.full((length,), math.inf, dtype=torch.float64)
        self.cost[0] = 0.0
        self.key = torch.full((length,), self.radix - 1, dtype=torch.int64)
        self.bits: List[torch.Tensor] = []
        best: Optional[Tuple[float, int, int, int]] = None
        best_at = (0, 0)
        for p in range(len(self.order)):
            found = self._query(p, exact)
            if found is not None and (best is None or found[0] < best):
                best, best_at = found[0], (p, found[1])
            self._add(p)
        selected = None if best is None else self._trace(*best_at)
        if exact and selected is not None:
            return selected, unit
        return self._refine(selected), unit

    def _unit(self) -> Tuple[int, bool]:
        """The gcd of the savings if its axis is short enough, else a coarser unit.

        Requirements are rounded up to the unit and savings down. With the gcd that loses
        nothing, since any sum of savings is a multiple of it; with a coarser unit it only
        makes plans more conservative, never infeasible.
        """
        span = min(max(self.needs), sum(self.saves))
        items = len(self.order)
        unit = self.grain
        if -(-span // unit) <= min(_EXACT_STEPS, max(1024, _MAX_CELLS // items)):
            return unit, True
        steps = min(_APPROX_STEPS, max(1024, _APPROX_CELLS // items))
        unit = max(unit, -(-span // steps))
        return unit, all(v % unit == 0 for v in self.saves)

    def _query(self, p: int, exact: bool) -> Optional[Tuple[Tuple[float, int, int, int], int]]:
        """The best selection whose largest member is ``order[p]``: its sort key and the
        state entry that holds the rest of it."""
        need = self.needs[p]
        if exact:
            r = -(-need // self.unit)
            if r >= self.length or math.isinf(self.cost[r].item()):
                return None
        else:
            # Entries hold subsets whose exact savings may exceed their rounded ones, so any
            # entry whose exact savings cover the need will do, not just those from r up.
            threshold = -(-need // self.grain) * self.radix
            cost = self.cost.masked_fill(self.key < threshold, math.inf)
            low = cost.min()
            if math.isinf(low.item()):
                return None
            r = int(torch.where(cost == low, self.key, -1).argmax().item())
        key = int(self.key[r].item())
        saved = (key // self.radix) * self.grain
        count = self.radix - 1 - key % self.radix
        time = self.cost[r].item() + self.items[self.order[p]].time
        peak = self.budget + need - saved
        return (time, peak, count + 1, p), r

    def _add(self, p: int) -> None:
        length, cost, key = self.length, self.cost, self.key
        shift = min(self.sigma[p], length)
        if shift:
            cost2 = torch.cat((cost[:1].expand(shift), cost[: length - shift]))
            key2 = torch.cat((key[:1].expand(shift), key[: length - shift]))
        else:
            cost2, key2 = cost, key
        cost2 = cost2 + self.items[self.order[p]].time
        key2 = key2 + ((self.saves[p] // self.grain) * self.radix - 1)
        better = (cost2 < cost) | ((cost2 == cost) & (key2 > key))
        self.cost = torch.where(better, cost2, cost)
        self.key = torch.where(better, key2, key)
        self.bits.append(better)

    def _trace(self, p: int, r: int) -> List[int]:
        selected = [self.order[p]]
        for j in range(p - 1, -1, -1):
            if self.bits[j][r]:
                selected.append(self.order[j])
                r = max(0, r - self.sigma[j])
        return selected

    def _refine(self, selected: Optional[List[int]]) -> List[int]:
        """Recover what rounding lost: start from the better of the knapsack's plan and
        the lowest-peak one, then drop the costliest members the exact slack allows."""
        items, base = self.items, self.base
        plans = [_lowest_peak(items, base)[1]] + ([selected] if selected is not None else [])
        best = min(
            plans,
            key=lambda s: (math.fsum(items[i].time for i in s), _peak(items, s, base), len(s)),
        )
        if not best:
            return best
        slack = self.budget - _peak(items, best, base)
        top = max(best, key=lambda i: (items[i].kept, i))
        kept = [top]
        # Dropping a member other than the largest raises the peak by exactly its saving.
        for i in sorted(best, key=lambda i: (-items[i].time, i)):
            if i == top:
                continue
            saving = items[i].kept - items[i].inputs
            if items[i].time > 0 and saving <= slack:
                slack -= saving
            else:
                kept.append(i)
        return kept

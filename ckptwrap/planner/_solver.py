"""The budget solver: which candidates to checkpoint so that the predicted activation peak
fits a budget at the least recompute time.

It knows nothing of modules; the planner hands it one :class:`CostItem` per candidate, in
the order the forward runs them. The peak model lives in ``_cost_model``, the dynamic
program in ``_search``; this module holds the entry points and their messages.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from .._errors import CheckpointConfigError
from ._device_memory import StepBudget
from ._cost_model import (
    CostItem,
    CostOption,
    _check,
    _check_bytes,
    format_bytes,
    predicted_peak,
)
from ._moments import _peak
from ._search import _Search

if TYPE_CHECKING:
    from ..policy import Budget

__all__ = [
    "BudgetSolution",
    "CostItem",
    "CostOption",
    "PercentBudget",
    "format_bytes",
    "lowest_plan",
    "pooled_times",
    "predicted_peak",
    "resolve_budget",
    "smallest_reachable_peak",
    "solve_budget",
]


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
    base = _check(items, base)
    tail = _check_bytes(tail, "tail")
    groups, options = _Search(items, base, None, tail=tail, within=within).run()  # type: ignore[misc]
    return _peak(items, groups, base, tail, options)


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
    base = _check(items, base)
    given = budget
    budget = _check_bytes(budget, "budget")
    tail = _check_bytes(tail, "tail")
    empty = _peak(items, (), base, tail)
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
        lowest = _peak(items, lowest_plan[0], base, tail, lowest_plan[1])
        if lowest > budget:
            lowest_set = [i for group in lowest_plan[0] for i in group]
            error = CheckpointConfigError(_below_reach(items, given, lowest, lowest_set))
            error.needed = _least_budget(given, lowest)
            del search
            raise error
        # On a coarse axis rounding can hide plans that fit; the lowest-peak one does.
        plan = search.refine(lowest_plan)
    groups, chosen = plan
    selected = tuple(sorted(i for group in groups for i in group))
    options = tuple(chosen.get(i, 0) for i in selected)
    return BudgetSolution(
        selected,
        _peak(items, groups, base, tail, chosen),
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
        return budget.total_for(lowest)
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

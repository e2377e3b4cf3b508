"""Selective levels of one candidate: ways to checkpoint it that save the outputs of some
of its operators and recompute the rest, derived from its measured operators.

Each level is a :class:`CostOption` the solver can choose instead of recomputing the whole
candidate, with the operator instances a selective policy must save to carry it out.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._peak_model import CostItem, CostOption

__all__ = ["Level", "MAX_LEVELS", "pooled_levels", "selective_levels"]

MAX_LEVELS = 6
"""At most this many levels per candidate: enough to span its byte range, few enough to
keep the solver's work small."""

Instance = Tuple[str, int]


@dataclasses.dataclass(frozen=True)
class Level:
    """One selective level of a candidate."""

    option: CostOption
    """What it costs, as the solver sees it."""
    instances: Tuple[Instance, ...]
    """``(operator packet, occurrence)`` of each operator call whose output it saves, in
    forward order."""


def selective_levels(
    cost: Any,
    item: CostItem,
    *,
    op_times: Optional[Sequence[float]] = None,
    overhead: Optional[float] = None,
) -> Tuple[Level, ...]:
    """The selective levels of one measured candidate, fewest saved bytes first.

    Only operator calls that create new storage (``bytes > 0``) which autograd saves for
    backward are worth saving. Saving an output autograd does not keep (a matmul feeding
    only an addition, say) makes the checkpoint hold it from forward to backward, and yet
    the recomputation must still rebuild everything backward needs: memory spent, nothing
    held less and little time gained. Outputs a later operator writes into in place
    cannot be saved at all, nor those of an operator that drew random numbers (the
    recomputation must draw them again, in order). The calls are taken in order of time saved per byte (ties by
    position), and each prefix of that order is a level: it keeps ``item.inputs`` plus
    the saved bytes, rebuilds what recomputation still must (as ``cost_item`` reckons it,
    with the saved bytes taken off), and costs the recompute time less the saved calls',
    plus twice ``selective_overhead`` (the forward and the recomputation each run under
    the selective dispatch mode).

    Per-operator times are measured one operator at a time, which adds overhead to each;
    when they add up to more than the candidate's recompute time they are scaled down to
    it, so that their shares, not the overhead, decide what a level saves.

    Only levels strictly between recomputing all and keeping all are returned: each holds
    less than the candidate keeps unchecked, takes less time than a full recomputation,
    and takes less time than every level that holds fewer bytes (the others are
    dominated). Of more than :data:`MAX_LEVELS`, that many are kept, spread evenly over
    the bytes they hold.

    Args:
        cost: The candidate's ``ModuleCost`` (its ``ops``, ``kept_bytes`` and
            ``forward_peak_bytes`` are read).
        item: The candidate's solver item (``cost_item(cost)``).
        op_times: Seconds per operator to use instead of those in ``cost.ops``.
        overhead: Seconds to use instead of ``cost.selective_overhead``.

    Returns:
        The levels; empty when the candidate has no operators worth saving.
    """
    ops = list(getattr(cost, "ops", ()) or ())
    times = [op.time for op in ops] if op_times is None else list(op_times)
    chosen = [
        (position, op) for position, op in enumerate(ops)
        if op.bytes > 0 and op.saved and not op.mutated and not op.random
    ]
    if not chosen:
        return ()
    # torch's selective checkpointing runs a dispatch mode over every operator of the
    # checkpointed forward and of its recomputation: a level pays that twice, on top of
    # the operators it recomputes.
    if overhead is None:
        overhead = float(getattr(cost, "selective_overhead", 0.0) or 0.0)
    overhead *= 2
    total = math.fsum(times)
    scale = item.time / total if total > item.time and total > 0 else 1.0
    chosen.sort(key=lambda pair: (-times[pair[0]] / pair[1].bytes, pair[0]))
    levels: List[Level] = []
    saved_bytes, saved_time, taken = 0, 0.0, []
    for position, op in chosen:
        saved_bytes += op.bytes
        saved_time += times[position] * scale
        taken.append((position, op))
        inputs = item.inputs + saved_bytes
        time = max(item.time - saved_time, 0.0) + overhead
        if inputs >= item.kept or time >= item.time:
            continue
        if levels and time >= levels[-1].option.time:
            continue  # holds more than the level before it, and saves no time on it
        rebuilt = max(
            int(cost.kept_bytes) - saved_bytes, int(cost.forward_peak_bytes) - saved_bytes, 0
        )
        instances = tuple(op.instance for _, op in sorted(taken, key=lambda pair: pair[0]))
        levels.append(Level(CostOption(_label(instances), inputs, rebuilt, time), instances))
    return tuple(_spread(levels, MAX_LEVELS))


def pooled_levels(
    pairs: Sequence[Tuple[Any, CostItem]],
    *,
    op_times: Sequence[Sequence[float]],
    overheads: Sequence[float],
) -> List[Tuple[Level, ...]]:
    """:func:`selective_levels` of each ``(cost, item)``, weighing ``op_times`` (per
    candidate, per operator) and ``overheads`` (per candidate, one pass of the selective
    mode) as the planner prices them (``RecomputePrices``); candidates alike in all but
    time share one set of levels, from the medians of their prices (alike candidates are
    priced alike but for the operators a call runs beyond those recorded), so the solver
    can weigh them as one (see ``pooled_times``).
    """
    groups: Dict[Any, List[int]] = {}
    for index, (cost, item) in enumerate(pairs):
        groups.setdefault(_alike(cost, item), []).append(index)
    result: List[Tuple[Level, ...]] = [()] * len(pairs)
    for members in groups.values():
        first = pairs[members[0]][0]
        count = len(getattr(first, "ops", ()) or ())
        times = [statistics.median(op_times[i][k] for i in members) for k in range(count)]
        typical = statistics.median(pairs[i][1].time for i in members)
        item = dataclasses.replace(pairs[members[0]][1], time=typical)
        overhead = statistics.median(overheads[i] for i in members)
        levels = selective_levels(first, item, op_times=times, overhead=overhead)
        for i in members:
            result[i] = levels
    return result


def _alike(cost: Any, item: CostItem) -> Tuple[Any, ...]:
    """What must match for two candidates to share their levels: all but times."""
    ops = tuple(
        (op.op, op.occurrence, op.bytes, op.flops, op.saved, op.mutated, op.random)
        for op in (getattr(cost, "ops", ()) or ())
    )
    return (
        item.kept, item.inputs, item.rebuilt,
        int(cost.kept_bytes), int(cost.forward_peak_bytes), ops,
    )


def _label(instances: Sequence[Instance]) -> str:
    """``save mm x3, addmm x2``: what a level saves, operators in order of first call."""
    counts: Dict[str, int] = Counter(name for name, _ in instances)
    order = list(dict.fromkeys(name for name, _ in instances))
    return "save " + ", ".join(
        name if counts[name] == 1 else f"{name} x{counts[name]}" for name in order
    )


def _spread(levels: List[Level], most: int) -> List[Level]:
    """At most ``most`` of ``levels`` (ordered by bytes held), the least and the most
    holding among them, the others nearest to evenly spaced byte counts between."""
    if len(levels) <= most:
        return levels
    low, high = levels[0].option.inputs, levels[-1].option.inputs
    picked: List[int] = []
    for step in range(most):
        target = low + (high - low) * step / (most - 1)
        free = [i for i in range(len(levels)) if i not in picked]
        picked.append(min(free, key=lambda i: (abs(levels[i].option.inputs - target), i)))
    return [levels[i] for i in sorted(picked)]

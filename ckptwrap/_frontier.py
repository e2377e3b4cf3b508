"""The memory/time trade-off of a model's candidates, which ``python -m ckptwrap plan
--pareto`` draws: the budget frontier, and fixed policies placed on the same cost model.

Everything is computed from one profile with the budget solver; nothing here draws.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._errors import CheckpointConfigError
from .policy import Blocks, Policy, as_policy, split_modifiers, split_terms
from .planner import CostItem, predicted_peak, smallest_reachable_peak, solve_budget, step_items
from .measure import ModelProfile, region_bytes, step_device
from .wrap import plan, profile_modules

__all__ = [
    "frontier",
    "frontier_candidates",
    "pareto_points",
    "Point",
    "reference_points",
]

_FRONTIER_POINTS = 25


@dataclasses.dataclass(frozen=True)
class Point:
    """One way to checkpoint the candidates, as the cost model predicts it."""

    label: str
    """What the point stands for, for the legend."""
    peak: int
    """Predicted activation peak, bytes."""
    time: float
    """Recompute time per training step, seconds."""
    names: Tuple[str, ...]
    """Qualified names of the checkpointed candidates."""


def pareto_points(
    model: nn.Module,
    inputs: Tuple[torch.Tensor, ...],
    policy: str,
    *,
    nested: bool = False,
    profile: Optional[ModelProfile] = None,
) -> Tuple[List[Point], List[Point]]:
    """Profile the candidates once and place the budget frontier and fixed policies on it.

    Args:
        model: The model, in train mode for a training trade-off.
        inputs: Positional example inputs of one forward.
        policy: The policy string; its set terms name the candidates (the repeated blocks
            if it has none), and its pickers and budget are ignored.
        nested: As for :func:`ckptwrap.plan`.
        profile: A profile already measured on ``inputs`` that covers every candidate
            (the one a plan was made from, so that the drawing and the plan agree); the
            candidates are profiled here when it is None.

    Returns:
        The frontier (see :func:`frontier`) and the points of :func:`reference_points`.

    Raises:
        CheckpointConfigError: If the policy is malformed or leaves no candidates, or
            ``profile`` lacks some of them.
    """
    candidates = _candidate_policy(as_policy(policy))
    names = frontier_candidates(model, policy, nested=nested)
    if profile is None:
        profile = profile_modules(model, names, inputs, step=True)
    else:
        absent = [name for name in names if name not in profile]
        if absent:
            raise CheckpointConfigError(
                f"the given profile lacks {len(absent)} of the {len(names)} candidates of "
                f"{policy!r} ({', '.join(absent[:3])}); pass a profile of all of them, or none "
                f"to profile here"
            )
    ordered, _, tail = step_items(
        profile, names, segments=True, region_bytes=region_bytes(step_device(model, tuple(inputs), {}))
    )
    items = [item for _, item in ordered]
    base = profile.base_bytes
    references = reference_points(items, base=base, candidates=str(candidates), tail=tail)
    return frontier(items, base=base, tail=tail), references


def frontier_candidates(model: nn.Module, policy: str, *, nested: bool = False) -> List[str]:
    """The qualified names a frontier of ``policy`` chooses among (see :func:`pareto_points`).

    Raises:
        CheckpointConfigError: If the policy is malformed or leaves no candidates.
    """
    names = plan(model, _candidate_policy(as_policy(policy)), nested=nested).names
    if not names:
        raise CheckpointConfigError(
            f"policy {policy!r} leaves no candidates in {type(model).__name__} to draw a "
            f"frontier over; give a policy whose set terms select some modules"
        )
    return names


def _candidate_policy(policy: Policy) -> Policy:
    """What the frontier chooses among: the policy's set terms, else the blocks (among
    which a lone picker, every:2, picks)."""
    sets = split_terms(split_modifiers(policy)[0])[0]
    return functools.reduce(operator.and_, sets) if sets else Blocks()


def frontier(
    items: Sequence[CostItem], *, base: int, points: int = _FRONTIER_POINTS, tail: int = 0
) -> List[Point]:
    """The least recompute time for each predicted peak, from the smallest reachable peak
    to checkpointing nothing.

    Args:
        items: The candidates, in model order.
        base: Bytes of activations outside every candidate.
        points: How many evenly spaced budgets to solve for, ends included.
        tail: As for :func:`~ckptwrap.policy._solver.predicted_peak`.

    Returns:
        The plans found, dominated ones dropped, by ascending peak and so by strictly
        falling time; the last checkpoints nothing.

    Raises:
        CheckpointConfigError: If ``points`` is below 2, or on a bad item or ``base``.
    """
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise CheckpointConfigError(f"points must be an integer >= 2, got {points!r}")
    low = smallest_reachable_peak(items, base=base, tail=tail)
    high = predicted_peak(items, (), base=base, tail=tail)
    budgets = sorted({low + (high - low) * k // (points - 1) for k in range(points)})
    solved = []
    for budget in budgets:
        solution = solve_budget(items, budget, base=base, tail=tail)
        names = tuple(items[i].name for i in solution.selected)
        label = f"budget:{100 * budget / max(high, 1):.0f}%"
        solved.append(Point(label, solution.predicted_peak, solution.recompute_time, names))
    best: List[Point] = []
    # On a coarse memory axis the solver may return a plan that a smaller budget's plan
    # beats; the frontier keeps only plans nothing else beats.
    for point in sorted(solved, key=lambda p: (p.peak, p.time)):
        if not best or point.time < best[-1].time:
            best.append(point)
    return best


def reference_points(
    items: Sequence[CostItem], *, base: int, candidates: str, tail: int = 0
) -> List[Point]:
    """Fixed policies to compare with the frontier: all candidates, every other one, and
    ``checkpoint_sequential`` with about sqrt(n) segments."""
    n = len(items)
    return [
        _point(f"{candidates} (all {n})", items, range(n), base, tail),
        _point("every:2", items, range(0, n, 2), base, tail),
        _sequential_point(items, base, tail),
    ]


def _point(
    label: str, items: Sequence[CostItem], selected: Sequence[int], base: int, tail: int = 0
) -> Point:
    selected = list(selected)
    return Point(
        label,
        predicted_peak(items, selected, base=base, tail=tail),
        math.fsum(items[i].time for i in selected),
        tuple(items[i].name for i in selected),
    )


def _sequential_point(items: Sequence[CostItem], base: int, tail: int = 0) -> Point:
    """``checkpoint_sequential`` as the cost model sees it: about sqrt(n) segments of
    consecutive candidates, each checkpointed as one region that keeps its first input;
    the last segment, as in ``checkpoint_sequential``, is not checkpointed. Candidates that
    cannot form segments (see ``CostItem.joins``) are merged by hand: each segment keeps
    its first candidate's inputs and recomputes all of its candidates at once."""
    n = len(items)
    segments = max(1, round(math.sqrt(n)))
    size = n // segments
    bounds = [k * size for k in range(segments)] + [n]
    groups = [tuple(range(bounds[k], bounds[k + 1])) for k in range(segments - 1)]
    label = f"checkpoint_sequential, {segments} segments"
    names = tuple(item.name for item in items[: bounds[segments - 1]])
    if all(items[i].joins is not None for group in groups for i in group[1:]):
        peak = predicted_peak(items, [group for group in groups if group], base=base, tail=tail)
        return Point(label, peak, math.fsum(items[i].time for i in range(len(names))), names)
    merged = [
        CostItem(
            f"segment {k}",
            kept=sum(item.kept for item in items[bounds[k] : bounds[k + 1]]),
            inputs=items[bounds[k]].inputs,
            time=math.fsum(item.time for item in items[bounds[k] : bounds[k + 1]]),
            # The segment's backward and recomputation carry its members' largest terms.
            grads=max(item.grads for item in items[bounds[k] : bounds[k + 1]]),
            recompute_grads=max(item.recompute_grads for item in items[bounds[k] : bounds[k + 1]]),
        )
        for k in range(segments)
    ]
    point = _point(label, merged, range(segments - 1), base, tail)
    return dataclasses.replace(point, names=names)

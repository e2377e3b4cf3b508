"""The moments of the peak model: what is alive at each point of the training step that
can set its peak, for one plan. ``_cost_model`` documents them (``predicted_peak``); the
dynamic program in ``_search`` prices its steps with the same functions.

The step's own terms (``forward``, ``recompute_grads``, ``grads`` and the tail) come from
one measured step with every candidate checkpointed: each is what a phase of it reached
beyond the activation part of the very moment that predicts that phase
(:func:`step_terms`), so measurement and prediction share their algebra here.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["step_terms"]

# The items are ``_cost_model.CostItem`` s, which imports this module: named loosely here
# so that the two import one way.
CostItem = Any
Group = Tuple[int, ...]


def _before(item: CostItem, base: int) -> int:
    return base if item.before is None else item.before


def _carried(item: CostItem) -> int:
    return 0 if item.joins is None else item.joins


def _choice(item: CostItem, option: int) -> Tuple[int, int]:
    """``inputs`` and ``rebuilt`` of option ``option`` (0: the full recomputation)."""
    if option == 0:
        return item.inputs, item.rebuilt  # type: ignore[return-value]
    chosen = item.options[option - 1]
    return chosen.inputs, chosen.rebuilt


def _held(item: CostItem, option: Optional[int]) -> int:
    """Bytes a candidate holds until its backward: plain (None), or checkpointed."""
    return _carried(item) + (item.kept if option is None else _choice(item, option)[0])


def _plain_moment(item: CostItem) -> int:
    """A plain candidate's forward and backward, above ``ahead`` and what the candidates
    before hold."""
    return _carried(item) + max(
        item.kept + item.grads, item.kept - item.call_kept + _plain_forward(item)
    )


def _plain_forward(item: CostItem) -> int:
    """What a plain candidate's forward holds at its highest, if its forward was measured."""
    return max(item.rebuilt, item.forward) if item.forward else 0  # type: ignore[type-var]


def _alone_parts(item: CostItem, option: int) -> Tuple[int, int, int]:
    """The activation part of a candidate checkpointed alone, above ``carried``: at its
    recomputation (what its checkpoint keeps and what it rebuilds), at its backward (its
    checkpoint's inputs and one call's rebuilt graph) and at its forward (beyond
    ``forward``, what the option saves as it goes, less one call's inputs, which
    ``forward`` holds)."""
    inputs, rebuilt = _choice(item, option)
    return (
        inputs + rebuilt,  # type: ignore[operator]
        item.inputs - item.saved + item.call_kept,
        inputs - item.call_inputs,
    )


def _alone_moment(item: CostItem, option: int) -> int:
    """A candidate checkpointed alone: its forward, its recomputation, then its backward."""
    recompute, backward, forward = _alone_parts(item, option)
    return _carried(item) + max(
        recompute + item.recompute_grads,
        backward + item.grads,
        item.forward + forward if item.forward else 0,
    )


def _segment_moment(items: Sequence[CostItem], group: Group) -> int:
    """A segment (or a candidate alone, recomputed in full): recomputation, then the
    backward of each member with what the members before it rebuilt."""
    first, last = items[group[0]], items[group[-1]]
    rebuilt, backward = 0, 0
    for i in group[:-1]:
        backward = max(backward, rebuilt + items[i].kept + items[i].grads)
        rebuilt += items[i].kept + _carried(items[i + 1])
    backward = max(backward, rebuilt + last.kept + last.grads)
    rebuilt += last.rebuilt  # type: ignore[operator]
    # Each member's forward, under the first's input, holds its own input and working set.
    forward = max(items[i].forward + _carried(items[i]) if items[i].forward else 0 for i in group)
    return _carried(first) + first.inputs + max(rebuilt + last.recompute_grads, backward, forward)


def _peak(
    items: Sequence[CostItem],
    groups: Iterable[Group],
    base: int,
    tail: int = 0,
    options: Optional[Mapping[int, int]] = None,
) -> int:
    moments, _, end = _moments(items, sorted(groups), base, tail, options or {})
    return max([end] + moments)


def _moments(
    items: Sequence[CostItem], groups: List[Group], base: int, tail: int, options: Mapping[int, int]
) -> Tuple[List[int], Dict[Group, Tuple[int, int]], int]:
    """A plan's moments (``groups`` sorted, ``options`` by first index) in forward order
    but for the end of the forward; per region, the index of its moment and what the
    candidates before it hold; and the end of the forward."""
    joined = list(itertools.accumulate(_carried(item) for item in items))
    starts = {group[0]: group for group in groups}
    inside = {i for group in groups for i in group[1:]}
    where: Dict[Group, Tuple[int, int]] = {}
    held, moments = 0, []
    for i, item in enumerate(items):
        if i in inside:
            continue
        ahead = _before(item, base) - joined[i]
        group = starts.get(i)
        if group is None:
            moments.append(ahead + held + _plain_moment(item))
            held += _held(item, None)
            continue
        option = options.get(i, 0)
        where[group] = (len(moments), held)
        region = _alone_moment(item, option) if len(group) == 1 else _segment_moment(items, group)
        moments.append(ahead + held + region)
        held += _held(item, option)
    return moments, where, base - (joined[-1] if joined else 0) + held + tail


def step_terms(
    items: Sequence[CostItem],
    base: int,
    forward: Mapping[int, int],
    recompute: Mapping[int, int],
    backward: Mapping[int, int],
    end: int,
) -> Tuple[List[Dict[str, int]], int]:
    """The step's terms of each item, from one step measured with every item
    checkpointed alone in full: per item index, the peaks of its forward, recomputation
    and backward phases (missing if not measured), and that of the end of the forward.

    Returns the terms per item, by field (``forward``, ``recompute_grads``, ``grads``;
    those its phases give), and the tail. Each term is its phase's peak less the rest of the moment that
    predicts the phase (:func:`_alone_moment` at option 0, and the end of the forward)
    with what the items before it held in that step; never negative.
    """
    changes: List[Dict[str, int]] = []
    held = joined = 0
    for index, item in enumerate(items):
        carried = _carried(item)
        joined += carried
        found: Dict[str, int] = {}
        if item.before is not None:
            ahead = item.before - joined + held + carried
            recompute_part, backward_part, forward_part = _alone_parts(item, 0)
            if index in forward:
                found["forward"] = max(0, forward[index] - ahead - forward_part)
            if index in recompute and index in backward:
                found["recompute_grads"] = max(0, recompute[index] - ahead - recompute_part)
                found["grads"] = max(0, backward[index] - ahead - backward_part)
        changes.append(found)
        held += carried + item.inputs
    return changes, max(0, end - (base - joined + held))

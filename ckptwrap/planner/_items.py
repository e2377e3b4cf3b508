"""From a profile to the solver's items: what checkpointing each measured candidate
frees, holds and costs, in the order the forward calls them, with its selective levels
and the terms of the profile's measured step. Times are the profile's prices
(``_timing.RecomputePrices``): the same counts give the same plan in every process.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple

from ._peak_model import CostItem
from ._levels import Level, pooled_levels
from ._peak_model import step_terms
from ._module_costs import ModelProfile
from ._timing import RecomputePrices

__all__ = ["cost_item", "forward_items", "forward_levels", "saving", "with_step_terms"]


def cost_item(cost: Any, *, time: float, segments: bool = False, region_bytes: int = 0) -> CostItem:
    """The solver's view of one measured module.

    A checkpoint keeps the module's inputs; the part of them the module saves itself is
    already counted in the profile's base bytes (it stays alive either way), so only the
    rest is extra, with ``region_bytes`` per checkpointed call (what the engine keeps for
    a region besides its inputs: on the CPU, the generator state it replays). Likewise
    its saved outputs that the code after it saves too are in the base, not freed by the
    checkpoint, yet rebuilt by its recomputation, which at its highest also holds the
    forward's temporaries. With ``segments``, a module that takes the previous
    candidate's output as its only input may run in one region with it. Measured with a
    save policy (the selective tier), the checkpoint also keeps the outputs the policy
    saves, and its recomputation rebuilds, and costs, only the rest.

    A module called several times keeps (and its checkpoint holds) the sum over its
    calls, while one recomputation rebuilds one call's share, and one backward holds it.

    ``time``: the seconds its recomputation is priced at (see ``RecomputePrices``).
    """
    calls = max(1, int(cost.calls))
    extra_inputs = max(0, int(cost.input_bytes) - int(cost.self_saved_input_bytes))
    handed_over = int(cost.handed_over_bytes)
    call_kept = max(0, int(cost.call_kept_bytes or cost.kept_bytes) - handed_over // calls)
    return CostItem(
        cost.name,
        int(cost.kept_bytes) - handed_over,
        extra_inputs + int(cost.policy_saved_bytes) + calls * region_bytes,
        float(time),
        rebuilt=max(
            call_kept - int(cost.policy_saved_kept_bytes) // calls,
            int(cost.forward_peak_bytes) - int(cost.policy_saved_bytes) // calls,
            0,
        ),
        before=cost.base_before_bytes,
        joins=int(cost.self_saved_input_bytes) if segments and cost.joins_previous else None,
        saved=int(cost.policy_saved_kept_bytes),
        call_kept=min(call_kept, int(cost.kept_bytes) - handed_over),
        call_inputs=(extra_inputs + int(cost.policy_saved_bytes)) // calls + region_bytes,
    )


def saving(item: CostItem, joined: bool) -> int:
    """What checkpointing the candidate saves: in a segment after its first module, all it
    keeps and its input; otherwise what it keeps beyond what its region keeps."""
    return item.kept + (item.joins or 0) if joined else item.kept - item.inputs


def forward_items(
    profile: ModelProfile,
    names: Sequence[str],
    *,
    segments: bool = False,
    levels: bool = False,
    region_bytes: int = 0,
) -> List[Tuple[str, CostItem]]:
    """The solver's items for ``names``, in the order the profiled forward called them.

    Candidates never called outside another candidate's call come last, in the given order.
    With ``segments``, a candidate may join the one before it only if that one is among
    ``names`` and just before it in this order. With ``levels``, each item carries its
    selective levels as ``options`` (see :func:`forward_levels`).
    """
    found = forward_levels(
        profile, names, segments=segments, levels=levels, region_bytes=region_bytes
    )
    return [(name, item) for name, item, _ in found]


def forward_levels(
    profile: ModelProfile,
    names: Sequence[str],
    *,
    segments: bool = False,
    levels: bool = True,
    region_bytes: int = 0,
) -> List[Tuple[str, CostItem, Tuple[Level, ...]]]:
    """:func:`forward_items`, with the selective levels behind each item's ``options``
    (none without ``levels``, nor for a candidate called several times). Every time is
    the profile's price (``RecomputePrices``), not a measured one."""
    costs = [profile[name] for name in names]
    prices = RecomputePrices(profile)
    order = sorted(range(len(costs)), key=lambda i: (costs[i].position < 0, costs[i].position, i))
    pairs = []
    for rank, i in enumerate(order):
        follows = rank > 0 and costs[order[rank - 1]].position == costs[i].position - 1
        item = cost_item(
            costs[i], segments=segments and follows, region_bytes=region_bytes, time=prices.time(costs[i].name)
        )
        pairs.append((costs[i], item))
    found = pooled_levels(
        pairs,
        op_times=[prices.op_times(cost.name) for cost, _ in pairs],
        overheads=[prices.selective(cost.name) for cost, _ in pairs],
    ) if levels else [()] * len(pairs)
    found = [ours if cost.calls <= 1 else () for (cost, _), ours in zip(pairs, found)]
    return [
        (names[i], dataclasses.replace(item, options=tuple(level.option for level in ours)), ours)
        for i, (_, item), ours in zip(order, pairs, found)
    ]


def with_step_terms(
    ordered: Sequence[Tuple[str, CostItem]], profile: ModelProfile
) -> Tuple[List[Tuple[str, CostItem]], int]:
    """``ordered`` (the solver's items in forward order) with ``forward``, ``grads`` and
    ``recompute_grads`` from the profile's measured step (see ``_peak_model.step_terms``),
    and the solver's ``tail``.

    Without a measured step the items are returned as they are and the tail is 0: the
    model then predicts the activation peak only.
    """
    step = profile.step
    if step is None:
        return list(ordered), 0
    index = {name: i for i, (name, _) in enumerate(ordered)}

    def by_index(table: Any) -> Any:
        return {index[name]: value for name, value in table.items() if name in index}

    changes, tail = step_terms(
        [item for _, item in ordered], profile.base_bytes,
        by_index(step.forward), by_index(step.recompute), by_index(step.backward), step.end,
    )
    return [(name, dataclasses.replace(item, **change)) for (name, item), change in zip(ordered, changes)], tail

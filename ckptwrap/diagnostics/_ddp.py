"""Re-entrant regions under ``DistributedDataParallel``.

Each re-entrant region runs its backward as a nested backward pass. DDP without
``static_graph`` expects every parameter's gradient exactly once per iteration and finds
unused parameters by searching the graph, so it fails ("marked as ready twice") with
``find_unused_parameters=True`` (the search cannot see inside a region) and when a
parameter is reached by a region more than once or also outside it (a region called twice,
a tied weight). Without those it works, but the next shared weight breaks it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

from torch import nn

from ._checks import display, few
from ._regions import Region
from ._report import Finding
from ._steps import CallLog

__all__ = ["check_ddp"]

_FIX = (
    "construct DistributedDataParallel(module, static_graph=True) (the graph must not change "
    "between iterations), or checkpoint with use_reentrant=False (the default), which DDP "
    "serves in every configuration."
)


def check_ddp(
    model: nn.Module,
    local: nn.Module,
    regions: List[Region],
    logs: Dict[str, CallLog],
    prefix: str,
) -> List[Finding]:
    """Re-entrant regions under DistributedDataParallel without ``static_graph=True``.

    Args:
        model: What the caller passed (a DDP wrapper or not).
        local: The module the regions belong to (a copy of the DDP wrapper's module).
        regions: The regions of ``local``.
        logs: Their calls in the checkpointed step.
        prefix: See :func:`display`: ``"module."`` when ``model`` is DistributedDataParallel.
    """
    if not prefix or getattr(model, "static_graph", False):
        return []
    reentrant = [region for region in regions if region.reentrant]
    if not reentrant:
        return []
    names = [display(prefix, region.name) for region in reentrant]
    setting = (
        f"the model is DistributedDataParallel without static_graph=True, and "
        f"{len(names)} region(s) use the re-entrant engine ({few(names)})"
    )
    reasons = []
    if getattr(model, "find_unused_parameters", False):
        reasons.append(
            "find_unused_parameters=True, whose search for unused parameters cannot see "
            "the parameters inside a re-entrant region"
        )
    reached_twice = _reached_twice(local, reentrant, logs)
    if reached_twice:
        reasons.append(
            f"parameters of {', '.join(display(prefix, name) for name in reached_twice)} "
            f"are reached more than once per step (a region called twice, or a weight "
            f"shared with other code)"
        )
    if reasons:
        return [Finding(
            "error", "reentrant-ddp", "",
            f"{setting}. Training fails ('Expected to mark a variable ready only once') "
            f"because of {' and '.join(reasons)}: each region's nested backward hands DDP "
            f"gradients it does not expect.",
            _FIX,
        )]
    return [Finding(
        "warning", "reentrant-ddp", "",
        f"{setting}. DDP serves that only while find_unused_parameters is False and every "
        f"parameter is reached once per step; the first tied weight or module called twice "
        f"makes training fail with 'Expected to mark a variable ready only once'.",
        _FIX,
    )]


def _reached_twice(local: nn.Module, reentrant: List[Region], logs: Dict[str, CallLog]) -> List[str]:
    """Re-entrant regions called more than once in the step, or holding a parameter that
    is also registered outside them."""
    names = sorted((region.name for region in reentrant), key=len, reverse=True)
    owners: Dict[int, Set[Optional[str]]] = {}
    for name, parameter in local.named_parameters(remove_duplicate=False):
        if parameter.requires_grad:
            region = next((r for r in names if r == "" or name.startswith(r + ".")), None)
            owners.setdefault(id(parameter), set()).add(region)
    shared = {region for regions in owners.values() if len(regions) > 1 for region in regions}
    return [
        region.name
        for region in reentrant
        if region.name in shared or logs[region.name].grad_calls > 1
    ]

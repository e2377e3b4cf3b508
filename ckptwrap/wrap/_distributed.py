"""Early, explained errors for re-entrant regions that ``DistributedDataParallel`` cannot
serve: raised in the forward of the first region that would fail, naming the module, the
parameter and the fixes, instead of a failure deep inside DDP's reducer in backward.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Set

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._errors import CheckpointConfigError

__all__ = ["check_reentrant_region"]

_FIX = (
    "Pass static_graph=True to DistributedDataParallel (the graph must not change between "
    "iterations), or checkpoint with use_reentrant=False (the default), which DDP serves "
    "in every configuration."
)


class _Tracker:
    """What one DDP model's re-entrant regions have used in its current forward."""

    __slots__ = ("used", "checked", "__weakref__")

    def __init__(self) -> None:
        self.used: Set[int] = set()  # ids of parameters reached by a region this forward
        self.checked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # owners whose layout was checked

    def __call__(self, ddp: nn.Module, args: Any) -> None:  # forward pre-hook of the DDP module
        self.used.clear()


_TRACKERS: "weakref.WeakKeyDictionary[nn.Module, _Tracker]" = weakref.WeakKeyDictionary()


def check_reentrant_region(owner: Any) -> None:
    """Raise if the re-entrant region of ``owner`` is about to run where DDP would fail.

    The re-entrant engine runs each region's backward as a nested backward pass. DDP
    without ``static_graph`` expects each parameter's gradient hook to fire once per
    iteration, so it fails ("marked as ready twice") with ``find_unused_parameters=True``,
    whose graph search cannot see the parameters inside a region, and when a parameter is
    reached by more than one region or by a region and code outside it (a module run
    twice, shared or tied weights). Both work with ``static_graph=True`` or
    ``use_reentrant=False``.

    Costs one attribute lookup unless a DDP forward without ``static_graph`` is running;
    then, per region, a pass over the owner's parameters.

    Args:
        owner: The module whose forward is the region, or None for a plain function.

    Raises:
        CheckpointConfigError: The active DDP model has ``find_unused_parameters=True``, or
            a parameter of ``owner`` is also reached by another region or outside it, and
            ``static_graph`` is off.
    """
    # DDP publishes the model whose forward is running (for the compiler's sake).
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or ddp.static_graph or not ddp.require_backward_grad_sync:
        return  # under no_sync() DDP's reducer does not watch the hooks
    if ddp.find_unused_parameters:
        raise CheckpointConfigError(
            f"{_describe(ddp, owner)} is checkpointed with use_reentrant=True under "
            f"DistributedDataParallel(find_unused_parameters=True) without static_graph. DDP's "
            f"search for unused parameters cannot see the parameters inside a re-entrant "
            f"region, marks them unused, and then fails when the region's backward produces "
            f"their gradients. {_FIX}"
        )
    if not isinstance(owner, nn.Module):
        return
    tracker = _TRACKERS.get(ddp)
    if tracker is None:
        tracker = _TRACKERS[ddp] = _Tracker()
        ddp.register_forward_pre_hook(tracker)  # a new forward starts with nothing used
    params = [p for p in owner.parameters() if p.requires_grad]
    if owner not in tracker.checked:
        _check_not_shared_outside(ddp, owner, params)
        tracker.checked.add(owner)
    ids = [id(p) for p in params]
    again = next((p for p, i in zip(params, ids) if i in tracker.used), None)
    if again is not None:
        raise CheckpointConfigError(
            f"{_describe(ddp, owner)} is checkpointed with use_reentrant=True and its parameter "
            f"{_param_name(ddp, again)!r} was already used by a re-entrant region in this "
            f"forward (the module runs twice, or shares weights with another region) under "
            f"DistributedDataParallel without static_graph. Each region's backward would "
            f"hand DDP that parameter's gradient again, which DDP rejects. {_FIX}"
        )
    tracker.used.update(ids)


def _check_not_shared_outside(ddp: nn.Module, owner: nn.Module, params: List[nn.Parameter]) -> None:
    """Raise if a parameter of ``owner`` is registered somewhere outside ``owner`` too (a
    tied weight): its gradient would reach DDP from two backward passes."""
    root: nn.Module = ddp.module
    prefixes = [name for name, module in root.named_modules(remove_duplicate=False) if module is owner]
    if not prefixes:
        return  # not part of the DDP model: nothing DDP watches
    ours = {id(p) for p in params}
    for name, param in root.named_parameters(remove_duplicate=False):
        if id(param) in ours and not any(_inside(name, prefix) for prefix in prefixes):
            raise CheckpointConfigError(
                f"{_describe(ddp, owner)} is checkpointed with use_reentrant=True and shares its "
                f"parameter {_param_name(ddp, param)!r} with {name!r} outside the region (a tied "
                f"weight) under DistributedDataParallel without static_graph. The region's "
                f"backward and the rest of the model would each hand DDP a gradient for it, "
                f"which DDP rejects. {_FIX}"
            )


def _inside(name: str, prefix: str) -> bool:
    return not prefix or name.startswith(prefix + ".")


def _describe(ddp: nn.Module, owner: Any) -> str:
    if not isinstance(owner, nn.Module):
        return "A function"
    root = getattr(ddp, "module", None)
    modules = root.named_modules() if isinstance(root, nn.Module) else ()
    name = next((name for name, module in modules if module is owner), None)
    kind = type(owner).__name__
    return f"{name} ({kind})" if name else kind


def _param_name(ddp: nn.Module, param: torch.Tensor) -> str:
    root = getattr(ddp, "module", None)
    params = root.named_parameters(remove_duplicate=False) if isinstance(root, nn.Module) else ()
    return next((name for name, candidate in params if candidate is param), "<unnamed parameter>")

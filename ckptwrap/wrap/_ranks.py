"""One set of measured costs for every rank of a process group.

Measured times and bytes differ between ranks (noise, or each rank's own share of the
batch), and ranks that planned from different costs could checkpoint different modules
at the same shape. So where the costs of a budget plan are measured, the ranks take each
value the lowest rank that holds the same model and policy has (the shapes to measure
at, whether the costs could be fitted, the fitted costs); every later plan is a solve on
them, the same on every rank, with no collective.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, List, Optional, Tuple

import torch.distributed as dist
from torch import nn

from ..planner import Plan
from ._selective import SelectiveContexts

__all__ = ["agreement"]


def agreement(model: nn.Module, plan: Plan) -> Optional[Callable[[Any], Any]]:
    """A function that returns, for a value of this rank's measurement, that of the lowest
    rank of the default process group whose model and policy match (one collective, so
    every rank must call it at the same point); None without a group of two or more ranks.

    Ranks that hold other models (the stages of a pipeline) keep their own.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    mine = _fingerprint(model, plan)

    def agree(value: Any) -> Any:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return value
        gathered: List[Optional[Tuple[str, Any]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, value))
        for entry in gathered:  # in rank order, so the lowest matching rank wins
            if entry is not None and entry[0] == mine:
                return entry[1]
        return value

    return agree


def _fingerprint(model: nn.Module, plan: Plan) -> str:
    """The same on two ranks exactly when they plan the same policy for the same layout."""
    digest = hashlib.sha256()
    options = plan.options.as_kwargs()
    context_fn = options.pop("context_fn")
    if context_fn is not None and not isinstance(context_fn, SelectiveContexts):
        # A user's function prints its address, which differs between processes.
        context_fn = f"{type(context_fn).__module__}.{getattr(context_fn, '__qualname__', '?')}"
    digest.update(repr((plan.policy, plan.tier, plan.nested, sorted(options.items()), context_fn)).encode())
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__};".encode())
    return digest.hexdigest()

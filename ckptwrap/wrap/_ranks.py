"""One budget plan for every rank of a process group.

A budget plan follows measured times and bytes, which differ between ranks (noise, or
each rank's own share of the batch). Ranks that checkpoint different modules of the same
model do different work and may disagree on peaks; so ``wrap_model`` makes every rank
apply the plan of the lowest rank that holds the same model.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
from torch import nn

from ..planner import Plan
from ._selective import SelectiveContexts

__all__ = ["agreed_plan"]


def agreed_plan(model: nn.Module, plan: Plan) -> Plan:
    """``plan`` as every rank of the default process group holding this model applies it.

    All ranks gather each other's plans (one collective, so ``wrap_model`` with a budget
    must run on every rank, as it does in a training script); a rank takes the plan of the
    lowest rank whose model and policy match its own. Ranks that hold other models (the
    stages of a pipeline) keep their own. Without an initialised group of two or more
    ranks, ``plan`` is returned as it is.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return plan
    mine = (_fingerprint(model, plan), _choice(plan))
    gathered: List[Optional[Tuple[str, Dict[str, Any]]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for entry in gathered:  # in rank order, so the lowest matching rank wins
        if entry is not None and entry[0] == mine[0]:
            return dataclasses.replace(plan, **entry[1])
    return plan


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


def _choice(plan: Plan) -> Dict[str, Any]:
    """What measurement decided in ``plan``: plain data that pickles on any rank."""
    return {
        "selected": plan.selected,
        "dropped": plan.dropped,
        "budget": plan.budget,
        "activation_bytes": plan.activation_bytes,
        "predicted_peak": plan.predicted_peak,
        "plain_peak": plan.plain_peak,
    }

"""``wrap_model`` and ``unwrap_model``: mark the modules a policy selects, in place.

A module is marked by giving the instance a ``forward`` attribute that runs the class's
forward as a checkpointed region. Nothing is renamed, re-parented or re-classed, so
qualified names, state dicts, ``type()`` and optimizer state are the same before, after
and after unwrapping.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ._forwards import _CheckpointedForward, _SegmentMember
from ._plan import Plan
from ._planning import _select, plan
from ._ranks import agreed_plan

__all__ = ["wrap_model", "unwrap_model", "PLAN_ATTRIBUTE"]

PLAN_ATTRIBUTE = "ckptwrap_plan"


def wrap_model(
    model: nn.Module,
    policy: Any = "blocks",
    *,
    nested: bool = False,
    example_inputs: Any = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    **options: Any,
) -> nn.Module:
    """Checkpoint the submodules ``policy`` selects, in place, and return the model.

    No qualified name, state-dict key, module type or optimizer state changes. Modules
    already checkpointed are left as they are, so wrapping twice is a no-op. The applied
    plan is kept as ``model.ckptwrap_plan``. On error the model is left unchanged.

    A ``budget:`` policy needs measured costs: with ``example_inputs`` they are measured
    now; without, on the model's first training forward (with autograd on), which then
    applies the plan before running on and says so once.

    Args:
        model: The model to change in place.
        policy: See :func:`plan`; also ``budget:X``, ``selective[:OP,...]``, ``offload``.
        nested: See :func:`plan`.
        example_inputs: See :func:`plan`.
        example_kwargs: See :func:`plan`.
        **options: Engine options of :func:`ckptwrap.checkpoint`.

    Returns:
        ``model`` itself.

    Raises:
        CheckpointConfigError: As :func:`plan`.

    Example:
        >>> model = wrap_model(AutoModelForCausalLM.from_config(cfg), "every:2")
        >>> print(model.ckptwrap_plan)
    """
    # Everything that can be checked without costs is checked now.
    unmeasured, budget = _select(model, policy, nested, options)
    if budget is not None and _applied_already(model, unmeasured):
        # Planned again on the wrapped model, the budget would be read against the memory
        # that is left: wrapping twice stays a no-op.
        return model
    if example_inputs is None and example_kwargs is None:
        if budget is not None:
            _remove_pending(model)
            model.register_forward_pre_hook(
                _PlanOnFirstForward(policy, nested, options), with_kwargs=True
            )
            setattr(model, PLAN_ATTRIBUTE, dataclasses.replace(unmeasured, pending=True))
            return model
        _apply(model, unmeasured)
        return model
    applied = plan(
        model, policy, nested=nested, example_inputs=example_inputs,
        example_kwargs=example_kwargs, **options,
    )
    _apply(model, agreed_plan(model, applied) if budget is not None else applied)
    return model


def _applied_already(model: nn.Module, unmeasured: Plan) -> bool:
    """Whether ``model`` carries a measured plan of the same policy, options and tier."""
    existing = model.__dict__.get(PLAN_ATTRIBUTE)
    return (
        isinstance(existing, Plan)
        and not existing.pending
        and (existing.policy, existing.options, existing.tier, existing.nested)
        == (unmeasured.policy, unmeasured.options, unmeasured.tier, unmeasured.nested)
    )


def _apply(model: nn.Module, applied: Plan) -> None:
    modules = dict(model.named_modules())
    offload = applied.tier == "offload"
    members: Dict[str, _SegmentMember] = {}
    for entry in applied.selected:
        if entry.joins is not None:
            module = modules[entry.name]
            members[entry.name] = _SegmentMember(module, applied.options, module.__dict__.get("forward"))
    follower = {entry.joins: entry.name for entry in applied.selected if entry.joins is not None}
    for entry in applied.selected:
        module = modules[entry.name]
        if entry.name in members:
            module.forward = members[entry.name]
            continue
        chain: List[_SegmentMember] = []
        name = follower.get(entry.name)
        while name is not None:
            chain.append(members[name])
            name = follower.get(name)
        module.forward = _CheckpointedForward(
            module, applied.options, module.__dict__.get("forward"), offload, tuple(chain)
        )
    setattr(model, PLAN_ATTRIBUTE, _recorded(model, applied, modules))


def _recorded(model: nn.Module, applied: Plan, modules: Dict[str, nn.Module]) -> Plan:
    """The plan to keep on ``model`` after applying ``applied`` over what it had.

    Wrapping again finds the modules an earlier ``wrap_model`` marked "already
    checkpointed" and selects none of them; the kept plan must still list them, since
    they are checkpointed.
    """
    existing = model.__dict__.get(PLAN_ATTRIBUTE)
    if not isinstance(existing, Plan) or existing.pending:
        return applied
    kept = [
        entry for entry in existing.selected
        if entry.name in modules
        and isinstance(modules[entry.name].__dict__.get("forward"), (_CheckpointedForward, _SegmentMember))
    ]
    order = {name: position for position, name in enumerate(modules)}
    selected = sorted([*kept, *applied.selected], key=lambda entry: order[entry.name])
    names = {entry.name for entry in selected}
    dropped = [item for item in existing.dropped if item[0] not in names]
    dropped += [item for item in applied.dropped if item[0] not in names and item not in dropped]
    # Nothing new marked: the predictions measured for the existing plan still hold.
    base = applied if applied.selected else existing
    return dataclasses.replace(
        base,
        policy=existing.policy if existing.policy == applied.policy else f"{existing.policy} + {applied.policy}",
        selected=tuple(selected),
        dropped=tuple(dropped),
    )


class _PlanOnFirstForward:
    """Forward pre-hook: measure on the first training forward, plan, wrap, then go away."""

    def __init__(self, policy: Any, nested: bool, options: Dict[str, Any]) -> None:
        self.policy = policy
        self.nested = nested
        self.options = options
        self.busy = False

    def __call__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if self.busy or not torch.is_grad_enabled() or not model.training:
            return None
        self.busy = True  # profiling runs the model's forward again
        try:
            applied = plan(
                model, self.policy, nested=self.nested, example_inputs=args,
                example_kwargs=kwargs, **self.options,
            )
        finally:
            self.busy = False
        applied = agreed_plan(model, applied)
        _remove_pending(model)
        _apply(model, applied)
        warnings.warn(
            f"ckptwrap measured {type(model).__name__} on its first training forward and "
            f"applied {applied.policy!r}: {len(applied)} module(s) checkpointed, "
            f"{(applied.predicted_peak or 0) / 2**20:.1f} MiB of activations predicted at the peak "
            f"(model.ckptwrap_plan has the details).",
            stacklevel=2,
        )
        return None


def _remove_pending(model: nn.Module) -> None:
    for key, hook in list(model._forward_pre_hooks.items()):
        if isinstance(hook, _PlanOnFirstForward):
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap_model` exactly and return the model.

    ``CheckpointWrapper`` modules and ``@checkpointed`` classes are left alone: they are
    part of the model's definition, not of a wrapping.

    Args:
        model: A model that ``wrap_model`` changed (anything else is returned unchanged).

    Returns:
        ``model`` itself.
    """
    if not isinstance(model, nn.Module):
        raise CheckpointConfigError(f"expected an nn.Module to unwrap, got {type(model).__name__}.")
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, (_CheckpointedForward, _SegmentMember)):
            if forward.previous is not None:
                module.forward = forward.previous
            else:
                del module.forward
    _remove_pending(model)
    model.__dict__.pop(PLAN_ATTRIBUTE, None)
    return model

"""Marks: a module is marked by giving the instance a ``forward`` attribute that runs the
class's forward as a checkpointed region, and the applied plan is kept on the model.

Nothing is renamed, re-parented or re-classed, so qualified names, state dicts, ``type()``
and optimizer state are the same before, after and after unmarking.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Tuple

from torch import nn

from ..planner import Plan
from ._forwards import CheckpointedForward, SegmentMember, entry_options

__all__ = ["PLAN_ATTRIBUTE", "apply_plan", "mark", "named", "record_plan", "unmark"]

PLAN_ATTRIBUTE = "ckptwrap_plan"


def apply_plan(model: nn.Module, applied: Plan) -> None:
    modules = mark(model, applied)
    record_plan(model, recorded(model, applied, modules))


def record_plan(model: nn.Module, plan: Optional[Plan]) -> None:
    """Keep ``plan`` as the model's ``ckptwrap_plan`` (None: remove it). A PEFT model's
    base model gets it as well, its names relative to that model: ``merge_and_unload()``
    returns the base model, still checkpointed as planned, and it keeps saying how."""
    base, prefix = _peft_base(model)
    for owner in (model, base):
        if owner is None:
            continue
        if plan is None:
            owner.__dict__.pop(PLAN_ATTRIBUTE, None)
        else:
            setattr(owner, PLAN_ATTRIBUTE, plan if owner is model else _rooted(plan, prefix))


_PEFT_BASES = ("base_model.model", "base_model")
"""Where PEFT keeps the base model: under its tuner (LoRA and the like), or as the tuner."""


def _peft_base(model: nn.Module) -> Tuple[Optional[nn.Module], str]:
    """A PEFT model's base model (``get_base_model()``) and its qualified name in it, with
    a dot. Asked with every plan recorded, at each training forward of a lazy budget: the
    places PEFT keeps it are looked at, not every module."""
    if type(model).__module__.split(".")[0] != "peft" or not callable(getattr(model, "get_base_model", None)):
        return None, ""
    base = model.get_base_model()
    for path in _PEFT_BASES:
        try:
            if model.get_submodule(path) is base:
                return base, path + "."
        except AttributeError:
            continue
    return None, ""


def _rooted(plan: Plan, prefix: str) -> Plan:
    """``plan`` for the module named ``prefix`` (ending in a dot): its entries inside it,
    renamed relative to it."""
    def inside(name: Optional[str]) -> bool:
        return name is not None and name.startswith(prefix)

    selected = tuple(
        dataclasses.replace(e, name=e.name[len(prefix):], joins=e.joins[len(prefix):] if inside(e.joins) else None)
        for e in plan.selected if inside(e.name)
    )
    dropped = tuple((name[len(prefix):], why) for name, why in plan.dropped if inside(name))
    return dataclasses.replace(plan, selected=selected, dropped=dropped)


def mark(model: nn.Module, applied: Plan, observer: Any = None) -> Dict[str, nn.Module]:
    """Give the modules ``applied`` selects their checkpointed forwards; returns the
    model's modules by name. With ``observer`` (a step recorder), each region tells it
    what it does."""
    modules = dict(model.named_modules())
    offload = applied.tier == "offload"
    members: Dict[str, SegmentMember] = {}
    for entry in applied.selected:
        if entry.joins is not None:
            module = modules[entry.name]
            members[entry.name] = SegmentMember(module, applied.options, module.__dict__.get("forward"))
    follower = {entry.joins: entry.name for entry in applied.selected if entry.joins is not None}
    for entry in applied.selected:
        module = modules[entry.name]
        if entry.name in members:
            module.forward = members[entry.name]
            continue
        chain: List[SegmentMember] = []
        name = follower.get(entry.name)
        while name is not None:
            chain.append(members[name])
            name = follower.get(name)
        options = entry_options(applied.options, entry.saved_ops)
        module.forward = CheckpointedForward(
            module, options, module.__dict__.get("forward"), offload, tuple(chain), observer, entry.name
        )
    return modules


def unmark(modules: Iterable[nn.Module]) -> None:
    """Take the checkpointed forwards ``wrap_model`` gave off ``modules``."""
    for module in modules:
        forward = module.__dict__.get("forward")
        if isinstance(forward, (CheckpointedForward, SegmentMember)):
            if forward.previous is not None:
                module.forward = forward.previous
            else:
                del module.forward


def recorded(model: nn.Module, applied: Plan, modules: Dict[str, nn.Module]) -> Plan:
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
        and isinstance(modules[entry.name].__dict__.get("forward"), (CheckpointedForward, SegmentMember))
    ]
    order = {name: position for position, name in enumerate(modules)}  # model order
    selected = tuple(sorted([*kept, *applied.selected], key=lambda entry: order[entry.name]))
    names = {entry.name for entry in selected}
    dropped = [item for item in existing.dropped if item[0] not in names]
    dropped += [item for item in applied.dropped if item[0] not in names and item not in dropped]
    # Nothing new marked: the predictions measured for the existing plan still hold.
    base = applied if applied.selected else existing
    # A policy stacked again (already one of those joined) is not named twice.
    stacked = existing.policy.split(" + ")
    return dataclasses.replace(
        base,
        policy=existing.policy if applied.policy in stacked else f"{existing.policy} + {applied.policy}",
        selected=selected,
        dropped=tuple(dropped),
    )


def named(model: nn.Module, applied: Optional[Plan]) -> List[nn.Module]:
    """The modules ``applied`` selects (none for no plan)."""
    modules = dict(model.named_modules())
    return [modules[name] for name in (applied.names if applied else []) if name in modules]

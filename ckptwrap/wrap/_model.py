"""``wrap_model`` and ``unwrap_model``: mark the modules a policy selects, in place.

A module is marked by giving the instance a ``forward`` attribute that runs the class's
forward as a checkpointed region. Nothing is renamed, re-parented or re-classed, so
qualified names, state dicts, ``type()`` and optimizer state are the same before, after
and after unwrapping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._errors import CheckpointConfigError
from .._warn import note
from ..planner import Plan, PlanEntry, ShapePlanner, as_example, is_measuring
from ._forwards import _CheckpointedForward, _SegmentMember, entry_options
from ._planning import _select, measured, plan, refuse_inference, shape_planner
from ._ranks import agreement

__all__ = ["wrap_model", "unwrap_model", "remove_pending", "PLAN_ATTRIBUTE"]

PLAN_ATTRIBUTE = "ckptwrap_plan"


def wrap_model(
    model: nn.Module,
    policy: Any = "blocks",
    *,
    nested: bool = False,
    example_inputs: Any = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    follow_shapes: Optional[bool] = None,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    max_shapes: Optional[Mapping[Any, Sequence[int]]] = None,
    **options: Any,
) -> nn.Module:
    """Checkpoint the submodules ``policy`` selects, in place, and return the model.

    No qualified name, state-dict key, module type or optimizer state changes. Modules
    already checkpointed are left as they are, so wrapping twice is a no-op. The applied
    plan is kept as ``model.ckptwrap_plan``. On error the model is left unchanged.

    A ``budget:`` policy needs measured costs: with ``example_inputs`` they are measured
    now; without, on the model's first training forward (with autograd on), which then
    applies the plan before running on. Costs are measured at small shapes of those inputs
    and fitted over their shapes, so every later training forward, at whatever batch size
    and length, gets the plan for its own shape before it goes on: a solve, not a new
    measurement. The budget holds at every training step, the ones that measure included;
    where a shape cannot reach it, that forward runs under its plan of least memory, said
    once (with ``example_inputs``, an unreachable budget is an error instead). A routine
    note of each plan made or switched goes to the ``ckptwrap`` logger.

    Args:
        model: The model to change in place.
        policy: See :func:`plan`; also ``budget:X``, ``selective[:OP,...]``, ``offload``.
        nested: See :func:`plan`.
        example_inputs: See :func:`plan`.
        example_kwargs: See :func:`plan`.
        follow_shapes: For a ``budget:`` policy, whether a training forward with inputs of
            another shape gets the plan for its shape (the default, ``None`` or ``True``),
            or keeps the first plan (``False``). In a process group the ranks agree once
            on the measured costs (a collective, where the costs are first measured: call
            ``wrap_model`` on every rank, as a training script does), so every rank plans
            a shape alike, with no collective afterwards.
        loss_fn: See :func:`plan`. Kept for measuring inputs of another layout, but not
            pickled with the model: after unpickling, measurements use the default.
        max_shapes: See :func:`plan`.
        **options: Engine options of :func:`ckptwrap.checkpoint`.

    Returns:
        ``model`` itself.

    Raises:
        CheckpointConfigError: As :func:`plan`; or ``follow_shapes`` is not a bool or None.

    Example:
        >>> model = wrap_model(AutoModelForCausalLM.from_config(cfg), "every:2")
        >>> print(model.ckptwrap_plan)
    """
    if follow_shapes is not None and not isinstance(follow_shapes, bool):
        raise CheckpointConfigError(
            f"follow_shapes must be True, False or None (the default: plan each training "
            f"forward's shape), got {follow_shapes!r}."
        )
    # Everything that can be checked without costs is checked now.
    unmeasured, budget = _select(model, policy, nested, options)
    if budget is None:
        if example_inputs is None and example_kwargs is None:
            _apply(model, unmeasured)
        else:
            _apply(model, plan(
                model, policy, nested=nested, example_inputs=example_inputs,
                example_kwargs=example_kwargs, loss_fn=loss_fn, **options,
            ))
        return model
    if _applied_already(model, unmeasured):
        # Planned again on the wrapped model, the budget would be read against the memory
        # that is left: wrapping twice stays a no-op.
        return model
    planner = shape_planner(
        model, policy, unmeasured, budget, loss_fn, max_shapes, agree=agreement(model, unmeasured)
    )
    hook = _PlanPerShape(planner, unmeasured, follow_shapes)
    if example_inputs is None and example_kwargs is None:
        remove_pending(model)
        model.register_forward_pre_hook(hook, with_kwargs=True)
        setattr(model, PLAN_ATTRIBUTE, dataclasses.replace(unmeasured, pending=True))
        return model
    args, kwargs = as_example(example_inputs, example_kwargs)
    refuse_inference(budget, unmeasured, args, kwargs)
    applied = measured(unmeasured, planner.choose(model, args, kwargs, strict=True))
    remove_pending(model)
    _apply(model, applied)
    hook.applied = applied
    model.register_forward_pre_hook(hook, with_kwargs=True)
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
    modules = _mark(model, applied)
    setattr(model, PLAN_ATTRIBUTE, _recorded(model, applied, modules))


def _mark(model: nn.Module, applied: Plan) -> Dict[str, nn.Module]:
    """Give the modules ``applied`` selects their checkpointed forwards; returns the
    model's modules by name."""
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
        options = entry_options(applied.options, entry.saved_ops)
        module.forward = _CheckpointedForward(
            module, options, module.__dict__.get("forward"), offload, tuple(chain)
        )
    return modules


def _unmark(modules: Iterable[nn.Module]) -> None:
    """Take the checkpointed forwards ``wrap_model`` gave off ``modules``."""
    for module in modules:
        forward = module.__dict__.get("forward")
        if isinstance(forward, (_CheckpointedForward, _SegmentMember)):
            if forward.previous is not None:
                module.forward = forward.previous
            else:
                del module.forward


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
    selected = _in_model_order(modules, [*kept, *applied.selected])
    names = {entry.name for entry in selected}
    dropped = [item for item in existing.dropped if item[0] not in names]
    dropped += [item for item in applied.dropped if item[0] not in names and item not in dropped]
    # Nothing new marked: the predictions measured for the existing plan still hold.
    base = applied if applied.selected else existing
    return dataclasses.replace(
        base,
        policy=existing.policy if existing.policy == applied.policy else f"{existing.policy} + {applied.policy}",
        selected=selected,
        dropped=tuple(dropped),
    )


def _in_model_order(modules: Dict[str, nn.Module], entries: List[PlanEntry]) -> Tuple[PlanEntry, ...]:
    """``entries`` sorted as ``model.named_modules()`` lists their modules."""
    order = {name: position for position, name in enumerate(modules)}
    return tuple(sorted(entries, key=lambda entry: order[entry.name]))


class _PlanPerShape:
    """Forward pre-hook of a model wrapped with a ``budget:`` policy: before each training
    forward goes on, it asks the planner for the plan of that forward's inputs (measuring
    costs on the first, a solve from then on) and switches the marks if the plan differs
    from the one applied.

    Switching only between forwards is safe for a backward still pending: each forward
    captured the function and options it ran with, and its recomputation uses those.
    """

    def __init__(self, planner: ShapePlanner, unmeasured: Plan, follow_shapes: Optional[bool]) -> None:
        self.planner = planner
        self.unmeasured = unmeasured  # the selection the planner chooses among
        self.follow_shapes = follow_shapes
        self.applied: Optional[Plan] = None  # the plan whose modules this hook marked

    def __call__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if is_measuring() or not torch.is_grad_enabled() or not model.training:
            return None  # not a training forward of the caller's
        if self.applied is not None and (torch.compiler.is_compiling() or self.follow_shapes is False):
            return None  # compiled code keeps the plan it was traced with
        record = model.__dict__.get(PLAN_ATTRIBUTE)
        previous = self.applied
        choice = self.planner.choose(
            model, args, kwargs, strict=False, around=functools.partial(_unmarked, model, previous)
        )
        new = measured(self.unmeasured, choice)
        if previous is not None and _same_marks(previous, new):
            self.applied = new
            if isinstance(record, Plan) and not record.pending:
                setattr(model, PLAN_ATTRIBUTE, dataclasses.replace(record, **_predictions(new)))
            return None
        if previous is None:
            _apply(model, new)
            self.applied = new
        else:
            _unmark(_named(model, previous))
            self._mark_recorded(model, new, record)
        shapes = self.planner.layout_of(args, kwargs) or "these inputs"
        verb = "applied" if previous is None else "switched to"
        note(
            f"ckptwrap {verb} {new.policy!r} for {type(model).__name__}'s inputs of {shapes}: "
            f"{len(new)} module(s) checkpointed, {(new.predicted_peak or 0) / 2**20:.1f} MiB "
            f"predicted at the training step's peak (model.ckptwrap_plan has the details)."
        )
        return None

    def _mark_recorded(self, model: nn.Module, new: Plan, record: Any) -> None:
        """Mark ``new``'s modules (this hook's old ones are unmarked) and record it as the
        model's plan, beside what other wrappings marked."""
        modules = _mark(model, new)
        old = set(self.applied.names) if self.applied is not None else set()
        self.applied = new
        if not isinstance(record, Plan) or record.pending:
            setattr(model, PLAN_ATTRIBUTE, new)
            return
        others = [entry for entry in record.selected if entry.name not in old]
        selected = _in_model_order(modules, [*others, *new.selected])
        names = {entry.name for entry in selected}
        setattr(model, PLAN_ATTRIBUTE, dataclasses.replace(
            new,
            policy=record.policy,
            selected=selected,
            dropped=tuple(item for item in new.dropped if item[0] not in names),
        ))


@contextlib.contextmanager
def _unmarked(model: nn.Module, applied: Optional[Plan]) -> Iterator[None]:
    """While the planner measures the model from inside its training forward: without the
    marks of ``applied`` (costs are measured as the model runs unmarked), put back after.

    An FSDP2 model's own parameters are gathered again afterwards: FSDP2 gathered them
    before this hook ran, and the measured step's backward sharded them once more, so the
    forward that goes on would meet sharded ones."""
    marks = [(module, module.__dict__.get("forward")) for module in _named(model, applied)]
    _unmark(module for module, _ in marks)
    try:
        yield
    finally:
        for module, forward in marks:
            if forward is not None:
                module.forward = forward
        fsdp = getattr(dist, "fsdp", None) if dist.is_available() else None
        module_class = getattr(fsdp, "FSDPModule", None)
        if module_class is not None and isinstance(model, module_class):
            model.unshard()


def _same_marks(old: Plan, new: Plan) -> bool:
    """Whether two plans mark the same modules the same way (predictions aside)."""
    def marks(plan: Plan) -> List[Tuple[Any, ...]]:
        return [(e.name, e.joins, e.saved_ops, e.option) for e in plan.selected]

    return marks(old) == marks(new)


def _predictions(plan: Plan) -> Dict[str, Any]:
    return {
        "budget": plan.budget,
        "activation_bytes": plan.activation_bytes,
        "predicted_peak": plan.predicted_peak,
        "plain_peak": plan.plain_peak,
    }


def _named(model: nn.Module, applied: Optional[Plan]) -> List[nn.Module]:
    """The modules ``applied`` selects (none for no plan)."""
    modules = dict(model.named_modules())
    return [modules[name] for name in (applied.names if applied else []) if name in modules]


def remove_pending(model: nn.Module) -> None:
    """Remove the hook that plans a ``budget:`` policy, with the costs and plans it keeps
    (the modules it marked stay marked)."""
    for key, hook in list(model._forward_pre_hooks.items()):
        if isinstance(hook, _PlanPerShape):
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
    _unmark(model.modules())
    remove_pending(model)
    model.__dict__.pop(PLAN_ATTRIBUTE, None)
    return model

"""``wrap_model`` and ``unwrap_model``: mark the modules a policy selects, in place.

A module is marked by giving the instance a ``forward`` attribute that runs the class's
forward as a checkpointed region. Nothing is renamed, re-parented or re-classed, so
qualified names, state dicts, ``type()`` and optimizer state are the same before, after
and after unwrapping.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._errors import CheckpointConfigError
from .._warn import warn
from ._forwards import _CheckpointedForward, _SegmentMember, entry_options
from ..planner import Plan, PlanEntry, ShapePlans, Shapes, as_example, bucket_of, describe, input_shapes
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
    follow_shapes: Optional[bool] = None,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    **options: Any,
) -> nn.Module:
    """Checkpoint the submodules ``policy`` selects, in place, and return the model.

    No qualified name, state-dict key, module type or optimizer state changes. Modules
    already checkpointed are left as they are, so wrapping twice is a no-op. The applied
    plan is kept as ``model.ckptwrap_plan``. On error the model is left unchanged.

    A ``budget:`` policy needs measured costs: with ``example_inputs`` they are measured
    now; without, on the model's first training forward (with autograd on), which then
    applies the plan before running on and says so once. A plan serves the inputs of its
    shape bucket (every tensor dimension rounded up to a power of two) that are nowhere
    larger than those it was measured on; a training forward that no plan made so far
    serves is measured and planned for before it goes on, and says so. The plans of the
    16 most recently used buckets are kept.

    Args:
        model: The model to change in place.
        policy: See :func:`plan`; also ``budget:X``, ``selective[:OP,...]``, ``offload``.
        nested: See :func:`plan`.
        example_inputs: See :func:`plan`.
        example_kwargs: See :func:`plan`.
        follow_shapes: For a ``budget:`` policy, whether a training forward with inputs of
            new shapes plans again. ``None`` (the default) does so except in an initialised
            process group of two or more ranks: planning there is a collective (every rank
            applies one plan), which every rank must reach at the same step, so pass
            ``True`` only if every rank sees the same input shapes at the same steps.
            ``False`` keeps the first plan for every shape.
        loss_fn: See :func:`plan`. Kept for planning again at new shapes, but not
            pickled with the model: after unpickling, plans made then use the default.
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
            f"follow_shapes must be True, False or None (the default: plan again for new "
            f"input shapes except in a process group), got {follow_shapes!r}."
        )
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
                _PlanPerShape(policy, nested, options, follow_shapes, loss_fn), with_kwargs=True
            )
            setattr(model, PLAN_ATTRIBUTE, dataclasses.replace(unmeasured, pending=True))
            return model
        _apply(model, unmeasured)
        return model
    applied = plan(
        model, policy, nested=nested, example_inputs=example_inputs,
        example_kwargs=example_kwargs, loss_fn=loss_fn, **options,
    )
    if budget is None:
        _apply(model, applied)
        return model
    applied = agreed_plan(model, applied)
    _remove_pending(model)
    _apply(model, applied)
    hook = _PlanPerShape(policy, nested, options, follow_shapes, loss_fn)
    hook.seed(input_shapes(*as_example(example_inputs, example_kwargs)), applied)
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
    """Forward pre-hook of a model wrapped with a ``budget:`` policy: it plans on the first
    training forward, and again on one whose inputs no plan made so far serves (the bucket
    rule of ``_shapes``), switching the marks before that forward goes on.

    Switching only between forwards is safe for a backward still pending: each forward
    captured the function and options it ran with, and its recomputation uses those.
    """

    def __init__(
        self,
        policy: Any,
        nested: bool,
        options: Dict[str, Any],
        follow_shapes: Optional[bool],
        loss_fn: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        self.policy = policy
        self.loss_fn = loss_fn
        self.nested = nested
        self.options = options
        self.follow_shapes = follow_shapes
        self.plans = ShapePlans()
        self.applied: Optional[Plan] = None  # the plan whose modules this hook marked
        self.noted: set = set()  # buckets left unplanned, said so once each
        self.busy = False

    def __getstate__(self) -> Dict[str, Any]:
        # A loss function is often a lambda or a closure, which cannot pickle; plans made
        # after unpickling then use the default loss.
        state = dict(self.__dict__)
        try:
            pickle.dumps(self.loss_fn)
        except Exception:  # noqa: BLE001 - whatever stops it pickling, leave it out
            state["loss_fn"] = None
        return state

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_PlanPerShape":
        # A copy in memory keeps the loss function, pickleable or not.
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def seed(self, shapes: Shapes, applied: Plan) -> None:
        """Start from ``applied``, made by ``wrap_model`` on inputs of ``shapes``."""
        self.plans.add(shapes, applied)
        self.applied = applied

    def __call__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if self.busy or not torch.is_grad_enabled() or not model.training:
            return None
        if self.applied is not None and torch.compiler.is_compiling():
            return None  # compiled code keeps the plan it was traced with
        shapes = input_shapes(args, kwargs)
        found = self.plans.find(shapes, prefer=self.applied)
        if found is not None:
            if found is not self.applied:
                record = model.__dict__.get(PLAN_ATTRIBUTE)
                _unmark(_named(model, self.applied))
                self._mark_recorded(model, found, record)
            return None
        if self.applied is not None and not self._following():
            self._note(model, shapes)
            return None
        new_bucket = not self.plans.knows(shapes)
        first = self.applied is None
        applied = self._plan(model, args, kwargs, shapes)
        self.plans.add(shapes, applied)
        peak = f"{(applied.predicted_peak or 0) / 2**20:.1f} MiB predicted at the training step's peak"
        if first:
            warn(
                f"ckptwrap measured {type(model).__name__} on its first training forward and "
                f"applied {applied.policy!r}: {len(applied)} module(s) checkpointed, {peak} "
                f"(model.ckptwrap_plan has the details).",
            )
        else:
            why = "a new shape bucket" if new_bucket else "larger than its bucket's plans were measured at"
            warn(
                f"ckptwrap measured {type(model).__name__} again on a training forward with "
                f"inputs of shapes {describe(shapes)} ({why}) and applied {applied.policy!r}: "
                f"{len(applied)} module(s) checkpointed, {peak} (plans are kept per shape "
                f"bucket; model.ckptwrap_plan has the details).",
            )
        return None

    def _plan(
        self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], shapes: Shapes
    ) -> Plan:
        """Measure and plan on these inputs and apply the plan, or leave all as it was."""
        record = model.__dict__.get(PLAN_ATTRIBUTE)
        previous = self.applied
        marks = [(module, module.__dict__.get("forward")) for module in _named(model, previous)]
        _unmark(module for module, _ in marks)  # measured as it runs without this hook's marks
        self.busy = True  # profiling runs the model's forward again
        try:
            made = plan(
                model, self.policy, nested=self.nested, example_inputs=args,
                example_kwargs=kwargs, loss_fn=self.loss_fn, **self.options,
            )
            made = agreed_plan(model, made)
        except BaseException as error:
            for module, forward in marks:
                if forward is not None:
                    module.forward = forward
            if record is not None:
                setattr(model, PLAN_ATTRIBUTE, record)
            if previous is None or not isinstance(error, CheckpointConfigError):
                raise
            raise CheckpointConfigError(
                f"{type(model).__name__} got a training forward with inputs of shapes "
                f"{describe(shapes)}, which no plan made so far serves, and planning "
                f"{previous.policy!r} for them failed; the previous plan is still applied. "
                f"{error}"
            ) from error
        finally:
            self.busy = False
        if previous is None:
            _apply(model, made)
            self.applied = made
        else:
            self._mark_recorded(model, made, record)
        return made

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

    def _following(self) -> bool:
        if self.follow_shapes is not None:
            return self.follow_shapes
        return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)

    def _note(self, model: nn.Module, shapes: Shapes) -> None:
        bucket = bucket_of(shapes)
        if self.follow_shapes is False or bucket in self.noted:
            return
        self.noted.add(bucket)
        warn(
            f"{type(model).__name__} got a training forward with inputs of shapes "
            f"{describe(shapes)}, which the applied {self.policy!r} plan was not measured "
            f"for, so an absolute budget may be exceeded. In a process group of "
            f"{dist.get_world_size()} ranks ckptwrap does not plan again on its own: planning "
            f"is a collective, and ranks may see other shapes at this step. Pass "
            f"follow_shapes=True to wrap_model if every rank sees the same shapes at the same "
            f"steps, or plan up front with example_inputs of the largest shapes (the same on "
            f"every rank).",
        )


def _named(model: nn.Module, applied: Optional[Plan]) -> List[nn.Module]:
    """The modules ``applied`` selects (none for no plan)."""
    modules = dict(model.named_modules())
    return [modules[name] for name in (applied.names if applied else []) if name in modules]


def _remove_pending(model: nn.Module) -> None:
    """Remove the hook that plans a ``budget:`` policy, with the plans it keeps."""
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
    _remove_pending(model)
    model.__dict__.pop(PLAN_ATTRIBUTE, None)
    return model

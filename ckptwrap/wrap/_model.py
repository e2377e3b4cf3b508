"""``wrap_model`` and ``unwrap_model``: mark the modules a policy selects, in place (see
``_marks``), plan a ``budget:`` policy per shape (``_per_shape``), and keep transformers'
own gradient checkpointing off meanwhile (``_transformers``)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..planner import Plan, as_example, optimizer_spec
from ..measure import step_device, unreal
from ._marks import PLAN_ATTRIBUTE, apply_plan, record_plan, unmark
from ._per_shape import PlanPerShape, StepEnd, remove_pending
from ._max_shapes import check_max_shapes
from ._planning import measured, plan, refuse_inference, resolve_policy, select, shape_planner
from ._clients import cache_writes_off
from ._transformers import TransformersSwitch, switch_of

__all__ = ["wrap_model", "unwrap_model", "remove_pending", "uncompiled", "PLAN_ATTRIBUTE"]


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
    optimizer: Any = None,
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
        optimizer: See :func:`plan`: the optimizer whose state and step a budget in a
            device's terms (``budget:total=SIZE``, ``budget:device``) counts.
        **options: Engine options of :func:`ckptwrap.checkpoint`.

    Returns:
        ``model`` itself.

    Raises:
        CheckpointConfigError: As :func:`plan`; or ``follow_shapes`` is not a bool or None;
            or the model is already wrapped in a way this call cannot go over (either is a
            ``budget:`` policy, or the tiers differ: ``blocks`` then ``blocks;offload``);
            or ``budget:device`` where the device's memory cannot be read (the CPU). The
            model is then left as it was.

    Example:
        >>> model = wrap_model(AutoModelForCausalLM.from_config(cfg), "every:2")
        >>> print(model.ckptwrap_plan)
    """
    if follow_shapes is not None and not isinstance(follow_shapes, bool):
        raise CheckpointConfigError(
            f"follow_shapes must be True, False or None (the default: plan each training "
            f"forward's shape), got {follow_shapes!r}."
        )
    given, model = model, uncompiled(model)
    # Everything that can be checked without costs is checked now, before anything changes.
    intent, rest, budget = resolve_policy(model, policy, nested, options)
    _refuse_stacking(model, intent, budget)
    _refuse_unreadable_device(model, budget, example_inputs, example_kwargs)
    unmeasured = select(model, intent, rest, candidates=budget is not None)
    spec = optimizer_spec(model, optimizer)
    example = example_inputs is not None or example_kwargs is not None
    with _transformers_off(model, budget is not None or bool(unmeasured.selected)):
        if budget is None:
            apply_plan(model, plan(
                model, policy, nested=nested, example_inputs=example_inputs,
                example_kwargs=example_kwargs, loss_fn=loss_fn, optimizer=spec, **options,
            ) if example else unmeasured)
            return given
        if _applied_already(model, unmeasured):
            # Planned again on the wrapped model, the budget would be read against the memory
            # that is left: wrapping twice stays a no-op.
            return given
        planner = shape_planner(model, policy, unmeasured, budget, loss_fn, max_shapes, optimizer=spec)
        hook = PlanPerShape(planner, unmeasured, follow_shapes, max_shapes)
        if not example:
            remove_pending(model)
            _register(model, hook)
            record_plan(model, dataclasses.replace(unmeasured, pending=True))
            return given
        args, kwargs = as_example(example_inputs, example_kwargs)
        check_max_shapes(model, max_shapes, (args, kwargs))
        refuse_inference(budget, unmeasured, args, kwargs)
        applied = measured(unmeasured, planner.choose(model, args, kwargs, strict=True))
        remove_pending(model)
        apply_plan(model, applied)
        hook.applied, hook.solved = applied, True
        _register(model, hook)
    return given


def uncompiled(model: Any) -> Any:
    """The model that ``torch.compile(model)`` compiled, for its ``OptimizedModule``: marks go
    on the model itself, under its own names, and the compiled module runs them."""
    if type(model).__name__ != "OptimizedModule":
        return model
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def _register(model: nn.Module, hook: PlanPerShape) -> None:
    """The hooks that plan each training forward and follow its step to the end, and keep
    every candidate layer from writing a KV cache in training (checkpointed or not)."""
    hook.handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    end = StepEnd(hook)
    end.handle = model.register_forward_hook(end, always_call=True)
    modules = dict(model.named_modules())
    cache_writes_off(modules[name] for name in hook.planner.settings.names if name in modules)


@contextlib.contextmanager
def _transformers_off(model: nn.Module, marks: bool) -> Iterator[None]:
    """Keep transformers' own gradient checkpointing off in ``model`` while ckptwrap
    checkpoints anything in it: off now if ``marks``, and off before any later training
    forward that finds it on. Put back as it was if wrapping fails."""
    switch = switch_of(model)
    registered = switch is None
    if switch is None:
        switch = TransformersSwitch(model, _marks_anything)
        if not switch.flagged:
            yield
            return
    before = len(switch.turned_off)
    if marks:
        switch.switch_off(model, force=True)
    try:
        yield
    except BaseException:
        switch.turn_back_on(since=before)
        raise
    if registered:
        # Before the planning hook, which must measure the model as ckptwrap will run it.
        switch.handle = model.register_forward_pre_hook(switch, with_kwargs=True, prepend=True)


def _refuse_stacking(model: nn.Module, intent: Plan, budget: Any) -> None:
    """Refuse a wrapping that would be recorded over another without being applied as
    asked: a budget plans the whole model from its un-checkpointed costs and switches its
    marks per shape, so nothing goes on top of one, nor one on top of marks; and the
    modules already marked keep how they are checkpointed, so stacking cannot change it
    (``blocks`` then ``blocks;offload``)."""
    existing = model.__dict__.get(PLAN_ATTRIBUTE)
    if not isinstance(existing, Plan) or _same_wrapping(existing, intent):
        return  # wrapping twice alike: a no-op, or the same budget measured now
    planned = existing.pending or any(isinstance(hook, PlanPerShape) for hook in model._forward_pre_hooks.values())
    marked = existing.pending or bool(existing.selected)
    if planned:
        what = (
            f"a budget: policy, whose marks change with the shape of each training forward, "
            f"so {intent.policy!r} cannot be added over them"
        )
    elif budget is not None and marked:
        what = (
            f"which marks {len(existing)} module(s), and a budget: policy ({intent.policy!r}) "
            f"plans from the model's un-checkpointed costs"
        )
    elif marked and _how(existing) != _how(intent):
        raise CheckpointConfigError(
            f"{type(model).__name__} is already wrapped with {existing.policy!r}, whose "
            f"{len(existing)} module(s) run under the {_how(existing)} tier, and "
            f"{intent.policy!r} asks for the {_how(intent)} tier: wrapping again adds modules "
            f"but cannot change how those already marked are checkpointed. Call "
            f"ckptwrap.unwrap_model(model) first, then wrap with {intent.policy!r}."
        )
    else:
        return
    raise CheckpointConfigError(
        f"{type(model).__name__} is already wrapped with {existing.policy!r}, {what}. Call "
        f"ckptwrap.unwrap_model(model) first, or write both in one policy (e.g. "
        f"'blocks;budget:50%' lets the budget choose among the blocks)."
    )


def _how(plan: Plan) -> str:
    """How a plan's modules are checkpointed, in the words of its policy's tier term."""
    if plan.tier == "selective":
        return f"selective ({', '.join(plan.selective_ops)})" if plan.selective_ops else "selective"
    if plan.tier == "offload":
        return "offload"
    return "overlap" if plan.options.recompute_ahead else "recompute"


def _refuse_unreadable_device(
    model: nn.Module, budget: Any, example_inputs: Any, example_kwargs: Optional[Dict[str, Any]]
) -> None:
    """``budget:device`` reads the free memory of the device the model trains on: refused
    now where that is a device whose memory cannot be read (the CPU's is the host's),
    rather than at every training forward after."""
    if budget is None or budget.scope != "device":
        return
    args, kwargs = as_example(example_inputs, example_kwargs) if (
        example_inputs is not None or example_kwargs is not None
    ) else ((), {})
    if unreal(model, args, kwargs) is not None:
        return  # fake tensors: the memory is that of the device its rates name
    if next(itertools.chain(model.parameters(), model.buffers()), None) is None and not (args or kwargs):
        return  # nothing tells the device yet
    device = step_device(model, args, kwargs)
    read = getattr(getattr(torch, device.type, None), "mem_get_info", None)
    if device.type != "cpu" and read is not None:
        return
    why = (
        "the CPU's memory is the host's, shared with everything else"
        if device.type == "cpu" else f"ckptwrap cannot read the free memory of a {device.type!r} device"
    )
    raise CheckpointConfigError(
        f"{budget.describe()} reads the free memory of the device {type(model).__name__} trains "
        f"on, and it is on {device} ({why}); nothing was wrapped. Move the model to the device "
        f"it trains on before wrap_model (model.to('cuda')), or write the memory to use as "
        f"budget:total=SIZE (the whole iteration) or budget:SIZE (one training step)."
    )


def _marks_anything(model: nn.Module) -> bool:
    plan = model.__dict__.get(PLAN_ATTRIBUTE)
    return isinstance(plan, Plan) and (plan.pending or bool(plan.selected))


def _applied_already(model: nn.Module, unmeasured: Plan) -> bool:
    """Whether ``model`` carries a measured plan of the same policy, options and tier."""
    existing = model.__dict__.get(PLAN_ATTRIBUTE)
    return isinstance(existing, Plan) and not existing.pending and _same_wrapping(existing, unmeasured)


def _same_wrapping(existing: Plan, intent: Plan) -> bool:
    return (existing.policy, existing.options, existing.tier, existing.nested) == (
        intent.policy, intent.options, intent.tier, intent.nested
    )


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
    given, model = model, uncompiled(model)
    unmark(model.modules())
    remove_pending(model)
    switch = switch_of(model)
    if switch is not None:
        switch.turn_back_on()
        switch.handle.remove()
    record_plan(model, None)
    return given

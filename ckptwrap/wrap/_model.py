"""``wrap_model``, ``unwrap_model`` and ``plan``: mark the modules a policy selects, in place.

A module is marked by giving the instance a ``forward`` attribute that runs the class's
forward as a checkpointed region. Nothing is renamed, re-parented or re-classed, so
qualified names, state dicts, ``type()`` and optimizer state are the same before, after
and after unwrapping.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..policy import Budget, Offload, Selective, as_policy, split_modifiers
from ._costs import as_example, measure_and_choose
from ._selective import SelectiveContexts
from ._decorator import decorator_options
from ._options import CheckpointOptions, options_from
from ._plan import Plan, PlanEntry
from ._region import run_offloaded, run_region
from ._wrapper import CheckpointWrapper

__all__ = ["wrap_model", "unwrap_model", "plan", "PLAN_ATTRIBUTE"]

PLAN_ATTRIBUTE = "ckptwrap_plan"


class _CheckpointedForward:
    """The ``forward`` attribute ``wrap_model`` gives a module instance.

    Holds the module weakly so marking creates no reference cycle; pickling and deep
    copying rebuild it around the copied module.
    """

    __slots__ = ("_module", "options", "previous", "offload", "__weakref__")

    def __init__(
        self,
        module: nn.Module,
        options: CheckpointOptions,
        previous: Optional[Callable[..., Any]],
        offload: bool = False,
    ) -> None:
        self._module = weakref.ref(module)
        self.options = options
        self.previous = previous  # an instance-level forward someone else had set, if any
        self.offload = offload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise CheckpointConfigError(
                "This forward belongs to a module that no longer exists; call the module itself."
            )
        call = self.previous if self.previous is not None else functools.partial(type(module).forward, module)
        if self.offload:
            return run_offloaded(module, call, args, kwargs)
        return run_region(module, call, args, kwargs, self.options)

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_CheckpointedForward, (self._module(), self.options, self.previous, self.offload))

    def __repr__(self) -> str:
        module = self._module()
        kind = type(module).__name__ if module is not None else "<dead module>"
        return f"<checkpointed forward of {kind}>"


def _marking(module: nn.Module) -> Optional[Tuple[str, CheckpointOptions]]:
    """How ``module`` is already checkpointed, if it is: (what marks it, its options)."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, _CheckpointedForward):
        return "wrap_model", forward.options
    if isinstance(module, CheckpointWrapper):
        return "CheckpointWrapper", module.checkpoint_options
    options = decorator_options(type(module))
    if options is not None:
        return "@checkpointed", options
    return None


def plan(
    model: nn.Module,
    policy: Any = "blocks",
    *,
    nested: bool = False,
    example_inputs: Any = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    **options: Any,
) -> Plan:
    """What :func:`wrap_model` would do with these arguments, without changing ``model``.

    Args:
        model: The model.
        policy: A policy string (``"blocks"``, ``"every:2"``, ``"type:Block;last:4"``...),
            a module class or tuple of classes, a predicate ``fn(module, name) -> bool``
            or a policy object.
        nested: Keep selected modules that lie inside other selected (or already
            checkpointed) modules, as nested checkpoints. By default they are left out.
        example_inputs: Positional inputs of one training forward (a tensor or a tuple).
            Given, the candidates are profiled on them and the plan carries predicted
            memory and time; a ``budget:`` policy needs them. The model runs as it is
            (profile a training model in train mode); its state is left unchanged.
        example_kwargs: Keyword inputs of that forward.
        **options: Engine options of :func:`ckptwrap.checkpoint`.

    Returns:
        The plan: selected qualified names with their classes, what was left out and why,
        and, when measured, predicted memory saved and recompute time per module and in
        total.

    Raises:
        CheckpointConfigError: The policy or an option is not valid for this model, or a
            selected module is already checkpointed with different options.
    """
    unmeasured, budget = _select(model, policy, nested, options)
    if budget is None and example_inputs is None and example_kwargs is None:
        return unmeasured
    if example_inputs is None and example_kwargs is None:
        raise CheckpointConfigError(
            f"{budget.describe()} chooses modules from measured costs, so plan() needs "
            f"example_inputs=(...) for one training forward of {type(model).__name__}; "
            f"wrap_model without them measures on the first training forward instead."
        )
    args, kwargs = as_example(example_inputs, example_kwargs)
    context_fn = unmeasured.options.context_fn
    save_policy = context_fn.args[0] if isinstance(context_fn, SelectiveContexts) else None
    choice = measure_and_choose(
        model, unmeasured.selected, budget, args, kwargs, save_policy=save_policy
    )
    return dataclasses.replace(
        unmeasured,
        selected=tuple(choice.entries),
        dropped=unmeasured.dropped + tuple(choice.dropped),
        budget=choice.budget,
        activation_bytes=choice.activation_bytes,
        predicted_peak=choice.predicted_peak,
    )


def _select(
    model: nn.Module, policy: Any, nested: bool, options: Dict[str, Any]
) -> Tuple[Plan, Optional[Budget]]:
    """The plan before any measurement (a budget's candidates), and the budget term."""
    if not isinstance(model, nn.Module):
        raise CheckpointConfigError(f"expected an nn.Module to plan for, got {type(model).__name__}.")
    if not isinstance(nested, bool):
        raise CheckpointConfigError(f"nested must be True or False, got {nested!r}.")
    resolved = options_from(options, where="wrap_model")
    policy_object = as_policy(policy)
    rest, budget, tier = split_modifiers(policy_object)
    tier_name, ops, resolved = _apply_tier(tier, resolved)
    names = rest.select(model)
    modules = dict(model.named_modules())
    markings = {name: _marking(module) for name, module in modules.items() if name}
    existing = [name for name, marking in markings.items() if marking is not None]

    selected: List[PlanEntry] = []
    dropped: List[Tuple[str, str]] = []
    for name in _callable_modules(names, modules, dropped):
        module = modules[name]
        marking = markings[name]
        if marking is not None:
            how, their_options = marking
            if their_options != resolved:
                raise CheckpointConfigError(
                    f"{name} ({type(module).__name__}) is already checkpointed by {how} with "
                    f"{their_options}, which differs from the requested {resolved}. Call "
                    f"unwrap_model(model) first to change the options."
                )
            dropped.append((name, f"already checkpointed by {how}"))
            continue
        if not nested:
            ancestor = _enclosing(name, [e.name for e in selected] + existing)
            if ancestor is not None:
                dropped.append((name, f"inside checkpointed {ancestor} (pass nested=True to nest)"))
                continue
            inner = next((other for other in existing if other.startswith(name + ".")), None)
            if inner is not None:
                dropped.append(
                    (name, f"contains checkpointed {inner} (pass nested=True to nest, or unwrap first)")
                )
                continue
        selected.append(PlanEntry(name, type(module).__name__))
    unmeasured = Plan(
        policy=str(policy_object),
        options=resolved,
        selected=tuple(selected),
        dropped=tuple(dropped),
        nested=nested,
        tier=tier_name,
        selective_ops=ops,
    )
    return unmeasured, budget


def _apply_tier(
    tier: Any, options: CheckpointOptions
) -> Tuple[str, Tuple[str, ...], CheckpointOptions]:
    """The tier's name, its operators, and the engine options that carry it out."""
    if isinstance(tier, Offload):
        return "offload", (), options
    if isinstance(tier, Selective):
        if options.use_reentrant or options.context_fn is not None:
            raise CheckpointConfigError(
                f"{tier.describe()} runs on the non-re-entrant engine through context_fn; "
                f"drop use_reentrant=True and context_fn, or drop the selective term."
            )
        return "selective", tier.ops, dataclasses.replace(options, context_fn=SelectiveContexts(tier.ops))
    return "recompute", (), options


def _callable_modules(
    names: List[str], modules: Dict[str, nn.Module], dropped: List[Tuple[str, str]]
) -> List[str]:
    """``names`` with containers that are never called (ModuleList, ModuleDict) replaced
    by their items: checkpointing a forward that never runs would silently do nothing."""
    result: List[str] = []
    for name in names:
        module = modules[name]
        if type(module).forward is not nn.Module.forward:
            result.append(name)
            continue
        items = [f"{name}.{child}" for child, sub in module.named_children() if sub is not None]
        items = [item for item in items if item in modules]
        dropped.append((name, f"{type(module).__name__} is never called; taking its items instead"))
        result.extend(_callable_modules(items, modules, dropped))
    order = {name: position for position, name in enumerate(modules)}
    return sorted(set(result), key=order.__getitem__)


def _enclosing(name: str, others: Iterable[str]) -> Optional[str]:
    return next((other for other in others if name.startswith(other + ".")), None)


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
    if example_inputs is None and example_kwargs is None:
        # Everything that can be checked without costs is checked now.
        unmeasured, budget = _select(model, policy, nested, options)
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
    _apply(model, applied)
    return model


def _apply(model: nn.Module, applied: Plan) -> None:
    modules = dict(model.named_modules())
    offload = applied.tier == "offload"
    for entry in applied.selected:
        module = modules[entry.name]
        module.forward = _CheckpointedForward(
            module, applied.options, module.__dict__.get("forward"), offload
        )
    setattr(model, PLAN_ATTRIBUTE, applied)


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
        if isinstance(forward, _CheckpointedForward):
            if forward.previous is not None:
                module.forward = forward.previous
            else:
                del module.forward
    _remove_pending(model)
    model.__dict__.pop(PLAN_ATTRIBUTE, None)
    return model

"""``wrap_model``, ``unwrap_model`` and ``plan``: mark the modules a policy selects, in place.

A module is marked by giving the instance a ``forward`` attribute that runs the class's
forward as a checkpointed region. Nothing is renamed, re-parented or re-classed, so
qualified names, state dicts, ``type()`` and optimizer state are the same before, after
and after unwrapping.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from torch import nn

from .._errors import CheckpointConfigError
from ..policy import as_policy
from ._decorator import decorator_options
from ._options import CheckpointOptions, options_from
from ._plan import Plan, PlanEntry
from ._region import run_region
from ._wrapper import CheckpointWrapper

__all__ = ["wrap_model", "unwrap_model", "plan", "PLAN_ATTRIBUTE"]

PLAN_ATTRIBUTE = "ckptwrap_plan"


class _CheckpointedForward:
    """The ``forward`` attribute ``wrap_model`` gives a module instance.

    Holds the module weakly so marking creates no reference cycle; pickling and deep
    copying rebuild it around the copied module.
    """

    __slots__ = ("_module", "options", "previous", "__weakref__")

    def __init__(
        self, module: nn.Module, options: CheckpointOptions, previous: Optional[Callable[..., Any]]
    ) -> None:
        self._module = weakref.ref(module)
        self.options = options
        self.previous = previous  # an instance-level forward someone else had set, if any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise CheckpointConfigError(
                "This forward belongs to a module that no longer exists; call the module itself."
            )
        call = self.previous if self.previous is not None else type(module).forward.__get__(module)
        return run_region(module, call, args, kwargs, self.options)

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_CheckpointedForward, (self._module(), self.options, self.previous))

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


def plan(model: nn.Module, policy: Any = "blocks", *, nested: bool = False, **options: Any) -> Plan:
    """What :func:`wrap_model` would do with these arguments, without changing ``model``.

    Args:
        model: The model.
        policy: A policy string (``"blocks"``, ``"every:2"``, ``"type:Block;last:4"``...),
            a module class or tuple of classes, a predicate ``fn(module, name) -> bool``
            or a policy object.
        nested: Keep selected modules that lie inside other selected (or already
            checkpointed) modules, as nested checkpoints. By default they are left out.
        **options: Engine options of :func:`ckptwrap.checkpoint`.

    Returns:
        The plan: selected qualified names with their classes, and what was left out, why.

    Raises:
        CheckpointConfigError: The policy or an option is not valid for this model, or a
            selected module is already checkpointed with different options.
    """
    if not isinstance(model, nn.Module):
        raise CheckpointConfigError(f"expected an nn.Module to plan for, got {type(model).__name__}.")
    if not isinstance(nested, bool):
        raise CheckpointConfigError(f"nested must be True or False, got {nested!r}.")
    resolved = options_from(options, where="wrap_model")
    policy_object = as_policy(policy)
    names = policy_object.select(model)
    modules = dict(model.named_modules())
    existing = [name for name, module in modules.items() if name and _marking(module) is not None]

    selected: List[PlanEntry] = []
    dropped: List[Tuple[str, str]] = []
    for name in _callable_modules(names, modules, dropped):
        module = modules[name]
        marking = _marking(module)
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
    return Plan(str(policy_object), resolved, tuple(selected), tuple(dropped), nested)


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


def wrap_model(model: nn.Module, policy: Any = "blocks", *, nested: bool = False, **options: Any) -> nn.Module:
    """Checkpoint the submodules ``policy`` selects, in place, and return the model.

    No qualified name, state-dict key, module type or optimizer state changes. Modules
    already checkpointed are left as they are, so wrapping twice is a no-op. The applied
    plan is kept as ``model.ckptwrap_plan``. On error the model is left unchanged.

    Args:
        model: The model to change in place.
        policy: See :func:`plan`.
        nested: See :func:`plan`.
        **options: Engine options of :func:`ckptwrap.checkpoint`.

    Returns:
        ``model`` itself.

    Raises:
        CheckpointConfigError: As :func:`plan`.

    Example:
        >>> model = wrap_model(AutoModelForCausalLM.from_config(cfg), "every:2")
        >>> print(model.ckptwrap_plan)
    """
    applied = plan(model, policy, nested=nested, **options)
    modules = dict(model.named_modules())
    for entry in applied.selected:
        module = modules[entry.name]
        module.forward = _CheckpointedForward(module, applied.options, module.__dict__.get("forward"))
    setattr(model, PLAN_ATTRIBUTE, applied)
    return model


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
    model.__dict__.pop(PLAN_ATTRIBUTE, None)
    return model

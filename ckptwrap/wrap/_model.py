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
from torch.nn.modules.module import _global_forward_pre_hooks

from .._errors import CheckpointConfigError
from ..policy import Budget, Offload, Selective, as_policy, split_modifiers
from ._costs import as_example, measure_and_choose
from ._selective import SelectiveContexts
from ._decorator import decorator_options
from ._options import CheckpointOptions, options_from
from ._plan import Plan, PlanEntry
from ._region import RngSnapshot, region_switched_off, run_offloaded, run_region, run_segment
from ._wrapper import CheckpointWrapper

__all__ = ["wrap_model", "unwrap_model", "plan", "PLAN_ATTRIBUTE"]

PLAN_ATTRIBUTE = "ckptwrap_plan"


class _CheckpointedForward:
    """The ``forward`` attribute ``wrap_model`` gives a module instance.

    Holds the module weakly so marking creates no reference cycle; pickling and deep
    copying rebuild it around the copied module.
    """

    __slots__ = ("_module", "options", "previous", "offload", "chain", "__weakref__")

    def __init__(
        self,
        module: nn.Module,
        options: CheckpointOptions,
        previous: Optional[Callable[..., Any]],
        offload: bool = False,
        chain: Tuple["_SegmentMember", ...] = (),
    ) -> None:
        self._module = weakref.ref(module)
        self.options = options
        self.previous = previous  # an instance-level forward someone else had set, if any
        self.offload = offload
        self.chain = chain  # the modules that run in this module's region after it

    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise CheckpointConfigError(
                "This forward belongs to a module that no longer exists; call the module itself."
            )
        return module

    def call(self) -> Callable[..., Any]:
        """The module's own forward, without the checkpoint."""
        if self.previous is not None:
            return self.previous
        module = self.module()
        return functools.partial(type(module).forward, module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, call = self.module(), self.call()
        if self.offload:
            return run_offloaded(module, call, args, kwargs)
        if self.chain and _segment_runs(args, kwargs) and not self._members_hooked():
            return self._run_segment(module, call, args[0])
        return run_region(module, call, args, kwargs, self.options)

    def _members_hooked(self) -> bool:
        """Whether something watches the later modules' calls before they run (FSDP2
        gathers their parameters there): inside a segment they would run before it."""
        return bool(_global_forward_pre_hooks) or any(
            member.module()._forward_pre_hooks for member in self.chain
        )

    def _run_segment(self, module: nn.Module, call: Callable[..., Any], value: torch.Tensor) -> Any:
        """Run this module and the chain after it as one region; hand each later module the
        output it is to return when the model's forward calls it on the one before's."""
        members = [member.module() for member in self.chain]
        calls = [call, *(member.call() for member in self.chain)]
        outputs, states = run_segment([module, *members], calls, value, self.options)
        for index, member in enumerate(self.chain):
            member.expect(outputs[index], outputs[index + 1], states[index], states[index + 1])
        return outputs[0]

    def __reduce__(self) -> Tuple[Any, ...]:
        return (
            _CheckpointedForward,
            (self._module(), self.options, self.previous, self.offload, self.chain),
        )

    def __repr__(self) -> str:
        module = self._module()
        kind = type(module).__name__ if module is not None else "<dead module>"
        return f"<checkpointed forward of {kind}>"


class _SegmentMember:
    """The ``forward`` of a module that runs inside the region of a module before it.

    Called by the model's forward on the output it expects (the one before's), it returns
    the output the segment computed. Called on anything else, or when the segment did not
    run as one (autograd or ckptwrap off, under ``torch.compile``, other arguments), it
    runs as a region of its own.
    """

    __slots__ = ("_module", "options", "previous", "_expected", "__weakref__")
    # The segment ran this module ahead of the model's forward: it returns the output only
    # if that forward calls it on the output before it, with the random generators where
    # the segment left them then, and moves them on as the module did.

    def __init__(
        self, module: nn.Module, options: CheckpointOptions, previous: Optional[Callable[..., Any]]
    ) -> None:
        self._module = weakref.ref(module)
        self.options = options
        self.previous = previous
        self._expected: Optional[Tuple[Any, Any, RngSnapshot, RngSnapshot]] = None

    module = _CheckpointedForward.module
    call = _CheckpointedForward.call

    def expect(self, given: Any, output: Any, before: RngSnapshot, after: RngSnapshot) -> None:
        """The segment's output for this module, when it is called on ``given`` with the
        generators in state ``before``; ``after`` is where the module left them."""
        self._expected = (given, output, before, after)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        expected, self._expected = self._expected, None
        if (
            expected is not None
            and not kwargs
            and len(args) == 1
            and args[0] is expected[0]
            and expected[2].is_current()
        ):
            expected[3].restore()
            return expected[1]
        if expected is not None:
            _warn_broken_segment(self.module())
        return run_region(self.module(), self.call(), args, kwargs, self.options)

    def __reduce__(self) -> Tuple[Any, ...]:
        # Built empty, then filled: the module's own dict refers back to this object, and
        # copying must meet the same copy there (the head's chain holds it too).
        return (_SegmentMember.__new__, (_SegmentMember,), (self._module(), self.options, self.previous))

    def __setstate__(self, state: Tuple[Any, ...]) -> None:
        module, options, previous = state
        self.__init__(module, options, previous)  # type: ignore[misc]

    def __repr__(self) -> str:
        module = self._module()
        kind = type(module).__name__ if module is not None else "<dead module>"
        return f"<forward of {kind}, checkpointed in a segment>"


def _segment_runs(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether a segment can run as one region now: on one tensor, eagerly, with regions on."""
    return (
        len(args) == 1
        and not kwargs
        and isinstance(args[0], torch.Tensor)
        and not torch.compiler.is_compiling()
        and not region_switched_off()
    )


_warned_segments: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _warn_broken_segment(module: nn.Module) -> None:
    if module in _warned_segments:
        return
    _warned_segments.add(module)
    warnings.warn(
        f"{type(module).__name__} was planned to run in one checkpointed segment with the "
        f"module before it, but the model's forward did not call it on that module's output "
        f"alone (or drew random numbers in between); it now runs as a region of its own, and "
        f"the segment's work for it was wasted. Plan again on inputs that take this path "
        f"(wrap_model(..., example_inputs=...)).",
        stacklevel=3,
    )


def _marking(module: nn.Module) -> Optional[Tuple[str, CheckpointOptions]]:
    """How ``module`` is already checkpointed, if it is: (what marks it, its options)."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, (_CheckpointedForward, _SegmentMember)):
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
        model, unmeasured.selected, budget, args, kwargs,
        save_policy=save_policy,
        # Segments run on the non-re-entrant engine only.
        segments=unmeasured.tier == "recompute" and not unmeasured.options.use_reentrant,
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
    _apply(model, applied)
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
        if isinstance(forward, (_CheckpointedForward, _SegmentMember)):
            if forward.previous is not None:
                module.forward = forward.previous
            else:
                del module.forward
    _remove_pending(model)
    model.__dict__.pop(PLAN_ATTRIBUTE, None)
    return model

"""``plan``: what a policy selects in a model, and, from measured costs, which of those
a budget keeps; nothing in the model changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._errors import CheckpointConfigError
from .._warn import warn
from ..policy import (
    Blocks,
    Budget,
    Every,
    First,
    Fraction,
    Intersection,
    Last,
    Offload,
    Policy,
    Selective,
    as_policy,
    code_units,
    library_nests,
    overlaps,
    split_modifiers,
)
from ..measure import SavePolicy
from ..planner import (
    Choice,
    OptimizerSpec,
    Plan,
    PlanEntry,
    PlanSettings,
    ShapePlanner,
    as_example,
    optimizer_spec,
)
from ..measure import ModelProfile, ProgressBar, device_rates, measure_inputs, resolve_targets, should_show
from ._max_shapes import check_max_shapes
from ._forwards import marking
from ._region import run_unswitched_region
from ..engine import CheckpointOptions, options_from
from ._selective import SelectiveContexts
from ._wrapper import refuse_torchscript

__all__ = [
    "measured", "plan", "plan_and_profile", "profile_modules", "refuse_inference", "resolve_policy", "select",
    "shape_planner",
]


def plan(
    model: nn.Module,
    policy: Any = "blocks",
    *,
    nested: bool = False,
    example_inputs: Any = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    max_shapes: Optional[Mapping[Any, Sequence[int]]] = None,
    device_rates: Any = None,
    fake: bool = False,
    optimizer: Any = None,
    accumulation: int = 1,
    **options: Any,
) -> Plan:
    """What :func:`wrap_model` would do with these arguments, without changing ``model``.

    Args:
        model: The model.
        policy: A policy string (``"blocks"``, ``"every:2"``, ``"type:Block;last:4"``...),
            a module class or tuple of classes, a predicate ``fn(module, name) -> bool``
            or a policy object.
        nested: Keep selected modules that lie inside other selected (or already
            checkpointed) modules, as nested checkpoints. By default they are left out,
            but for units a model's library hands to a checkpoint function inside
            others it checkpoints (a diffusers autoencoder's resnets inside its blocks):
            a plan of fixed modules nests those as the library does.
        example_inputs: Positional inputs of one training forward (a tensor or a tuple).
            Given, the candidates' costs are measured on one training step on these
            inputs and the plan carries predicted memory and time; a ``budget:`` policy
            needs them. The model runs in train mode, on these inputs only; its state is
            left unchanged. A model on the meta device or made of fake tensors
            (``FakeTensorMode``) runs on fake tensors: bytes as on the device, times
            priced at ``device_rates``.
        example_kwargs: Keyword inputs of that forward (a Hugging Face model's
            ``input_ids``, ``attention_mask``, ``labels``...).
        loss_fn: How the training step turns the model's output into the loss
            (``loss_fn(output) -> scalar tensor``), for measuring the step whose peak the
            plan predicts and a budget caps. By default the output itself if it is a
            scalar, its ``loss`` if it has one (a Hugging Face output given labels), else
            each floating-point output gets a gradient of ones. It must take outputs of
            any shape; one that fails on smaller ones is used on the example inputs alone.
        max_shapes: The largest shapes the inputs will take in training, as a mapping
            from an input's keyword (or position, an int) to its shape, such as
            ``{"input_ids": (8, 1024)}``: a ``budget:NN%`` is then read against the
            un-checkpointed step's peak at those shapes, and a budget they cannot reach
            is an error now.
        device_rates: For a step on fake tensors, the rates its times are priced at: a
            name of ``ckptwrap.planner.DEVICE_RATES`` (``"h100-sxm"``, ``"a100-80gb"``...),
            ``"cpu"`` (this CPU's, measured), or a ``ckptwrap.planner.DeviceRates``. By
            default those of the fake tensors' device here.
        fake: Plan from a step on fake tensors even for a real model: its parameters and
            buffers stand in as fake tensors for that step, so nothing is allocated but
            the inputs; for asking what a plan is at shapes too large to run here (give
            inputs of that shape: real ones stay real). Bytes as a real step's; times
            priced at ``device_rates``.
        optimizer: The optimizer the model trains with: a ``torch.optim.Optimizer`` over
            its parameters or a name (``"adamw"``, ``"adam"``, ``"sgd"``,
            ``"sgd-momentum"``, ``"adagrad"``, ``"rmsprop"``). Its state and its step's
            temporaries are measured from two steps of it on fake stand-ins of the
            parameters (nothing allocated, the optimizer untouched) and count in a budget
            in a device's terms (``budget:total=80GiB``, ``budget:device``); with example
            inputs the plan shows the device's memory part by part.
        accumulation: Micro-steps per optimizer step (gradient accumulation). Past one,
            a plan in a device's terms is for the micro-steps after the first, which
            start with the gradients held: a ``budget:total`` leaves room for them, and
            the plan's ``device_peak`` counts them (a bound: the step's own peak counts
            the gradients its backward has made by then, which accumulating into held
            ones does not allocate again).
        **options: Engine options of :func:`ckptwrap.checkpoint`.

    Returns:
        The plan: selected qualified names with their classes, what was left out and why,
        and, when measured, predicted memory saved and recompute time per module and in
        total.

    Raises:
        CheckpointConfigError: The policy or an option is not valid for this model, a
            selected module is already checkpointed with different options, or no plan
            fits the budget at the example inputs' shapes (or at ``max_shapes``).
    """
    return plan_and_profile(
        model, policy, nested=nested, example_inputs=example_inputs,
        example_kwargs=example_kwargs, loss_fn=loss_fn, max_shapes=max_shapes,
        device_rates=device_rates, fake=fake, optimizer=optimizer, accumulation=accumulation, **options,
    )[0]


def plan_and_profile(
    model: nn.Module,
    policy: Any = "blocks",
    *,
    nested: bool = False,
    example_inputs: Any = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    profile: Optional[ModelProfile] = None,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    max_shapes: Optional[Mapping[Any, Sequence[int]]] = None,
    device_rates: Any = None,
    fake: bool = False,
    optimizer: Any = None,
    accumulation: int = 1,
    **options: Any,
) -> Tuple[Plan, Optional[ModelProfile]]:
    """:func:`plan`, and the profile its predictions come from (None when unmeasured).

    ``profile``, measured directly on the same example inputs, is used instead of
    measuring where it serves (it covers the candidates and, for a budget, no more), so
    that a drawing made from it agrees with the plan.
    """
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise CheckpointConfigError(
            f"accumulation must be a whole number of micro-steps per optimizer step, 1 or more; "
            f"got {accumulation!r}"
        )
    intent, rest, budget = resolve_policy(model, policy, nested, options)
    unmeasured = select(model, intent, rest, candidates=budget is not None)
    spec = optimizer if isinstance(optimizer, OptimizerSpec) else optimizer_spec(model, optimizer)
    if budget is None and example_inputs is None and example_kwargs is None:
        return unmeasured, None
    if example_inputs is None and example_kwargs is None:
        raise CheckpointConfigError(
            f"{budget.describe()} chooses modules from measured costs, so plan() needs "
            f"example_inputs=(...) (or example_kwargs={{...}}) for one training forward of "
            f"{type(model).__name__}; wrap_model without them measures on the first "
            f"training forward instead."
        )
    if not isinstance(fake, bool):
        raise CheckpointConfigError(f"fake must be True or False, got {fake!r}")
    planner = shape_planner(
        model, policy, unmeasured, budget, loss_fn, max_shapes, device_rates, fake, optimizer=spec,
        accumulation=accumulation,
    )
    args, kwargs = as_example(example_inputs, example_kwargs)
    check_max_shapes(model, max_shapes, (args, kwargs))
    refuse_inference(budget, unmeasured, args, kwargs)
    if profile is not None and _serves(profile, unmeasured.names, budget, planner.settings.save_policy):
        planner.seed(args, kwargs, profile)
    choice = planner.choose(model, args, kwargs, strict=True)
    return measured(unmeasured, choice), choice.profile


def shape_planner(
    model: nn.Module,
    policy: Any,
    unmeasured: Plan,
    budget: Optional[Budget],
    loss_fn: Optional[Callable[[Any], Any]],
    max_shapes: Optional[Mapping[Any, Sequence[int]]],
    rates: Any = None,
    fake: bool = False,
    *,
    optimizer: Any = None,
    accumulation: int = 1,
) -> ShapePlanner:
    """The planner of ``unmeasured``'s candidates, as ``policy`` allows it to checkpoint
    them."""
    if loss_fn is not None and not callable(loss_fn):
        raise CheckpointConfigError(
            f"loss_fn must be a callable loss_fn(output) -> loss tensor, got "
            f"{type(loss_fn).__name__} {loss_fn!r}."
        )
    check_max_shapes(model, max_shapes)
    if rates is not None:
        device_rates(torch.device("cpu"), rates)  # a bad name is refused now
    options = unmeasured.options
    context_fn = options.context_fn
    settings = PlanSettings(
        candidates=tuple((entry.name, entry.kind) for entry in unmeasured.selected),
        run_region=run_unswitched_region,
        budget=budget,
        save_policy=context_fn.args[0] if isinstance(context_fn, SelectiveContexts) else None,
        # Segments run on the non-re-entrant engine only.
        segments=unmeasured.tier == "recompute" and not options.use_reentrant,
        levels=budget is not None and _levels_allowed(policy, unmeasured),
        recompute=unmeasured.tier == "recompute",
        preserve_rng_state=options.preserve_rng_state,
        loss_fn=loss_fn,
        rates=rates,
        fake=fake,
        optimizer=optimizer,
        accumulation=accumulation,
    )
    return ShapePlanner(settings, max_shapes=dict(max_shapes) if max_shapes else None)


def profile_modules(
    model: nn.Module,
    names: Sequence[str],
    args: Any = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    *,
    repeats: int = 1,
    progress: Optional[bool] = None,
    save_policy: Optional[SavePolicy] = None,
    step: bool = False,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    preserve_rng_state: bool = True,
) -> ModelProfile:
    """Measure what each named module costs in one training step of ``model`` on these
    inputs.

    One step runs, forward and backward, with every outermost candidate checkpointed (a
    region run as a plan's regions run, statistics kept and buffers replayed): the least
    any plan holds between forward and backward, so measuring never needs more
    memory than the most checkpointed plan. Without ``loss_fn`` the output stays alive
    through the backward, as in the loop people write around a model that returns its
    loss (``out = model(**batch); out.loss.backward()``); with one, it is dropped once the
    loss is made (``loss_fn(model(x)).backward()``). Each candidate's saved tensors are seen as
    its region drops them (what it would keep if it were plain), its operators (bytes,
    FLOPs, which outputs autograd saves) through a dispatch mode inside its forward, its
    inputs and outputs as it is called, and its working set as it is recomputed. What the
    forward saves outside the candidates is seen through saved-tensor hooks. A candidate
    nested in another is measured inside it through forward hooks.

    Bytes are counted per storage, never per tensor: a saved view keeps its whole storage,
    and storages shared by several saved tensors (``q``, ``k``, ``v`` split from one
    projection) count once. A module that calls itself is measured at its outermost call
    only; one called several times gets the sum of its calls. A layer that writes a KV
    cache (a Hugging Face decoder layer) runs without the cache, as a checkpointed call of
    it does; a cache passed in is copied first, so the caller's is left as it was.

    The model runs in its current train or eval mode (profile a training model in train
    mode). Afterwards it is as it was: training flags, buffers (BatchNorm running
    statistics), ``.grad`` fields and the CPU and accelerator RNG states, so the next
    training step draws the same dropout masks as it would have without profiling.

    Args:
        model: The model to profile. Profile it unwrapped: a checkpointed module keeps
            less than it would otherwise.
        names: Qualified names (from ``model.named_modules()``) of the candidate modules.
        args: Positional example inputs of ``model``'s forward (a single tensor is allowed).
        kwargs: Keyword example inputs of ``model``'s forward.
        repeats: ``0`` leaves every time at zero (bytes only); any other count keeps the
            times of the step measured (its forwards and recomputations, the meter's own
            cost per operator taken off).
        progress: ``True`` or ``False`` to force a progress bar on standard error on or off;
            ``None`` draws one only on a terminal and for more than about twenty candidates.
        save_policy: A selective-checkpointing policy, as given to torch's
            ``create_selective_checkpoint_contexts``: the candidates then run as selective
            checkpoints of them would (``policy_saved_bytes``, ``policy_saved_kept_bytes``,
            ``recompute_time``).
        step: Keep the step's memory phase by phase
            (``planner.StepPeaks``) in the profile, for predicting the
            whole step's peak under any plan.
        loss_fn: ``loss_fn(output)`` is the loss the step backpropagates from; by default
            the output itself if it is a scalar, its ``loss`` if it has one, else every
            floating-point output with gradients of ones (see above for how long the
            output lives).
        preserve_rng_state: The engine option the step's checkpoints run with (on the CPU
            each keeps the generator's state).

    Returns:
        A :class:`ModelProfile` with one :class:`ModuleCost` per name, in model order.

    Raises:
        CheckpointConfigError: If a name is not in ``model.named_modules()``, ``names`` is a
            single string or holds something else than strings, or ``repeats`` is not a
            non-negative integer.

    Example:
        >>> profile = profile_modules(model, ["layers.0", "layers.1"], (tokens,))
        >>> profile["layers.0"].kept_bytes, profile.total_activation_bytes
    """
    if not isinstance(model, nn.Module):
        raise CheckpointConfigError(
            f"profile_modules needs an nn.Module, got {type(model).__name__}"
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise CheckpointConfigError(f"repeats must be an integer >= 0, got {repeats!r}")
    if save_policy is not None and not callable(save_policy):
        raise CheckpointConfigError(
            f"save_policy must be a callable policy(ctx, op, *args, **kwargs), got "
            f"{type(save_policy).__name__}"
        )
    targets = resolve_targets(model, names)
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    bar = ProgressBar(
        2 * len(targets), label="profiling", enabled=should_show(progress, len(targets))
    )
    try:
        profile = measure_inputs(
            model, targets, args, dict(kwargs or {}), run_region=run_unswitched_region, loss_fn=loss_fn, save_policy=save_policy,
            preserve_rng_state=preserve_rng_state, timed=repeats > 0, bar=bar, train=False,
        )
    finally:
        bar.close()
    return profile if step else dataclasses.replace(profile, step=None)


def measured(unmeasured: Plan, choice: Choice, costs_from: str = "measured") -> Plan:
    """``unmeasured`` with the choice made from costs (``costs_from``: where they came
    from), and its predictions."""
    return dataclasses.replace(
        unmeasured,
        selected=choice.entries,
        dropped=unmeasured.dropped + choice.dropped,
        budget=choice.budget,
        activation_bytes=choice.activation_bytes,
        predicted_peak=choice.predicted_peak,
        plain_peak=choice.plain_peak,
        costs_from=costs_from,
        priced_at=choice.profile.priced_at if choice.profile is not None else None,
        step_time=_step_time(choice),
        device_memory=choice.memory,
    )


def _step_time(choice: Choice) -> Optional[float]:
    """The priced step time with the choice: nothing checkpointed, plus its recomputation."""
    plain = choice.profile.step_time if choice.profile is not None else None
    if plain is None or any(entry.recompute_time is None for entry in choice.entries):
        return None
    return plain + sum(entry.recompute_time for entry in choice.entries)  # type: ignore[misc]


def _serves(
    profile: ModelProfile, names: Sequence[str], budget: Optional[Budget], save_policy: Any
) -> bool:
    """Whether a given profile can stand for measuring ``names`` here."""
    if save_policy is not None or profile.step is None:
        return False
    profiled = {cost.name for cost in profile.modules}
    return set(names) <= profiled and (budget is None or profiled == set(names))


def _levels_allowed(policy: Any, unmeasured: Plan) -> bool:
    """Whether a budget plan may checkpoint a module at a selective level: on the plain
    recompute tier (no ``recompute`` term asking for whole modules), on the non-re-entrant
    engine (which alone takes a ``context_fn``), and without a ``context_fn`` of the
    caller's, which a level's would replace."""
    tier = split_modifiers(as_policy(policy))[2]
    options = unmeasured.options
    return (
        tier is None
        and unmeasured.tier == "recompute"
        and not options.use_reentrant
        and options.context_fn is None
    )


def refuse_inference(
    budget: Optional[Budget], unmeasured: Plan, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> None:
    """Costs are measured on a training forward; under inference mode (or on its tensors)
    autograd saves nothing, and every module would look free to keep."""
    what = budget.describe() if budget is not None else f"measuring the plan of {unmeasured.policy!r}"
    if not torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        raise CheckpointConfigError(
            f"{what} plans a training step (forward and backward), but autograd is off here "
            f"(torch.no_grad()): no step it would run checkpoints anything, and a training peak "
            f"would answer another question. Call plan()/wrap_model() with example inputs "
            f"outside torch.no_grad(); for the peak of an inference forward, read it with "
            f"ckptwrap.measure.measure_peak around that forward."
        )
    if torch.is_inference_mode_enabled():
        raise CheckpointConfigError(
            f"{what} measures one training forward, but torch.inference_mode() is on, so "
            f"autograd would save nothing and every module would measure 0 bytes. Call "
            f"plan()/wrap_model() outside torch.inference_mode()."
        )
    leaves = [*args, *kwargs.values()]
    inference = [t for t in tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.is_inference()]
    if inference:
        raise CheckpointConfigError(
            f"{what} measures one training forward, but an example input (shape "
            f"{tuple(inference[0].shape)}) was created under torch.inference_mode() and cannot "
            f"take part in autograd. Make the example inputs outside inference mode (or pass "
            f"tensor.clone() of them, made outside it)."
        )


def resolve_policy(
    model: nn.Module, policy: Any, nested: bool, options: Dict[str, Any]
) -> Tuple[Plan, Policy, Optional[Budget]]:
    """What a policy asks for before anything is selected: a plan with nothing selected
    that carries its policy, engine options, tier and nesting; the selecting rest of the
    policy; and its budget term.

    Raises:
        CheckpointConfigError: The model, ``nested``, an option or the policy is not valid.
    """
    if not isinstance(model, nn.Module):
        raise CheckpointConfigError(f"expected an nn.Module to plan for, got {type(model).__name__}.")
    if not isinstance(nested, bool):
        raise CheckpointConfigError(f"nested must be True or False, got {nested!r}.")
    refuse_torchscript(model, "wrap_model", "the model")
    resolved = options_from(options, where="wrap_model")
    policy_object = as_policy(policy)
    rest, budget, tier = split_modifiers(policy_object)
    tier_name, ops, resolved = _apply_tier(tier, resolved)
    if overlaps(policy_object) or resolved.recompute_ahead:
        resolved = _ahead_options(budget, tier_name, resolved)
    intent = Plan(
        policy=str(policy_object), options=resolved, selected=(), nested=nested, tier=tier_name,
        selective_ops=ops,
    )
    return intent, rest, budget


def select(model: nn.Module, intent: Plan, rest: Policy, *, candidates: bool = False) -> Plan:
    """``intent`` (see :func:`resolve_policy`) with the modules ``rest`` selects in
    ``model``, less those already checkpointed or, unless nested, inside or around one
    (but for units a library checkpoints inside another selected unit, which are nested
    as it nests them, unless these are a budget's ``candidates``); each left out is in
    ``dropped``, with why.

    Raises:
        CheckpointConfigError: A term matches nothing, or a selected module is already
            checkpointed with other options.
    """
    resolved, nested = intent.options, intent.nested
    names = rest.select(model)
    modules = dict(model.named_modules())
    markings = {name: marking(module) for name, module in modules.items() if name}
    existing = [name for name, how_marked in markings.items() if how_marked is not None]
    # What the model's own code checkpoints is a checkpointed module to the plan.
    by_code = _checkpointed_by_code(modules)
    existing += [name for name in by_code if name not in existing]

    selected: List[PlanEntry] = []
    dropped: List[Tuple[str, str]] = [] if names else _picked_nothing(model, rest)
    left_to_code: List[str] = []  # selected, but the model's own code checkpoints it, in or around it
    # Units a library checkpoints inside others it checkpoints stay nested as it nests
    # them; a budget chooses among candidates that do not nest.
    library_nested = library_nests(model) if not nested and not candidates else {}
    for name in _callable_modules(names, modules, dropped):
        module = modules[name]
        if name in by_code:
            dropped.append((name, f"already checkpointed by {by_code[name]}"))
            left_to_code.append(name)
            continue
        how_marked = markings[name]
        if how_marked is not None:
            how, their_options = how_marked
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
            if ancestor is not None and library_nested.get(name) not in [e.name for e in selected]:
                dropped.append((name, f"inside checkpointed {ancestor} (pass nested=True to nest)"))
                if ancestor in by_code:
                    left_to_code.append(name)
                continue
            inner = next((other for other in existing if other.startswith(name + ".")), None)
            if inner is not None:
                dropped.append(
                    (name, f"contains checkpointed {inner} (pass nested=True to nest, or unwrap first)")
                )
                if inner in by_code:
                    left_to_code.append(name)
                continue
        selected.append(PlanEntry(name, type(module).__name__))
    _say_left_to_code(model, left_to_code, by_code)
    return dataclasses.replace(intent, selected=tuple(selected), dropped=tuple(dropped))


def _checkpointed_by_code(modules: Dict[str, nn.Module]) -> Dict[str, str]:
    """Per module the model's own code checkpoints (qualified name), what does it:
    ``a checkpoint call in Model.forward (the model)``.

    A forward that hands a module to ``torch.utils.checkpoint`` itself (``x =
    checkpoint(block, x)``), with no library flag around it, checkpoints that module whatever
    ckptwrap does: to the plan it is a checkpointed module, as one marked by ckptwrap is. A
    policy's selection leaves it, and whatever holds it or lies in it, to that code (a module
    checkpointed twice runs three times a step and saves nothing more), and says so once
    (:func:`_say_left_to_code`). The calls are read from the source (``policy.code_units``),
    never by running the model; one under ``if self.use_checkpoint:`` with that flag off does
    not count.
    """
    return {
        name: f"a checkpoint call in {type(modules[owner]).__name__}.forward ({owner or 'the model'})"
        for name, owner in code_units(list(modules.items())).items()
    }


def _say_left_to_code(model: nn.Module, left: List[str], by_code: Dict[str, str]) -> None:
    """One warning when the policy selected modules (``left``) that the model's own code
    checkpoints, or that hold them or lie in them: they are left to that code."""
    if not left:
        return
    calls = sorted(set(by_code.values()))
    warn(
        f"{type(model).__name__}: the model's own code checkpoints {len(by_code)} module(s) "
        f"({'; '.join(calls)}), so ckptwrap leaves {len(left)} module(s) the policy selected to "
        f"it ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}): checkpointed there and "
        f"again by ckptwrap, a module would run three times a step for no memory saved. To let "
        f"ckptwrap plan them, remove those checkpoint calls."
    )


def _picked_nothing(model: nn.Module, rest: Policy) -> List[Tuple[str, str]]:
    """Where the picking terms of ``rest`` (``every:``, ``first:``, ``last:``,
    ``fraction:``) pick none of its candidates: each candidate, with why, so that a
    selection that rounds to nothing says so in the plan."""
    if isinstance(rest, Intersection) and rest.pickers:
        sets, pickers = rest.sets, rest.pickers
    elif isinstance(rest, (Every, First, Last, Fraction)):
        sets, pickers = (), (rest,)
    else:
        return []
    candidates = Intersection(sets=sets).select(model) if sets else Blocks().select(model)
    count = len(candidates)
    rounded = [p for p in pickers if isinstance(p, Fraction) and round(p.p * count) == 0]
    if rounded:
        p = rounded[0].p
        why = (
            f"{rounded[0].describe()} of {count} candidate(s) rounds to none "
            f"(round({p!r} x {count}) = 0); raise the fraction, or use first:1 or last:1"
        )
    else:
        why = f"{rest.describe()} picks none of its {count} candidate(s): its picking terms pick different ones"
    return [(name, why) for name in candidates]


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


def _ahead_options(budget: Optional[Budget], tier_name: str, options: CheckpointOptions) -> CheckpointOptions:
    """The options for ``overlap`` (or ``recompute_ahead=True``), refused where nothing is
    recomputed or where a budget's plan would not count the region held ahead."""
    if tier_name == "offload":
        raise CheckpointConfigError(
            "overlap recomputes regions ahead of the backward, but offload recomputes nothing "
            "(it copies saved tensors to the host); drop one of the two."
        )
    if budget is not None:
        raise CheckpointConfigError(
            f"overlap cannot join {budget.describe()} yet: the budget's plan does not count "
            f"the region held ahead of the backward. Use a selecting policy (blocks;overlap) "
            f"or drop overlap."
        )
    if options.use_reentrant:
        raise CheckpointConfigError(
            "overlap needs use_reentrant=False: the re-entrant engine reruns each region "
            "inside its own backward node, with nothing to run ahead of."
        )
    return dataclasses.replace(options, recompute_ahead=True)


def _callable_modules(
    names: List[str], modules: Dict[str, nn.Module], dropped: List[Tuple[str, str]]
) -> List[str]:
    """``names`` with containers that are never called (ModuleList, ModuleDict) replaced
    by their items: checkpointing a forward that never runs would silently do nothing."""
    result: List[str] = []
    for name in names:
        module = modules[name]
        refuse_torchscript(module, "wrap_model", name)
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

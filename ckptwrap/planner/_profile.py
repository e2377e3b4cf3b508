"""What each candidate module costs, measured on one training step run on given inputs:
every outermost candidate checkpointed, the step's loss backpropagated with
``torch.autograd.grad`` (the model's ``.grad`` fields untouched; a model sharded by
FSDP2, or one with a re-entrant region, backpropagates into fresh ``.grad`` fields put
back after, FSDP2's counted storage by storage through its hooks), and a recorder
(``_recorder``) fed by the candidates as they run and are recomputed.

This is how costs are measured where the caller hands example inputs (``plan``,
``wrap_model(..., example_inputs=...)``, the doctor, the command line); a wrapped model
learns from its own training steps instead, through the same recorder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import gc
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from .. import _torch_private
from .._errors import CheckpointConfigError
from .._caches import given_caches
from .._hf import fresh_caches
from ..engine import checkpoint, graph_nodes, reaches_reentrant
from ..measure import SavePolicy, differentiable, tensors
from ._module_costs import ModelProfile
from ._progress import ProgressBar, should_show
from ._recorder import StepRecorder
from ._unreal import measure_unreal, step_device, unreal

__all__ = ["measure_inputs", "profile_modules", "resolve_targets"]


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

    One step runs, forward and backward, with every outermost candidate checkpointed:
    the least any plan holds between forward and backward, so measuring never needs more
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
            (:class:`~ckptwrap.planner.StepPeaks`) in the profile, for predicting the
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
            model, targets, args, dict(kwargs or {}), loss_fn=loss_fn, save_policy=save_policy,
            preserve_rng_state=preserve_rng_state, timed=repeats > 0, bar=bar, train=False,
        )
    finally:
        bar.close()
    return profile if step else dataclasses.replace(profile, step=None)


def measure_inputs(
    model: nn.Module,
    targets: Sequence[Tuple[str, nn.Module]],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    *,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    save_policy: Optional[SavePolicy] = None,
    preserve_rng_state: bool = True,
    timed: bool = True,
    bar: Optional[ProgressBar] = None,
    train: bool = True,
    rates: Any = None,
    fake: bool = False,
) -> ModelProfile:
    """One step on given inputs, measured (see :func:`profile_modules`); the model is left
    as it was. With ``train``, a model in eval mode is measured in train mode (dropout
    on), as it will train. A model on the meta device or made of fake tensors, or any
    with ``fake``, runs on fake tensors, its times priced at ``rates`` (``_unreal``).

    Raises:
        CheckpointConfigError: If the recording failed (it says why), or a step on fake
            tensors needs a tensor's values.
    """
    options = dict(
        loss_fn=loss_fn, save_policy=save_policy, preserve_rng_state=preserve_rng_state, bar=bar, train=train,
    )
    why = unreal(model, args, kwargs) or ("planned on fake tensors, as asked" if fake else None)
    if why is not None:
        return measure_unreal(
            lambda *step: _measure(*step, targets, timed=False, **options), model, args, kwargs, why, rates,
        )
    return _measure(model, args, kwargs, targets, timed=timed, **options)


def _measure(
    model: nn.Module,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    targets: Sequence[Tuple[str, nn.Module]],
    *,
    loss_fn: Optional[Callable[[Any], Any]],
    save_policy: Optional[SavePolicy],
    preserve_rng_state: bool,
    timed: bool,
    bar: Optional[ProgressBar],
    train: bool,
) -> ModelProfile:
    device = step_device(model, args, kwargs)
    recorder = StepRecorder(model, targets, device, save_policy=save_policy, timed=timed, bar=bar)
    state = _ModelState(model)
    grad_mode = torch.is_grad_enabled()
    context_fn = None
    if save_policy is not None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, save_policy)
    originals: List[Tuple[nn.Module, Any]] = []
    try:
        if train and not model.training:
            model.train()
        for _, module in recorder.outermost:
            originals.append((module, module.__dict__.get("forward")))
            module.forward = _Region(recorder, module, context_fn, preserve_rng_state)
        with _generators_kept(device), _collector_held():
            call_args, call_kwargs = fresh_caches(args, kwargs)
            torch.set_grad_enabled(True)
            recorder.begin(call_args, call_kwargs)
            output = None
            try:
                output = model(*call_args, **call_kwargs)
            finally:
                recorder.forward_done(output, follow=False)
            # Without a loss function the output stays alive through the backward, as in
            # the loop people write around a model that returns its loss (``out =
            # model(**batch); out.loss.backward()``): logits and caches count. With one,
            # as in ``loss_fn(model(x)).backward()``, only what the loss keeps does.
            with recorder.phases.inside():
                roots, grads = _loss(output if loss_fn is None else loss_fn(output))
            if loss_fn is not None:
                del output
            recorder.phases.follow(roots)
            wanted = [p for p in model.parameters() if p.requires_grad]
            # A model sharded by FSDP2 backpropagates into fresh .grad fields, FSDP2's to
            # reduce-scatter (``_backward_keeping_grads``), with the counter on the stack
            # for the whole backward, as under modes already (a step on fake tensors): what
            # FSDP2's hooks between nodes allocate and free counts (a layer's all-gather in
            # a tensor hook, before any node's pre-hook; its reduce-scatter after), and so
            # do the resizes that free gathered storages. Followed node by node, a real
            # step missed the all-gathers (7-33% under FSDPMemTracker on two gloo ranks,
            # ``benchmarks/fsdp2_ranks.py``; now within 0.7%), and took a gathered gradient
            # FSDP2 frees in its hook as held to the end.
            under = _torch_private.dispatch_modes_active()
            sharded = _torch_private.fsdp2_params(model)
            if roots and wanted and not sharded and reaches_reentrant(roots):
                _backward_keeping_grads(roots, grads, wanted)
            elif roots and wanted:
                # Returned, not accumulated: the caller's .grad fields stay as they were
                # (but for FSDP2's, above).
                with recorder.phases.inside() if under or sharded else contextlib.nullcontext():
                    if sharded:
                        _backward_keeping_grads(roots, grads, wanted, sharded)
                    else:
                        torch.autograd.grad(roots, wanted, grads, allow_unused=True)
            del roots, grads
            profile = recorder.finish()
    finally:
        recorder.abandon("the step raised")
        for module, forward in originals:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
        torch.set_grad_enabled(grad_mode)
        state.restore()
    if profile is None:
        raise CheckpointConfigError(
            f"measuring {type(model).__name__} on the given inputs failed: {recorder.failed}"
        )
    return profile


class _Region:
    """An outermost candidate's forward while a step on given inputs is measured: a
    checkpointed region, as a plan's regions run, that tells the recorder what it does."""

    copies_caches = True
    """It runs on copies of the caches it is given, as a checkpointed forward does
    (``wrap``'s ``CacheWritesOff`` leaves it to them)."""

    def __init__(self, recorder: StepRecorder, module: nn.Module, context_fn: Any, preserve_rng_state: bool) -> None:
        self.recorder, self.module = recorder, module
        self.previous = module.__dict__.get("forward")
        self.context_fn, self.preserve_rng_state = context_fn, preserve_rng_state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        call = self.previous or functools.partial(type(module).forward, module)
        caches = given_caches(args, kwargs, training=module.training)
        if caches is not None:
            args, kwargs = caches.arguments(args, kwargs)

        def run(fn: Callable[..., Any]) -> Any:
            return checkpoint(
                fn if caches is None else caches.around(fn, module), *args, context_fn=self.context_fn,
                preserve_rng_state=self.preserve_rng_state, **kwargs,
            )

        return self.recorder.region(module, call, args, kwargs, run)


def _loss(output: Any) -> Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]:
    """What the step backpropagates from, and the gradients it starts with."""
    loss = output if isinstance(output, torch.Tensor) else _loss_attribute(output)
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
        return [loss], [None]
    roots = [t for t in tensors(output) if t.requires_grad and differentiable(t)]
    return roots, [torch.ones_like(t) for t in roots]


def _loss_attribute(output: Any) -> Any:
    if isinstance(output, dict) or hasattr(output, "keys"):
        try:
            return output.get("loss")
        except (AttributeError, TypeError):
            return None
    return getattr(output, "loss", None)


def _backward_keeping_grads(
    roots: List[torch.Tensor],
    grads: List[Optional[torch.Tensor]],
    parameters: List[torch.Tensor],
    sharded: Sequence[Any] = (),
) -> None:
    """Backward from ``roots`` accumulated into fresh ``.grad`` fields, as a step from
    zeroed gradients does, then put back as the caller had them.

    Two steps are measured so. One through a re-entrant region (a checkpoint inside the
    model with ``use_reentrant=True``, which ``torch.autograd.grad`` cannot pass): a
    re-entrant region's own parameters are reached only by the backward it runs inside,
    so every parameter is kept besides the leaves in the graph. And one of a model
    sharded by FSDP2 (``sharded``: its ``FSDPParam``s, ``_torch_private.fsdp2_params``),
    whose backward is FSDP2's as much as autograd's: a layer's gradients are computed into
    the ``.grad`` of its gathered parameters (the graph's leaves, never the model's
    registered parameters but for the root's, gathered through the step), and the layer's
    post-backward hook copies them into a reduce-scatter input, reduce-scatters that into
    each sharded parameter's ``.grad`` and frees the gathered ones. Asked for the
    registered parameters' gradients alone, ``torch.autograd.grad`` computed none of a
    layer's, so none of that ran: the sharded gradients of the layers done and the
    reduce-scatter input FSDP2 keeps in flight were missing from the end of the backward
    (2.2% of a rank's peak at 2 ranks, Llama of width 512, 512 tokens). Here the backward is
    FSDP2's, as in training (the counter following every storage its hooks make and
    free, on fake tensors and real: see ``_measure``), and every gradient it leaves is
    put back: each sharded parameter's ``.grad`` (FSDP2 accumulates into one it finds,
    so it is cleared first, as ``zero_grad`` would), each gathered one's (kept without a
    sync) and any unreduced gradient FSDP2 accumulates of its own."""
    held = [
        tensor
        for fsdp_param in sharded
        for tensor in (fsdp_param.sharded_param, getattr(fsdp_param, "_unsharded_param", None))
        if isinstance(tensor, torch.Tensor)
    ]
    leaves = list({id(t): t for t in [*parameters, *held, *_leaves(roots)]}.values())
    kept = [(leaf, leaf.grad) for leaf in leaves]
    unreduced = [
        (fsdp_param, fsdp_param.unsharded_accumulated_grad)
        for fsdp_param in sharded
        if hasattr(fsdp_param, "unsharded_accumulated_grad")
    ]
    for leaf in leaves:
        leaf.grad = None
    for fsdp_param, _ in unreduced:
        fsdp_param.unsharded_accumulated_grad = None
    try:
        torch.autograd.backward(roots, grads)
    finally:
        for leaf, grad in kept:
            leaf.grad = grad
        for fsdp_param, grad in unreduced:
            fsdp_param.unsharded_accumulated_grad = grad


def _leaves(roots: List[torch.Tensor]) -> List[torch.Tensor]:
    """The leaf tensors whose ``.grad`` a backward from ``roots`` accumulates into."""
    found = (getattr(node, "variable", None) for node in graph_nodes(roots))
    return list({id(t): t for t in found if isinstance(t, torch.Tensor)}.values())


def resolve_targets(model: nn.Module, names: Sequence[str]) -> List[Tuple[str, nn.Module]]:
    """Check ``names`` against the model and return them, without repeats, in model order."""
    if isinstance(names, str):
        raise CheckpointConfigError(
            f"names must be a sequence of qualified module names, got the string {names!r}; "
            f"pass [{names!r}] to profile one module"
        )
    names = list(names)
    odd = [name for name in names if not isinstance(name, str)]
    if odd:
        raise CheckpointConfigError(
            f"names must be qualified module names (strings), got {odd[0]!r} among them"
        )
    modules = dict(model.named_modules())
    wanted = list(dict.fromkeys(names))
    unknown = [name for name in wanted if name not in modules]
    if unknown:
        raise CheckpointConfigError(_unknown_names_message(model, unknown, list(modules)))
    order = {name: index for index, name in enumerate(modules)}
    return [(name, modules[name]) for name in sorted(wanted, key=order.__getitem__)]


def _unknown_names_message(model: nn.Module, unknown: List[str], valid: List[str]) -> str:
    shown = ", ".join(repr(name) for name in unknown[:5])
    if len(unknown) > 5:
        shown += f" and {len(unknown) - 5} more"
    close: List[str] = []
    for name in unknown[:3]:
        close += difflib.get_close_matches(name, valid, n=3)
    if close:
        hint = "did you mean " + ", ".join(repr(name) for name in dict.fromkeys(close)) + "?"
    else:
        hint = "valid names include " + ", ".join(repr(name) for name in valid[1:6] or valid)
    return (
        f"profile_modules got module names not in {type(model).__name__}.named_modules(): "
        f"{shown}; {hint} ({len(valid)} modules in all, '' is the model itself)"
    )


class _ModelState:
    """Training flags and buffers of every submodule, to undo what profiling forwards change
    (BatchNorm running statistics, for one)."""

    def __init__(self, model: nn.Module) -> None:
        modules = list(model.modules())
        self._training = [(module, module.training) for module in modules]
        with torch.no_grad():
            self._buffers = [
                (module, name, buffer, buffer.clone())
                for module in modules
                for name, buffer in module._buffers.items()
                if buffer is not None
            ]

    def restore(self) -> None:
        for module, training in self._training:
            module.training = training
        with torch.no_grad():
            for module, name, buffer, saved in self._buffers:
                module._buffers[name] = buffer
                buffer.copy_(saved)


@contextlib.contextmanager
def _collector_held() -> Any:
    """Python's cyclic collector held off for the block, then as it was. The recorder's
    bookkeeping (objects per operator that live to the step's end) set off full
    collections of the whole process: 0.30 s inside one plan on a GPU whose step takes
    0.04; on the CPU the worst of ten plans of a small GPT-2 took 325 ms against 161 held,
    and no full collection came at all, as the bookkeeping is freed by reference counting
    when the step ends. (Only here, where the block is ours: a lazy budget's measured
    step spans the caller's forward and backward, and one never finished would hold the
    collector off for good.)"""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _generators_kept(device: torch.device) -> Any:
    """A block after which the CPU generator, and ``device``'s if it is an accelerator's,
    are as they were before it: a measured step draws nothing from the caller's stream."""
    module = None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)
    if module is None or not hasattr(module, "get_rng_state"):
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else module.current_device()
    return torch.random.fork_rng(devices=[index], device_type=device.type)

"""What each candidate module costs: the bytes its forward keeps for backward, the bytes of
its inputs and outputs, its forward time and FLOPs, and the model's total activation memory.

Modules are measured one at a time, on detached copies of the inputs the model's own forward
hands them, so profiling never holds the whole model's un-checkpointed activations.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ._module_costs import ModelProfile, ModuleCost
from ._profile_run import Record, SavePolicy, Session
from ._progress import ProgressBar, should_show
from ._step import StepPeaks, measure_step
from ..measure import tensors

__all__ = ["measure_training_step", "profile_modules"]


def profile_modules(
    model: nn.Module,
    names: Sequence[str],
    args: Any = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    *,
    repeats: int = 3,
    progress: Optional[bool] = None,
    save_policy: Optional[SavePolicy] = None,
    step: bool = False,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    preserve_rng_state: bool = True,
) -> ModelProfile:
    """Measure what each named module costs in one forward of ``model``.

    The model runs as it is, in its current train or eval mode: profile a training model in
    train mode. Each candidate is measured when the model's own forward reaches it: its
    inputs are detached and copied, and the module's ``forward`` alone runs on them with
    autograd on, under a saved-tensors hook that collects the storages it saves, and under
    ``FlopCounterMode``; its outputs are dropped at once, and the real call then runs with
    autograd off. The rest of the forward runs with autograd on, so that what is saved
    outside the candidates is counted too. Memory thus never exceeds the activations outside
    the candidates plus those of one candidate. A second forward, with autograd off, times
    each candidate's forward ``repeats`` times with autograd on.

    Bytes are counted per storage, never per tensor: a saved view keeps its whole storage,
    and storages shared by several saved tensors (``q``, ``k``, ``v`` split from one
    projection) count once. A candidate nested in another is measured on its own as well;
    inside the outer one it runs with autograd off, so whether its inputs would need grad
    is guessed (they do if anything in the model does). A module that calls itself is
    measured at its outermost call only; one called several times gets the sum of its calls.
    A layer that writes a KV cache (a Hugging Face decoder layer) is measured as a
    checkpointed call of it runs, without the cache: the measurement is a second run of its
    forward, which must not write the cache again.

    Afterwards the model is as it was: training flags, buffers (BatchNorm running statistics)
    and the CPU and accelerator RNG states are restored, so the next training step draws the
    same dropout masks as it would have without profiling.

    Args:
        model: The model to profile. Profile it unwrapped: a checkpointed module keeps
            less than it would otherwise.
        names: Qualified names (from ``model.named_modules()``) of the candidate modules.
        args: Positional example inputs of ``model``'s forward (a single tensor is allowed).
        kwargs: Keyword example inputs of ``model``'s forward.
        repeats: How many timed runs each candidate call gets (the median is kept); ``0``
            skips timing and leaves every ``forward_time`` at zero.
        progress: ``True`` or ``False`` to force a progress bar on standard error on or off;
            ``None`` draws one only on a terminal and for more than about twenty candidates.
        save_policy: A selective-checkpointing policy, as given to torch's
            ``create_selective_checkpoint_contexts``: each module's forward is then also
            measured as a selective checkpoint of it would run (``policy_saved_bytes``,
            ``policy_saved_kept_bytes``, ``recompute_time``).
        step: Also run one training step (forward and backward) with every outermost
            candidate checkpointed and measure its memory phase by phase
            (:class:`~ckptwrap.measure._step.StepPeaks`), for predicting the whole step's
            peak. Its memory is that of the plan that recomputes every candidate. The
            model's ``.grad`` fields are left as they were.
        loss_fn: With ``step``, ``loss_fn(output)`` is the loss the step backpropagates
            from; by default the output itself if it is a scalar, its ``loss`` if it has
            one, else every floating-point output with gradients of ones.
        preserve_rng_state: With ``step``, the engine option the step's checkpoints run
            with (on the CPU each keeps the generator's state).

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
    targets = _resolve_targets(model, names)
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    kwargs = dict(kwargs or {})
    passes = 2 if repeats else 1
    bar = ProgressBar(
        len(targets) * passes,
        label="profiling memory",
        enabled=should_show(progress, len(targets)),
    )
    if save_policy is not None and not callable(save_policy):
        raise CheckpointConfigError(
            f"save_policy must be a callable policy(ctx, op, *args, **kwargs), got "
            f"{type(save_policy).__name__}"
        )
    session = Session(
        model, targets, args, kwargs, repeats=repeats, bar=bar, save_policy=save_policy
    )
    state = _ModelState(model)
    grad_mode = torch.is_grad_enabled()
    steps = None
    try:
        session.run()
        if step:
            session.start_rng.restore()
            state.restore()
            steps = measure_step(
                model, _outermost(targets), args, kwargs, _device(model, args, kwargs),
                loss_fn, save_policy, preserve_rng_state,
            )
    finally:
        torch.set_grad_enabled(grad_mode)
        session.start_rng.restore()
        state.restore()
        bar.close()
    # Calls nested in another candidate's call are inside that one's kept bytes already.
    kept = sum(record.outer_kept for record in session.records)
    return ModelProfile(
        modules=tuple(_cost(record, save_policy is not None) for record in session.records),
        total_activation_bytes=session.base_bytes + kept,
        base_bytes=session.base_bytes,
        step=steps,
    )


def measure_training_step(
    model: nn.Module,
    names: Sequence[str],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    *,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    save_policy: Optional[SavePolicy] = None,
    preserve_rng_state: bool = True,
) -> StepPeaks:
    """One training step of ``model`` with every outermost one of ``names`` checkpointed,
    measured phase by phase (what ``profile_modules(..., step=True)`` adds to a profile),
    without profiling the modules: how the planner checks its fitted costs on the shape
    it plans for. The model is left as it was (``.grad`` fields, buffers, flags, RNG)."""
    targets = _resolve_targets(model, names)
    state = _ModelState(model)
    grad_mode = torch.is_grad_enabled()
    try:
        return measure_step(
            model, _outermost(targets), tuple(args), dict(kwargs), _device(model, args, kwargs),
            loss_fn, save_policy, preserve_rng_state,
        )
    finally:
        torch.set_grad_enabled(grad_mode)
        state.restore()


def _outermost(targets: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """The targets not inside another target: each is checkpointed once in the step."""
    names = [name for name, _ in targets]
    return [
        (name, module)
        for name, module in targets
        if not any(name.startswith(other + ".") for other in names if other)
        and name != ""
    ]


def _device(model: nn.Module, args: Any, kwargs: Any) -> torch.device:
    """The device the step allocates on: that of the first accelerator tensor, else the CPU."""
    for tensor in [*tensors((args, kwargs)), *model.parameters(), *model.buffers()]:
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device
    return torch.device("cpu")


def _resolve_targets(model: nn.Module, names: Sequence[str]) -> List[Tuple[str, nn.Module]]:
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


def _cost(record: Record, replayed: bool) -> ModuleCost:
    """The frozen cost of a finished record (they share their fields' names)."""
    values = {
        field.name: getattr(record, field.name)
        for field in dataclasses.fields(ModuleCost)
        if hasattr(record, field.name)
    }
    values.update(
        kind=type(record.module).__name__,
        called=record.calls > 0,
        recompute_time=record.recompute_time if replayed else None,
        ops=tuple(record.ops or ()),
    )
    return ModuleCost(**values)


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

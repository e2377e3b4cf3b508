"""The engine's public entry points: ``checkpoint`` and ``checkpoint_sequential``."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint

from .. import _torch_private
from .._errors import CheckpointConfigError
from . import _state
from ._nonreentrant import run_checkpointed
from ._reentrant import run_reentrant

__all__ = ["check_options", "checkpoint", "checkpoint_sequential"]

_DETERMINISM_CHECKS = ("default", "none")

ContextFn = Callable[[], Tuple[ContextManager, ContextManager]]


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    context_fn: Optional[ContextFn] = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: Optional[bool] = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Gradients equal those of calling ``fn`` directly, bit for bit when RNG state is
    preserved. With autograd off (``torch.no_grad()``, inference mode) this just calls
    ``fn``. Under ``torch.compile`` the region is handed to ``torch.utils.checkpoint``,
    the only checkpoint the compiler understands; eager runs use this engine.

    Args:
        fn: The function or module to run.
        *args: Positional arguments for ``fn``; tensors may be nested in containers.
        use_reentrant: False (default) for the saved-tensor-hook engine, which supports
            ``torch.autograd.grad``, keyword arguments, nesting and early stop. True for
            the autograd-Function engine, which reruns the whole region in backward.
        preserve_rng_state: Replay the CPU and accelerator RNG state of the forward
            during recomputation, so dropout draws the same masks.
        context_fn: Returns two context managers, entered around the forward and around
            the recomputation, e.g. ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
            Non-re-entrant only.
        determinism_check: ``"default"`` compares shape, dtype and device of each
            recomputed tensor with the forward's; ``"none"`` skips the check.
        debug: Put the operators run in the forward and in the recomputation into any
            :class:`CheckpointError`. Non-re-entrant only. Inside torch's
            ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True or False)`` its
            setting wins over this one, as it does for torch's own checkpoint (the
            re-entrant engine, which has no operator log, ignores it, as torch's does).
        early_stop: End each recomputation once every tensor backward still needs has
            been recomputed. None uses :func:`set_checkpoint_early_stop`'s setting (True
            by default). Ignored by the re-entrant engine, which always reruns everything.
        **kwargs: Keyword arguments for ``fn``. Non-re-entrant only.

    Returns:
        Whatever ``fn`` returns.

    Raises:
        CheckpointConfigError: ``fn`` is not callable, an option has a value that is not
            allowed, or the re-entrant engine was given keyword arguments, ``context_fn``
            or ``debug``.
        CheckpointError: A recomputation did not match its forward, or a re-entrant region
            was reached by ``torch.autograd.grad``.

    Example:
        >>> y = checkpoint(block, x)            # block's activations are not kept
        >>> y.sum().backward()                  # block runs again here
    """
    if not callable(fn):
        raise CheckpointConfigError(
            f"checkpoint's first argument must be callable (the function or module to run), "
            f"got {_describe(fn)}. Pass the function first and its inputs after it: "
            f"checkpoint(fn, *args)."
        )
    check_options(use_reentrant, preserve_rng_state, context_fn, determinism_check, debug, early_stop, kwargs)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        options: dict = {"use_reentrant": use_reentrant, "preserve_rng_state": preserve_rng_state}
        if not use_reentrant:
            options.update(determinism_check=determinism_check, debug=debug)
            if context_fn is not None:
                options["context_fn"] = context_fn
            if early_stop is not None:
                options["early_stop"] = early_stop
        return torch.utils.checkpoint.checkpoint(fn, *args, **options, **kwargs)
    if use_reentrant:
        return run_reentrant(fn, args, preserve_rng_state=preserve_rng_state)
    switched = _torch_private.checkpoint_debug_switch()
    if switched is not None:  # torch.utils.checkpoint.set_checkpoint_debug_enabled
        debug = switched
    return run_checkpointed(
        fn,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        check=determinism_check == "default",
        debug=debug,
        early_stop=_state.early_stop_setting(early_stop),
    )


def check_options(
    use_reentrant: Any,
    preserve_rng_state: Any,
    context_fn: Any,
    determinism_check: Any,
    debug: Any,
    early_stop: Any,
    keywords: Sequence[str] = (),
) -> None:
    """Refuse an option of a value not allowed, and what the re-entrant engine cannot take
    (``keywords``: the names of keyword arguments for the checkpointed function), in the
    order ``torch.utils.checkpoint`` refuses them."""
    for name, value in (
        ("use_reentrant", use_reentrant),
        ("preserve_rng_state", preserve_rng_state),
        ("debug", debug),
    ):
        if not isinstance(value, bool):
            raise CheckpointConfigError(
                f"{name} must be True or False, got {value!r} ({type(value).__name__})."
            )
    if early_stop is not None and not isinstance(early_stop, bool):
        raise CheckpointConfigError(
            f"early_stop must be True, False or None, got {early_stop!r} "
            f"({type(early_stop).__name__})."
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise CheckpointConfigError(
            f"determinism_check must be one of {', '.join(map(repr, _DETERMINISM_CHECKS))}, "
            f"got {determinism_check!r}."
        )
    if context_fn is not None and not callable(context_fn):
        raise CheckpointConfigError(
            f"context_fn must be a callable returning two context managers, or None; got "
            f"{context_fn!r}."
        )
    if use_reentrant and keywords:
        names = ", ".join(repr(name) for name in keywords)
        raise CheckpointConfigError(
            f"use_reentrant=True cannot pass keyword arguments to the checkpointed function "
            f"(got {names}). Pass them positionally, bind them with functools.partial, or "
            f"use use_reentrant=False."
        )
    if use_reentrant and (context_fn is not None or debug):
        raise CheckpointConfigError(
            "context_fn and debug=True need use_reentrant=False; the re-entrant engine "
            "runs the forward without a graph and has nothing to hand them."
        )


def checkpoint_sequential(
    functions: Union[torch.nn.Sequential, Sequence[Callable[..., Any]]],
    segments: int,
    *inputs: Any,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
) -> Any:
    """Run a sequence of modules in ``segments`` chunks, checkpointing all but the last.

    Each stage receives the previous stage's output; a stage that returns a tuple has it
    passed on unpacked, so stages may take and return several tensors. The chunks are
    ``len(functions) // segments`` stages long, the last one taking the remainder, as in
    ``torch.utils.checkpoint.checkpoint_sequential``.

    Args:
        functions: An ``nn.Sequential`` or a list of modules or functions.
        segments: Number of chunks, from 1 to ``len(functions)``.
        *inputs: Inputs of the first stage.
        use_reentrant: Which engine checkpoints the chunks (see :func:`checkpoint`).
        preserve_rng_state: Replay RNG state during recomputation.

    Returns:
        The output of the last stage.

    Raises:
        CheckpointConfigError: ``segments`` is out of range, or ``functions`` is empty, not
            a sequence or holds something that is not callable.

    Example:
        >>> model = nn.Sequential(*layers)
        >>> out = checkpoint_sequential(model, 4, x)
    """
    stages = _stages_of(functions)
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise CheckpointConfigError(
            f"segments must be an int from 1 to {len(stages)}, got {segments!r} "
            f"({type(segments).__name__})."
        )
    if not 1 <= segments <= len(stages):
        raise CheckpointConfigError(
            f"segments={segments} is out of range for {len(stages)} functions; "
            f"pass a number from 1 to {len(stages)}."
        )
    size = len(stages) // segments
    values: Tuple[Any, ...] = inputs
    last = size * (segments - 1)
    for start in range(0, last, size):
        values = _as_args(
            checkpoint(
                _Chunk(stages[start : start + size]), *values,
                use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state,
            )
        )
    return _Chunk(stages[last:])(*values)


def _stages_of(functions: Any) -> list:
    if isinstance(functions, torch.nn.Sequential):
        stages = list(functions.children())
    elif isinstance(functions, (list, tuple, torch.nn.ModuleList)):
        stages = list(functions)
    else:
        raise CheckpointConfigError(
            f"functions must be an nn.Sequential, nn.ModuleList, list or tuple of callables, "
            f"got {type(functions).__name__}."
        )
    if not stages:
        raise CheckpointConfigError("functions is empty; checkpoint_sequential needs at least one stage.")
    not_callable = [
        f"{i}: {_describe(stage)}" for i, stage in enumerate(stages) if not callable(stage)
    ]
    if not_callable:
        raise CheckpointConfigError(
            f"every stage of checkpoint_sequential must be callable (a module or function); "
            f"the items at these positions are not: {'; '.join(not_callable)}. Remove them or "
            f"replace them with modules."
        )
    return stages


def _describe(value: Any) -> str:
    """The type and a short repr of ``value``, for error messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def _as_args(value: Any) -> Tuple[Any, ...]:
    return value if type(value) is tuple else (value,)


class _Chunk:
    """Consecutive stages run as one function; a tuple result feeds the next stage unpacked."""

    __slots__ = ("stages",)

    def __init__(self, stages: list) -> None:
        self.stages = stages

    def __call__(self, *values: Any) -> Any:
        result: Any = None
        for stage in self.stages:
            result = stage(*values)
            values = _as_args(result)
        return result

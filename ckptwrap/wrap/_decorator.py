"""``@checkpointed``: mark a forward method or any function as a checkpointed region."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, TypeVar, overload

from torch import nn

from .._errors import CheckpointConfigError
from ..engine import CheckpointOptions, options_from
from ._region import run_region

__all__ = ["checkpointed", "decorator_options"]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def checkpointed(wrapped: F) -> F: ...
@overload
def checkpointed(wrapped: None = None, *, enabled: bool = True, **options: Any) -> Callable[[F], F]: ...


def checkpointed(wrapped: Optional[F] = None, *, enabled: bool = True, **options: Any) -> Any:
    """Checkpoint every call of a function, or of a module's ``forward`` on every instance.

    Works bare (``@checkpointed``) or with engine options
    (``@checkpointed(use_reentrant=True, preserve_rng_state=False)``). The decorated
    function keeps its name, docstring and signature. Nothing is checkpointed while
    autograd is off or inside :func:`ckptwrap.disabled`. On a module's ``forward`` (a
    function whose first parameter is ``self``, called on a module), running statistics
    of BatchNorm-like submodules are updated once per step, not again by the
    recomputation. The decorated function is a plain Python function, so ``torch.compile``
    traces into it and checkpoints the region in its graph, closures and all.

    Args:
        wrapped: The function; given when used without parentheses.
        enabled: False returns the function untouched, at no cost.
        **options: Engine options of :func:`ckptwrap.checkpoint` (``use_reentrant``,
            ``preserve_rng_state``, ``early_stop``, ``determinism_check``, ``context_fn``,
            ``debug``).

    Returns:
        The decorated function, or a decorator when called with options only.

    Raises:
        CheckpointConfigError: An unknown option or a value that is not allowed.

    Example:
        >>> class Block(nn.Module):
        ...     @checkpointed
        ...     def forward(self, x):
        ...         return self.mlp(self.attn(x))
    """
    if not isinstance(enabled, bool):
        raise CheckpointConfigError(f"enabled must be True or False, got {enabled!r}.")
    resolved = options_from(options, where="@checkpointed")
    if wrapped is None:
        return functools.partial(_decorate, enabled=enabled, options=resolved)
    return _decorate(wrapped, enabled=enabled, options=resolved)


def _decorate(wrapped: F, *, enabled: bool, options: CheckpointOptions) -> F:
    if not callable(wrapped):
        raise CheckpointConfigError(
            f"@checkpointed decorates a function or method, got {type(wrapped).__name__}."
        )
    if not enabled:
        return wrapped
    method = _takes_self(wrapped)

    # A plain function, as functools.wraps makes, rather than a proxy object: the compiler
    # traces into it and finds the region (a proxy that passes for the function it wraps
    # is inlined as that function, unchecked, and its closure cells cannot be guarded).
    @functools.wraps(wrapped)
    def region(*args: Any, **kwargs: Any) -> Any:
        if method and args and isinstance(args[0], nn.Module):
            owner = args[0]
            return run_region(owner, functools.partial(wrapped, owner), args[1:], kwargs, options)
        return run_region(None, wrapped, args, kwargs, options)

    region._ckptwrap_options = options  # type: ignore[attr-defined]
    return region  # type: ignore[return-value]


def _takes_self(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is written as a method (its first parameter is ``self``): called
    on a module, that module owns the region (its running statistics, its KV cache)."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return False
    return parameters[:1] == ["self"]


def decorator_options(cls: type) -> Optional[CheckpointOptions]:
    """The options of a ``@checkpointed`` forward defined on ``cls`` or its bases, if any."""
    forward = inspect.getattr_static(cls, "forward", None)
    try:
        return getattr(forward, "_ckptwrap_options", None)
    except Exception:  # a proxy or descriptor that refuses attribute access
        return None

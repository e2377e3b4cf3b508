"""``@checkpointed``: mark a forward method or any function as a checkpointed region."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, TypeVar, overload

import wrapt

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
    autograd is off or inside :func:`ckptwrap.disabled`. On a module's ``forward``,
    running statistics of BatchNorm-like submodules are updated once per step, not again
    by the recomputation.

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
        from .._errors import CheckpointConfigError

        raise CheckpointConfigError(f"enabled must be True or False, got {enabled!r}.")
    resolved = options_from(options, where="@checkpointed")
    if wrapped is None:
        return functools.partial(_decorate, enabled=enabled, options=resolved)
    return _decorate(wrapped, enabled=enabled, options=resolved)


def _decorate(wrapped: F, *, enabled: bool, options: CheckpointOptions) -> F:
    if not callable(wrapped):
        from .._errors import CheckpointConfigError

        raise CheckpointConfigError(
            f"@checkpointed decorates a function or method, got {type(wrapped).__name__}."
        )
    if not enabled:
        return wrapped

    @wrapt.decorator
    def region(call: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return run_region(instance, call, args, kwargs, options)

    decorated = region(wrapped)
    decorated._self_ckptwrap_options = options
    return decorated


def decorator_options(cls: type) -> Optional[CheckpointOptions]:
    """The options of a ``@checkpointed`` forward defined on ``cls`` or its bases, if any."""
    forward = inspect.getattr_static(cls, "forward", None)
    try:
        return getattr(forward, "_self_ckptwrap_options", None)
    except Exception:  # a proxy or descriptor that refuses attribute access
        return None

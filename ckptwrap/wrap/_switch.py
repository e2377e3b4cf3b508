"""The off switch for every decorated and wrapped region, for evaluation and debugging."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

__all__ = ["disabled", "is_disabled"]

_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptwrap_disabled", default=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run every ``@checkpointed`` function and wrapped module without checkpointing.

    Context-local like the engine's own settings; direct calls of ``checkpoint`` are not
    affected.

    Example:
        >>> with ckptwrap.disabled():
        ...     loss = model(batch).loss   # keeps activations, no recomputation
    """
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def is_disabled() -> bool:
    """Whether marked regions currently run without checkpointing."""
    return _DISABLED.get()

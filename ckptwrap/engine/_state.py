"""Context-local engine state: the early-stop setting, whether a recomputation is running,
who watches what the next region's forward saves, and which regions are recomputed ahead.

All live in ``contextvars`` so that threads and asyncio tasks never see each other's
values, and both are changed only through context managers that restore them in ``finally``.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, Optional

import torch

from .._errors import CheckpointConfigError

__all__ = [
    "early_stop_setting",
    "is_recomputing",
    "observe_saved",
    "recompute_ahead",
    "recomputing",
    "saved_observer",
    "set_checkpoint_early_stop",
]

SavedObserver = Callable[[torch.Tensor], None]


class Watch(NamedTuple):
    """Who is told what the next region keeps (see :func:`observe_saved`)."""

    saved: SavedObserver
    """Told of each tensor the region's forward saves for backward."""
    kept: Optional[SavedObserver]
    """Told of each tensor the engine itself keeps for the recomputation (the CPU
    generator's state it replays)."""

_EARLY_STOP: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptwrap_early_stop", default=True)
_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ckptwrap_recomputing", default=False
)
_AHEAD: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptwrap_ahead", default=False)
_IN_REGION: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ckptwrap_in_region", default=False
)
_LAST_AHEAD: contextvars.ContextVar[Optional[Callable[[], Any]]] = contextvars.ContextVar(
    "ckptwrap_last_ahead", default=None
)
_OBSERVER: contextvars.ContextVar[Optional[Watch]] = contextvars.ContextVar(
    "ckptwrap_saved_observer", default=None
)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """``var`` set to ``value`` inside the block, put back in ``finally``."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """Choose whether non-re-entrant checkpoints stop recomputing early.

    Applies to checkpoints whose *forward* runs inside the block; their backward may run
    anywhere. The setting is context-local: other threads and asyncio tasks keep theirs.
    An explicit ``early_stop=`` passed to :func:`checkpoint` takes precedence.

    Args:
        enable: True to stop each recomputation as soon as every tensor backward needs
            has been recomputed (the default), False to always run the region to the end.

    Raises:
        CheckpointConfigError: ``enable`` is not a bool.

    Example:
        >>> with set_checkpoint_early_stop(False):
        ...     y = checkpoint(block, x)
        >>> y.sum().backward()
    """
    if not isinstance(enable, bool):
        raise CheckpointConfigError(
            f"set_checkpoint_early_stop expects True or False, got {enable!r} "
            f"({type(enable).__name__})."
        )
    with _setting(_EARLY_STOP, enable):
        yield


def early_stop_setting(explicit: Optional[bool]) -> bool:
    """The early-stop choice for a checkpoint whose forward starts now."""
    return explicit if explicit is not None else _EARLY_STOP.get()


def is_recomputing() -> bool:
    """True while a checkpointed region is being recomputed for the backward pass.

    User code can test it to skip side effects (logging, counters, running statistics)
    that must happen once per forward.

    Returns:
        Whether the calling code runs inside a recomputation.
    """
    return _RECOMPUTING.get()


def recomputing() -> ContextManager[None]:
    """Mark the enclosed code as a recomputation for :func:`is_recomputing`."""
    return _setting(_RECOMPUTING, True)


def observe_saved(observer: Optional[SavedObserver], kept: Optional[SavedObserver] = None) -> ContextManager[None]:
    """Report to ``observer`` every tensor that the forward of the next non-re-entrant
    region entered inside the block saves for backward: the tensors its placeholders stand
    for, before they are dropped; and to ``kept`` each tensor the engine keeps for that
    region's recomputation (the CPU generator's state). Regions entered inside that
    region's forward report nothing (they keep what they save themselves). A meter of what
    a region would keep if it were not checkpointed watches through this; the region runs
    exactly as without it.
    """
    return _setting(_OBSERVER, None if observer is None else Watch(observer, kept))


def saved_observer() -> Optional[Watch]:
    """The observer the next region entered now reports to (see :func:`observe_saved`);
    while a region's inputs are being saved on its entry, that region's observer."""
    return _OBSERVER.get()


def recompute_ahead(enable: bool = True) -> ContextManager[None]:
    """Regions whose forward runs inside the block (at top level) are recomputed ahead:
    while backward differentiates one of them, the one entered before it is recomputed in
    a worker thread, on a side stream (see ``_ahead``)."""
    return _setting(_AHEAD, enable)


def link_ahead(frame: Any) -> Optional[Callable[[], Any]]:
    """For a region whose forward starts now: a weak reference to the region to recompute
    ahead when backward starts on this one (the one entered before it), or None; records
    this region as the last one entered."""
    if not _AHEAD.get() or _IN_REGION.get() or _RECOMPUTING.get():
        return None
    previous = _LAST_AHEAD.get()
    _LAST_AHEAD.set(weakref.ref(frame))
    return previous


def in_region() -> ContextManager[None]:
    """Mark a region's forward as running, so regions entered inside it are not linked."""
    return _setting(_IN_REGION, True)

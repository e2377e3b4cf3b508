"""The one exception family of ckptwrap.

Every error the library raises on purpose derives from :class:`CheckpointError`,
so ``except ckptwrap.CheckpointError`` catches all of them. It subclasses torch's
own ``CheckpointError`` so code written against ``torch.utils.checkpoint`` keeps working.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch.utils.checkpoint as _torch_checkpoint
from torch import nn

__all__ = ["CheckpointError", "CheckpointConfigError", "input_changed_error", "is_version_error"]


class CheckpointError(_torch_checkpoint.CheckpointError):
    """Raised when checkpointing cannot proceed or a recomputation does not match its forward."""

    module: Optional[Any] = None
    """The module whose checkpointed region failed, where the error knows it (else None)."""
    fix: Optional[str] = None
    """What to change, where the error knows it (the message says it too), else None."""


class CheckpointConfigError(CheckpointError, ValueError):
    """Raised for an argument or option that is not allowed; the message names what was passed."""

    needed: Optional[int] = None
    """For a budget no plan reaches: the least budget, in bytes, that one would (for a
    budget in a device's terms, the device's memory), else None."""

    offered: Optional[int] = None
    """For a budget no plan reaches: the budget given, in bytes, in the terms of
    :attr:`needed` (a device's memory for a budget in its terms), else None."""


def input_changed_error(region: Any, changed: Optional[str], cause: Optional[BaseException] = None) -> CheckpointError:
    """The error for a checkpointed region whose input was changed in place, which its
    recomputation cannot start from: by the region's own forward (``changed`` describes
    the input it changed) or, with ``changed`` None, by code after it ran. ``region`` is
    what the engine ran (the module or function); ``cause``, autograd's own error where
    it raised one, is quoted without its hint (the caller chains it too).
    """
    module = _region_module(region)
    where = _region_label(region, module)
    if changed is not None:
        what = f"its forward changed its input {changed} in place"
        fix = (
            "clone the input before changing it in the forward (x = x.clone(), or x = x + y "
            "rather than x += y), or don't modify the region's inputs in place."
        )
    else:
        what = "one of its inputs was changed in place after it ran, before the backward"
        fix = (
            "clone the input before changing it after the region (x = x.clone()), or don't "
            "modify the region's inputs in place."
        )
    said = str(cause).split(" Hint:")[0].strip() if cause is not None else ""
    error = CheckpointError(
        f"{where} is checkpointed, and {what}: the recomputation in backward starts again "
        f"from the region's inputs, which no longer hold what its forward saw"
        f"{f' (autograd: {said})' if said else ''}. Fix: {fix}"
    )
    error.module = module
    error.fix = fix
    return error


def is_version_error(error: BaseException) -> bool:
    """Whether ``error`` is autograd's own for a saved tensor that was changed in place
    after it was saved (not one of ours, which derive from it)."""
    return (
        isinstance(error, RuntimeError)
        and not isinstance(error, CheckpointError)
        and "modified by an inplace operation" in str(error)
    )


def _region_module(region: Any) -> Optional[Any]:
    """The module a checkpointed callable runs, where one is found: the callable itself, a
    bound method's object, a ``functools.partial``'s function or first argument, or what a
    callable object holds (a wrapper of any of these), a few levels deep."""
    pending, seen = [region], 0
    while pending and seen < 8:
        current, seen = pending.pop(0), seen + 1
        if isinstance(current, nn.Module):
            return current
        if isinstance(current, tuple):
            pending.extend(current)
            continue
        bound = getattr(current, "__self__", None)
        if isinstance(bound, nn.Module):
            return bound
        if isinstance(current, functools.partial):
            pending.extend([*current.args[:1], current.func])
            continue
        if callable(current) and not isinstance(current, type):
            held = getattr(current, "__dict__", None) or {
                name: getattr(current, name, None) for name in getattr(type(current), "__slots__", ())
            }
            pending.extend(value for value in held.values() if callable(value) or isinstance(value, tuple))
    return None


def _region_label(region: Any, module: Optional[Any]) -> str:
    """How an error names a region: its module's class and, for a module ``wrap_model``
    marked, its name in the model; else the function's name."""
    if module is None:
        name = getattr(region, "__qualname__", None) or type(region).__name__
        return f"The checkpointed function {name}"
    label = type(module).__name__
    qualified = getattr(module.__dict__.get("forward"), "qualified_name", "")
    return f"{label} {qualified!r}" if qualified else label

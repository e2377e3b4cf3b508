"""How ckptwrap speaks: warnings for what the user must act on, pointing at the user's
line rather than at torch's or ours; routine notes to the ``ckptwrap`` logger.

Most of ckptwrap's warnings are raised from inside a module's call (a forward pre-hook, a
checkpointed forward), where a fixed ``stacklevel`` would name a line of torch's
``Module.__call__``, which differs between torch versions and under the compiler.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, Type

import torch

__all__ = ["debugging", "note", "note_step", "warn"]

_log = logging.getLogger("ckptwrap")

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def warn(message: str, category: Type[Warning] = UserWarning, *, repeat: bool = False) -> None:
    """``warnings.warn`` attributed to the innermost frame outside ckptwrap and torch.

    With ``repeat``, said each time it is called (the user's filters still apply): the
    caller decides how often, where the default filter would show a message only the
    first time it comes from a line (a shape met again after others, say).
    """
    level = 2  # 1 would be this function; 2 its caller
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith((_OURS, _TORCH)):
        frame = frame.f_back
        level += 1
    if not repeat or frame is None:
        warnings.warn(message, category, stacklevel=level if frame is not None else 2)
        return
    module = frame.f_globals.get("__name__", "<string>")
    # No registry: nothing remembers that this line said it before.
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno, module=module)


def note(message: str, **step: Any) -> None:
    """A routine note (a plan made or switched): the ``ckptwrap`` logger, at INFO; a note
    of one training step carries ``step`` as the record's ``ckptwrap_step``."""
    _log.info(message, extra={"ckptwrap_step": step} if step else None)


def debugging() -> bool:
    """Whether the ``ckptwrap`` logger takes DEBUG records: build a step's note only then."""
    return _log.isEnabledFor(logging.DEBUG)


def note_step(message: str, **step: Any) -> None:
    """A note of one training step too routine for INFO (what a lazy budget ran it under,
    a check that held): the ``ckptwrap`` logger at DEBUG, with ``step`` as the record's
    ``ckptwrap_step``."""
    _log.debug(message, extra={"ckptwrap_step": step})

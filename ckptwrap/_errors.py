"""The one exception family of ckptwrap.

Every error the library raises on purpose derives from :class:`CheckpointError`,
so ``except ckptwrap.CheckpointError`` catches all of them. It subclasses torch's
own ``CheckpointError`` so code written against ``torch.utils.checkpoint`` keeps working.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.utils.checkpoint as _torch_checkpoint

__all__ = ["CheckpointError", "CheckpointConfigError"]


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

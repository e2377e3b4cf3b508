"""The one exception family of ckptwrap.

Every error the library raises on purpose derives from :class:`CheckpointError`,
so ``except ckptwrap.CheckpointError`` catches all of them. It subclasses torch's
own ``CheckpointError`` so code written against ``torch.utils.checkpoint`` keeps working.
"""

from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint

__all__ = ["CheckpointError", "CheckpointConfigError"]


class CheckpointError(_torch_checkpoint.CheckpointError):
    """Raised when checkpointing cannot proceed or a recomputation does not match its forward."""


class CheckpointConfigError(CheckpointError, ValueError):
    """Raised for an argument or option that is not allowed; the message names what was passed."""

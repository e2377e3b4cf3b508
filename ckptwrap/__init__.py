"""ckptwrap: activation checkpointing for PyTorch that is easy, correct and fast."""

from ._errors import CheckpointError
from .engine import checkpoint, checkpoint_sequential, is_recomputing, set_checkpoint_early_stop

__all__ = [
    "CheckpointError",
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "set_checkpoint_early_stop",
]

__version__ = "0.1.0"

"""ckptwrap: activation checkpointing for PyTorch that is easy, correct and fast.

Mark a module with ``@checkpointed``, wrap a model with ``wrap_model(model, "blocks")``,
or call ``checkpoint(fn, *args)`` directly; all of them run on ckptwrap's own engine.
"""

from ._errors import CheckpointConfigError, CheckpointError
from .engine import checkpoint, checkpoint_sequential, is_recomputing, set_checkpoint_early_stop
from .diagnostics import doctor
from .wrap import CheckpointWrapper, checkpointed, disabled, plan, unwrap_model, wrap_model
from . import config  # noqa: F401  (a submodule, so that ckptwrap.config.* works after import ckptwrap)

__all__ = [
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointWrapper",
    "checkpoint",
    "checkpoint_sequential",
    "checkpointed",
    "disabled",
    "doctor",
    "is_recomputing",
    "plan",
    "set_checkpoint_early_stop",
    "unwrap_model",
    "wrap_model",
]

__version__ = "0.1.0"

"""How a region is recomputed: the re-entrant and non-re-entrant engines, device state,
early stop, nesting and ``checkpoint_sequential``. Knows nothing of policies or wrappers."""

from ._api import checkpoint, checkpoint_sequential
from ._state import is_recomputing, set_checkpoint_early_stop

__all__ = ["checkpoint", "checkpoint_sequential", "is_recomputing", "set_checkpoint_early_stop"]

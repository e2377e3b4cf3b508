"""How a region is recomputed: the re-entrant and non-re-entrant engines, device state,
early stop, nesting and ``checkpoint_sequential``. Knows nothing of policies or wrappers."""

from ._api import checkpoint, checkpoint_sequential
from ._options import CheckpointOptions, options_from
from ._reentrant import graph_nodes, reaches_reentrant
from ._state import (
    is_recomputing,
    observe_saved,
    recompute_ahead,
    saved_observer,
    set_checkpoint_early_stop,
)
from ._tree import flatten, tensor_leaves, unflatten

__all__ = [
    "CheckpointOptions",
    "checkpoint",
    "checkpoint_sequential",
    "flatten",
    "graph_nodes",
    "is_recomputing",
    "observe_saved",
    "options_from",
    "reaches_reentrant",
    "recompute_ahead",
    "saved_observer",
    "set_checkpoint_early_stop",
    "tensor_leaves",
    "unflatten",
]

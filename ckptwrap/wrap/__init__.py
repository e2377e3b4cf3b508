"""Marking: the ``@checkpointed`` decorator, ``CheckpointWrapper``, and ``wrap_model`` /
``unwrap_model`` / ``plan``, which mark the modules a policy selects. Uses the engine."""

from ._decorator import checkpointed
from ._model import unwrap_model, wrap_model
from ._planning import plan
from ..engine import CheckpointOptions
from ..planner import Plan, PlanEntry
from ._switch import disabled
from ._wrapper import CheckpointWrapper

__all__ = [
    "CheckpointOptions",
    "CheckpointWrapper",
    "Plan",
    "PlanEntry",
    "checkpointed",
    "disabled",
    "plan",
    "unwrap_model",
    "wrap_model",
]

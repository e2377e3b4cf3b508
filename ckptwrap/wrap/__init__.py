"""Marking: the ``@checkpointed`` decorator, ``CheckpointWrapper``, and ``wrap_model`` /
``unwrap_model`` / ``plan``, which mark the modules a policy selects. Uses the engine."""

from ._decorator import checkpointed
from ._forwards import markings_of
from ._model import PLAN_ATTRIBUTE, remove_pending, unwrap_model, wrap_model
from ._planning import plan, plan_and_profile, profile_modules
from ._region import disabled
from ._wrapper import CheckpointWrapper

__all__ = [
    "PLAN_ATTRIBUTE",
    "CheckpointWrapper",
    "checkpointed",
    "disabled",
    "markings_of",
    "plan",
    "plan_and_profile",
    "profile_modules",
    "remove_pending",
    "unwrap_model",
    "wrap_model",
]

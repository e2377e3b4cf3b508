"""Engine options as one frozen value, shared by the decorator, the wrapper and wrap_model."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ContextManager, Dict, Optional, Tuple

from .._errors import CheckpointConfigError
from ._api import check_options

__all__ = ["CheckpointOptions", "options_from"]

@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How each marked region is checkpointed; every field is passed to ``checkpoint``."""

    use_reentrant: bool = False
    """Use the autograd-Function engine instead of saved-tensor hooks."""
    preserve_rng_state: bool = True
    """Replay RNG state in the recomputation so dropout masks match."""
    early_stop: Optional[bool] = None
    """End recomputation once every needed tensor exists; None follows the context setting."""
    determinism_check: str = "default"
    """``"default"`` checks recomputed shapes, dtypes and devices; ``"none"`` does not."""
    context_fn: Optional[Callable[[], Tuple[ContextManager, ContextManager]]] = None
    """Contexts for forward and recomputation, e.g. selective checkpointing."""
    debug: bool = False
    """Add operator logs of forward and recomputation to errors."""
    recompute_ahead: bool = False
    """Recompute the region entered before this one in a worker thread (on a side stream
    of the device) while backward runs through this one, so that the recomputation's
    launches overlap the backward's; holds one region's activations more."""

    def __post_init__(self) -> None:
        check_options(
            self.use_reentrant,
            self.preserve_rng_state,
            self.context_fn,
            self.determinism_check,
            self.debug,
            self.early_stop,
        )
        if not isinstance(self.recompute_ahead, bool):
            raise CheckpointConfigError(
                f"recompute_ahead must be True or False, got {self.recompute_ahead!r} "
                f"({type(self.recompute_ahead).__name__})."
            )
        if self.use_reentrant and self.recompute_ahead:
            raise CheckpointConfigError(
                "recompute_ahead=True needs use_reentrant=False: the re-entrant engine reruns "
                "each region inside its own backward node, with nothing to run ahead of."
            )

    def as_kwargs(self) -> Dict[str, Any]:
        """Every option, as keyword arguments (for ``wrap_model`` and ``checkpointed``)."""
        return {name: getattr(self, name) for name in _FIELDS}

    def checkpoint_kwargs(self) -> Dict[str, Any]:
        """The options ``checkpoint`` takes; ``recompute_ahead`` is a context around it
        (:func:`ckptwrap.engine.recompute_ahead`)."""
        return {name: getattr(self, name) for name in _CHECKPOINT_ARGUMENTS}


_FIELDS = tuple(field.name for field in dataclasses.fields(CheckpointOptions))
_CHECKPOINT_ARGUMENTS = _FIELDS[:-1]  # all but recompute_ahead


def options_from(given: Dict[str, Any], *, where: str) -> CheckpointOptions:
    """Build options from keyword arguments, naming unknown ones and the allowed set."""
    unknown = sorted(set(given) - set(_FIELDS))
    if unknown:
        raise CheckpointConfigError(
            f"{where} got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(_FIELDS)}."
        )
    return CheckpointOptions(**given)

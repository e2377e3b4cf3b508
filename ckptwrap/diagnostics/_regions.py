"""Finding the checkpointed regions of a model: modules marked by ``wrap_model``,
``CheckpointWrapper`` modules and modules whose class has a ``@checkpointed`` forward,
with every marking that applies to each (a module can be marked more than once)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from torch import nn

from ..engine import CheckpointOptions
from ..wrap import CheckpointWrapper, markings_of

__all__ = ["Region", "find_regions", "region_running"]

Marking = Tuple[str, CheckpointOptions]


@dataclasses.dataclass(frozen=True)
class Region:
    """One checkpointed module of the model."""

    name: str
    """Qualified name in the model."""
    module: nn.Module
    """The module (the ``CheckpointWrapper`` itself, for a wrapper)."""
    markings: Tuple[Marking, ...]
    """What checkpoints it, outermost first: (``"wrap_model"``, ``"CheckpointWrapper"`` or
    ``"@checkpointed"``, its options)."""
    parent: Optional[str] = None
    """The nearest enclosing region, if this one is nested inside another."""

    @property
    def reentrant(self) -> bool:
        """Whether any of its markings uses the re-entrant engine."""
        return any(options.use_reentrant for _, options in self.markings)

    @property
    def drops_rng_state(self) -> bool:
        """Whether any of its markings recomputes without replaying the RNG state."""
        return any(not options.preserve_rng_state for _, options in self.markings)

    @property
    def runs(self) -> nn.Module:
        """The module whose forward runs checkpointed (the wrapped one, for a wrapper)."""
        if isinstance(self.module, CheckpointWrapper):
            return self.module.wrapped_module
        return self.module

    @property
    def kind(self) -> str:
        """Class name of the module it runs."""
        return type(self.runs).__name__


def find_regions(model: nn.Module) -> List[Region]:
    """The checkpointed regions of ``model`` in model order, each with its enclosing region."""
    regions: List[Region] = []
    for name, module in model.named_modules():
        markings = markings_of(module)
        if not markings:
            continue
        parent = next(
            (
                outer.name
                for outer in reversed(regions)
                if outer.name == "" or name.startswith(outer.name + ".")
            ),
            None,
        )
        regions.append(Region(name, module, tuple(markings), parent))
    return regions


def region_running(regions: List[Region], module: object) -> Optional[Region]:
    """The region whose checkpointed forward is ``module``'s, if there is one."""
    return next((region for region in regions if region.runs is module), None)

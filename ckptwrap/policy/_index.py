"""A snapshot of one model's modules, built afresh for every selection.

Policies read the model only through it, so a selection depends on the model alone and
never on earlier calls; it also gathers the facts that error messages show.
"""

from __future__ import annotations

import functools
from typing import AbstractSet, Dict, List, Tuple

from torch import nn

from .._errors import CheckpointConfigError
from ._blocks import detect_blocks

__all__ = ["ModelIndex", "NoMatch"]

_SAMPLE_NAMES = 8


class NoMatch(CheckpointConfigError):
    """A policy term selects nothing from a model; raised while selecting."""


class ModelIndex:
    """The non-root modules of a model, in the order of ``named_modules()``.

    Attributes:
        model: The model itself (the root, never selected).
        names: Qualified names of every other module, in model order.
        modules: The module of each name in ``names``.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise CheckpointConfigError(
                f"a policy selects from an nn.Module; got {type(model).__name__}"
            )
        self._named = list(model.named_modules())
        self.model = model
        self.names: Tuple[str, ...] = tuple(name for name, _ in self._named[1:])
        self.modules: Dict[str, nn.Module] = dict(self._named[1:])
        self._position = {name: i for i, name in enumerate(self.names)}

    @functools.cached_property
    def blocks(self) -> Tuple[str, ...]:
        """The repeated blocks (see :func:`find_blocks`); empty if nothing repeats."""
        return detect_blocks(self._named)

    def ordered(self, names: AbstractSet[str]) -> Tuple[str, ...]:
        """``names`` in model order."""
        return tuple(sorted(names, key=self._position.__getitem__))

    def default_candidates(self, term: str) -> Tuple[str, ...]:
        """The blocks, which a picker term picks from when no set term is given.

        Raises:
            NoMatch: If the model has no repeated blocks.
        """
        if not self.blocks:
            raise NoMatch(
                f"{term} picks among the repeated blocks when no set term is given, "
                f"but {self.no_blocks_reason()}; add a set term such as 'type:NAME' "
                f"or 'name:GLOB' to pick from"
            )
        return self.blocks

    def no_blocks_reason(self) -> str:
        """Why ``blocks`` is empty, for error messages."""
        if not self.names:
            return f"{type(self.model).__name__} has no submodules"
        return (
            f"{type(self.model).__name__} has no repeated blocks (no nn.ModuleList or "
            f"nn.Sequential holds two modules of one class); {self.classes_phrase()}"
        )

    def classes_phrase(self) -> str:
        """What classes the model holds, for error messages."""
        if not self.names:
            return f"{type(self.model).__name__} has no submodules"
        return f"the classes in {type(self.model).__name__} are {', '.join(self.class_names())}"

    def class_names(self) -> List[str]:
        """Sorted class names of the non-root modules."""
        return sorted({type(m).__name__ for m in self.modules.values()})

    def sample_names(self) -> str:
        """A few qualified names, shallowest first, to show what names look like."""
        by_depth = sorted(self.names, key=lambda n: (n.count("."), self._position[n]))
        shown = ", ".join(by_depth[:_SAMPLE_NAMES]) or "(none)"
        more = len(self.names) - _SAMPLE_NAMES
        return f"{shown}, ... ({len(self.names)} in all)" if more > 0 else shown

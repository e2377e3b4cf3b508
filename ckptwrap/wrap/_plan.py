"""``Plan``: what ``wrap_model`` does or would do, printable as a table."""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Sequence, Tuple

from ._options import CheckpointOptions

__all__ = ["Plan", "PlanEntry"]


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One module the plan checkpoints."""

    name: str
    """Qualified name in the model."""
    kind: str
    """Class name of the module."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The modules a policy selects in one model, and those it left out, with reasons.

    Iterating a plan yields the selected qualified names in model order; ``print(plan)``
    shows a table.
    """

    policy: str
    """The policy, in its string form."""
    options: CheckpointOptions
    """Engine options for every selected module."""
    selected: Tuple[PlanEntry, ...]
    """Modules to checkpoint, in model order."""
    dropped: Tuple[Tuple[str, str], ...] = ()
    """(qualified name, reason) for modules the policy matched but the plan leaves out."""
    nested: bool = False
    """Whether selected modules inside other selected modules are kept (nested checkpoints)."""

    @property
    def names(self) -> List[str]:
        """Selected qualified names, in model order."""
        return [entry.name for entry in self.selected]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.selected)

    def __str__(self) -> str:
        lines = [f"ckptwrap plan for policy {self.policy!r}: {len(self.selected)} module(s)"]
        changed = {
            name: value
            for name, value in self.options.as_kwargs().items()
            if value != getattr(CheckpointOptions, name)
        }
        if changed:
            lines.append("options: " + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
        lines += _table(("module", "class"), [(e.name, e.kind) for e in self.selected])
        if self.dropped:
            lines.append("left out:")
            lines += _table(("module", "reason"), list(self.dropped))
        return "\n".join(lines)


def _table(header: Tuple[str, str], rows: Sequence[Tuple[str, str]]) -> List[str]:
    if not rows:
        return ["  (none)"]
    width = max(len(header[0]), *(len(row[0]) for row in rows))
    lines = [f"  {header[0]:<{width}}  {header[1]}", f"  {'-' * width}  {'-' * len(header[1])}"]
    lines += [f"  {first:<{width}}  {second}" for first, second in rows]
    return lines

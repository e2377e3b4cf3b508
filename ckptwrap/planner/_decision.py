"""What one training forward runs under, as the planner decided it."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from ._choose import Choice
from ._measuring import LayoutCosts

__all__ = ["Decision"]

Sizes = Tuple[int, ...]


@dataclasses.dataclass
class Decision:
    """What one training forward runs under."""

    costs: Optional[LayoutCosts]
    sizes: Sizes
    measure: bool
    """Run under the plan of least memory and measure the step."""
    choice: Optional[Choice] = None
    """The plan solved for, when not measuring; None with ``measure`` or where the layout
    is no longer measured (then the plan of least memory runs unmeasured)."""
    source: str = ""
    """Where the costs came from: ``measured``, ``fitted``, ``bounded`` or ``scaled``
    (``LayoutCosts.source_at``)."""
    check: bool = False
    """Whether to meter the step and compare it with ``choice.predicted_peak``."""
    metered: bool = False
    """Whether that check costs time (a counting dispatch mode; an accelerator's
    statistics cost nothing)."""
    learn: bool = False
    """With ``measure``: measured to learn, where a bound would have done."""
    reset: bool = False
    """Whether that meter resets an accelerator's peak statistics (an earlier reading
    without a reset could not tell)."""
    region: int = 0
    """Bytes the engine keeps per checkpointed call besides its inputs (``region_bytes``)."""
    margin: float = 0.0
    """The share of the un-checkpointed peak the plan kept free beyond its prediction."""
    seconds: float = 0.0
    """With ``measure``: how long the step took, forward to end of backward, once it has."""

    def describe(self) -> str:
        if self.costs is None:
            return "these inputs"
        return self.costs.layout.describe(self.sizes)

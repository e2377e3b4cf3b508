"""The budget in bytes a planner solves for at each shape: an amount, the same at every
shape; a share of the largest un-checkpointed peak planned for so far (or predicted at
the declared largest shapes); or a device's memory less what the model holds there.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from .._errors import CheckpointConfigError
from ._choose import plain_peak
from ._device_memory import DeviceTerms
from ._measuring import LayoutCosts
from ._module_costs import ModelProfile
from ._solver import resolve_budget

__all__ = ["BudgetReading"]


class BudgetReading:
    """One planner's budget term read in bytes (see the module). Plain data."""

    def __init__(self, settings: Any, max_shapes: Optional[Dict[Any, Sequence[int]]]) -> None:
        self.budget = settings.budget
        self.names = settings.names
        self.max_shapes = max_shapes
        self.reference = 0
        """The largest un-checkpointed peak planned for so far."""
        self.device = DeviceTerms(settings)
        """A budget in a device's terms, and what the device holds besides the step."""
        self._declared: Optional[Tuple[ModelProfile, int]] = None  # the last, with its plain peak

    @property
    def percent(self) -> bool:
        """Whether the budget is a share of the un-checkpointed peak."""
        return self.budget is not None and self.budget.parsed()[0] is not None

    def at(self, plain: int, costs: LayoutCosts, *, reference: bool = True) -> Optional[int]:
        """The budget in bytes at a shape whose plain peak is ``plain`` (which counts for
        the largest so far, with ``reference``); with ``max_shapes`` and trusted costs,
        also the plain peak predicted there."""
        if self.budget is None:
            return None
        if reference:
            self.reference = max(self.reference, plain)
        if self.max_shapes and costs.fit is not None and costs.trusted:
            try:
                declared = costs.layout.declared(self.max_shapes)
            except CheckpointConfigError:
                declared = None
            if declared is not None:
                self.reference = max(self.reference, self._plain_at(costs.profile_at(declared)))
        if self.device.in_terms:
            return self.device.step_budget()
        return resolve_budget(self.budget, self.reference)

    def now(self, costs: LayoutCosts) -> Optional[int]:
        """The budget in bytes as it stands, at a shape no larger than one planned."""
        budget = self.at(0, costs, reference=False)
        return None if budget is None else int(budget)

    def _plain_at(self, profile: ModelProfile) -> int:
        # Read at every plan and every nothing-needed lookup: the same profile while the
        # fit stands, so its plain peak is worked out once.
        if self._declared is None or self._declared[0] is not profile:
            self._declared = (profile, plain_peak(profile, self.names))
        return self._declared[1]

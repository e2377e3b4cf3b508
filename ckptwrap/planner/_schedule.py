"""Which solved training steps are metered against their prediction, the closed loop's
checks: each check costs a metered step (on the CPU, every operator goes through a
counting dispatch mode; on an accelerator, reading the allocator's statistics is free).

A check is due after a step is measured and after a check that missed, then after 1, 2,
4, then every 8 solved steps while they hit. On the CPU checks are spaced further, so
that the time they add beyond unmetered steps stays within ``SHARE`` of the training
time of the steps between them.

Also here: when a step may be measured to learn, where a bound from the shapes measured
already would do (``may_learn``). Measured steps cost several unmetered ones; those the
planner cannot do without (a layout's first shape, a shape no bound fits the budget at, a
shape whose plan missed) are always taken, and those it takes to learn more (to find a
fit it can trust, for plans closer to the budget) add at most ``LEARN_SHARE`` of the
training time, counted as checks are.
"""

from __future__ import annotations

from typing import List, Tuple

__all__ = ["CheckSchedule"]

SHARE = 0.03
"""The most of the training time the CPU's checks may add."""
LEARN_SHARE = 0.05
"""The most of the training time measuring to learn may add, beyond the measured steps
that cannot be done without."""
_LONGEST = 8
"""After checks that hit, the next is at most this many steps later."""
_WEIGHT = 0.3
"""How much one step's time moves the running means."""


class CheckSchedule:
    """When to check (see the module)."""

    def __init__(self) -> None:
        self._steps = 0
        self._next = 0
        self._interval = 1
        self._urgent = True
        self._credit = 0.0  # seconds of checking the time trained so far allows
        self._step_seconds = 0.0  # running mean of unmetered steps
        self._cost = 0.0  # running mean of what a check adds to a step
        self._learn_credit = 0.0  # seconds of measuring to learn the time so far allows
        self._learn_cost = 0.0  # running mean of what a measured step adds to a step
        self._unsettled: List[Tuple[float, bool]] = []  # measured before any step was timed

    def step(self) -> None:
        """A training step begins."""
        self._steps += 1

    def due(self, *, cheap: bool) -> bool:
        """Whether the solved step beginning now is checked; ``cheap``: metering costs nothing."""
        if cheap:
            return True
        if self._steps < self._next:
            return False
        return self._urgent or self._credit >= self._cost

    def soon(self) -> None:
        """Check the next solved step (costs were learned, or a check missed)."""
        self._next, self._interval, self._urgent = self._steps + 1, 1, True

    def hit(self) -> None:
        """A check found the step within its prediction."""
        self._interval = min(_LONGEST, 2 * self._interval)
        self._next = self._steps + self._interval
        self._urgent = False

    def inconclusive(self) -> None:
        """A check could not tell (an accelerator's peak not reset): the next one decides."""
        self._next = self._steps + 1

    def timed(self, seconds: float, *, checked: bool) -> None:
        """A solved step took ``seconds``, metered (``checked``) or not."""
        if checked:
            cost = max(0.0, seconds - self._step_seconds)
            self._cost = cost if not self._cost else (1 - _WEIGHT) * self._cost + _WEIGHT * cost
            self._credit -= cost
            return
        self._step_seconds = seconds if not self._step_seconds else (1 - _WEIGHT) * self._step_seconds + _WEIGHT * seconds
        self._credit += SHARE * seconds
        self._learn_credit += LEARN_SHARE * seconds
        unsettled, self._unsettled = self._unsettled, []
        for measured, learning in unsettled:
            self.measured(measured, learning=learning)

    def may_learn(self) -> bool:
        """Whether a step whose costs a bound gives may be measured instead."""
        return self._step_seconds > 0 and self._learn_credit >= self._learn_cost

    def measured(self, seconds: float, *, learning: bool = False) -> None:
        """A measured step took ``seconds``: what it added beyond an unmetered step is
        what the next would add; one measured to learn (``learning``) draws it from what
        learning may spend."""
        if not self._step_seconds:
            self._unsettled.append((seconds, learning))  # told once a step is timed
            return
        cost = max(0.0, seconds - self._step_seconds)
        self._learn_cost = cost if not self._learn_cost else (1 - _WEIGHT) * self._learn_cost + _WEIGHT * cost
        if learning:
            self._learn_credit -= cost

"""Which solved training steps are metered against their prediction, the closed loop's
checks: each check costs a metered step (on the CPU, every operator goes through a
counting dispatch mode; on an accelerator, reading the allocator's statistics is free).

A check is due after a step is measured and after a check that missed, then after 1, 2,
4, then every 8 solved steps while they hit. On the CPU checks are spaced further, so
that the time they add beyond unmetered steps stays within ``SHARE`` of the training
time of the steps between them.
"""

from __future__ import annotations

__all__ = ["CheckSchedule"]

SHARE = 0.03
"""The most of the training time the CPU's checks may add."""
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

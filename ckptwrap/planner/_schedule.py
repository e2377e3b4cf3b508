"""Which solved training steps are metered against their prediction, the closed loop's
checks: each check costs a metered step (on the CPU, every operator goes through a
counting dispatch mode; on an accelerator, reading the allocator's statistics is free).

A check is due after a step is measured (one the planner could not do without: a step
measured to learn was a test of the costs already) and after a check that missed, then
after 1, 2, 4, then every 8 solved steps while they hit. On the CPU checks are spaced
further, so that the time they add beyond unmetered steps stays within ``SHARE`` of the
training time of the steps between them; there the check due after a measurement or a
miss waits for a step no larger than the steps so far on average (or for the credit to
pay for a larger one), rather than metering whichever comes next.

Also here: when a step may be measured to learn, where a bound from the shapes measured
already would do (``may_learn``). Measured steps cost several unmetered ones; those the
planner cannot do without (a layout's first shape, a shape no bound fits the budget at, a
shape whose plan missed) are always taken, and those it takes to learn more (to find a
fit it can trust, for plans closer to the budget) add at most ``LEARN_SHARE`` of the
training time, counted as checks are.

What a metered step adds grows with the step: each step comes with its *size* (the
product of its shape variables, batch and lengths: a measure of its work known before it
runs, whatever its costs came from). Unmetered steps give a line through the shortest
step timed and their running means of seconds and size (a small model's steps take about
the same at any size: the operators' launch, not their work), and a metered step what it
adds as a share of the time an unmetered step of its size takes. A check or measurement
is due where that share of the coming step's own time is within what the training so
far allows: a check learned on a short batch is not taken as the price of a long one.
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
        self._seconds_mean = 0.0  # running mean of the unmetered steps' seconds
        self._size = 0.0  # running mean of their sizes
        self._shortest = (0.0, 0)  # the shortest of them (seconds, size): what any step takes
        self._cost = 0.0  # running mean of what a check adds, per second of its step
        self._learn_credit = 0.0  # seconds of measuring to learn the time so far allows
        self._learn_cost = 0.0  # running mean of what a measured step adds, per second of its step
        # Metered before any step was timed unmetered: (seconds, size, kind), told once one is.
        self._unsettled: List[Tuple[float, int, str]] = []

    def step(self) -> None:
        """A training step begins."""
        self._steps += 1

    def due(self, *, cheap: bool, size: int) -> bool:
        """Whether the solved step beginning now, of ``size``, is checked; ``cheap``:
        metering costs nothing."""
        if cheap:
            return True
        if self._steps < self._next:
            return False
        if self._urgent and (not self._size or size <= self._size * (1 + 1e-9)):
            return True  # no larger than the steps so far, on average (or the first)
        # Before any check was timed, a measured step's share stands for a check's (a
        # check meters less: it costs at most as much).
        cost = self._cost or self._learn_cost
        return self._credit >= cost * self._seconds(size)

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

    def timed(self, seconds: float, *, checked: bool, size: int) -> None:
        """A solved step of ``size`` took ``seconds``, metered (``checked``) or not."""
        if checked:
            self._metered(seconds, size, "check")
            return
        if not self._shortest[0] or seconds < self._shortest[0]:
            self._shortest = (seconds, size)
        self._seconds_mean = seconds if not self._seconds_mean else (1 - _WEIGHT) * self._seconds_mean + _WEIGHT * seconds
        self._size = size if not self._size else (1 - _WEIGHT) * self._size + _WEIGHT * size
        self._credit += SHARE * seconds
        self._learn_credit += LEARN_SHARE * seconds
        unsettled, self._unsettled = self._unsettled, []
        for each in unsettled:
            self._metered(*each)

    def may_learn(self, size: int) -> bool:
        """Whether a step of ``size`` whose costs a bound gives may be measured instead."""
        return self._shortest[0] > 0 and self._learn_credit > 0 and self._learn_credit >= self._learn_cost * self._seconds(size)

    def measured(self, seconds: float, *, size: int, learning: bool = False) -> None:
        """A measured step of ``size`` took ``seconds``: what it added beyond an unmetered
        step is what the next would add, in proportion; one measured to learn
        (``learning``) draws it from what learning may spend."""
        self._metered(seconds, size, "learn" if learning else "measure")

    def _seconds(self, size: int) -> float:
        """What an unmetered step of ``size`` is expected to take: the shortest step timed
        (what any step takes: the operators' launch, most of a small model's step) and a
        part in proportion to its size (their work)."""
        shortest, at = self._shortest
        rate = max(0.0, self._seconds_mean - shortest) / max(self._size - at, 1.0)
        return shortest + rate * max(0, size - at)

    def _metered(self, seconds: float, size: int, kind: str) -> None:
        expected = self._seconds(size)
        if not expected:
            self._unsettled.append((seconds, size, kind))
            return
        added = max(0.0, seconds - expected)
        share = added / expected
        if kind == "check":
            self._cost = share if not self._cost else (1 - _WEIGHT) * self._cost + _WEIGHT * share
            self._credit -= added
            return
        self._learn_cost = share if not self._learn_cost else (1 - _WEIGHT) * self._learn_cost + _WEIGHT * share
        if kind == "learn":
            self._learn_credit -= added

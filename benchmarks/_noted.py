"""What a lazy budget says of each training step, read from the ``ckptwrap`` logger as a
handler of a user's would read it (docs/budget.md, "What the planner says of each step"):
the benchmarks and the tests observe the planner through it, not through its state."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional


class NotedSteps(logging.Handler):
    """Collects the ``ckptwrap_step`` fields of every note while entered (the ``ckptwrap``
    logger set to DEBUG meanwhile, then as it was), each with the ``thread`` it came from."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.all: List[Dict[str, Any]] = []
        self._logger = logging.getLogger("ckptwrap")
        self._level = self._logger.level

    def __enter__(self) -> "NotedSteps":
        self._level = self._logger.level
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def emit(self, record: logging.LogRecord) -> None:
        step = getattr(record, "ckptwrap_step", None)
        if step is not None:
            self.all.append(dict(step, thread=record.thread))

    def of(self, event: str, thread: Optional[int] = None) -> List[Dict[str, Any]]:
        """The notes of one kind (``forward``, ``measured``, ``checked``), of one thread's
        steps if given."""
        return [s for s in self.all if s["event"] == event and (thread is None or s["thread"] == thread)]

    @property
    def forward(self) -> Dict[str, Any]:
        """What the last training forward ran under."""
        forwards = self.of("forward")
        assert forwards, "no training forward was noted"
        return forwards[-1]

    def measured_forwards(self, thread: Optional[int] = None) -> int:
        """How many training forwards ran measured."""
        return sum(step["measured"] for step in self.of("forward", thread))

    @property
    def measured(self) -> int:
        """How many training forwards ran measured."""
        return self.measured_forwards()

    @property
    def checked(self) -> int:
        """How many steps were checked against their prediction."""
        return len(self.of("checked"))

"""Shared test configuration: Hypothesis profiles, one intra-op thread, and a check that
every test leaves autograd and ckptwrap's state as it found them.

Hypothesis profiles: ``default`` keeps the suite fast; ``HYPOTHESIS_PROFILE=thorough`` runs
many more examples (for a nightly job or before a release).
"""

import logging
import os
from typing import Any, Dict, List

import pytest
import torch
from hypothesis import HealthCheck, settings

import ckptwrap
from ckptwrap.wrap import _switch

settings.register_profile("default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _one_thread():
    # The models in the suite are tiny: intra-op threads only add synchronisation, which
    # costs seconds per step when the machine's cores are busy with other work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _state_is_clean(_one_thread):
    """Every test must leave autograd as it found it: no recomputation flag left set, no
    saved-tensor hook left on the stack (it would swallow the next plain forward), and
    checkpointing switched back on."""
    yield
    assert ckptwrap.is_recomputing() is False, "is_recomputing() left True after the test"
    assert _switch.is_disabled() is False, "ckptwrap.disabled() left on after the test"
    x = torch.randn(2, requires_grad=True)
    saved = x.sin().grad_fn._saved_self
    assert isinstance(saved, torch.Tensor) and torch.equal(saved, x), "a saved-tensor hook leaked"


class NotedSteps:
    """The ``ckptwrap_step`` fields of every note the ``ckptwrap`` logger gave of a training
    step (docs/budget.md, "What the planner says"), in order."""

    def __init__(self) -> None:
        self.all: List[Dict[str, Any]] = []

    def of(self, event: str) -> List[Dict[str, Any]]:
        """The notes of one kind: ``forward``, ``measured`` or ``checked``."""
        return [step for step in self.all if step["event"] == event]

    @property
    def forward(self) -> Dict[str, Any]:
        """What the last training forward ran under."""
        forwards = self.of("forward")
        assert forwards, "no training forward was noted"
        return forwards[-1]

    @property
    def measured(self) -> int:
        """How many training forwards ran measured."""
        return sum(step["measured"] for step in self.of("forward"))


@pytest.fixture
def noted_steps():
    """What the planner says of each training step, read from the ``ckptwrap`` logger at
    DEBUG (as a user would), for the length of the test."""
    noted = NotedSteps()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            step = getattr(record, "ckptwrap_step", None)
            if step is not None:
                noted.all.append(step)

    logger = logging.getLogger("ckptwrap")
    handler, level = Handler(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield noted
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)

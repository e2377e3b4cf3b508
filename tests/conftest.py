"""Shared test configuration: Hypothesis profiles, one intra-op thread, and a check that
every test leaves autograd and ckptwrap's state as it found them.

Hypothesis profiles: ``default`` keeps the suite fast; ``HYPOTHESIS_PROFILE=thorough`` runs
many more examples (for a nightly job or before a release).
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

import ckptwrap
from ckptwrap.wrap import _region

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _noted import NotedSteps  # noqa: E402  (what a handler of a user's would read)

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
    assert _region.is_disabled() is False, "ckptwrap.disabled() left on after the test"
    x = torch.randn(2, requires_grad=True)
    saved = x.sin().grad_fn._saved_self
    assert isinstance(saved, torch.Tensor) and torch.equal(saved, x), "a saved-tensor hook leaked"


@pytest.fixture
def noted_steps():
    """What the planner says of each training step, read from the ``ckptwrap`` logger at
    DEBUG as a user's handler would (``benchmarks/_noted.py``), for the length of the test."""
    with NotedSteps() as noted:
        yield noted

"""The closed loop's checks on the CPU, where metering a step costs time: what a check
adds is weighed against the coming step's own size (a check learned on a short batch is
not the price of a long one), checks stay within their share of the training time, and
the check due after a measurement waits for a step no larger than the steps so far.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ckptwrap
from ckptwrap.planner._schedule import SHARE, CheckSchedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bounds import _batch, _gpt, _hook, _no_learning, _step  # noqa: E402

_SMALL = 1 << 20
_LARGE = 10 * _SMALL


def _trained(schedule: CheckSchedule, steps: int, *, seconds_per_small: float = 0.01) -> None:
    """``steps`` unmetered steps, each of size ``_SMALL``, at ``seconds_per_small``."""
    for _ in range(steps):
        schedule.step()
        schedule.timed(seconds_per_small, checked=False, size=_SMALL)


def _checked_once(schedule: CheckSchedule) -> None:
    """The urgent check after a measurement, at size ``_SMALL``: it costs twice the step."""
    schedule.soon()
    schedule.step()
    assert schedule.due(cheap=False, size=_SMALL)
    schedule.timed(0.03, checked=True, size=_SMALL)
    schedule.hit()


def test_a_check_learned_on_a_short_step_is_not_the_price_of_a_long_one():
    schedule = CheckSchedule()
    _trained(schedule, 1)
    _checked_once(schedule)
    # The check added 0.02 s to a 0.01 s step. The credit the steps earn (SHARE of their
    # time) repays it, then pays for another at the same size (0.02 s) or at ten times
    # the size (0.2 s).
    small = large = None
    for step in range(1, 2000):
        _trained(schedule, 1)
        schedule.step()
        if small is None and schedule.due(cheap=False, size=_SMALL):
            small = step
        if large is None and schedule.due(cheap=False, size=_LARGE):
            large = step
        if large is not None:
            break
    earned = SHARE * 0.01  # per step
    assert small == pytest.approx((0.02 + 0.02) / earned, rel=0.05)
    assert large == pytest.approx((0.02 + 0.2) / earned, rel=0.05)


def test_checks_stay_within_their_share_when_the_steps_grow():
    # Steps alternating short and ten times as long, checks costing twice the step:
    # whatever sizes the checks land on, they add at most SHARE of the training time.
    schedule = CheckSchedule()
    trained = added = 0.0
    schedule.measured(0.05, size=_SMALL)
    for index in range(3000):
        size = _LARGE if index % 2 else _SMALL
        seconds = 0.01 * size / _SMALL
        schedule.step()
        if schedule.due(cheap=False, size=size):
            schedule.timed(3 * seconds, checked=True, size=size)
            schedule.hit()
            added += 2 * seconds
        else:
            schedule.timed(seconds, checked=False, size=size)
        trained += seconds
    assert 0 < added <= SHARE * trained + 3 * 0.01 * _LARGE / _SMALL


def test_before_any_check_a_measured_steps_share_stands_for_a_checks():
    schedule = CheckSchedule()
    schedule.measured(0.05, size=_SMALL)  # adds 4 steps' time: settled at the first timed step
    _trained(schedule, 1)
    schedule.soon()
    schedule.step()
    assert schedule.due(cheap=False, size=_SMALL), "the check after a measurement"
    # A step larger than those so far waits for the credit to pay for it, priced as the
    # measured step was (4 times its step) until a check has been timed.
    steps = 0
    while not schedule.due(cheap=False, size=_LARGE):
        _trained(schedule, 1)
        schedule.step()
        steps += 1
        assert steps < 100_000
    assert steps == pytest.approx(4 * 0.1 / (SHARE * 0.01), rel=0.05)


def test_an_accelerator_checks_every_step():
    schedule = CheckSchedule()
    schedule.step()
    assert schedule.due(cheap=True, size=_LARGE)


def test_after_a_measurement_the_cpu_checks_a_step_no_larger_than_those_so_far(monkeypatch):
    _no_learning(monkeypatch)
    model = ckptwrap.wrap_model(_gpt(), "budget:200MiB")
    _step(model, _batch(4, 160))  # measured
    assert _hook(model)._step.decision.measure
    _step(model, _batch(4, 100))  # the step after the measurement: unmetered
    assert not _hook(model)._step.decision.check
    _step(model, _batch(4, 120))  # larger than the steps timed so far: not metered
    decision = _hook(model)._step.decision
    assert not decision.measure and not decision.check
    _step(model, _batch(4, 80))  # smaller: the check the measurement calls for
    decision = _hook(model)._step.decision
    assert not decision.measure and decision.check

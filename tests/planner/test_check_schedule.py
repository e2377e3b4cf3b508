"""The closed loop's checks on the CPU, where metering a step costs time: what a check
adds is weighed against the coming step's own size (a check learned on a short batch is
not the price of a long one), checks stay within their share of the training time, and
the check due after a measurement waits for a step no larger than the steps so far.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import ckptwrap
from ckptwrap.planner._planner import SHARE, CheckSchedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bounds import _batch, _gpt, _no_learning, _step  # noqa: E402

_SMALL = 1 << 20
_LARGE = 10 * _SMALL


def _trained(schedule: CheckSchedule, steps: int) -> None:
    """``steps`` unmetered steps, short and ten times as long in turn, each taking 0.01 s
    per ``_SMALL`` of size."""
    for index in range(steps):
        size = _LARGE if index % 2 else _SMALL
        schedule.step()
        schedule.timed(0.01 * size / _SMALL, checked=False, size=size)


def _until_due(schedule: CheckSchedule, size: int) -> int:
    """Unmetered steps trained until a check at ``size`` is due."""
    steps = 0
    while not schedule.due(cheap=False, size=size):
        _trained(schedule, 2)
        steps += 2
        assert steps < 100_000
    return steps


def test_a_check_learned_on_a_short_step_is_not_the_price_of_a_long_one():
    schedule = CheckSchedule()
    _trained(schedule, 10)
    schedule.soon()
    schedule.step()
    assert schedule.due(cheap=False, size=_SMALL), "the check after a measurement, on a short step"
    schedule.timed(0.03, checked=True, size=_SMALL)  # twice what the short step takes
    schedule.hit()
    # A long step's check is priced at twice the long step's time: the credit the
    # steps earn (SHARE of their time) pays for a short one's far sooner.
    short = _until_due(copy.deepcopy(schedule), _SMALL)
    long = _until_due(copy.deepcopy(schedule), _LARGE)
    assert long > 3 * short, (short, long)


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
    schedule.measured(0.05, size=_SMALL)  # five times a short step: settled once one is timed
    _trained(schedule, 2)
    cheap = CheckSchedule()
    cheap.measured(0.011, size=_SMALL)  # about what a short step takes
    _trained(cheap, 2)
    for each in (schedule, cheap):
        each.soon()
        each.step()
        assert each.due(cheap=False, size=_SMALL), "the check after a measurement"
    # Not the first check: a long step waits for the credit, priced as the measured step
    # was; the dearer the measurement, the longer.
    assert _until_due(copy.deepcopy(schedule), _LARGE) > 3 * max(1, _until_due(copy.deepcopy(cheap), _LARGE))


def test_an_accelerator_checks_every_step():
    schedule = CheckSchedule()
    schedule.step()
    assert schedule.due(cheap=True, size=_LARGE)


def test_after_a_measurement_the_cpu_checks_a_step_no_larger_than_those_so_far(monkeypatch, noted_steps):
    _no_learning(monkeypatch)
    model = ckptwrap.wrap_model(_gpt(), "budget:200MiB")
    _step(model, _batch(4, 160))  # measured
    assert noted_steps.forward["measured"]
    _step(model, _batch(4, 100))  # the step after the measurement: unmetered
    assert not noted_steps.forward["checked"]
    _step(model, _batch(4, 120))  # larger than the steps timed so far: not metered
    assert not noted_steps.forward["measured"] and not noted_steps.forward["checked"]
    _step(model, _batch(4, 80))  # smaller: the check the measurement calls for
    assert not noted_steps.forward["measured"] and noted_steps.forward["checked"]
    # The check is told at the end of its backward, with the peak it read.
    checked = noted_steps.of("checked")
    assert len(checked) == 1 and checked[0]["sizes"] == (4, 80) and checked[0]["peak"] > 0

"""Costs bounded from the shapes measured: a step at a shape no trusted fit stands for is
solved from a larger measured shape's costs, or a smaller one's scaled up, instead of
being measured; the step keeps the budget (read at the CPU allocator, an independent
meter), its gradients are the plain model's, and measuring to learn is held to a share of
the training time.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap.planner._planner import LEARN_SHARE, CheckSchedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402
from wrap._meter import allocator_step_peak  # noqa: E402
from wrap._models import assert_same, grads  # noqa: E402

_VOCAB = 64
OVER = 0.03
"""A step may pass the budget by this share of the plain peak (the benchmark's target)."""


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    config = GPTConfig(vocab=_VOCAB, width=32, heads=2, layers=4, seq_len=256, dropout=0.1)
    return GPT(config).train()


def _batch(rows: int, length: int):
    ids = torch.randint(_VOCAB, (rows, length + 1), generator=torch.Generator().manual_seed(97 * rows + length))
    return ids[:, :-1], ids[:, 1:]


def _step(model: nn.Module, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = model(*batch)
    loss.backward()
    return loss.detach()


def _planner(model: nn.Module):
    return next(h for h in model._forward_pre_hooks.values() if hasattr(h, "planner")).planner


def _no_learning(monkeypatch) -> None:
    # Measuring to learn is what a bound saves: off here, so that each step shows what
    # stands without it.
    monkeypatch.setattr("ckptwrap.planner._planner.LEARN_SHARE", 0.0)


def _budgeted(plain_at: tuple) -> tuple:
    """A GPT, its plain twin, and an absolute budget halfway between the least and the
    plain peak at ``plain_at`` (rows, length): long batches must checkpoint."""
    model = _gpt()
    plain = copy.deepcopy(model)
    every = ckptwrap.plan(copy.deepcopy(model), "blocks", example_inputs=_batch(*plain_at))
    budget = (every.predicted_peak + every.plain_peak) // 2
    return ckptwrap.wrap_model(model, f"budget:{budget}B"), plain, budget


def _run(model, plain, budget, rows, length, largest):
    """One step of each on the same batch; the budget's read at the allocator."""
    batch = _batch(rows, length)
    peaks, losses = [], []
    for each in (model, plain):
        losses.append(None)

        def step(each=each, index=len(losses) - 1):
            losses[index] = _step(each, batch)

        peaks.append(allocator_step_peak(step))
    assert_same({"loss": losses[0]}, {"loss": losses[1]})
    assert_same(grads(model), grads(plain), "gradients")
    largest = max(largest, peaks[1])
    assert peaks[0] - budget <= OVER * largest, (rows, length, peaks[0], budget)
    applied = model.ckptwrap_plan
    if applied.costs_from in ("bounded", "scaled"):
        # Solved from a bound: its predictions are at or above the step's own.
        assert applied.predicted_peak >= peaks[0] - OVER * largest, (rows, length, applied.predicted_peak, peaks[0])
        assert applied.plain_peak >= peaks[1] - OVER * largest, (rows, length, applied.plain_peak, peaks[1])
        assert "from a bound" in str(applied)
    return largest


def test_a_shape_smaller_than_one_measured_is_solved_from_its_costs(monkeypatch, noted_steps):
    _no_learning(monkeypatch)
    model, plain, budget = _budgeted((4, 192))
    largest = _run(model, plain, budget, 4, 192, 0)
    assert noted_steps.measured == 1
    for rows, length in [(4, 64), (2, 150), (3, 191), (1, 30)]:
        largest = _run(model, plain, budget, rows, length, largest)
        forward = noted_steps.forward
        assert not forward["measured"] and forward["source"] == "bounded", (rows, length, forward)
        assert model.ckptwrap_plan.costs_from == "bounded"
    assert noted_steps.measured == 1, "a shape below the measured one was measured"


def test_a_shape_a_little_larger_than_one_measured_is_solved_from_its_costs_scaled_up(monkeypatch, noted_steps):
    _no_learning(monkeypatch)
    model, plain, budget = _budgeted((4, 200))
    largest = _run(model, plain, budget, 4, 160, 0)
    planner = _planner(model)
    measured = noted_steps.measured
    for rows, length in [(4, 168), (4, 172)]:
        largest = _run(model, plain, budget, rows, length, largest)
        forward = noted_steps.forward
        assert not forward["measured"] and forward["source"] == "scaled", (rows, length, forward)
        assert model.ckptwrap_plan.costs_from == "scaled"
        scale = (length / 160) ** 2
        measured_peak = planner._layouts.of(_batch(4, 160), {})[0].profiles[(4, 160)].step.total
        bound = planner._layouts.of(_batch(rows, length), {})[0].profile_at((rows, length)).step.total
        assert bound >= scale * measured_peak - 64, (bound, scale, measured_peak)
    assert noted_steps.measured == measured


def test_a_shape_far_larger_than_any_measured_is_measured_not_warned_about(monkeypatch, noted_steps):
    _no_learning(monkeypatch)
    model, plain, budget = _budgeted((4, 224))
    largest = _run(model, plain, budget, 4, 16, 0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        largest = _run(model, plain, budget, 4, 224, largest)
    # A bound 196 times the measured costs fits no plan: the shape is measured, and no
    # "no plan fits" is said of it.
    assert not [w for w in said if "no plan fits" in str(w.message)]
    assert noted_steps.forward["measured"]
    assert noted_steps.measured == 2


def test_a_share_of_the_plain_peak_at_a_larger_shape_is_read_by_measuring_it(monkeypatch, noted_steps):
    _no_learning(monkeypatch)
    model = ckptwrap.wrap_model(_gpt(), "budget:50%")
    _step(model, _batch(4, 160))
    _step(model, _batch(4, 168))  # within a bound's reach, but the share's reference moves
    assert noted_steps.forward["measured"]
    _step(model, _batch(4, 100))  # below: the reference stands
    forward = noted_steps.forward
    assert not forward["measured"] and forward["source"] == "bounded"
    assert noted_steps.measured == 2


_SIZE = 1 << 20
"""The size (un-checkpointed peak) of every step in the schedule tests."""


def _steps_until_learning(schedule: CheckSchedule, seconds: float) -> int:
    """Unmetered steps of ``seconds`` each until ``schedule`` lets a step be measured to learn."""
    steps = 0
    while not schedule.may_learn(_SIZE):
        schedule.timed(seconds, checked=False, size=_SIZE)
        steps += 1
        assert steps < 10_000
    return steps


def test_measuring_to_learn_waits_for_its_share_of_the_training_time():
    schedule = CheckSchedule()
    assert not schedule.may_learn(_SIZE), "nothing timed yet"
    schedule.measured(0.30, size=_SIZE)  # one that could not be skipped: settled once a step is timed
    schedule.timed(0.10, checked=False, size=_SIZE)
    assert not schedule.may_learn(_SIZE)
    # A measured step adds 0.2 s over an unmetered one: learning may measure once the
    # steps have earned that much at LEARN_SHARE of their time (the step that could not be
    # skipped drew nothing), and then waits as long again.
    steps = _steps_until_learning(schedule, 0.10)
    assert steps == pytest.approx(0.2 / (LEARN_SHARE * 0.10), abs=1.5)
    schedule.measured(0.30, size=_SIZE, learning=True)
    assert not schedule.may_learn(_SIZE)
    assert _steps_until_learning(schedule, 0.10) == pytest.approx(steps, abs=1.5)


def test_with_learning_on_a_bounded_shape_is_measured_once_the_share_allows(monkeypatch, noted_steps):
    monkeypatch.setattr("ckptwrap.planner._planner.LEARN_SHARE", 1e9)
    model = ckptwrap.wrap_model(_gpt(), "budget:200MiB")
    _step(model, _batch(4, 160))
    for length in (100, 110, 120):  # solved from the bound until a step is timed unmetered
        _step(model, _batch(4, length))
        if noted_steps.forward["measured"]:
            break
    assert noted_steps.forward["measured"], "learning never measured"
    assert noted_steps.measured == 2


def test_a_bound_out_of_reach_is_given_up_without_the_unbounded_search(monkeypatch):
    # Under a bound a plan is not needed (the step is measured instead); the search for
    # the least peak, whose arrays the budget does not bound, would run inside the step.
    from ckptwrap.planner import _solver
    from ckptwrap.planner._peak_model import CostItem

    budgets = []
    real = _solver._Search.__init__

    def spy(self, items, base, budget, *args, **kwargs):
        budgets.append(budget)
        real(self, items, base, budget, *args, **kwargs)

    monkeypatch.setattr(_solver._Search, "__init__", spy)
    items = [CostItem(f"l{i}", kept=1000, inputs=100, time=1.0) for i in range(6)]
    with pytest.raises(ckptwrap.CheckpointConfigError, match="no plan was found within the budget"):
        _solver.solve_budget(items, 500, base=0, settle=False)
    assert budgets == [500]
    with pytest.raises(ckptwrap.CheckpointConfigError, match="below the smallest reachable peak"):
        _solver.solve_budget(items, 500, base=0)
    assert None in budgets[1:]  # settling searches without a budget


def _count(monkeypatch, module: str, name: str) -> list:
    """Calls of ``module.name`` (``ckptwrap.planner`` modules), counted."""
    import importlib

    owner = importlib.import_module(module)
    calls: list = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_shapes_one_measured_shape_bounds_share_one_solve(monkeypatch, noted_steps):
    """A loop with dynamic padding meets a new shape at most steps: those one measured
    shape bounds are solved on the same costs, so once, not once per shape."""
    _no_learning(monkeypatch)
    model, plain, budget = _budgeted((4, 128))
    largest = _run(model, plain, budget, 4, 192, 0)  # measured: bounds all below
    solves = _count(monkeypatch, "ckptwrap.planner._planner", "choose")
    plans = []
    for rows, length in [(4, 180), (3, 150), (4, 121), (2, 190), (3, 177), (4, 160)]:
        largest = _run(model, plain, budget, rows, length, largest)
        assert noted_steps.forward["source"] == "bounded"
        plans.append(model.ckptwrap_plan.names)
    assert len(solves) == 1, len(solves)
    assert all(names == plans[0] for names in plans) and plans[0]  # checkpointed, within the budget


def test_scaled_shapes_between_two_grid_steps_share_one_bound(monkeypatch, noted_steps):
    _no_learning(monkeypatch)
    model, plain, budget = _budgeted((4, 200))
    largest = _run(model, plain, budget, 4, 160, 0)
    solves = _count(monkeypatch, "ckptwrap.planner._planner", "choose")
    # (length / 160) ** 2 of 1.0125 and 1.025: within one step of the grid (2 ** (1/16)).
    for length in (161, 162):
        largest = _run(model, plain, budget, 4, length, largest)
        assert noted_steps.forward["source"] == "scaled"
    assert len(solves) == 1
    costs = _planner(model)._layouts.of(_batch(4, 160), {})[0]
    bounds = [costs.profile_at((4, length)) for length in (161, 162)]
    assert bounds[0] is bounds[1]
    measured_peak = costs.profiles[(4, 160)].step.total
    assert bounds[0].step.total >= (162 / 160) ** 2 * measured_peak - 64  # still a bound


def test_a_scaled_bound_worked_out_a_step_or_two_higher_is_taken_as_it_is(monkeypatch, noted_steps):
    """A shape whose scaled bound falls one or two steps of the grid below one already
    worked out (from the same measured shape) is planned from that one: a larger bound,
    its plan solved already. One further below gets its own, solved once."""
    _no_learning(monkeypatch)
    model, plain, budget = _budgeted((4, 200))
    largest = _run(model, plain, budget, 4, 160, 0)
    solves = _count(monkeypatch, "ckptwrap.planner._planner", "choose")
    seen = {}
    # (length / 160) ** 2 on the grid of 2 ** (1/16): steps 6, 4, 2 and 2.
    for length in (180, 172, 166, 164):
        largest = _run(model, plain, budget, 4, length, largest)
        assert noted_steps.forward["source"] == "scaled"
        costs = _planner(model)._layouts.of(_batch(4, 160), {})[0]
        measured_peak = costs.profiles[(4, 160)].step.total
        seen[length] = costs.profile_at((4, length))
        assert seen[length].step.total >= (length / 160) ** 2 * measured_peak - 64  # a bound
    assert seen[172] is seen[180]  # two steps below: taken as it is
    assert seen[166] is not seen[180] and seen[166].step.total < seen[180].step.total
    assert seen[164] is seen[166]
    assert len(solves) == 2  # 180's and 166's


def test_many_shapes_under_one_plan_keep_what_is_kept_of_them_bounded(monkeypatch, noted_steps):
    """Every shape a measured shape bounds is planned from its one solve; what is kept of
    each (its un-checkpointed peak) stays bounded however many shapes come."""
    _no_learning(monkeypatch)
    model, plain, budget = _budgeted((4, 200))
    _run(model, plain, budget, 4, 200, 0)  # measured: bounds every shape below
    solves = _count(monkeypatch, "ckptwrap.planner._planner", "choose")
    for length in range(110, 200):
        _step(model, _batch(4, length))
        assert noted_steps.forward["source"] == "bounded"
    cache = _planner(model)._cache
    assert len(solves) == 1 and len(cache.plans) == 1
    assert len(cache.plain) <= 64


def test_a_shape_below_one_that_fitted_with_nothing_checkpointed_is_not_evaluated(monkeypatch):
    """Where a larger shape's step fitted the budget with nothing checkpointed, a smaller
    one needs no plan: no costs are evaluated, nothing solved, nothing checkpointed."""
    _no_learning(monkeypatch)
    model, plain, budget = _budgeted((4, 256))  # far above the plain peak at 4 x 100
    largest = _run(model, plain, budget, 4, 100, 0)  # measured
    largest = _run(model, plain, budget, 4, 96, largest)  # bounded: solved, nothing needed
    assert model.ckptwrap_plan.names == []
    from ckptwrap.planner._shapes import LayoutCosts

    sources = []
    original = LayoutCosts.source_at
    monkeypatch.setattr(LayoutCosts, "source_at", lambda self, sizes: sources.append(sizes) or original(self, sizes))
    solves = _count(monkeypatch, "ckptwrap.planner._planner", "choose")
    for rows, length in [(4, 90), (3, 96), (2, 50), (1, 7)]:
        largest = _run(model, plain, budget, rows, length, largest)
        assert model.ckptwrap_plan.names == [] and model.ckptwrap_plan.costs_from == "bounded"
    assert sources == [] and solves == []

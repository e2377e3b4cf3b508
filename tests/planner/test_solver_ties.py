"""The budget solver on measured times: noise must not decide between candidates of
equal cost, and a budget given in percent is refused in percent."""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.planner._solver import resolve_budget
from ckptwrap.policy import Budget
from ckptwrap.planner import CostItem, predicted_peak
from ckptwrap.planner._solver import PercentBudget, pooled_times, smallest_reachable_peak, solve_budget


def _blocks(times, *, joins: bool = False, rebuilt: int = 120):
    # Like a stack of identical transformer layers: each saved 4 bytes more of base
    # before it, and (with joins) takes the previous one's output as its input.
    return [
        CostItem(
            f"h.{i}", kept=100, inputs=10, time=t, rebuilt=rebuilt, before=4 * i,
            joins=4 if joins and i else None,
        )
        for i, t in enumerate(times)
    ]


@pytest.mark.parametrize("joins", [False, True])
def test_noise_in_the_times_of_equal_blocks_does_not_change_the_plan(joins):
    rng = random.Random(7)
    base = 40
    plans = set()
    for _ in range(20):
        # Load on a shared machine: each measurement within 0.5x to 10x of the truth.
        items = _blocks([1e-3 * rng.choice([0.5, 1, 1, 2, 10]) for _ in range(8)], joins=joins)
        solution = solve_budget(items, 520, base=base)
        plans.add((solution.selected, solution.segments))
    exact = solve_budget(_blocks([1e-3] * 8, joins=joins), 520, base=base)
    assert plans == {(exact.selected, exact.segments)}


def test_ties_go_by_model_order():
    items = _blocks([1.0] * 8, rebuilt=0)
    # With nothing rebuilt, every selection of k ends the forward at the same peak;
    # the first k candidates are taken.
    solution = solve_budget(items, 540, base=40)
    assert solution.selected == (0, 1, 2, 3)


def test_the_plan_is_optimal_for_the_pooled_times():
    rng = random.Random(3)
    items = _blocks([rng.uniform(1e-3, 9e-3) for _ in range(7)])
    pooled = pooled_times(items)
    assert len(set(pooled)) == 1
    budget = 500
    solution = solve_budget(items, budget, base=40)
    fits = [
        chosen
        for k in range(len(items) + 1)
        for chosen in itertools.combinations(range(len(items)), k)
        if predicted_peak(items, chosen, base=40) <= budget
    ]
    best = min(math.fsum(pooled[i] for i in chosen) for chosen in fits)
    assert math.isclose(math.fsum(pooled[i] for i in solution.selected), best)
    # What the plan reports is what was measured for its members.
    assert solution.recompute_time == math.fsum(items[i].time for i in solution.selected)


def test_candidates_that_differ_keep_their_own_times():
    items = [
        CostItem("a", kept=100, inputs=10, time=1.0),
        CostItem("b", kept=100, inputs=10, time=3.0),
        CostItem("c", kept=90, inputs=10, time=5.0),
        CostItem("d", kept=100, inputs=20, time=7.0),
        CostItem("e", kept=100, inputs=10, time=4.0, rebuilt=50),
    ]
    assert pooled_times(items) == [2.0, 2.0, 5.0, 7.0, 4.0]


# ------------------------------------------------------------------ budgets in percent


def test_a_percent_budget_below_reach_is_stated_in_percent_and_bytes():
    items = [CostItem(f"layers.{i}", kept=10 << 20, inputs=1 << 20, time=1.0) for i in range(6)]
    base = 2 << 20
    reference = base + 60 * (1 << 20)  # the un-checkpointed peak, 62 MiB
    lowest = smallest_reachable_peak(items, base=base)  # 17 MiB (see test_solver)
    budget = resolve_budget(Budget("10%"), reference)
    share = 100 * lowest / reference
    match = (
        rf"budget 10% of the un-checkpointed step's peak at the largest shape planned so far "
        rf"\(62\.0 MiB \({reference} bytes\)\), that is 6\.2 MiB \({int(0.1 * reference)} bytes\), "
        rf"is below the smallest reachable peak 17\.0 MiB \({lowest} bytes\), {share:.2f}% of the "
        rf"un-checkpointed step's peak at the largest shape planned so far, reached by "
        rf"checkpointing 5 of 6 candidates .*; raise the "
        rf"budget to at least budget:27\.5%"
    )
    with pytest.raises(CheckpointConfigError, match=match):
        solve_budget(items, budget, base=base)
    # The suggested percentage reaches the lowest peak, a tenth of a percent less does not.
    assert resolve_budget(Budget("27.5%"), reference) >= lowest > resolve_budget(Budget("27.4%"), reference)
    assert solve_budget(items, resolve_budget(Budget("27.5%"), reference), base=base).predicted_peak == lowest


def test_a_byte_budget_below_reach_is_stated_in_bytes_only():
    items = [CostItem(f"layers.{i}", kept=10 << 20, inputs=1 << 20, time=1.0) for i in range(6)]
    with pytest.raises(CheckpointConfigError) as caught:
        solve_budget(items, resolve_budget(Budget("6MiB"), 64 << 20), base=2 << 20)
    assert "%" not in str(caught.value)
    assert re.search(r"budget 6\.0 MiB \(6291456 bytes\) is below the smallest reachable peak", str(caught.value))


def test_a_percent_budget_whose_floor_passes_the_reference_suggests_bytes():
    # The reference a percentage is of may lie below the lowest predicted peak.
    items = [CostItem("only", kept=100, inputs=10, time=1.0)]
    with pytest.raises(CheckpointConfigError, match=r"104\.90% of it, .*at least budget:107B"):
        solve_budget(items, PercentBudget(0.5, 102, of="it"), base=7)

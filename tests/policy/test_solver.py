"""Tests of the budget planner's solver against brute force over every subset.

On sizes that are multiples of a memory unit the solver must match the brute-force
optimum exactly (time, then peak, then count); on any sizes its plan must fit the budget.
"""

from __future__ import annotations

import math
import random
from typing import List, Sequence, Tuple
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.policy import _solver
from ckptwrap.policy._solver import (
    BudgetSolution,
    CostItem,
    format_bytes,
    predicted_peak,
    smallest_reachable_peak,
    solve_budget,
)

MIB = 1 << 20


# ------------------------------------------------------------------------- brute force


class BruteForce:
    """Peak, time and size of every subset of ``items`` (subset k holds item i iff bit i)."""

    def __init__(self, items: Sequence[CostItem], base: int) -> None:
        n = len(items)
        masks = (torch.arange(1 << n)[:, None] >> torch.arange(n)) & 1
        kept = torch.tensor([item.kept for item in items], dtype=torch.int64)
        inputs = torch.tensor([item.inputs for item in items], dtype=torch.int64)
        times = torch.tensor([item.time for item in items], dtype=torch.float64)
        largest = (masks * kept).amax(dim=1) if n else torch.zeros(1, dtype=torch.int64)
        self.peaks = base + ((1 - masks) * kept).sum(1) + (masks * inputs).sum(1) + largest
        self.times = (masks * times).sum(1)
        self.counts = masks.sum(1)

    def peak_of(self, selected: Sequence[int]) -> int:
        return int(self.peaks[sum(1 << i for i in selected)])

    def lowest_peak(self) -> int:
        return int(self.peaks.min())

    def optimum(self, budget: int) -> Tuple[float, int, int]:
        """Least (time, peak, count) over the subsets that fit; nothing if none is needed."""
        if self.peaks[0] <= budget:
            return 0.0, int(self.peaks[0]), 0
        fits = self.peaks <= budget
        time = self.times.masked_fill(~fits, math.inf).min()
        best = fits & (self.times == time)
        peak = self.peaks[best].min()
        best &= self.peaks == peak
        return float(time), int(peak), int(self.counts[best].min())


def random_instance(
    rng: random.Random, n: int, unit: int, *, integer_times: bool = True
) -> Tuple[List[CostItem], int]:
    """Candidates whose sizes are multiples of ``unit``; some keep less than their inputs."""
    items = [
        CostItem(
            f"layers.{i}",
            kept=rng.randint(0, 40) * unit,
            inputs=rng.randint(0, 15) * unit,
            time=float(rng.randint(0, 9)) if integer_times else rng.uniform(0.0, 1e-2),
        )
        for i in range(n)
    ]
    return items, rng.randint(0, 50) * unit


def random_budget(rng: random.Random, lowest: int, empty: int, unit: int) -> int:
    """Mostly strictly between the lowest and the un-checkpointed peak, sometimes at an end."""
    roll = rng.random()
    if roll < 0.1:
        return lowest
    if roll < 0.15 or lowest >= empty:
        return empty + rng.randint(0, 3) * unit
    return rng.randint(lowest, empty - 1)


def solution_key(solution: BudgetSolution) -> Tuple[float, int, int]:
    return solution.recompute_time, solution.predicted_peak, len(solution.selected)


def check_fits(solution: BudgetSolution, items: Sequence[CostItem], brute: BruteForce) -> None:
    assert list(solution.selected) == sorted(set(solution.selected))
    assert solution.predicted_peak == brute.peak_of(solution.selected)
    assert solution.predicted_peak <= solution.budget
    assert solution.recompute_time == math.fsum(items[i].time for i in solution.selected)


# ---------------------------------------------------------------------------- optimality


@pytest.mark.parametrize("unit", [1, 7, 4096, MIB])
def test_matches_brute_force_optimum_on_unit_multiples(unit):
    rng = random.Random(unit)
    for trial in range(60):
        items, base = random_instance(rng, rng.randint(max(0, 14 - trial), 14), unit)
        brute = BruteForce(items, base)
        budget = random_budget(rng, brute.lowest_peak(), int(brute.peaks[0]), unit)
        solution = solve_budget(items, budget, base=base)
        context = f"items={items} base={base} budget={budget} solution={solution}"
        check_fits(solution, items, brute)
        assert solution_key(solution) == brute.optimum(budget), context
        # The solver's axis is never coarser than the sizes' own unit allows.
        assert solution.unit % unit == 0 or budget >= brute.peaks[0], context


def test_matches_brute_force_time_with_real_valued_times():
    rng = random.Random(1)
    for _ in range(40):
        items, base = random_instance(rng, rng.randint(8, 14), MIB, integer_times=False)
        brute = BruteForce(items, base)
        budget = random_budget(rng, brute.lowest_peak(), int(brute.peaks[0]), MIB)
        solution = solve_budget(items, budget, base=base)
        check_fits(solution, items, brute)
        assert math.isclose(solution.recompute_time, brute.optimum(budget)[0], abs_tol=1e-12)


def test_arbitrary_sizes_fit_and_cost_at_least_the_optimum():
    rng = random.Random(2)
    for trial in range(60):
        n = rng.randint(1, 12)
        items = [
            CostItem(
                f"m{i}",
                kept=rng.randint(0, 1 << 33),
                inputs=rng.randint(0, 1 << 31),
                time=rng.uniform(0.0, 1.0),
            )
            for i in range(n)
        ]
        base = rng.randint(0, 1 << 32)
        brute = BruteForce(items, base)
        budget = rng.randint(brute.lowest_peak(), int(brute.peaks[0]))
        # A tiny axis forces the coarse, rounded path on half of the instances.
        steps = 8 if trial % 2 else _solver._APPROX_STEPS
        with mock.patch.multiple(_solver, _EXACT_STEPS=steps, _APPROX_STEPS=steps):
            solution = solve_budget(items, budget, base=base)
        check_fits(solution, items, brute)
        assert solution.recompute_time >= brute.optimum(budget)[0] - 1e-12
        # Rounding may cost optimality, but no member that takes time is superfluous.
        chosen = set(solution.selected)
        top = max(chosen, key=lambda i: (items[i].kept, i), default=None)
        for i in chosen - {top}:
            assert items[i].time == 0 or brute.peak_of(sorted(chosen - {i})) > budget


@given(
    sizes=st.lists(
        st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.floats(0, 10)),
        max_size=10,
    ),
    base=st.integers(0, 1 << 40),
    position=st.floats(0, 1.2),
    steps=st.sampled_from([2, 16, 1024]),
)
def test_any_plan_fits_its_budget(sizes, base, position, steps):
    items = [CostItem(f"m{i}", kept=a, inputs=x, time=t) for i, (a, x, t) in enumerate(sizes)]
    lowest = smallest_reachable_peak(items, base=base)
    empty = base + sum(item.kept for item in items)
    budget = lowest + int(position * (empty - lowest))
    with mock.patch.multiple(_solver, _EXACT_STEPS=steps, _APPROX_STEPS=steps):
        solution = solve_budget(items, budget, base=base)
    assert solution.predicted_peak == predicted_peak(items, solution.selected, base=base)
    assert solution.predicted_peak <= budget


# ----------------------------------------------------------------- reachable peak, budgets


def test_smallest_reachable_peak_is_the_brute_force_minimum():
    rng = random.Random(3)
    for _ in range(80):
        unit = rng.choice([1, 3, MIB, 12345])
        items, base = random_instance(rng, rng.randint(0, 12), unit)
        assert smallest_reachable_peak(items, base=base) == BruteForce(items, base).lowest_peak()


def test_budget_below_the_smallest_reachable_peak_raises_with_both():
    items = [CostItem(f"layers.{i}", kept=10 * MIB, inputs=MIB, time=1.0) for i in range(6)]
    lowest = smallest_reachable_peak(items, base=2 * MIB)
    assert solve_budget(items, lowest, base=2 * MIB).predicted_peak == lowest
    match = (
        rf"budget {format_bytes(lowest - 1)} .*below the smallest reachable peak "
        rf"{format_bytes(lowest)} \({lowest} bytes\).*layers\.0"
    )
    with pytest.raises(CheckpointConfigError, match=match):
        solve_budget(items, lowest - 1, base=2 * MIB)


def test_budget_at_or_above_the_unchecked_peak_selects_nothing():
    rng = random.Random(4)
    for _ in range(20):
        items, base = random_instance(rng, rng.randint(0, 10), MIB)
        empty = base + sum(item.kept for item in items)
        for budget in (empty, empty + rng.randint(1, 10 * MIB)):
            solution = solve_budget(items, budget, base=base)
            assert solution.selected == ()
            assert solution.recompute_time == 0.0
            assert solution.predicted_peak == empty


# ------------------------------------------------------------------------------ edge cases


def test_no_candidates():
    assert smallest_reachable_peak([], base=5) == 5
    assert solve_budget([], 5, base=5) == BudgetSolution((), 5, 0.0, 5, 1)
    with pytest.raises(CheckpointConfigError, match="no candidates"):
        solve_budget([], 4, base=5)


def test_one_candidate_never_lowers_the_peak():
    # Checkpointed, it keeps its inputs and still recomputes all its activations.
    items = [CostItem("only", kept=100, inputs=10, time=1.0)]
    assert smallest_reachable_peak(items, base=7) == 107
    assert solve_budget(items, 107, base=7).selected == ()
    with pytest.raises(CheckpointConfigError, match="nothing checkpointed"):
        solve_budget(items, 106, base=7)


def test_equal_candidates_take_the_fewest_needed_deterministically():
    items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0) for i in range(8)]
    # k checkpointed: 800 - 90k + 100, so 500 needs k = 5.
    first = solve_budget(items, 500, base=0)
    assert len(first.selected) == 5 and first.predicted_peak == 450
    assert solve_budget(items, 500, base=0) == first


def test_zero_time_candidates_are_preferred_and_lower_the_peak():
    items = [
        CostItem("free0", kept=50, inputs=0, time=0.0),
        CostItem("free1", kept=50, inputs=0, time=0.0),
        CostItem("paid", kept=60, inputs=0, time=2.0),
    ]
    # Nothing is needed at the unchecked peak, even though free candidates exist.
    assert solve_budget(items, 160, base=0).selected == ()
    # Below it, time 0 is reachable and the lowest peak at time 0 is chosen.
    assert solve_budget(items, 159, base=0) == BudgetSolution((0, 1), 110, 0.0, 159, 10)


def test_candidates_whose_inputs_exceed_their_activations_are_never_chosen():
    items = [
        CostItem("wide_in", kept=10, inputs=40, time=0.0),
        CostItem("a", kept=50, inputs=5, time=1.0),
        CostItem("b", kept=50, inputs=5, time=1.0),
    ]
    # Checkpointing a and b: 10 kept + 5 + 5 inputs + 50 recomputed.
    assert smallest_reachable_peak(items, base=0) == 70
    assert solve_budget(items, 70, base=0).selected == (1, 2)


def test_predicted_peak_by_hand():
    items = [
        CostItem("a", kept=100, inputs=10, time=1.0),
        CostItem("b", kept=300, inputs=20, time=1.0),
        CostItem("c", kept=200, inputs=30, time=1.0),
    ]
    assert predicted_peak(items, [], base=5) == 605
    # b and c recomputed: a kept, inputs of b and c, largest recomputed is b.
    assert predicted_peak(items, [2, 1], base=5) == 5 + 100 + 50 + 300
    with pytest.raises(CheckpointConfigError, match=r"selected index 3 .*\[0, 3\)"):
        predicted_peak(items, [3], base=0)


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(kept=-1, inputs=0, time=1.0), r"'bad'.*kept.*-1"),
        (dict(kept=1, inputs=-5, time=1.0), r"'bad'.*inputs.*-5"),
        (dict(kept=1.5, inputs=0, time=1.0), r"'bad'.*kept.*1\.5"),
        (dict(kept=1, inputs=0, time=math.nan), r"'bad'.*time.*nan"),
        (dict(kept=1, inputs=0, time=math.inf), r"'bad'.*time.*inf"),
        (dict(kept=1, inputs=0, time=-0.5), r"'bad'.*time.*-0\.5"),
    ],
)
def test_bad_cost_items_are_named(fields, match):
    with pytest.raises(CheckpointConfigError, match=match):
        CostItem("bad", **fields)


def test_bad_budget_base_and_items():
    items = [CostItem("a", kept=1, inputs=0, time=1.0)]
    with pytest.raises(CheckpointConfigError, match="budget .*-1"):
        solve_budget(items, -1, base=0)
    with pytest.raises(CheckpointConfigError, match="base .*-2"):
        solve_budget(items, 1, base=-2)
    with pytest.raises(CheckpointConfigError, match="budget .*True"):
        solve_budget(items, True, base=0)
    with pytest.raises(CheckpointConfigError, match="candidate 1 is a dict"):
        solve_budget([items[0], {"kept": 1}], 1, base=0)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (MIB - 1, "1.0 MiB"),
        (12 * MIB + MIB // 2, "12.5 MiB"),
        (2 << 30, "2.0 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text

"""Tests of the budget solver's step-peak model: options (selective levels a candidate may
be checkpointed with instead of recomputing all of it), the backward moments (``grads``,
``recompute_grads``) and ``tail``.

The solver is checked against an oracle written from ``predicted_peak``'s definition of
the moments, independently of the solver and of the peak model's code, over every
combination of choices; segments with options against ``predicted_peak`` on every plan.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, List, Sequence, Tuple
from unittest import mock

import pytest
import torch

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.planner import _solver
from ckptwrap.planner import CostItem, CostOption, predicted_peak
from ckptwrap.planner._solver import BudgetSolution, pooled_times, smallest_reachable_peak, solve_budget

MIB = 1 << 20


# ------------------------------------------------------------------------------ oracle


class Oracle:
    """Peak and time of every combination of choices, without segments: candidate i is
    plain (choice 0), recomputed in full (1) or checkpointed with its option k (k + 1).

    From the moments' definitions: a candidate holds ``kept`` plain, else the option's
    ``inputs``; the end of the forward holds ``base``, all of them and ``tail``; a plain
    candidate's backward holds its ``before`` (``base`` if None), what the candidates
    before it hold, its ``kept`` and ``grads``; a checkpointed one's, on the same, the
    larger of its recomputation (the option's ``inputs`` and ``rebuilt`` and its
    ``recompute_grads``) and its backward (its own ``inputs``, what one call keeps,
    ``call_kept``, and ``grads``).
    """

    def __init__(self, items: Sequence[CostItem], base: int, tail: int) -> None:
        self.counts = [2 + len(item.options) for item in items]
        self.strides = [math.prod(self.counts[:i]) for i in range(len(items))]
        total = math.prod(self.counts)
        index = torch.arange(total)
        held_cols, moment_cols, time_cols = [], [], []
        for item, count, stride in zip(items, self.counts, self.strides):
            choice = (index // stride) % count
            ways = [(item.inputs, item.rebuilt, item.time)]
            ways += [(o.inputs, o.rebuilt, o.time) for o in item.options]
            held = [item.kept] + [inputs for inputs, _, _ in ways]
            moment = [item.kept + item.grads] + [
                max(inputs + rebuilt + item.recompute_grads, item.inputs + item.call_kept + item.grads)
                for inputs, rebuilt, _ in ways
            ]
            times = [0.0] + [time for _, _, time in ways]
            held_cols.append(torch.tensor(held, dtype=torch.int64)[choice])
            moment_cols.append(torch.tensor(moment, dtype=torch.int64)[choice])
            time_cols.append(torch.tensor(times, dtype=torch.float64)[choice])
        before = torch.tensor([base if item.before is None else item.before for item in items], dtype=torch.int64)
        held = torch.stack(held_cols, 1) if items else torch.zeros((1, 0), dtype=torch.int64)
        ahead = held.cumsum(1) - held
        end = base + tail + held.sum(1)
        if items:
            moments = before + ahead + torch.stack(moment_cols, 1)
            self.peaks = torch.maximum(end, moments.amax(1))
            self.times = torch.stack(time_cols, 1).sum(1)
        else:
            self.peaks, self.times = end, torch.zeros(1, dtype=torch.float64)

    def index_of(self, solution: BudgetSolution) -> int:
        chosen = dict(zip(solution.selected, solution.options))
        return sum(
            stride * (0 if i not in chosen else 1 + chosen[i]) for i, stride in enumerate(self.strides)
        )

    def optimum(self, budget: int) -> Tuple[float, int]:
        """Least time of the combinations that fit, and the least peak at that time."""
        fits = self.peaks <= budget
        time = self.times.masked_fill(~fits, math.inf).min()
        return float(time), int(self.peaks[fits & (self.times == time)].min())


def option_instance(rng: random.Random, n: int, unit: int) -> Tuple[List[CostItem], int, int]:
    """Candidates with up to two options each, ``grads``, ``recompute_grads``, ``before``
    and sizes in multiples of ``unit``; ``kept`` differ, so that no times are pooled."""
    base = rng.randint(0, 40) * unit
    integer_times = rng.random() < 0.5

    def time() -> float:
        return float(rng.randint(0, 9)) if integer_times else rng.uniform(0.0, 1e-2)

    items = []
    for i, kept in enumerate(rng.sample(range(1, 60), n)):
        options = tuple(
            CostOption(f"level {k}", inputs=rng.randint(0, 40) * unit, rebuilt=rng.randint(0, 50) * unit, time=time())
            for k in range(rng.randint(0, 2))
        )
        items.append(
            CostItem(
                f"layers.{i}",
                kept=kept * unit,
                inputs=rng.randint(0, 15) * unit,
                time=time(),
                rebuilt=rng.choice([None, rng.randint(0, 60) * unit]),
                before=rng.choice([None, rng.randint(0, base // unit) * unit]),
                options=options,
                grads=rng.choice([0, rng.randint(0, 80) * unit]),
                recompute_grads=rng.choice([0, rng.randint(0, 40) * unit]),
                # A candidate called several times: one call keeps a share of ``kept``.
                call_kept=rng.choice([None, rng.randint(0, kept) * unit]),
            )
        )
    return items, base, rng.choice([0, rng.randint(0, 30) * unit])


def test_oracle_agrees_with_predicted_peak_on_every_combination():
    rng = random.Random(11)
    for _ in range(40):
        items, base, tail = option_instance(rng, rng.randint(0, 4), rng.choice([1, 5]))
        oracle = Oracle(items, base, tail)
        for index in range(len(oracle.peaks)):
            choices = [(index // s) % c for s, c in zip(oracle.strides, oracle.counts)]
            selected = [i for i, c in enumerate(choices) if c]
            options = {i: c - 1 for i, c in enumerate(choices) if c}
            peak = predicted_peak(items, selected, base=base, tail=tail, options=options)
            assert peak == int(oracle.peaks[index])


def test_solver_matches_the_oracle_on_random_instances():
    rng = random.Random(2024)
    for trial in range(220):
        unit = rng.choice([1, 3, 4096, MIB])
        items, base, tail = option_instance(rng, rng.randint(1, 10), unit)
        oracle = Oracle(items, base, tail)
        lowest = int(oracle.peaks.min())
        context = f"trial={trial} items={items} base={base} tail={tail}"
        assert smallest_reachable_peak(items, base=base, tail=tail) == lowest, context
        empty = int(oracle.peaks[0])
        budget = lowest if rng.random() < 0.2 or lowest >= empty else rng.randint(lowest, empty - 1)
        solution = solve_budget(items, budget, base=base, tail=tail)
        context += f" budget={budget} solution={solution}"
        time, peak = oracle.optimum(budget)
        assert math.isclose(solution.recompute_time, time, rel_tol=1e-9, abs_tol=1e-12), context
        assert solution.predicted_peak <= budget, context
        assert solution.predicted_peak == int(oracle.peaks[oracle.index_of(solution)]), context
        assert len(solution.options) == len(solution.selected), context
        times = [item.time for item in items] + [o.time for item in items for o in item.options]
        if all(t.is_integer() for t in times):
            # Integer times sum exactly: then the peak is the least at that time too.
            assert solution.predicted_peak == peak, context


# -------------------------------------------------------------------- segments and options


def all_plans(items: Sequence[CostItem]) -> List[Tuple[List[Tuple[int, ...]], Dict[int, int]]]:
    """Every plan: each candidate plain, alone with each way to recompute it, or starting
    a segment over the candidates after it that have ``joins``."""
    n = len(items)

    def from_position(i: int) -> List[Tuple[List[Tuple[int, ...]], Dict[int, int]]]:
        if i == n:
            return [([], {})]
        rest = from_position(i + 1)
        plans = list(rest)
        for option in range(len(items[i].options) + 1):
            plans += [([(i,)] + groups, {**options, i: option}) for groups, options in rest]
        j = i + 1
        while j < n and items[j].joins is not None:
            plans += [([tuple(range(i, j + 1))] + g, o) for g, o in from_position(j + 1)]
            j += 1
        return plans

    return from_position(0)


def plan_time(items: Sequence[CostItem], groups, options) -> float:
    times = []
    for group in groups:
        option = options.get(group[0], 0) if len(group) == 1 else 0
        for i in group:
            times.append(items[i].time if option == 0 else items[i].options[option - 1].time)
    return math.fsum(times)


def test_segments_with_options_match_the_best_of_every_plan():
    rng = random.Random(77)
    for _ in range(60):
        unit = rng.choice([1, 3, 4096])
        items, base, tail = option_instance(rng, rng.randint(1, 6), unit)
        # Join most candidates to the one before, within what 'before' leaves.
        joined, chained = 0, []
        for i, item in enumerate(items):
            room = (base if item.before is None else item.before) - joined
            joins = None
            if i and room >= 0 and rng.random() < 0.7:
                joins = rng.randint(0, room // unit) * unit
                joined += joins
            chained.append(CostItem(**{**vars(item), "joins": joins, "time": float(rng.randint(0, 9))}))
        items = chained
        plans = all_plans(items)
        peaks = [predicted_peak(items, g, base=base, tail=tail, options=o) for g, o in plans]
        assert smallest_reachable_peak(items, base=base, tail=tail) == min(peaks)
        empty = predicted_peak(items, [], base=base, tail=tail)
        if min(peaks) >= empty:
            assert solve_budget(items, empty, base=base, tail=tail).selected == ()
            continue
        budget = rng.randint(min(peaks), empty - 1)
        solution = solve_budget(items, budget, base=base, tail=tail)
        best = min((plan_time(items, g, o), p) for (g, o), p in zip(plans, peaks) if p <= budget)
        context = f"items={items} base={base} tail={tail} budget={budget} solution={solution}"
        assert (solution.recompute_time, solution.predicted_peak) == best, context
        alone = [i for i in solution.selected if not any(i in s for s in solution.segments)]
        options = {i: o for i, o in zip(solution.selected, solution.options) if i in alone}
        groups = list(solution.segments) + [(i,) for i in alone]
        assert predicted_peak(items, groups, base=base, tail=tail, options=options) == solution.predicted_peak
        assert all(o == 0 for i, o in zip(solution.selected, solution.options) if i not in alone)


# ------------------------------------------------------------------------------ by hand


def test_a_plain_candidates_backward_moment_binds():
    # a's backward holds all of base (saved before it), its activations and 150 bytes of
    # gradients: 50 + 100 + 150 = 300, above the end of the forward, 50 + 200.
    a = CostItem("a", kept=100, inputs=10, time=1.0, grads=150)
    b = CostItem("b", kept=100, inputs=10, time=1.0)
    assert predicted_peak([a, b], [], base=50) == 300
    # Without grads the end of the forward binds.
    assert predicted_peak([dataclasses.replace(a, grads=0), b], [], base=50) == 250
    # Checkpointing b leaves a's backward as it is; checkpointing a adds its inputs to it.
    assert predicted_peak([a, b], [1], base=50) == 300
    assert predicted_peak([a, b], [0], base=50) == 310
    assert smallest_reachable_peak([a, b], base=50) == 300
    with pytest.raises(CheckpointConfigError, match="below the smallest reachable peak 300 B"):
        solve_budget([a, b], 299, base=50)


def test_a_plain_backward_moment_forces_a_checkpoint_before_it():
    # a's backward holds what the candidates before it hold: checkpointing them lowers it.
    items = [
        CostItem("early", kept=100, inputs=10, time=1.0, before=0),
        CostItem("a", kept=50, inputs=40, time=1.0, before=0, grads=200),
    ]
    # Plain: end 150; a's backward 100 + 50 + 200 = 350. early checkpointed: end 60, a's
    # backward 10 + 50 + 200 = 260, early's moment 0 + 10 + 100 = 110.
    assert predicted_peak(items, [], base=0) == 350
    assert predicted_peak(items, [0], base=0) == 260
    assert solve_budget(items, 300, base=0).selected == (0,)


def test_a_cheaper_option_is_chosen_over_the_full_recomputation():
    cheap = CostOption("save mm", inputs=30, rebuilt=60, time=0.25)
    dear = CostOption("save all", inputs=90, rebuilt=0, time=0.1)
    items = [
        CostItem(f"l{i}", kept=100, inputs=10, time=1.0, options=(cheap, dear), before=0)
        for i in range(3)
    ]
    # Nothing: 300. Each candidate held 10 in full (moment 10 + 100), 30 with cheap
    # (moment max(30 + 60, 10 + 100) = 110), 90 with dear (max(90, 110) = 110).
    # At 250, one candidate in full (210, 1 s) or cheap (230, 0.25 s) fits, or two with
    # dear and cheap (220, 0.35 s): cheap alone is the cheapest.
    solution = solve_budget(items, 250, base=0)
    assert (solution.selected, solution.options) == ((0,), (1,))
    assert solution.recompute_time == 0.25 and solution.predicted_peak == 230
    # At 205 cheap alone does not fit; two cheap (160, moments 110 and 140) do, for 0.5 s.
    solution = solve_budget(items, 205, base=0)
    assert (solution.selected, solution.options, solution.recompute_time) == ((0, 1), (1, 1), 0.5)
    # At 295 dear alone fits (290) and costs least.
    solution = solve_budget(items, 295, base=0)
    assert (solution.selected, solution.options, solution.recompute_time) == ((0,), (2,), 0.1)


def test_tail_shifts_the_end_of_the_forward():
    items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0, before=0) for i in range(4)]
    # Two checkpointed: end 20 + 200 = 220 (+ tail); moments at most 10 + 10 + 100 = 120.
    assert predicted_peak(items, [0, 1], base=0) == 220
    assert predicted_peak(items, [0, 1], base=0, tail=30) == 250
    assert solve_budget(items, 240, base=0).selected == (0, 1)
    assert solve_budget(items, 240, base=0, tail=30).selected == (0, 1, 2)
    # All four: end 40 + 30, the last one's moment 30 + 10 + 100 = 140.
    assert smallest_reachable_peak(items, base=0, tail=30) == 140
    # A budget at the un-checkpointed peak, tail included, needs nothing.
    assert solve_budget(items, 430, base=0, tail=30).selected == ()


def test_recompute_grads_raise_the_recomputation():
    item = CostItem("a", kept=100, inputs=10, time=1.0, recompute_grads=40, grads=5)
    # Recomputation 10 + 100 + 40 = 150 above the backward 10 + 100 + 5.
    assert predicted_peak([item], [0], base=0) == 150
    # A segment adds the last member's recompute_grads to its recomputation.
    pair = [
        CostItem("a", kept=100, inputs=10, time=1.0),
        CostItem("b", kept=100, inputs=10, time=1.0, joins=0, recompute_grads=40),
    ]
    assert predicted_peak(pair, [(0, 1)], base=0) == 10 + 100 + 100 + 40


def test_solution_reports_options_and_their_times():
    option = CostOption("save mm", inputs=20, rebuilt=60, time=0.5)
    items = [CostItem(f"l{i}", kept=100, inputs=10, time=2.0, options=(option,)) for i in range(4)]
    solution = solve_budget(items, 250, base=0)
    assert solution == BudgetSolution((0, 1), 240, 1.0, 250, 10, (), (1, 1))


def test_pooled_times_pool_each_option():
    options = lambda t: (CostOption("o", inputs=5, rebuilt=50, time=t),)  # noqa: E731
    items = [
        CostItem("a", kept=100, inputs=10, time=1.0, options=options(0.1), grads=7),
        CostItem("b", kept=100, inputs=10, time=9.0, options=options(0.9)),
        CostItem("c", kept=100, inputs=10, time=2.0, options=options(0.2)),
        CostItem("d", kept=100, inputs=10, time=4.0, options=(CostOption("o", inputs=6, rebuilt=50, time=0.4),)),
    ]
    assert pooled_times(items) == [2.0, 2.0, 2.0, 4.0]
    # Noise in the options' times does not move the plan between the pooled candidates.
    plans = set()
    rng = random.Random(5)
    for _ in range(10):
        noisy = [
            CostItem(item.name, kept=100, inputs=10, time=1.0, options=options(rng.uniform(0.05, 0.5)))
            for item in items
        ]
        solution = solve_budget(noisy, 330, base=0)
        plans.add((solution.selected, solution.options))
    assert len(plans) == 1


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(grads=-1), r"'bad': grads .*-1"),
        (dict(grads=1.5), r"'bad': grads .*1\.5"),
        (dict(recompute_grads=-2), r"'bad': recompute_grads .*-2"),
        (dict(recompute_grads=True), r"'bad': recompute_grads .*True"),
        (dict(options="save"), r"'bad': options must be a sequence of CostOption; got 'save'"),
        (dict(options=[{"inputs": 1}]), r"'bad': options\[0\] is a dict"),
        (dict(options=[CostOption("x", inputs=-1, rebuilt=0, time=0.0)]), r"'bad': options\[0\] \('x'\) inputs .*-1"),
        (dict(options=[CostOption("x", 1, 2, 0.0), CostOption("y", inputs=1, rebuilt=2.5, time=0.0)]), r"'bad': options\[1\] \('y'\) rebuilt .*2\.5"),
        (dict(options=[CostOption("x", inputs=1, rebuilt=2, time=math.nan)]), r"'bad': options\[0\] \('x'\) time .*nan"),
        (dict(options=[CostOption("x", inputs=1, rebuilt=2, time=-1.0)]), r"'bad': options\[0\] \('x'\) time .*-1\.0"),
    ],
)
def test_bad_options_and_grads_are_named(fields, match):
    with pytest.raises(CheckpointConfigError, match=match):
        CostItem("bad", kept=10, inputs=1, time=1.0, **fields)


def test_options_are_stored_as_a_tuple():
    option = CostOption("x", inputs=1, rebuilt=2, time=0.5)
    assert CostItem("a", kept=10, inputs=1, time=1.0, options=[option]).options == (option,)


@pytest.mark.parametrize(
    ("selected", "options", "match"),
    [
        ([0], {0: 2}, r"candidate 0 \('a'\) option 2; it has 1 option\(s\), so allowed are 0 .* to 1"),
        ([0], {0: -1}, r"option -1"),
        ([0], {1: 1}, r"candidate 1, which is not selected"),
        ([(1, 2)], {1: 1}, r"candidate 1, which is in a segment"),
        ([0], [1], r"options must map a selected candidate index .*\[1\]"),
    ],
)
def test_bad_option_choices_are_named(selected, options, match):
    option = CostOption("x", inputs=1, rebuilt=2, time=0.5)
    items = [
        CostItem("a", kept=10, inputs=1, time=1.0, options=(option,)),
        CostItem("b", kept=10, inputs=1, time=1.0, options=(option,)),
        CostItem("c", kept=10, inputs=1, time=1.0, joins=1),
    ]
    with pytest.raises(CheckpointConfigError, match=match):
        predicted_peak(items, selected, base=5, options=options)


def test_bad_tail_is_named():
    items = [CostItem("a", kept=10, inputs=1, time=1.0)]
    for call in (
        lambda: predicted_peak(items, [], base=0, tail=-1),
        lambda: solve_budget(items, 10, base=0, tail=-1),
        lambda: smallest_reachable_peak(items, base=0, tail=-1),
    ):
        with pytest.raises(CheckpointConfigError, match=r"tail must be a non-negative integer .*-1"):
            call()


def test_plans_on_a_coarse_axis_fit_and_report_their_options():
    # Arbitrary byte sizes on a tiny axis: rounded, so only fitting is promised, and the
    # plan's peak is the exact one of its regions and options.
    rng = random.Random(9)
    for _ in range(40):
        items, base, tail = option_instance(rng, rng.randint(1, 8), 1)
        items = [
            dataclasses.replace(
                item,
                kept=item.kept * 7919 + rng.randrange(7919),
                call_kept=None,
                options=tuple(dataclasses.replace(o, inputs=o.inputs * 7919 + rng.randrange(97)) for o in item.options),
            )
            for item in items
        ]
        with mock.patch.multiple(_solver, _EXACT_STEPS=8, _APPROX_STEPS=8):
            lowest = smallest_reachable_peak(items, base=base, tail=tail)
            empty = predicted_peak(items, [], base=base, tail=tail)
            budget = rng.randint(min(lowest, empty), empty)
            solution = solve_budget(items, budget, base=base, tail=tail)
        assert Oracle(items, base, tail).peaks.min() <= lowest
        options = dict(zip(solution.selected, solution.options))
        peak = predicted_peak(items, solution.selected, base=base, tail=tail, options=options)
        assert solution.predicted_peak == peak <= budget

"""Benchmark the budget planner's solver on random instances of realistic size.

Candidates keep MiB-scale activations. With sizes in arbitrary bytes the solver works on
its coarse axis; with savings in whole MiB (a few dozen per candidate) it takes the exact
axis, up to ~32k steps. Budgets lie between the smallest reachable peak and the
un-checkpointed one. Prints the median solve time over a few repeats against the
targets (50 ms for 100 candidates, 1 s for 1000, 100 ms for 100 candidates with eight
choices each) and the recompute time of each plan.

    python benchmarks/solver.py [--repeats 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import List, Optional, Sequence, Tuple

from ckptwrap.planner import CostItem, CostOption, format_bytes, predicted_peak
from ckptwrap.planner._solver import BudgetSolution, smallest_reachable_peak, solve_budget

_MIB = 1 << 20
CASES: Tuple[Tuple[int, str, Optional[float]], ...] = (
    (10, "bytes", None),
    (100, "bytes", 0.050),
    (1000, "bytes", 1.0),
    (100, "MiB", 0.050),
    (1000, "MiB", 1.0),
    (100, "chain", None),
    (1000, "chain", None),
    (100, "options", 0.100),
    (1000, "options", None),
)
"""Candidate count, size granularity and target seconds (None: no target). ``chain``
candidates (sizes in bytes) each take the previous one's output, so the solver also
weighs segments of consecutive candidates: more work per candidate, no target.
``options`` candidates (sizes in bytes) have eight choices each: plain, recomputed in
full, or one of six selective levels, with gradients held by their backward and
recomputation, and a tail after the last one."""
OPTION_LEVELS = 6
"""Selective levels per ``options`` candidate, besides the full recomputation."""
BUDGET_POSITIONS = (0.1, 0.5, 0.9)
"""Where each budget lies between the smallest reachable peak (0) and no checkpointing (1)."""


def random_instance(n: int, sizes: str, rng: random.Random) -> Tuple[List[CostItem], int, int]:
    """``n`` candidates like blocks of mixed widths, the base bytes and the tail bytes.

    ``sizes`` is ``"bytes"`` for arbitrary byte counts, ``"MiB"`` for whole MiB,
    ``"chain"`` for byte counts of candidates that can form segments, or ``"options"`` for
    byte counts of candidates with selective levels.
    """
    items = []
    for i in range(n):
        if sizes == "MiB":
            kept, inputs = rng.randint(2, 60) * _MIB, rng.randint(0, 1) * _MIB
        else:
            kept, inputs = rng.randint(8 * _MIB, 96 * _MIB), rng.randint(_MIB // 2, 8 * _MIB)
        time = rng.uniform(1e-3, 2e-2)
        joins = rng.randint(_MIB // 2, 2 * _MIB) if sizes == "chain" and i else None
        if sizes != "options":
            items.append(CostItem(f"layers.{i}", kept=kept, inputs=inputs, time=time, joins=joins))
            continue
        # Level k saves a growing share of the activations: it holds more and recomputes
        # less, in bytes and in time.
        shares = sorted(rng.uniform(0.05, 0.9) for _ in range(OPTION_LEVELS))
        options = tuple(
            CostOption(
                f"level {k}",
                inputs=inputs + int(share * kept),
                rebuilt=kept - int(share * kept),
                time=time * (1 - share) * rng.uniform(0.9, 1.1),
            )
            for k, share in enumerate(shares, 1)
        )
        items.append(
            CostItem(
                f"layers.{i}", kept=kept, inputs=inputs, time=time, options=options,
                grads=rng.randint(_MIB, 16 * _MIB), recompute_grads=rng.randint(_MIB, 8 * _MIB),
            )
        )
    joined = sum(item.joins or 0 for item in items)
    tail = rng.randint(_MIB, 64 * _MIB) if sizes == "options" else 0
    return items, joined + rng.randint(16 * _MIB, 256 * _MIB), tail


def budgets(items: Sequence[CostItem], base: int, tail: int) -> List[int]:
    """One budget per position in ``BUDGET_POSITIONS``."""
    low = smallest_reachable_peak(items, base=base, tail=tail)
    high = predicted_peak(items, (), base=base, tail=tail)
    return [low + int(position * (high - low)) for position in BUDGET_POSITIONS]


def time_solve(
    items: Sequence[CostItem], budget: int, base: int, tail: int, repeats: int
) -> Tuple[float, BudgetSolution]:
    """Median seconds of ``solve_budget`` over ``repeats`` runs, and its plan."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        solution = solve_budget(items, budget, base=base, tail=tail)
        seconds.append(time.perf_counter() - start)
        assert solution.predicted_peak <= budget
    return statistics.median(seconds), solution


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    header = (
        f"{'candidates':>10}  {'sizes':>7}  {'budget pos':>10}  {'selected':>8}  "
        f"{'recompute':>9}  {'unit':>9}  {'median':>10}  {'target':>8}  result"
    )
    print(header)
    print("-" * len(header))
    failed = False
    for n, sizes, target in CASES:
        items, base, tail = random_instance(n, sizes, rng)
        for position, budget in zip(BUDGET_POSITIONS, budgets(items, base, tail)):
            seconds, solution = time_solve(items, budget, base, tail, args.repeats)
            verdict = f"{'-':>8}  -"
            if target is not None:
                verdict = f"{target * 1e3:>5.0f} ms  {'pass' if seconds <= target else 'FAIL'}"
                failed |= seconds > target
            print(
                f"{n:>10}  {sizes:>7}  {position:>10.1f}  {len(solution.selected):>8}  "
                f"{solution.recompute_time * 1e3:>6.1f} ms  {format_bytes(solution.unit):>9}  "
                f"{seconds * 1e3:>7.2f} ms  {verdict}"
            )
    print("all targets met" if not failed else "some targets missed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the budget planner's solver on random instances of realistic size.

Candidates keep MiB-scale activations (sizes not multiples of any round unit, so the
solver works on its coarse axis), budgets lie between the smallest reachable peak and the
un-checkpointed one. Prints, per candidate count, the median solve time over a few
repeats (the slowest budget's) against the targets: 50 ms for 100 candidates, 1 s for 1000.

    python benchmarks/solver.py [--repeats 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ckptwrap.policy._solver import (
    CostItem,
    format_bytes,
    smallest_reachable_peak,
    solve_budget,
)

_MIB = 1 << 20
TARGETS: Dict[int, Optional[float]] = {10: None, 100: 0.050, 1000: 1.0}
BUDGET_POSITIONS = (0.1, 0.5, 0.9)
"""Where each budget lies between the smallest reachable peak (0) and no checkpointing (1)."""


def random_instance(n: int, rng: random.Random) -> Tuple[List[CostItem], int]:
    """``n`` candidates like transformer blocks of mixed widths, and the base bytes."""
    items = []
    for i in range(n):
        kept = rng.randint(8 * _MIB, 96 * _MIB)
        inputs = rng.randint(_MIB // 2, 8 * _MIB)
        items.append(CostItem(f"layers.{i}", kept=kept, inputs=inputs, time=rng.uniform(1e-3, 2e-2)))
    return items, rng.randint(16 * _MIB, 256 * _MIB)


def budgets(items: Sequence[CostItem], base: int) -> List[int]:
    """One budget per position in ``BUDGET_POSITIONS``."""
    low = smallest_reachable_peak(items, base=base)
    high = base + sum(item.kept for item in items)
    return [low + int(position * (high - low)) for position in BUDGET_POSITIONS]


def time_solve(items: Sequence[CostItem], budget: int, base: int, repeats: int) -> Tuple[float, int, int]:
    """Median seconds of ``solve_budget`` over ``repeats`` runs, the plan's size and unit."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        solution = solve_budget(items, budget, base=base)
        seconds.append(time.perf_counter() - start)
        assert solution.predicted_peak <= budget
    return statistics.median(seconds), len(solution.selected), solution.unit


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    header = f"{'candidates':>10}  {'budget pos':>10}  {'selected':>8}  {'unit':>9}  {'median':>10}  {'target':>8}  result"
    print(header)
    print("-" * len(header))
    failed = False
    for n, target in TARGETS.items():
        items, base = random_instance(n, rng)
        slowest = 0.0
        for position, budget in zip(BUDGET_POSITIONS, budgets(items, base)):
            seconds, count, unit = time_solve(items, budget, base, args.repeats)
            slowest = max(slowest, seconds)
            print(
                f"{n:>10}  {position:>10.1f}  {count:>8}  {format_bytes(unit):>9}  "
                f"{seconds * 1e3:>7.2f} ms  "
                + (f"{target * 1e3:>5.0f} ms  {'pass' if seconds <= target else 'FAIL'}" if target else f"{'-':>8}  -")
            )
        failed |= target is not None and slowest > target
    print("all targets met" if not failed else "some targets missed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What planning costs at a realistic size, in plain training steps of the same model.

GPT-2 124M (transformers' default GPT2Config, random weights) at 2 x 512 tokens, on the
CPU (or ``--device cuda``): one plain training step (forward and backward, the faster of two after a warm-up)
and one step under ``blocks`` unmetered (every block recomputed: the plan a measured step
runs under), then, each beside them as ratios:

- ``plan(blocks)`` and ``plan(budget:50%)`` with example inputs (one measured step each);
- ``plan(budget:50%)`` on the model built on the meta device (a step on fake tensors,
  nothing allocated);
- a lazy ``budget:50%``'s first training step (measured as it runs) and its second (solved).

Targets: planning with example inputs within one plain step, a lazy first step within
1.25, and a measured step within 1.3 times the same plan unmetered (``blocks``). The exit
status is 0 only where every target is met.

    python benchmarks/planning_time.py [--rows 2] [--length 512] [--threads N] [--budget budget:50%] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import torch

import ckptwrap

PLANNING_TARGET = 1.0
"""The most plain steps planning with example inputs may take."""
LAZY_TARGET = 1.25
"""The most plain steps a lazy budget's first (measured) step may take."""
METERED_TARGET = 1.3
"""The most a measured step may take, in steps of the same plan unmetered (``blocks``)."""


def _seconds(run: Callable[[], object]) -> float:
    """Wall-clock seconds of ``run()``, with the accelerator's queue (if any) drained
    before and after."""
    accelerated = torch.accelerator.is_available()
    if accelerated:
        torch.accelerator.synchronize()
    start = time.perf_counter()
    run()
    if accelerated:
        torch.accelerator.synchronize()
    return time.perf_counter() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--budget", default="budget:50%", help="the budget planned (default budget:50%%)")
    parser.add_argument("--device", default="cpu", help="where the model trains (default cpu; cuda on a GPU)")
    args = parser.parse_args(argv)
    import transformers

    torch.set_num_threads(args.threads)
    config = transformers.GPT2Config()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train().to(args.device)
    ids = torch.randint(config.vocab_size, (args.rows, args.length), generator=torch.Generator().manual_seed(0))
    on_cpu = {"input_ids": ids, "labels": ids}
    batch = {name: value.to(args.device) for name, value in on_cpu.items()}

    def step(trained: torch.nn.Module) -> None:
        out = trained(**batch)
        out.loss.backward()
        trained.zero_grad(set_to_none=True)

    step(model)
    plain = min(_seconds(lambda: step(model)), _seconds(lambda: step(model)))
    # One copy: timed under blocks, then unwrapped (exactly) and wrapped with the lazy budget.
    lazy = ckptwrap.wrap_model(copy.deepcopy(model), "blocks")
    step(lazy)
    unmetered = min(_seconds(lambda: step(lazy)), _seconds(lambda: step(lazy)))
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(config)
    budget = args.budget
    ckptwrap.wrap_model(ckptwrap.unwrap_model(lazy), budget)
    rows: List[Tuple[str, float]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows.append(("plan(blocks), example inputs", _seconds(lambda: ckptwrap.plan(model, "blocks", example_kwargs=batch))))
        rows.append((f"plan({budget}), example inputs", _seconds(lambda: ckptwrap.plan(model, budget, example_kwargs=batch))))
        rows.append((f"plan({budget}), meta device", _seconds(lambda: ckptwrap.plan(meta, budget, example_kwargs=on_cpu))))
        rows.append((f"lazy {budget}, first step (measured)", _seconds(lambda: step(lazy))))
        rows.append((f"lazy {budget}, second step (solved)", _seconds(lambda: step(lazy))))
    where = f"{args.threads} threads" if args.device == "cpu" else args.device
    print(f"GPT-2 124M, {args.rows} x {args.length} tokens, {where}: plain step {plain:.3f} s, "
          f"blocks unmetered {unmetered:.3f} s ({unmetered / plain:.2f} plain steps)\n")
    width = max(len(name) for name, _ in rows)
    print(f"{'':{width}}  seconds  plain steps  blocks steps")
    for name, seconds in rows:
        print(f"{name:{width}}  {seconds:7.3f}  {seconds / plain:11.2f}  {seconds / unmetered:12.2f}")
    planning = max(seconds / plain for _, seconds in rows[:2])
    lazy = rows[3][1] / plain
    metered = max(seconds / unmetered for _, seconds in (rows[0], rows[1], rows[3]))
    targets = [
        (f"planning with example inputs within {PLANNING_TARGET:g} plain step", planning, PLANNING_TARGET),
        (f"a lazy first step within {LAZY_TARGET:g} plain steps", lazy, LAZY_TARGET),
        (f"a measured step within {METERED_TARGET:g} blocks steps unmetered", metered, METERED_TARGET),
    ]
    print()
    for name, value, target in targets:
        print(f"target ({name}): {'met' if value <= target else 'MISSED'} ({value:.2f})")
    return 0 if all(value <= target for _, value, target in targets) else 1


if __name__ == "__main__":
    sys.exit(main())

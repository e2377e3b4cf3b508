"""The budget planner on the model zoo (``benchmarks/_zoo.py``): stacks of blocks, and models
that are not (encoder-decoders, a mixture of experts, a U-Net's skip connections, a
recurrent cell called once per time step, ALBERT's shared layer).

Per model, three plans made on example inputs: every candidate checkpointed (the policy's
set term alone), and budgets a third and two thirds of the way from the least peak the
planner predicts reachable to the un-checkpointed one. Each is applied and one training
step measured at the CPU allocator (``torch.profiler``'s memory events).

- "plain MiB": the un-checkpointed step's measured peak; "pred/meas": its prediction over it.
- "predicted", "measured": the plan's predicted and measured step peaks, MiB;
  "pred/meas" their ratio (target: within 5%).
- "over": how far the measured peak passed the budget, in % of the plain peak (target:
  at most 3%); "grads": every gradient equal to the plain model's, bit for bit.
- "plan s": the time ``wrap_model`` took to measure and plan.

    python benchmarks/zoo.py [--rows 4] [--length 128] [--only NAME,...] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptwrap  # noqa: E402
from _allocator import allocator_peak  # noqa: E402
from _zoo import HF_MODELS, ZOO, Workload, has_transformers  # noqa: E402

PREDICTION = 0.05
OVER = 0.03


def _step(workload: Workload, model: torch.nn.Module) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = workload.loss(model(*workload.args, **workload.kwargs))
    loss.backward()
    return loss.detach()


def _peak(workload: Workload, model: torch.nn.Module) -> int:
    model.zero_grad(set_to_none=True)
    peak = allocator_peak(lambda: _step(workload, model))
    model.zero_grad(set_to_none=True)
    return peak


def _same(workload: Workload, model: torch.nn.Module, plain: torch.nn.Module) -> bool:
    if not torch.equal(_step(workload, model), _step(workload, plain)):
        return False
    return all(
        (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
        for a, b in zip(model.parameters(), plain.parameters())
    )


def run(name: str, rows: int, length: int) -> List[bool]:
    workload = ZOO[name](rows, length)
    plain = copy.deepcopy(workload.model)
    example = dict(example_inputs=workload.args, example_kwargs=workload.kwargs, loss_fn=workload.loss)
    plain_peak = _peak(workload, plain)
    every = ckptwrap.plan(copy.deepcopy(plain), workload.candidates, **example)
    low, high = every.predicted_peak, every.plain_peak
    policies = [workload.candidates] + [
        f"{workload.candidates};budget:{int(low + share * (high - low))}B" for share in (1 / 3, 2 / 3)
    ]
    print(f"\n{workload.name} (rows {rows}, length {length}): plain {plain_peak / 2**20:.2f} MiB, "
          f"predicted {every.plain_peak / plain_peak:.3f} of it")
    print(f"  {'policy':<34}{'ckpt':>5}{'predicted':>11}{'measured':>10}{'pred/meas':>11}{'over':>8}{'grads':>7}{'plan s':>8}")
    results = []
    for policy in policies:
        model = copy.deepcopy(plain)
        start = time.perf_counter()
        ckptwrap.wrap_model(model, policy, **example)
        seconds = time.perf_counter() - start
        applied = model.ckptwrap_plan
        measured = _peak(workload, model)
        ratio = applied.predicted_peak / measured
        over = (measured - applied.budget) / plain_peak if applied.budget is not None else 0.0
        same = _same(workload, model, plain)
        results.append(abs(ratio - 1) <= PREDICTION and over <= OVER and same)
        print(f"  {policy:<34}{len(applied.names):>5}{applied.predicted_peak / 2**20:>11.2f}"
              f"{measured / 2**20:>10.2f}{ratio:>11.3f}{100 * over:>7.1f}%{'yes' if same else 'NO':>7}{seconds:>8.2f}")
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--only", help="comma-separated model names: " + ", ".join(ZOO))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.only.split(",") if args.only else list(ZOO)
    unknown = [name for name in names if name not in ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(ZOO)}")
    rows, length = (2, 32) if args.quick else (args.rows, args.length)
    results = []
    for name in names:
        if name in HF_MODELS and not has_transformers():
            print(f"\n{name}: skipped, transformers is not installed")
            continue
        results += run(name, rows, length)
    met = all(results)
    print(f"\ntargets (pred/meas within {PREDICTION:.0%}, over at most {OVER:.0%}, grads bit-exact): "
          f"{sum(results)} of {len(results)} plans met them{'' if met else ' -- NOT all'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

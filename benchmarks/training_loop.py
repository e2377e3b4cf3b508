"""A lazy ``budget:`` in a training loop with dynamic padding, against ``blocks``.

Each model (Hugging Face GPT-2 and the GPT stack, dropout on) is fine-tuned with SGD for
``--steps`` steps on batches whose length is drawn from ``--min-len``..``--max-len`` per
step, under four policies applied the way a training script does, with no example
inputs: ``none`` (the reference), ``blocks``, an absolute budget (half the predicted
un-checkpointed step peak at the longest length, in bytes) and ``budget:50%``. The budget
rows plan on their first training forward and then each new shape before its forward
goes on.

Two passes over the same batches:

- **time**: the policies take turns step by step (the order rotating each step) and
  nothing is measured but time. "total s" is a policy's summed step time, planning
  included; "vs blocks" is it over ``blocks``'s (target: at most 1.10 for the budget rows).
  "measured" counts the steps its planner measured (each ran under the plan of least
  memory, metered), "checked" the steps metered against their prediction, "solves" the
  steps planned by a solve, with the median and longest time a plan took.
- **memory**: every step of the budget rows and of ``none`` runs under an allocator meter
  (``torch.profiler``'s memory events). "worst over" is the largest step peak above the
  budget at that step, planning steps included, in % of ``none``'s step peak at the
  longest length (target: at most 3%); "steps over" counts steps above the budget at
  all. Losses and every gradient are compared with ``none``'s at every step, bit for bit.

    python benchmarks/training_loop.py [--steps 48] [--batch 8] [--only gpt2|stack] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptwrap  # noqa: E402
from ckptwrap.planner import ShapePlanner  # noqa: E402
from _allocator import allocator_peak  # noqa: E402
from _loop import LoopModel, gpt_stack, hf_gpt2, lengths, train_step  # noqa: E402

TIME_TARGET = 1.10
"""A budget row's total time over ``blocks``'s."""
OVER_TARGET = 0.03
"""How far above the budget a step may peak, in a share of the plain peak at the longest length."""
_LR = 1e-3


class _Timed:
    """Times every call of ``ShapePlanner.decide``, and whether it measured or checked."""

    def __init__(self) -> None:
        self.calls: Dict[int, List[Tuple[float, str]]] = {}
        self._original = ShapePlanner.decide

    def __enter__(self) -> "_Timed":
        timed = self

        def decide(planner: ShapePlanner, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            decision = timed._original(planner, *args, **kwargs)
            kind = "measured" if decision.measure else "checked" if decision.check else "solved"
            timed.calls.setdefault(id(planner), []).append((time.perf_counter() - start, kind))
            return decision

        ShapePlanner.decide = decide  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        ShapePlanner.decide = self._original  # type: ignore[method-assign]

    def of(self, model: torch.nn.Module) -> List[Tuple[float, str]]:
        hook = next(h for h in model._forward_pre_hooks.values() if hasattr(h, "planner"))
        return self.calls.get(id(hook.planner), [])


def _policies(loop: LoopModel, rows: int, longest: int) -> List[str]:
    """``none``, ``blocks`` and the two budgets; the absolute one is half the predicted
    un-checkpointed peak at the longest length."""
    args, kwargs = loop.batch(rows, longest, 0)
    plain = ckptwrap.plan(loop.build(), "blocks", example_inputs=args, example_kwargs=kwargs).plain_peak
    return ["none", "blocks", f"budget:{plain // 2}B", "budget:50%"]


def _models(loop: LoopModel, policies: Sequence[str]) -> Dict[str, Tuple[torch.nn.Module, torch.optim.Optimizer]]:
    built = {}
    for policy in policies:
        model = loop.build()
        if policy != "none":
            ckptwrap.wrap_model(model, policy)
        built[policy] = (model, torch.optim.SGD(model.parameters(), lr=_LR))
    return built


def time_pass(loop: LoopModel, policies: Sequence[str], drawn: Sequence[int], rows: int) -> Dict[str, Any]:
    models = _models(loop, policies)
    totals = {policy: 0.0 for policy in policies}
    with _Timed() as timed:
        for step, length in enumerate(drawn):
            batch = loop.batch(rows, length, step)
            order = list(policies[step % len(policies):]) + list(policies[: step % len(policies)])
            for policy in order:
                model, optimizer = models[policy]
                start = time.perf_counter()
                train_step(model, loop, batch, step, optimizer)
                totals[policy] += time.perf_counter() - start
        plans = {p: timed.of(models[p][0]) for p in policies if p.startswith("budget")}
    return {"totals": totals, "plans": plans}


def memory_pass(loop: LoopModel, policies: Sequence[str], drawn: Sequence[int], rows: int) -> Dict[str, Any]:
    models = _models(loop, policies)
    budgets = [p for p in policies if p.startswith("budget")]
    longest_plain = 0
    worst = {p: -1.0 for p in budgets}
    over = {p: 0 for p in budgets}
    equal = {p: True for p in budgets}
    for step, length in enumerate(drawn):
        batch = loop.batch(rows, length, step)
        peaks, losses = {}, {}
        for policy in ["none", *budgets]:
            model, optimizer = models[policy]

            def run() -> None:
                losses[policy] = train_step(model, loop, batch, step, optimizer)

            peaks[policy] = allocator_peak(run)
        if length == max(drawn):
            longest_plain = max(longest_plain, peaks["none"])
        reference = models["none"][0]
        for policy in budgets:
            model = models[policy][0]
            budget = model.ckptwrap_plan.budget
            worst[policy] = max(worst[policy], peaks[policy] - budget)
            over[policy] += peaks[policy] > budget
            same = torch.equal(losses[policy], losses["none"]) and all(
                (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
                for a, b in zip(model.parameters(), reference.parameters())
            )
            equal[policy] = equal[policy] and same
    return {
        "worst": {p: worst[p] / longest_plain for p in budgets},
        "over": over, "equal": equal, "plain": longest_plain,
    }


def _plans(calls: List[Tuple[float, str]]) -> Tuple[int, int, int, str]:
    kinds = [kind for _, kind in calls]
    solves = [seconds for seconds, kind in calls if kind != "measured"]
    shown = f"{1e3 * statistics.median(solves):.1f} / {1e3 * max(solves):.1f}" if solves else "-"
    return kinds.count("measured"), kinds.count("checked"), len(solves), shown


def report(loop: LoopModel, timing: Dict[str, Any], memory: Dict[str, Any], steps: int) -> bool:
    totals = timing["totals"]
    print(f"\n{loop.name}: {steps} steps; plain step peak at the longest length {memory['plain'] / 2**20:.1f} MiB")
    header = f"{'policy':<22}{'total s':>9}{'vs blocks':>11}{'measured':>10}{'checked':>9}{'solves':>8}{'plan ms med/max':>17}{'worst over':>12}{'steps over':>12}{'grads':>7}"
    print(header)
    print("-" * len(header))
    ok = True
    for policy, total in totals.items():
        ratio = total / totals["blocks"]
        row = f"{policy:<22}{total:>9.2f}{ratio:>11.3f}"
        if policy in timing["plans"]:
            measured, checked, solves, shown = _plans(timing["plans"][policy])
            worst = memory["worst"][policy]
            row += f"{measured:>10}{checked:>9}{solves:>8}{shown:>17}{100 * worst:>11.1f}%{memory['over'][policy]:>12}"
            row += f"{'yes' if memory['equal'][policy] else 'NO':>7}"
            ok &= ratio <= TIME_TARGET and worst <= OVER_TARGET and memory["equal"][policy]
        print(row)
    return ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--only", choices=["gpt2", "stack"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps: a smoke run")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size: Dict[str, int] = dict(width=32, layers=2, heads=2, longest=args.max_len) if args.quick else dict(longest=args.max_len)
    steps = 6 if args.quick else args.steps
    loops = []
    if args.only in (None, "gpt2"):
        try:
            loops.append(hf_gpt2(**size, vocab=256 if args.quick else 1024))
        except ImportError:
            print("HF GPT-2 skipped, transformers is not installed")
    if args.only in (None, "stack"):
        loops.append(gpt_stack(**size, vocab=256 if args.quick else 512))
    drawn = lengths(steps, args.min_len, args.max_len)
    print(f"lengths: {drawn}")
    ok = True
    for loop in loops:
        policies = _policies(loop, args.batch, args.max_len)
        timing = time_pass(loop, policies, drawn, args.batch)
        memory = memory_pass(loop, policies, drawn, args.batch)
        ok &= report(loop, timing, memory, steps)
    print(f"\ntargets (vs blocks <= {TIME_TARGET:.2f}, worst over <= {100 * OVER_TARGET:.0f}%, grads bit-exact): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

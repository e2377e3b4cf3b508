"""Tell a kernel's nondeterminism from ckptwrap's: train three copies of a model side by
side (the plain model, a second plain copy, and the model under a lazy ``budget:``), the
loops of ``benchmarks/_budget_loops``, over and over, and say at which step each copy
first differs from the plain model, with the budget model's decision at every step.

A plain copy that differs means the kernels are not deterministic (nothing ckptwrap can
fix); a budget model that differs while the plain copy never does is ckptwrap's.
Deterministic kernels and math attention, as in ``tests/cuda``. Every other run wraps
each training step in ``torch.profiler`` as the budget-loop benchmark's meter does.

    python scripts/repeat_exactness.py --device cuda --seconds 200 --cases bert:padded,whisper:held
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ckptwrap  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _allocator import allocator_peak  # noqa: E402
from _architectures import ARCHITECTURES, widened  # noqa: E402
from _budget_loops import _forward, _inputs, _policy, _warm, budget_for, schedule  # noqa: E402


def _differing(model: nn.Module, plain: nn.Module) -> List[Tuple[str, float]]:
    found = []
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        if (ours.grad is None) != (theirs.grad is None):
            found.append((name, float("inf")))
        elif ours.grad is not None and not torch.equal(ours.grad, theirs.grad):
            found.append((name, (ours.grad - theirs.grad).abs().max().item()))
    return found


def _decision(hook: Any) -> str:
    step = hook.current
    if step is None:
        return "-"
    decision = step.decision
    chosen = "" if decision.choice is None else " " + ", ".join(
        e.name + (f" ({e.option})" if e.option else "") + (f" joins {e.joins}" if e.joins else "")
        for e in decision.choice.entries)
    return f"measure={decision.measure} check={decision.check} source={decision.source or '-'}{chosen}"


def one_run(name: str, loop: str, width: int, steps: int, device: str, profiled: bool) -> List[str]:
    """One training run of the three copies; lines saying where each first differed."""
    arch = widened(ARCHITECTURES[name], width)
    template = arch.build().to(device)
    if torch.device(device).type != "cpu":
        _warm(device)
    plain, again, model = (copy.deepcopy(template) for _ in range(3))
    ckptwrap.wrap_model(model, _policy(arch, budget_for(arch, template, device)))
    hook = next(h for h in model._forward_pre_hooks.values() if hasattr(h, "planner"))
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (plain, again, model)]
    first = {"plain copy": None, "budget": None}
    decisions = []
    for index, forwards in enumerate(schedule(arch, loop, steps)):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        for forward in forwards:
            losses: List[torch.Tensor] = []
            for each in (plain, again, model):
                batch = _inputs(each, arch, forward, device)

                def step(each: nn.Module = each, batch: Any = batch, forward: Any = forward) -> None:
                    losses.append(_forward(each, arch, forward, loop != "loss", batch))

                allocator_peak(step, device) if profiled else step()
            decisions.append(f"  step {index} {forward[:2]}: {_decision(hook)}")
            for label, each, loss in (("plain copy", again, losses[1]), ("budget", model, losses[2])):
                differing = _differing(each, plain)
                if first[label] is None and (differing or not torch.equal(losses[0], loss)):
                    first[label] = (f"step {index} {forward[:2]}, loss equal: {torch.equal(losses[0], loss)}, "
                                    f"{len(differing)} gradients differ, e.g. {differing[:3]}")
        for optimizer in optimizers:
            optimizer.step()
    lines = [f"{name}-{loop} ({'profiled' if profiled else 'plain'}): plain copy: {first['plain copy'] or 'equal'}; "
             f"budget: {first['budget'] or 'equal'}"]
    return lines + (decisions if first["budget"] else [])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", default="bert:padded,whisper:held,bert:held", help="model:loop, comma-separated")
    parser.add_argument("--width", type=int, default=4, help="the catalogue's widths this many times (tests/cuda: 4)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=120, help="run rounds until this much time has passed")
    parser.add_argument("--rounds", type=int, default=0, help="exactly this many rounds (0: as time allows)")
    args = parser.parse_args(argv)
    cases = [tuple(case.split(":")) for case in args.cases.split(",") if case]
    unknown = [case for case in cases if len(case) != 2 or case[0] not in ARCHITECTURES]
    if unknown:
        parser.error(f"--cases takes model:loop with models of {', '.join(ARCHITECTURES)}; got {unknown}")
    torch.use_deterministic_algorithms(True, warn_only=True)
    for fused in ("flash", "mem_efficient", "cudnn"):
        getattr(torch.backends.cuda, f"enable_{fused}_sdp")(False)
    deadline, rounds, differed = time.perf_counter() + args.seconds, 0, 0
    while rounds < args.rounds if args.rounds else (rounds == 0 or time.perf_counter() < deadline):
        for name, loop in cases:
            lines = one_run(name, loop, args.width, args.steps, args.device, profiled=rounds % 2 == 1)
            differed += "budget: equal" not in lines[0]
            print(f"round {rounds} " + "\n".join(lines), flush=True)
        rounds += 1
    print(f"{rounds} rounds of {len(cases)} cases; the budget model differed in {differed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

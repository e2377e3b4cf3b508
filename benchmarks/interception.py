"""What intercepting every operator costs: one block's forward, plain and under each mode.

A selective level (``budget:`` choosing per block down to operators, or the ``selective``
tier) runs the checkpointed forward and its recomputation under torch's selective
checkpointing dispatch mode, which calls into Python for every operator. This benchmark
takes the first repeated block of each model of ``benchmarks/frontier.py`` (same sizes,
same flags), with the inputs it gets in a training step, and times its forward (autograd
off, so only the operators and the mode are timed) under:

- nothing (the reference);
- torch's selective-checkpoint forward context, saving nothing (what a level pays per
  pass; the planner measures the same as ``selective_overhead``);
- a bare ``TorchDispatchMode`` that only calls each operator (the floor of any per-operator
  mode: the Python round trip);
- a bare ``TorchFunctionMode`` (one Python call per torch function, above autograd).

Modes take turns round by round; each column is the median of per-round ratios to the
plain forward, and "us per call" divides the added time by the calls the mode saw.

    python benchmarks/interception.py [--threads 1] [--rounds 30] [--only gpt2] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptwrap  # noqa: E402
from _frontier_models import Bench, build_benches, parse_run_args  # noqa: E402


class _BareDispatch(TorchDispatchMode):
    """Calls each operator as it is; counts the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class _BareFunction(TorchFunctionMode):
    """Calls each torch function as it is; counts the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _save_nothing(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective() -> ContextManager:
    return create_selective_checkpoint_contexts(_save_nothing)[0]


MODES: Dict[str, Callable[[], ContextManager]] = {
    "plain": contextlib.nullcontext,
    "selective checkpoint mode": _selective,
    "bare dispatch mode": _BareDispatch,
    "bare function mode": _BareFunction,
}


def first_block(bench: Bench) -> Tuple[str, nn.Module, Tuple[Any, ...], Dict[str, Any]]:
    """The first module ``blocks`` selects, and the inputs a training step gives it."""
    name = ckptwrap.plan(bench.model, "blocks").selected[0].name
    block = bench.model.get_submodule(name)
    seen: List[Tuple[Tuple[Any, ...], Dict[str, Any]]] = []

    def capture(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if not seen:
            seen.append((_detached(args), _detached(kwargs)))

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            bench.model(*bench.args, **bench.kwargs)
    finally:
        handle.remove()
    return name, block, seen[0][0], seen[0][1]


def _detached(value: Any) -> Any:
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), value)


def _dispatch_calls(block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, int]:
    counts = {}
    for label, make in (("bare dispatch mode", _BareDispatch), ("bare function mode", _BareFunction)):
        mode = make()
        with torch.no_grad(), mode:
            block(*args, **kwargs)
        counts[label] = mode.calls
    # Both are dispatch modes: the selective one sees the same operators as the bare one.
    counts["selective checkpoint mode"] = counts["bare dispatch mode"]
    return counts


def measure(block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], rounds: int,
            warmup: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Per mode, the median forward seconds and the median per-round ratio to plain."""
    labels = list(MODES)
    seconds: Dict[str, List[float]] = {label: [] for label in labels}
    ratios: Dict[str, List[float]] = {label: [] for label in labels}
    for index in range(warmup + rounds):
        shift = index % len(labels)
        taken = {}
        for label in labels[shift:] + labels[:shift]:
            with torch.no_grad(), MODES[label]():
                start = time.perf_counter()
                block(*args, **kwargs)
                taken[label] = time.perf_counter() - start
        if index >= warmup:
            for label in labels:
                seconds[label].append(taken[label])
                ratios[label].append(taken[label] / taken["plain"])
    return ({label: statistics.median(v) for label, v in seconds.items()},
            {label: statistics.median(v) for label, v in ratios.items()})


def format_rows(rows: Sequence[Tuple[str, str, float, float, int]]) -> str:
    header = ("model / block", "mode", "forward ms", "x plain", "us per call", "calls")
    table = [header]
    for model, mode, ms, ratio, added_us, calls in rows:
        table.append((model, mode, f"{ms:.2f}", f"{ratio:.3f}",
                      "-" if calls == 0 else f"{added_us:.1f}", "-" if calls == 0 else str(calls)))
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per block")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds before timing")
    args = parse_run_args(parser, argv, rounds="rounds", quick_rounds=3)
    print(f"torch {torch.__version__}, CPU threads {torch.get_num_threads()}, {args.warmup} "
          f"warm-up and {args.rounds} timed rounds per block, autograd off")
    benches, notes = build_benches(args, args.only)
    for note in notes:
        print(f"note: {note}")
    rows = []
    for bench in benches:
        name, block, block_args, block_kwargs = first_block(bench)
        calls = _dispatch_calls(block, block_args, block_kwargs)
        seconds, ratios = measure(block, block_args, block_kwargs, args.rounds, args.warmup)
        plain = seconds["plain"]
        for label in MODES:
            count = calls.get(label, 0)
            added = (ratios[label] - 1) * plain / count * 1e6 if count else 0.0
            rows.append((f"{bench.name} / {name}", label, seconds[label] * 1000, ratios[label],
                         added, count))
    print(format_rows(rows))
    print("\nA selective level runs its forward and its recomputation under the selective "
          "checkpoint mode: it pays that column's added time twice, against the time of the "
          "operators it saves.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

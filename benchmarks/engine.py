"""Benchmark ckptwrap's checkpoint against torch.utils.checkpoint on a GPT-style stack.

Every block is checkpointed. Configurations take turns step by step (the order rotating
each round) so that a slow spell of the machine hits all of them alike; each one's
peak memory is measured in a separate, untimed step. Prints median step time, peak
memory, ckptwrap's ratios to torch against the targets (time <= 1.02, memory <= 1.00,
on every device), and whether every checkpointed configuration's gradients equal the
un-checkpointed ones.

On CUDA the step runs under bfloat16 autocast by default (``--dtype``; the parameters
stay float32, as in mixed-precision training), peak memory is the allocator's
``torch.cuda.max_memory_allocated`` above the step's start, and timings synchronise
the device before and after each step. The default model on CUDA is larger (width 1024,
16 heads, 1024 tokens, batch 8: about 7 TFLOP a step), so that kernels rather than
launches set the step time; the CPU's default (width 256) would be launch-bound there,
and a ratio of two launch-bound medians at a target of 1.00 is a coin toss. The target
stays 1.02 on CUDA too: two medians of nearly the same work still differ by about 1%.
The CPU runs in float32 unless told otherwise.

    python benchmarks/engine.py [--device cuda] [--dtype bfloat16] [--steps 7] [--warmup 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
import torch.utils.checkpoint as torch_checkpoint

import ckptwrap
from ckptwrap.measure import measure_peak

# The model is the examples' GPT, so that the benchmark and the demo measure the same thing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, BlockRunner, GPTConfig, synthetic_batch  # noqa: E402

_MIB = 1024 * 1024
TIME_TARGET = 1.02
"""Time ratio target (ckptwrap / torch), on every device: the median of per-round ratios of
nearly identical work still moves by about 1% from run to run."""
MEMORY_TARGET = 1.00
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZES = {
    "cpu": dict(layers=12, width=256, heads=4, seq_len=256, batch=8),
    "cuda": dict(layers=12, width=1024, heads=16, seq_len=1024, batch=8),
}
"""Default model per device type: on CUDA large enough to be compute-bound, not
launch-bound (other accelerators take the CPU's sizes unless told otherwise)."""


def time_target(device: str) -> float:
    """The time ratio target (ckptwrap / torch) on ``device``: the same everywhere."""
    return TIME_TARGET


def default_sizes(device: str) -> Dict[str, int]:
    """The default model and batch sizes on ``device``."""
    return dict(SIZES.get(torch.device(device).type, SIZES["cpu"]))


def default_dtype(device: str) -> str:
    """bfloat16 on CUDA, float32 elsewhere."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


@dataclasses.dataclass(frozen=True)
class Contender:
    """One configuration of the benchmark."""

    name: str
    """Name printed in the table."""
    runner: BlockRunner | None
    """How each block runs; None for no checkpointing."""
    baseline: str | None = None
    """Name of the torch configuration that ckptwrap's is compared with, if any."""


CONTENDERS = (
    Contender("no checkpointing", None),
    Contender(
        "ckptwrap non-re-entrant",
        lambda block, x: ckptwrap.checkpoint(block, x, use_reentrant=False),
        baseline="torch non-re-entrant",
    ),
    Contender(
        "torch non-re-entrant",
        lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=False),
    ),
    Contender(
        "ckptwrap re-entrant",
        lambda block, x: ckptwrap.checkpoint(block, x, use_reentrant=True),
        baseline="torch re-entrant",
    ),
    Contender(
        "torch re-entrant",
        lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=True),
    ),
)


@dataclasses.dataclass
class Measurement:
    """What was measured for one contender."""

    contender: Contender
    peak_bytes: int = 0
    step_ms: List[float] = dataclasses.field(default_factory=list)
    grads: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def median_ms(self) -> float:
        """Median of the timed steps, in milliseconds."""
        return statistics.median(self.step_ms)


def training_step(
    model: GPT, runner: BlockRunner | None, batch, *, seed: int, dtype: torch.dtype = torch.float32
) -> None:
    """One forward and backward pass with fresh gradients and a fixed dropout seed; the
    forward runs under autocast to ``dtype`` unless it is float32."""
    tokens, targets = batch
    model.checkpoint_blocks = runner
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    device_type = tokens.device.type
    with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(tokens, targets)
    loss.backward()


def run_benchmark(
    config: GPTConfig,
    *,
    batch_size: int,
    steps: int,
    warmup: int,
    device: str = "cpu",
    dtype: str | None = None,
    contenders: Sequence[Contender] = CONTENDERS,
) -> List[Measurement]:
    """Measure every contender on one shared model; the first contender is the reference.

    Args:
        config: Sizes of the GPT stack.
        batch_size: Sequences per step.
        steps: Timed steps per contender.
        warmup: Untimed rounds before the timed ones.
        device: Where to run.
        dtype: Autocast dtype name (see ``DTYPES``); None for the device's default.
        contenders: The configurations, the un-checkpointed one first.

    Returns:
        One measurement per contender, in the order given.
    """
    autocast_dtype = DTYPES[dtype or default_dtype(device)]
    torch.manual_seed(0)
    model = GPT(config).to(device).train()
    batch = synthetic_batch(config, batch_size, seed=0, device=device)
    results = [Measurement(contender) for contender in contenders]
    # Memory and gradients first, in steps that are never timed: the CPU meter runs
    # every operator through Python.
    for result in results:
        # Free the last step's gradients first: on an accelerator, memory freed inside
        # the block would hide as much of the block's own peak.
        model.zero_grad(set_to_none=True)
        result.peak_bytes = _peak_bytes(
            device, lambda: training_step(model, result.contender.runner, batch, seed=0, dtype=autocast_dtype)
        )
        result.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for round_index in range(warmup + steps):
        shift = round_index % len(results)
        for result in results[shift:] + results[:shift]:
            _synchronize(device)
            start = time.perf_counter()
            training_step(model, result.contender.runner, batch, seed=round_index + 1, dtype=autocast_dtype)
            _synchronize(device)
            if round_index >= warmup:
                result.step_ms.append((time.perf_counter() - start) * 1000)
    model.zero_grad(set_to_none=True)
    return results


def grads_equal(reference: Measurement, other: Measurement) -> bool:
    """True when both have bit-identical gradients for the same parameters."""
    return reference.grads.keys() == other.grads.keys() and all(
        torch.equal(reference.grads[name], other.grads[name]) for name in reference.grads
    )


def meets_targets(results: Sequence[Measurement], device: str = "cpu") -> Dict[str, bool]:
    """For each ckptwrap contender, whether both its ratios to torch meet the targets on
    ``device``."""
    by_name = {result.contender.name: result for result in results}
    verdicts = {}
    for result in results:
        baseline = by_name.get(result.contender.baseline)
        if baseline is not None:
            time_ratio, memory_ratio = _ratios(result, baseline)
            verdicts[result.contender.name] = time_ratio <= time_target(device) and memory_ratio <= MEMORY_TARGET
    return verdicts


def format_table(results: Sequence[Measurement], device: str = "cpu") -> str:
    """The results as a text table; ratios are ckptwrap / torch for the same variant."""
    by_name = {result.contender.name: result for result in results}
    reference = results[0]
    header = (
        "configuration", "median ms", "min ms", "peak MiB", "time ratio", "mem ratio", "targets", "grads"
    )
    rows = [header]
    for result in results:
        time_cell = memory_cell = verdict = ""
        baseline = by_name.get(result.contender.baseline)
        if baseline is not None:
            time_ratio, memory_ratio = _ratios(result, baseline)
            time_cell, memory_cell = f"{time_ratio:.3f}", f"{memory_ratio:.3f}"
            targets = (("time", time_ratio, time_target(device)), ("mem", memory_ratio, MEMORY_TARGET))
            missed = [label for label, ratio, target in targets if ratio > target]
            verdict = "pass" if not missed else "FAIL " + "+".join(missed)
        if result is reference:
            same = "reference"
        else:
            same = "equal" if grads_equal(reference, result) else "DIFFER"
        rows.append(
            (
                result.contender.name,
                f"{result.median_ms:.1f}",
                f"{min(result.step_ms):.1f}",
                f"{result.peak_bytes / _MIB:.1f}",
                time_cell,
                memory_cell,
                verdict,
                same,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(_align(row, widths)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the benchmark and print the table.

    Returns:
        0, or 1 if some gradients differ (or, with ``--strict``, a target is missed).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or another accelerator")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None,
        help="autocast dtype of the forward (default: bfloat16 on cuda, float32 elsewhere)",
    )
    parser.add_argument("--steps", type=int, default=7, help="timed steps per configuration (>= 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    sizes = "(default: {cpu} on the CPU, {cuda} on CUDA)"
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks " + sizes.format(**_of("layers")))
    parser.add_argument("--width", type=int, default=None, help="hidden size " + sizes.format(**_of("width")))
    parser.add_argument("--heads", type=int, default=None, help="attention heads " + sizes.format(**_of("heads")))
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence " + sizes.format(**_of("seq_len")))
    parser.add_argument("--batch", type=int, default=None, help="sequences per step " + sizes.format(**_of("batch")))
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file, as JSON")
    args = parser.parse_args(argv)
    for name, value in default_sizes(args.device).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads is not None:
        # On a machine shared with other work, fewer threads than cores keeps the
        # threads of one operator from waiting on each other and gives steadier times.
        torch.set_num_threads(args.threads)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    try:
        config = GPTConfig(width=args.width, heads=args.heads, layers=args.layers, seq_len=args.seq_len)
    except ValueError as error:
        parser.error(str(error))
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was given, but torch.cuda.is_available() is False")
    dtype = args.dtype or default_dtype(args.device)
    print(
        f"GPT stack: {config.layers} blocks, width {config.width}, {config.heads} heads, sequence "
        f"{config.seq_len}, batch {args.batch}, every block checkpointed; {args.device}, {dtype}"
        f"{' autocast' if dtype != 'float32' else ''}, "
        f"torch {torch.__version__}, CPU threads: {torch.get_num_threads()}; {args.warmup} warm-up "
        f"rounds, median of {args.steps} steps (peak memory from a separate step)"
    )
    started = time.perf_counter()
    results = run_benchmark(
        config, batch_size=args.batch, steps=args.steps, warmup=args.warmup, device=args.device, dtype=dtype
    )
    table = format_table(results, args.device)
    print(table)
    print(
        f"targets: time ratio <= {time_target(args.device):.2f}, memory ratio <= {MEMORY_TARGET:.2f} "
        "(ckptwrap / torch), the same on every device"
        + ("; the model is sized to be compute-bound on CUDA" if torch.device(args.device).type == "cuda" else "")
    )
    print(f"total {time.perf_counter() - started:.0f} s")
    all_equal = all(grads_equal(results[0], result) for result in results[1:])
    if not all_equal:
        print("error: some gradients differ from the un-checkpointed run", file=sys.stderr)
    if args.json:
        _write_json(args.json, args, config, dtype, results, table)
    return 0 if all_equal and (not args.strict or all(meets_targets(results, args.device).values())) else 1


def _of(name: str) -> Dict[str, int]:
    return {kind: sizes[name] for kind, sizes in SIZES.items()}


def _write_json(path: str, args: argparse.Namespace, config: GPTConfig, dtype: str,
                results: Sequence[Measurement], table: str) -> None:
    """The run as JSON: what ran, every row, and a verdict per target (for scripts/gpu_check.py)."""
    by_name = {result.contender.name: result for result in results}
    targets = []
    for result in results:
        baseline = by_name.get(result.contender.baseline)
        if baseline is None:
            continue
        time_ratio, memory_ratio = _ratios(result, baseline)
        targets.append({"name": f"{result.contender.name}: time ratio <= {time_target(args.device):.2f}",
                        "value": round(time_ratio, 4), "passed": time_ratio <= time_target(args.device)})
        targets.append({"name": f"{result.contender.name}: memory ratio <= {MEMORY_TARGET:.2f}",
                        "value": round(memory_ratio, 4), "passed": memory_ratio <= MEMORY_TARGET})
    for result in results[1:]:
        targets.append({"name": f"{result.contender.name}: gradients equal the un-checkpointed run",
                        "value": None, "passed": grads_equal(results[0], result)})
    record = {
        "device": args.device, "dtype": dtype, "torch": torch.__version__,
        "model": {"layers": config.layers, "width": config.width, "heads": config.heads,
                  "seq_len": config.seq_len, "batch": args.batch},
        "rows": [{"name": r.contender.name, "median_ms": r.median_ms, "peak_bytes": r.peak_bytes} for r in results],
        "table": table, "targets": targets,
    }
    Path(path).write_text(json.dumps(record, indent=2))


def _ratios(result: Measurement, baseline: Measurement) -> tuple[float, float]:
    """Time and memory of ``result`` relative to ``baseline``.

    The time ratio is the median of the per-round ratios: both steps of a round ran
    within seconds of each other, so a slow spell of a shared machine cancels out,
    where it would not in a ratio of two medians.
    """
    time_ratio = statistics.median(ours / theirs for ours, theirs in zip(result.step_ms, baseline.step_ms))
    return time_ratio, result.peak_bytes / max(baseline.peak_bytes, 1)


def _align(row: Sequence[str], widths: Sequence[int]) -> List[str]:
    """Left-align the first cell (a name) and right-align the others (numbers)."""
    return [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]


def _synchronize(device: str) -> None:
    """Wait for queued device work, so that a step's time includes it."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind != "cpu":
        torch.accelerator.synchronize()


def _peak_bytes(device: str, step) -> int:
    """Peak bytes ``step()`` allocates above what is allocated when it starts: on CUDA
    read from the allocator (``torch.cuda.max_memory_allocated``), elsewhere measured by
    ``measure_peak``."""
    if torch.device(device).type != "cuda":
        with measure_peak(device) as peak:
            step()
        return peak.peak_bytes
    _synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    step()
    _synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


if __name__ == "__main__":
    sys.exit(main())

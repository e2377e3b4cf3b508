"""A lazy ``budget:`` on many architectures, in the loops people write.

Every architecture of ``_architectures`` (Hugging Face models built tiny from their
configs: causal, encoder, encoder-decoder, speech, vision, hierarchical vision,
multimodal, state-space) and of ``_diffusion`` (diffusers models, where diffusers is
installed), in each loop of ``_budget_loops`` (loss only; outputs held through the
backward; right-padded masks with changing batch sizes and lengths; accumulation with
evaluation and ``generate`` between), under an absolute budget halfway between the least
peak any plan reaches and the plain peak at the longest length, wrapped with no example
inputs, as a training script does.

- memory: every micro-step of the budget model and of the plain model trained alongside,
  read at the CPU allocator (``torch.profiler``'s memory events, independent of
  ckptwrap's meters). "over" is the largest step peak above the budget, in % of the plain
  peak at the largest shape so far (target: at most 3%); "exact": every loss and gradient
  equal to the plain model's, bit for bit; "same": the model, its configuration and its
  parameters as plain training left them.
- time: the budget model and ``blocks`` taking turns step by step, nothing metered; "vs
  blocks" is the budget's total over ``blocks``'s (target: at most 1.10). At the
  catalogue's widths (hidden sizes of 32) an operator takes microseconds, and the Python
  cost of metering a measured step's operators outweighs it; ``--width 8`` (hidden sizes
  of 256) times models whose operators do some work.
- "measured" / "checked": the steps the planner measured (under the plan of least
  memory), and those it metered against their prediction; "under": the most a solved
  step peaked above its predicted peak, in % of the plain peak at the largest shape so far
  (steps from fresh gradients; 0 where every prediction was at or above the step's peak,
  as a bound from a larger shape is).

``--grow`` makes the lengths grow from the shortest to the longest, by one factor each
step (``--steps 24``: the growth phase of a loop, a curriculum), so that almost every step
meets a length not seen before: the time target is then 1.30 at the catalogue's widths and
1.10 at ``--width 8`` and wider.

``--percent`` states the same budget as a share of the plain peak (``budget:NN%``, NN
rounded up), as training scripts write it; each step is then held to that share of the
largest plain peak read so far, and a shape larger than any before is one whose plain
peak the planner must know.

``--device cuda`` runs it all on that device (read at the CUDA allocator through the same
profiler events; deterministic kernels and math attention, so that "exact" can hold there
too).

    python benchmarks/budget_loops.py [--steps 48] [--only NAME,...] [--loops loss,...]
                                      [--width 1] [--no-time | --no-memory] [--markdown FILE]
                                      [--device cuda] [--grow] [--percent]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _budget_loops import LOOPS, OVER, budget_for, memory_pass, time_pass  # noqa: E402

TIME_TARGET = 1.10
GROW_TARGET = 1.30
"""With ``--grow``, at the catalogue's widths: every new length there is a shape to learn."""
GROW_TARGET_WIDE = 1.10
"""With ``--grow`` at ``--width 8`` and wider."""


def architectures(width: int = 1) -> Dict[str, Any]:
    """Every architecture that builds here, by name, its widths ``width`` times as large
    (the diffusers models at their own widths)."""
    from _architectures import ARCHITECTURES, available, widened

    found = {name: widened(ARCHITECTURES[name], width) for name in available()}
    try:
        from _diffusion import DIFFUSION, available as diffusion_available
    except ImportError:
        return found
    found.update((name, DIFFUSION[name]) for name in diffusion_available())
    return found


def run(
    arch: Any, loop: str, steps: int, timed: bool, metered: bool = True, device: str = "cpu", grow: bool = False,
    percent: bool = False,
) -> Dict[str, Any]:
    start = time.perf_counter()
    row: Dict[str, Any] = {"name": arch.name, "family": arch.family, "loop": loop}
    if metered:
        memory = row["memory"] = memory_pass(arch, loop, steps, device, grow, percent)
        budget, error = memory.budget, memory.error
    else:
        try:
            budget, error = budget_for(arch, arch.build().to(device), device, percent), None
        except Exception as failure:  # noqa: BLE001 - reported in the table
            budget, error = 0, f"{type(failure).__name__}: {failure}"[:200]
    row["error"] = error
    if timed and error is None:
        row["time"] = time_pass(arch, loop, steps, budget, device, grow, percent)
    row["seconds"] = time.perf_counter() - start
    return row


def ok(row: Dict[str, Any]) -> bool:
    memory = row.get("memory")
    fine = row["error"] is None and (
        memory is None or (memory.worst_over <= OVER and memory.exact and memory.unchanged)
    )
    timing = row.get("time")
    return fine and (timing is None or timing.ratio <= row.get("target", TIME_TARGET))


def line(row: Dict[str, Any]) -> List[str]:
    memory, timing = row.get("memory"), row.get("time")
    if row["error"] is not None:
        return [row["name"], row["family"], row["loop"], "-", "-", "-", "-", "-", "-", "-", "ERROR " + row["error"]]
    ratio = "-" if timing is None else f"{timing.ratio:.2f}"
    if memory is None:
        return [row["name"], row["family"], row["loop"], "-", "-", "-", ratio, "-", "-", "-", "ok" if ok(row) else "MISSED"]
    return [
        row["name"], row["family"], row["loop"],
        f"{100 * memory.worst_over:.1f}%", "yes" if memory.exact else "NO", "yes" if memory.unchanged else "NO",
        ratio, str(memory.measured), str(memory.checked), f"{100 * memory.worst_under:.1f}%",
        "ok" if ok(row) else "MISSED",
    ]


HEADER = ["model", "family", "loop", "over", "exact", "same", "vs blocks", "measured", "checked", "under", ""]


def table(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    out = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def markdown(rows: List[List[str]]) -> str:
    out = ["| " + " | ".join(HEADER[:-1]) + " | |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--only", help="comma-separated architecture names")
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)}")
    parser.add_argument("--no-time", action="store_true", help="memory and exactness only")
    parser.add_argument("--no-memory", action="store_true", help="time only")
    parser.add_argument(
        "--width", type=int, default=1,
        help="every width of the transformers models' configs this many times as large (default 1)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    parser.add_argument("--device", default="cpu", help="where the models train (default cpu)")
    parser.add_argument(
        "--grow", action="store_true",
        help="lengths grow from the shortest to the longest over the steps (the growth phase; time target "
        f"{GROW_TARGET:.2f}, {GROW_TARGET_WIDE:.2f} at --width 8 and wider)",
    )
    parser.add_argument(
        "--percent", action="store_true",
        help="the budget as a share of the plain peak (budget:NN%%), held to that share of the largest plain peak so far",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda":
        # Deterministic kernels, so that the budget model's gradients can equal the plain
        # model's bit for bit: cuBLAS reads its setting when it starts, and attention runs
        # on the math kernels (the fused ones' backwards add in no fixed order).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        for fused in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{fused}_sdp")(False)
    found = architectures(args.width)
    names = args.only.split(",") if args.only else list(found)
    unknown = [name for name in names if name not in found]
    if unknown:
        parser.error(f"unknown or unavailable architectures {unknown}; available: {', '.join(found)}")
    loops = args.loops.split(",")
    target = (GROW_TARGET_WIDE if args.width >= 8 else GROW_TARGET) if args.grow else TIME_TARGET
    rows, met = [], 0
    start = time.perf_counter()
    for name in names:
        for loop in loops:
            row = run(
                found[name], loop, args.steps, timed=not args.no_time, metered=not args.no_memory,
                device=args.device, grow=args.grow, percent=args.percent,
            )
            row["target"] = target
            rows.append(line(row))
            met += ok(row)
            print("  ".join(rows[-1]), f"({row['seconds']:.0f} s)", flush=True)
    print()
    print(table(rows))
    total = len(rows)
    print(
        f"\n{len(names)} models (widths x{args.width}) x {len(loops)} loops, {args.steps} steps each"
        f"{', lengths growing' if args.grow else ''}, "
        f"on {args.device}, in {time.perf_counter() - start:.0f} s"
    )
    print(f"targets (over <= {100 * OVER:.0f}%, exact, same, vs blocks <= {target:.2f}): {met} of {total} met")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Planning without the hardware: each architecture of the catalogue
(``benchmarks/_architectures.py``, and the diffusers models of ``_diffusion.py`` where
diffusers installs) planned on the meta device from real example inputs,
beside the same model built for real and measured.

Per architecture, on one padded batch (2 rows at its longest length):

- "plain", "blocks": the un-checkpointed and ``blocks`` step peaks the meta plan predicts,
  over those the real model's own plan predicts (target: 1.000, the same bytes);
- "pred/meas": a ``budget:`` made on the meta device (two thirds of the way from
  ``blocks``'s peak to the plain one), applied to the real model, its prediction over the
  step measured at the CPU allocator (``torch.profiler``'s memory events); target: the step
  at most 3% above its prediction (a prediction above the step is safe) and within its
  budget. "real plan's pred/meas": the same for the budget planned on the real model, the
  planner's own accuracy on this architecture;
- "meta s", "real s": the time planning took (``blocks`` and the budget, and the step).

A model that cannot run on fake tensors is listed with the reason ckptwrap gives.

    python benchmarks/unreal.py [--only NAME,...] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptwrap  # noqa: E402
from _allocator import allocator_peak  # noqa: E402
from _architectures import ARCHITECTURES, available  # noqa: E402
from _diffusion import DIFFUSION, available as diffusion_available  # noqa: E402

from ckptwrap.wrap._marks import apply_plan  # noqa: E402

SAME = 0.001
PREDICTION = 0.03


def _policy(arch, term: str) -> str:
    return ";".join(filter(None, (arch.candidates, term)))


def _budget_step(arch, model_made, batch) -> Tuple[Any, Any, int]:
    """``blocks`` (or the architecture's own candidates) and a budget two thirds of the way from its peak to the plain one, both
    planned on ``model_made``, and the budget's step measured on the model built for real."""
    blocks = ckptwrap.plan(model_made, arch.candidates or "blocks", example_kwargs=batch)
    share = (blocks.predicted_peak + 2 * blocks.plain_peak) / 3 / blocks.plain_peak
    budget = ckptwrap.plan(model_made, _policy(arch, f"budget:{100 * share:.1f}%"), example_kwargs=batch)
    model = arch.build()
    apply_plan(model, budget)

    def step() -> None:
        out = model(**batch)
        out.loss.backward()

    return blocks, budget, allocator_peak(step)


def _row(name: str) -> List[str]:
    arch = ARCHITECTURES[name] if name in ARCHITECTURES else DIFFUSION[name]
    padded = arch.family in ("causal", "encoder", "encoder-decoder")
    batch = arch.batch(2, arch.lengths[1], 0, padded)
    start = time.perf_counter()
    real, real_budget, real_measured = _budget_step(arch, arch.build(), batch)
    real_seconds = time.perf_counter() - start
    with torch.device("meta"):
        meta_model = arch.build()
    start = time.perf_counter()
    try:
        meta, budget, measured = _budget_step(arch, meta_model, batch)
    except ckptwrap.CheckpointConfigError as error:
        reason = str(error).split(": ", 1)[-1][:90]
        return [name, arch.family, "-", "-", "-", "-", "-", "-", f"{real_seconds:.1f}", reason]
    meta_seconds = time.perf_counter() - start
    plain, blocks = meta.plain_peak / real.plain_peak, meta.predicted_peak / real.predicted_peak
    predicted = budget.predicted_peak / measured
    met = (
        abs(plain - 1) <= SAME and abs(blocks - 1) <= SAME and predicted >= 1 - PREDICTION
        and measured <= budget.budget + PREDICTION * budget.plain_peak
    )
    return [
        name, arch.family, f"{plain:.3f}", f"{blocks:.3f}", f"{len(budget.names)}/{len(meta.names)}",
        f"{predicted:.3f}", f"{real_budget.predicted_peak / real_measured:.3f}", f"{meta_seconds:.1f}",
        f"{real_seconds:.1f}", "ok" if met else "MISSED",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated architecture names")
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else available() + diffusion_available()
    header = [
        "model", "family", "plain", "blocks", "budget keeps", "pred/meas", "real plan's pred/meas", "meta s",
        "real s", "",
    ]
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            rows.append(_row(name))
            print("  ".join(rows[-1]), flush=True)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    ran = [row for row in rows if row[2] != "-"]
    met = sum(row[-1] == "ok" for row in ran)
    print(
        f"\n{len(names)} architectures: {len(ran)} planned on the meta device, {met} of them with the real "
        f"model's bytes (plain, blocks within {SAME:.1%}), the budget's step at most {PREDICTION:.0%} above its "
        f"prediction and its budget; "
        f"{len(names) - len(ran)} refused, named"
    )
    if args.markdown:
        lines = ["| " + " | ".join(header[:-1]) + " | |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0 if met == len(ran) else 1


if __name__ == "__main__":
    sys.exit(main())

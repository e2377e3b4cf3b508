"""Smoke test: the planner-against-compiler frontier benchmark runs end to end at tiny sizes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


def _compile_works() -> bool:
    """Whether torch.compile with the aot_eager backend runs a training step here."""
    try:
        layer = torch.nn.Linear(2, 2)
        torch.compile(layer, backend="aot_eager")(torch.ones(1, 2)).sum().backward()
    except Exception:  # noqa: BLE001 - any failure means the platform cannot compile
        return False
    finally:
        torch._dynamo.reset()
    return True


@pytest.mark.skipif(not _compile_works(), reason="torch.compile is unavailable on this platform")
def test_quick_run_prints_every_table_and_the_targets():
    result = subprocess.run(
        [sys.executable, str(_ROOT / "benchmarks" / "frontier.py"), "--quick", "--threads", "1"],
        capture_output=True, text=True, timeout=120, cwd=_ROOT, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    models = ["GPT stack", "conv pyramid"]
    if importlib.util.find_spec("transformers") is not None:
        models += ["HF GPT-2", "HF Llama"]
    else:
        assert "skipped, transformers is not installed" in out
    header = "configuration"
    for name in models:
        section = out.split(f"\n{name}: ", 1)
        assert len(section) == 2, f"no table for {name}"
        table = section[1].split("targets:", 1)[0]
        assert header in table and "\nnone " in table and "compile aot_eager 50%" in table
        for label in ("blocks ", "checkpoint_sequential(", "budget:75% ", "budget:50% ",
                      "budget:30% ", "budget:50%;recompute ", "blocks;selective "):
            assert f"\n{label}" in table, f"{name}: no row {label}"
    for target in ("(1) budget:50% honoured", "(1) budget:50%;recompute honoured",
                   "(2) step peak never higher", "(3) at 50%", "(4, compile's",
                   "(5) blocks predicted within 5%"):
        lines = [line for line in out.splitlines() if target in line]
        assert len(lines) >= len(models), f"target {target!r} printed {len(lines)} times"
        assert all(line.lstrip().startswith(("[pass]", "[fail]", "[n/a]")) for line in lines)


def test_quick_interception_run_times_every_mode_on_every_model():
    result = subprocess.run(
        [sys.executable, str(_ROOT / "benchmarks" / "interception.py"), "--quick", "--threads", "1"],
        capture_output=True, text=True, timeout=120, cwd=_ROOT, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    models = ["GPT stack", "conv pyramid"]
    if importlib.util.find_spec("transformers") is not None:
        models += ["HF GPT-2", "HF Llama"]
    rows = [line for line in result.stdout.splitlines() if " / " in line]
    for name in models:
        modes = [row for row in rows if row.startswith(f"{name} / ")]
        for mode in ("plain", "selective checkpoint mode", "bare dispatch mode",
                     "bare function mode"):
            assert any(f"  {mode}  " in row for row in modes), f"{name}: no row {mode!r}"
    counted = [row.split()[-1] for row in rows if "dispatch mode" in row]
    assert counted and all(count.isdigit() and int(count) > 0 for count in counted)


@pytest.mark.parametrize("workload, sizes", [
    ("gpt", ["--layers", "4", "--width", "64", "--seq-len", "64", "--batch", "2", "--steps", "2"]),
    ("pyramid", ["--image-batch", "2", "--image-size", "32", "--pyramid-blocks", "2",
                 "--pyramid-steps", "2"]),
])
def test_quick_policies_run_prints_its_table_and_targets(workload, sizes):
    result = subprocess.run(
        [sys.executable, str(_ROOT / "benchmarks" / "policies.py"), "--only", workload,
         "--warmup", "1", "--threads", "1", *sizes],
        capture_output=True, text=True, timeout=120, cwd=_ROOT, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for label in ("\nnone ", "\nblocks ", "\ncheckpoint_sequential(", "\nblocks;selective ",
                  "\nbudget:<smallest reachable> ", "\nbudget:<sequential's peak> "):
        assert label in out, f"no row {label.strip()!r}"
    assert "equal" in out and "differ" not in out
    assert "summary: " in out and " targets met" in out

"""``make gpu-check`` (scripts/gpu_check.py): the dry run writes the whole report on the
CPU; a step that fails or runs out of time is recorded and the next one still runs; the
deadline skips what cannot fit; the report gathers steps run in parts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("_ckptwrap_gpu_check", _ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_writes_every_section_of_the_report(check, tmp_path):
    done = subprocess.run([sys.executable, str(_ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = (tmp_path / "gpu-report.md").read_text()
    for heading in ["# ckptwrap GPU check", "## Device and versions", "## Summary", "## Targets",
                    *(f"## {step.title}" for step in check.STEPS if step.kind != "environment")]:
        assert heading in report, heading
    assert "**Dry run**" in report and "| torch | " in report and "| private torch names missing | none |" in report
    summary = report.split("## Summary")[1].split("## Targets")[0]
    assert all(f"| {step.name} | pass |" in summary for step in check.STEPS), summary
    assert "Would install ckptwrap" in report  # pip's dry run of the registry-free install
    assert "tests collected (dry run" in report  # the CPU suite's selection, with the plugin loaded
    # Every benchmark table, and the Llama rows with the partial offload row among them.
    assert report.count("configuration ") >= 3
    for row in ["no checkpointing", "ckptwrap non-re-entrant", "budget:50%", "save_on_cpu", "first:2;offload"]:
        assert row in report, row
    assert "Offload arithmetic:" in report and "not judged (dry run)" in report
    assert "1 ranks, a lazy budget:total" in report and "every plan within 3% of the allocator" in report  # fsdp2
    records = {p.stem for p in (tmp_path / "steps").glob("*.json")}
    assert records == {step.name for step in check.STEPS}


def _step(check, name, code, limit=30, reserve=0):
    return check.Step(name, f"step {name}", "install", lambda c: [c.python, "-c", code], limit, reserve)


def test_a_failure_and_a_timeout_are_recorded_and_the_rest_still_run(check, tmp_path, monkeypatch):
    steps = (
        _step(check, "fails", "import sys; print('boom'); sys.exit(3)"),
        _step(check, "hangs", "import time; time.sleep(60)", limit=1),
        _step(check, "works", "print('fine')"),
    )
    monkeypatch.setattr(check, "STEPS", steps)
    assert check.main(["--out", str(tmp_path)]) == 1
    records = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "steps").glob("*.json")}
    assert {name: r["status"] for name, r in records.items()} == {"fails": "failed", "hangs": "timeout", "works": "passed"}
    assert records["fails"]["returncode"] == 3 and records["hangs"]["seconds"] < 30
    report = (tmp_path / "gpu-report.md").read_text()
    assert "| fails | FAILED |" in report and "| hangs | TIMEOUT |" in report and "| works | pass |" in report
    assert "boom" in report  # a failed step's output is in the report


def test_the_deadline_skips_what_cannot_fit_and_parts_join_one_report(check, tmp_path, monkeypatch):
    steps = (_step(check, "first", "print(1)"), _step(check, "second", "print(2)", reserve=120))
    monkeypatch.setattr(check, "STEPS", steps)
    check.main(["--out", str(tmp_path), "--steps", "second", "--minutes", "1"])
    assert json.loads((tmp_path / "steps" / "second.json").read_text())["status"] == "skipped"
    assert check.main(["--out", str(tmp_path), "--steps", "first"]) == 1  # second is still skipped
    summary = (tmp_path / "gpu-report.md").read_text().split("## Targets")[0]
    assert summary.index("| first | pass |") < summary.index("| second | SKIPPED |")


def test_an_unknown_step_is_named(check, tmp_path, capsys):
    with pytest.raises(SystemExit):
        check.main(["--out", str(tmp_path), "--steps", "install,llama-16k"])
    assert "unknown step(s) llama-16k" in capsys.readouterr().err


def test_the_cpu_suite_selection_exists(check):
    for path in check.CPU_SUITE_ON_CUDA:
        assert (_ROOT / path).is_file(), path

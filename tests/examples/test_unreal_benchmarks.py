"""The benchmarks of planning without the hardware run and judge their own targets:
``benchmarks/unreal.py`` on an architecture it plans and one it must refuse, and
``benchmarks/planning_time.py`` at a short length."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

_ROOT = Path(__file__).resolve().parents[2]


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, _ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_meta_device_benchmark_plans_one_model_and_names_why_it_refuses_another(capsys):
    unreal = _load("benchmarks/unreal.py", "_ckptwrap_benchmark_unreal")
    assert unreal.main(["--only", "gpt2,wav2vec2"]) == 0
    out = capsys.readouterr().out
    assert "2 architectures: 1 planned on the meta device, 1 of them" in out and "1 refused, named" in out
    assert "_ctc_loss" in out


def test_the_planning_time_benchmark_reports_plain_steps(capsys):
    timing = _load("benchmarks/planning_time.py", "_ckptwrap_benchmark_planning_time")
    # At so short a length the parameters' gradients are nearly the whole peak.
    assert timing.main(["--rows", "1", "--length", "16", "--threads", "1", "--budget", "budget:100%"]) in (0, 1)
    out = capsys.readouterr().out
    assert "plan(budget:100%), meta device" in out and "plain steps" in out

"""Smoke tests of the GPU benchmark's code paths at tiny sizes on the CPU (``--tiny``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("_ckptwrap_benchmark_gpu_llama", _ROOT / "benchmarks" / "gpu_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _rows(output: str):
    """The table's rows by configuration name (the rows end in the bit-equal column)."""
    cells = [line.split() for line in output.splitlines()]
    return {row[0]: row for row in cells if row and row[-1] in ("yes", "NO", "reference")}


def test_tiny_run_on_the_cpu_measures_every_configuration(bench, capsys):
    assert bench.main(["--device", "cpu", "--tiny"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    for name in bench.CONFIGURATIONS:
        assert name in rows, f"{name} missing from\n{out}"
    # Every configuration's gradients equal the un-checkpointed run's, bit for bit.
    assert all(rows[name][-1] == "yes" for name in bench.CONFIGURATIONS[1:]), out
    assert "model: llama" in out and "not checked (512 tokens/step)" in out


def test_falls_back_to_the_examples_gpt_without_transformers(bench, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    assert bench.main(["--device", "cpu", "--tiny", "--configs", "none,offload"]) == 0
    out = capsys.readouterr().out
    assert "transformers is not installed" in out and "model: gpt" in out
    assert _rows(out)["offload"][-1] == "yes"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_to_run_without_cuda(bench, capsys):
    assert bench.main([]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_bad_configuration_list_is_named(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--configs", "blocks,none"])
    assert "--configs must start with 'none'" in capsys.readouterr().err


def test_offload_verdict_needs_enough_tokens(bench):
    none, offload = bench.Result("none", [100.0]), bench.Result("offload", [104.0])
    assert bench.offload_verdict([none, offload], 4096) is None
    assert bench.offload_verdict([none, offload], 8192) is True
    offload.step_ms = [106.0]
    assert bench.offload_verdict([none, offload], 8192) is False

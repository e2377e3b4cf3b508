"""``scripts/repeat_exactness.py``, the GPU run's check that tells a kernel's
nondeterminism from ckptwrap's, runs on the CPU: a round of three copies trained side by
side, where neither the plain copy nor the budget model differs from the plain model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "repeat_exactness.py"


def test_one_round_on_the_cpu_finds_every_copy_equal(capsys):
    spec = importlib.util.spec_from_file_location("_ckptwrap_repeat_exactness", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--cases", "gpt2:padded", "--rounds", "1", "--steps", "6", "--width", "1"]) == 0
    out = capsys.readouterr().out
    assert "gpt2-padded (plain): plain copy: equal; budget: equal" in out, out
    assert "1 rounds of 1 cases; the budget model differed in 0" in out, out

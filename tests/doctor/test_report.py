"""Tests of ``DoctorReport`` and ``Finding``: ordering, ``ok``, printing and ``to_dict``."""

from __future__ import annotations

import json

import pytest

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.diagnostics import DoctorReport, Finding

INFO = Finding("info", "reentrant-keyword-tensors", "layers.1", "gets tensors by keyword.", "nothing.")
WARNING = Finding("warning", "no-savings", "head", "saves almost nothing.", "leave it out.")
ERROR = Finding("error", "dropout-rng", "layers.0", "has dropout.", "keep the RNG state.")


def report(*findings: Finding) -> DoctorReport:
    return DoctorReport(model="Stack", regions=("layers.0", "layers.1"), findings=findings)


def test_findings_are_sorted_worst_first():
    assert report(INFO, WARNING, ERROR).findings == (ERROR, WARNING, INFO)
    full = report(INFO, WARNING, ERROR)
    assert (full.errors, full.warnings, full.infos) == ((ERROR,), (WARNING,), (INFO,))


@pytest.mark.parametrize(
    "findings, ok", [((), True), ((INFO,), True), ((WARNING,), False), ((ERROR, INFO), False)]
)
def test_ok_means_nothing_to_fix(findings, ok):
    assert report(*findings).ok is ok


def test_printed_report_shows_each_finding_with_its_fix():
    text = str(report(INFO, ERROR))
    lines = text.splitlines()
    assert lines[0].startswith("ckptwrap doctor: Stack, 2 checkpointed region(s)")
    assert "ERROR   layers.0  [dropout-rng]" in lines
    assert "  fix: keep the RNG state." in lines
    assert lines[-1] == "1 error(s), 0 warning(s), 1 info(s): problems found"
    model_level = Finding("error", "reentrant-ddp", "", "ddp.", "static graph.")
    assert "ERROR   <model>  [reentrant-ddp]" in str(report(model_level))


def test_to_dict_is_json_and_complete():
    data = json.loads(json.dumps(report(WARNING).to_dict()))
    assert data["ok"] is False and data["model"] == "Stack"
    assert data["findings"] == [WARNING.to_dict()]
    assert Finding(**data["findings"][0]) == WARNING


def test_unknown_severity_is_refused():
    with pytest.raises(CheckpointConfigError, match="one of error, warning, info, got 'fatal'"):
        Finding("fatal", "x", "", "m", "f")

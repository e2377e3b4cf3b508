"""Tests of ``DoctorReport`` and ``Finding``: ordering, ``ok``, printing and ``to_dict``."""

from __future__ import annotations

import json

import pytest

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.diagnostics import DoctorReport, Finding
from ckptwrap.diagnostics._report import group_findings

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


def _note(name: str, calls: int = 2) -> Finding:
    return Finding(
        "info", "reentrant-keyword-tensors", name,
        f"{name} uses the re-entrant engine in {calls} call(s).", f"nothing to change in {name}.",
    )


def test_findings_that_differ_only_in_their_module_are_grouped_in_order():
    grouped = group_findings([_note("layers.0"), ERROR, _note("layers.1"), _note("layers.10")])
    assert grouped[1] == ERROR
    note = grouped[0]
    assert note.modules == ("layers.0", "layers.1", "layers.10") and note.module == "layers.0"
    assert note.message == "each of these modules uses the re-entrant engine in 2 call(s)."
    assert note.fix == "nothing to change in each of these modules."
    assert "INFO    layers.0, layers.1, layers.10 (3 modules)  [reentrant-keyword-tensors]" in str(report(note))


def test_findings_that_differ_in_substance_stay_apart():
    apart = [_note("layers.0"), _note("layers.1", calls=3)]
    # Names inside longer names are part of what a finding says, not where it is.
    apart += [Finding("error", "dropout-rng", f"layers.{i}", f"layers.{i} has layers.{i}.drop.", "f.") for i in (1, 2)]
    assert group_findings(apart) == apart
    assert group_findings([INFO]) == [INFO] and INFO.modules == ("layers.1",)


def test_a_grouped_finding_round_trips_through_json():
    [note] = group_findings([_note("a"), _note("b")])
    data = json.loads(json.dumps(note.to_dict()))
    assert data["modules"] == ["a", "b"] and Finding(**data) == note


def test_a_finding_whose_module_is_not_in_its_modules_is_refused():
    with pytest.raises(CheckpointConfigError, match="module 'x' must be the first of modules"):
        Finding("info", "c", "x", "m", "f", modules=("a", "x"))


def _dropout(name: str) -> Finding:
    return Finding(
        "error", "dropout-rng", name,
        f"{name} draws random numbers.", f"keep the RNG state of {name}.",
        details=(f"{name} has dropout ({name}.drop)",),
    )


def test_findings_that_differ_only_in_their_details_are_grouped_keeping_every_detail():
    names = [f"h.{i}" for i in range(6)]
    [grouped] = group_findings([_dropout(name) for name in names])
    assert grouped.modules == tuple(names)
    assert grouped.details == tuple(f"{name} has dropout ({name}.drop)" for name in names)
    assert grouped.fix == "keep the RNG state of each of these modules."
    lines = str(report(grouped)).splitlines()
    assert "ERROR   h.0, h.1, ..., h.5 (6 modules)  [dropout-rng]" in lines
    assert "  - h.2 has dropout (h.2.drop)" in lines and "  - ... and 3 more" in lines
    assert "  - h.3 has dropout (h.3.drop)" not in lines
    [four] = group_findings([_dropout(name) for name in names[:4]])
    assert "ERROR   h.0, h.1, h.2, h.3 (4 modules)  [dropout-rng]" in str(report(four))
    assert Finding(**json.loads(json.dumps(grouped.to_dict()))) == grouped

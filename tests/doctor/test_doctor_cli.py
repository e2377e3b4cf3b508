"""Tests of ``ckptwrap.diagnostics.main``, the ``python -m ckptwrap doctor`` command: exit
status 0 when there is nothing to fix, 1 when there is, 2 for a bad command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptwrap.diagnostics import main

_FACTORIES = Path(__file__).resolve().parent / "_doctor_models.py"
SHAPE = ["--input-shape", "4,8"]


def factory(name: str) -> str:
    return f"{_FACTORIES}:{name}"


def test_healthy_after_wrapping_exits_0(capsys):
    assert main([factory("plain_stack"), *SHAPE, "--policy", "blocks"]) == 0
    out = capsys.readouterr().out
    assert "3 checkpointed region(s)" in out
    assert out.rstrip().endswith(": ok")


def test_problem_exits_1_and_prints_the_fix(capsys):
    assert main([factory("rng_broken_stack"), *SHAPE]) == 1
    out = capsys.readouterr().out
    assert "ERROR   layers.0, layers.1, layers.2 (3 modules)  [dropout-rng]" in out
    assert "fix: checkpoint each of these modules with preserve_rng_state=True" in out


def test_warnings_fail_unless_fail_on_error(capsys):
    assert main([factory("plain_stack"), *SHAPE]) == 1  # nothing checkpointed
    assert main([factory("plain_stack"), *SHAPE, "--fail-on", "error"]) == 0
    assert "[no-regions]" in capsys.readouterr().out


def test_json_report(capsys):
    assert main([factory("rng_broken_stack"), *SHAPE, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["regions"] == ["layers.0", "layers.1", "layers.2"]
    checks = {(f["check"], tuple(f["modules"])) for f in report["findings"]}
    assert ("dropout-rng", ("layers.0", "layers.1", "layers.2")) in checks


def test_reentrant_policy(capsys):
    argv = [factory("plain_stack"), *SHAPE, "--policy", "blocks", "--use-reentrant"]
    assert main(argv) == 0
    assert "[reentrant-no-grad-input]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        ([factory("plain_stack")], "needs inputs: give --input-shape"),
        ([factory("plain_stack"), *SHAPE, "--use-reentrant"], "give a policy"),
        ([factory("missing"), *SHAPE], "has no 'missing'; callables defined there"),
        ([factory("not_a_model"), *SHAPE], "returned int, expected an nn.Module"),
        ([factory("plain_stack"), *SHAPE, "--policy", "bogus:1"], "bogus"),
        ([factory("plain_stack"), "--input-shape", "4,5"], "failed on inputs"),
        (["no_colon", *SHAPE], "expected MODULE:FACTORY"),
        ([factory("plain_stack"), *SHAPE, "--device", "meta"], "nothing runs for real"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m ckptwrap doctor: error: ")
    assert message in err


def test_argparse_errors_and_help_return_instead_of_exiting(capsys):
    assert main([factory("plain_stack"), "--fail-on", "never"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "MODULE:FACTORY" in capsys.readouterr().out


def test_python_m_ckptwrap_doctor_dispatches_here(capsys):
    from ckptwrap import cli

    try:
        status = cli.main(["doctor", factory("plain_stack"), *SHAPE, "--policy", "blocks"])
    except SystemExit:  # argparse: invalid choice 'doctor'
        pytest.skip("ckptwrap/cli.py does not dispatch the doctor command yet")
    assert status == 0
    assert capsys.readouterr().out.rstrip().endswith(": ok")

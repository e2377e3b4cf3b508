"""The GPU check's report: reads what each step left (its output, pytest's JUnit XML, the
benchmarks' JSON) and writes ``gpu-report.md``: device and versions, a summary, every
target with its verdict, and every table."""

from __future__ import annotations

import json
import re
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPORT = "gpu-report.md"
_TAIL_LINES = 40


def read_results(record: Dict[str, Any], logs: Path) -> Dict[str, Any]:
    """What the report needs from one step beyond its status: parsed info, counts,
    tables and targets."""
    kind = record["kind"]
    ran = record["status"] in ("passed", "failed")
    source = logs / record["result"] if record.get("result") else None
    if kind == "environment":
        return {"info": _last_json(record["output"]) if ran else {}, "targets": []}
    if kind == "install":
        return {"targets": [_target("installs with no registry", None, record["status"] == "passed")]}
    if kind == "tests":
        counts = _junit(source) if ran and source is not None else None
        collected = _collected(record["output"]) if "--collect-only" in record["command"] else None
        if collected is not None:
            return {"collected": collected, "targets": [_target("every test is collected", f"{collected} collected",
                                                                record["status"] == "passed")]}
        return {"counts": counts, "targets": [_target("every test passes", _count_text(counts, record),
                                                      record["status"] == "passed")]}
    if kind == "log":  # scripts/repeat_exactness.py: its last line counts the runs that differed
        found = re.search(r"(\d+) rounds of (\d+) cases; the budget model differed in (\d+)", record["output"])
        value = None if found is None else f"{found.group(3)} of {int(found.group(1)) * int(found.group(2))} runs differed"
        return {"targets": [_target("the budget model equals the plain model in every run", value,
                                    None if found is None else found.group(3) == "0")]}
    result = json.loads(source.read_text()) if ran and source is not None and source.exists() else {}
    found = {"table": result.get("table"), "targets": result.get("targets", []),
             "arithmetic": result.get("arithmetic", []), "nondeterministic": result.get("nondeterministic", [])}
    if not result:
        found["targets"] = [_target("the benchmark ran to its end", None, False)]
    return found


def write(out: Path, order: Sequence[str]) -> Path:
    """Write ``out/gpu-report.md`` from every step record in ``out/steps``."""
    records = [json.loads(p.read_text()) for p in (out / "steps").glob("*.json")]
    records.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    dry = any(r.get("dry_run") for r in records)
    lines = ["# ckptwrap GPU check", ""]
    lines.append(f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `make gpu-check` "
                 f"(`python scripts/gpu_check.py`); steps run: {sum(r['seconds'] for r in records) / 60:.1f} min.")
    if dry:
        lines += ["", "**Dry run**: on the CPU at tiny sizes; the CUDA-only tests skip or are only collected, and "
                      "timings and memory are not what the targets are about (their verdicts are not judged)."]
    lines += ["", "## Device and versions", ""] + _environment(records)
    lines += ["", "## Summary", "", "| step | status | time | limit | targets passed |", "|---|---|---|---|---|"]
    for r in records:
        passed = sum(1 for t in r.get("targets", []) if t["passed"] is True)
        judged = sum(1 for t in r.get("targets", []) if t["passed"] is not None)
        lines.append(f"| {r['name']} | {r['status'].upper() if r['status'] != 'passed' else 'pass'} | "
                     f"{r['seconds']:.0f} s | {r['limit_s']} s | {passed}/{judged} |")
    lines += ["", "## Targets", "", "| step | target | value | verdict |", "|---|---|---|---|"]
    for r in records:
        for t in r.get("targets", []):
            lines.append(f"| {r['name']} | {t['name']} | {_value(t['value'])} | {_verdict(t['passed'], r)} |")
    for r in (r for r in records if r["kind"] != "environment"):
        lines += ["", f"## {r['title']}", "", f"`{r['command']}`: {r['status']} in {r['seconds']:.0f} s "
                                                f"(limit {r['limit_s']} s)", ""]
        lines += _details(r)
    path = out / REPORT
    path.write_text("\n".join(lines) + "\n")
    return path


def all_passed(out: Path) -> bool:
    """Every step ran to success and, outside a dry run, no target failed."""
    records = [json.loads(p.read_text()) for p in (out / "steps").glob("*.json")]
    return all(r["status"] == "passed" and (r.get("dry_run") or all(t["passed"] is not False for t in r["targets"]))
               for r in records)


def _details(r: Dict[str, Any]) -> List[str]:
    lines: List[str] = []
    if r["kind"] == "tests" and r.get("counts"):
        c = r["counts"]
        lines.append(f"{c['tests']} tests: {c['passed']} passed, {c['failures']} failed, {c['errors']} errors, "
                     f"{c['skipped']} skipped.")
        lines += [f"- FAILED {case}" for case in c["failed"]]
    if r["kind"] == "tests" and r.get("collected") is not None:
        lines.append(f"{r['collected']} tests collected (dry run: collected with the plugin in place, not run).")
    if r.get("table"):
        lines += ["```text", r["table"], "```"]
    if r.get("arithmetic"):
        lines += ["", "Offload arithmetic:", ""] + [f"- {line}" for line in r["arithmetic"]]
    if r.get("nondeterministic"):
        lines += ["", "Operators without a deterministic kernel:", ""] + [f"- {m}" for m in r["nondeterministic"]]
    if r["status"] != "passed" or r["kind"] in ("install", "log"):
        tail = r["output"].rstrip().splitlines()[-_TAIL_LINES:]
        lines += ["", "Output (last lines):", "", "```text", *tail, "```"]
    return lines


def _environment(records: List[Dict[str, Any]]) -> List[str]:
    info = next((r.get("info") for r in records if r["kind"] == "environment"), None)
    if not info:
        return ["Not recorded (the environment step did not run or failed)."]
    lines = ["| | |", "|---|---|"]
    for key, value in info.items():
        shown = ", ".join(value) if isinstance(value, list) else value
        lines.append(f"| {key} | {'none' if shown in ('', None) else shown} |")
    return lines


def _target(name: str, value: Any, passed: Optional[bool]) -> Dict[str, Any]:
    return {"name": name, "value": value, "passed": passed}


def _verdict(passed: Optional[bool], record: Dict[str, Any]) -> str:
    if record.get("dry_run") and record["kind"] == "benchmark":
        return "not judged (dry run)"
    return {True: "PASS", False: "FAIL", None: "not checked"}[passed]


def _value(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value).replace("|", "/")


def _count_text(counts: Optional[Dict[str, Any]], record: Dict[str, Any]) -> str:
    if counts is None:
        return record["status"]
    return f"{counts['passed']} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"


def _junit(path: Path) -> Optional[Dict[str, Any]]:
    """Counts and failed test ids from pytest's JUnit XML (None if it wrote none)."""
    if not path.exists():
        return None
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    counts["failed"] = failed[:50]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _collected(output: str) -> Optional[int]:
    """Tests pytest collected: its "N tests collected" line, or (quieter) "file.py: N" lines."""
    found = re.search(r"(\d+) tests? collected", output)
    if found:
        return int(found.group(1))
    per_file = re.findall(r"^\S+\.py: (\d+)$", output, flags=re.MULTILINE)
    return sum(int(n) for n in per_file) if per_file else None


def _last_json(output: str) -> Dict[str, Any]:
    for line in reversed(output.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


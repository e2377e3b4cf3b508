"""One command for a GPU run: install ckptwrap without a package registry, run the CUDA
tests and a CPU test selection on CUDA, the engine benchmark in bf16, the Llama-style
benchmark at 4k and 8k tokens, the budget planner at that size and the repeated
exactness loops, and write one Markdown report into ``--out``.

Every step runs in its own process under its own time limit, and all of them within
``--minutes`` (25 by default); a step that fails or runs out of time is recorded in the
report and the next one runs. Each step's result is kept in ``OUT/steps/NAME.json`` and
the report (``OUT/gpu-report.md``) is rebuilt from every result there, so a machine that
limits one command's time can run the steps in parts (``--steps``) into one report.
``--dry-run`` runs what it can on the CPU at tiny sizes (CUDA-only test runs are
collected, not run) and still writes the report.

    python scripts/gpu_check.py --out DIR [--dry-run] [--steps install,cuda-tests,...] [--minutes 25]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ["-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", "."]
"""How ckptwrap is installed on a machine without a registry: ``--no-build-isolation``
builds with the setuptools already installed (an isolated build would fetch it), and
``--no-index`` makes sure nothing is looked up."""
CPU_SUITE_ON_CUDA = (
    "tests/engine/test_differential.py",
    "tests/engine/test_nesting.py",
    "tests/engine/test_early_stop.py",
    "tests/engine/test_context_fn.py",
    "tests/engine/test_sequential.py",
    "tests/engine/test_nonreentrant.py",
    "tests/engine/test_reentrant.py",
    "tests/engine/test_saved_inputs.py",
    "tests/engine/test_private_api_fallbacks.py",
)
"""The CPU suite's engine tests that build every tensor without naming a device: run with
CUDA as torch's default device, they compare both engines with the plain run and with
torch's checkpoint on CUDA (dropout, nesting, early stop, context_fn, sequential, the
inputs saved through a Function as on torch < 2.12, each private-API fallback). The
marking-layer tests build their batches from CPU generators and stay CPU-only;
tests/cuda/test_wrap_cuda.py covers that layer on CUDA."""
_ENVIRONMENT = r"""
import importlib.metadata as md, json, platform, torch
from ckptwrap import _torch_private
info = {"python": platform.python_version(), "torch": torch.__version__, "torch CUDA": torch.version.cuda,
        "CUDA available": torch.cuda.is_available(), "private torch names missing": _torch_private.fallbacks_in_use()}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update({"device": props.name, "device memory GiB": round(props.total_memory / 2**30, 1),
                 "compute capability": f"{props.major}.{props.minor}", "devices": torch.cuda.device_count(),
                 "cuDNN": torch.backends.cudnn.version()})
for name in ("transformers", "pytest", "hypothesis", "setuptools", "pip"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
print(json.dumps(info))
"""


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a run writes, with which interpreter, and whether it is a dry run."""

    out: Path
    python: str
    dry_run: bool


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the run: the command, its time limit and how its result is read."""

    name: str
    title: str
    kind: str
    """How the report reads the result: environment, install, tests or benchmark."""
    argv: Callable[[Context], List[str]]
    limit_s: int
    """The most this step may take."""
    reserve_s: int
    """What it needs at the least: later steps' reserves are kept back from earlier steps."""
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    result: Optional[str] = None
    """The file under ``OUT/logs`` where the step writes its results (JSON or JUnit XML)."""


def _pytest(ctx: Context, name: str, paths: Sequence[str], *extra: str) -> List[str]:
    argv = [ctx.python, "-m", "pytest", *paths, "-q", "-rfE", f"--junitxml={ctx.out / 'logs' / (name + '.xml')}"]
    return argv + (["--collect-only"] if ctx.dry_run and name != "cuda-tests" else []) + list(extra)


def _engine(ctx: Context) -> List[str]:
    argv = [ctx.python, "benchmarks/engine.py", "--dtype", "bfloat16", "--json", str(ctx.out / "logs" / "engine-bench.json")]
    if ctx.dry_run:
        return argv + ["--device", "cpu", "--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "16",
                       "--batch", "2", "--steps", "1", "--warmup", "0"]
    return argv + ["--device", "cuda"]


def _llama(seq: int) -> Callable[[Context], List[str]]:
    def argv(ctx: Context) -> List[str]:
        base = [ctx.python, "benchmarks/gpu_llama.py", "--json", str(ctx.out / "logs" / f"llama-{seq // 1024}k.json")]
        if seq < 8192:  # where the step's time goes: one profiled step per row, two timelines
            base += ["--profile", str(ctx.out / "logs" / "profile-4k"), "--trace", "blocks,blocks;overlap"]
        if ctx.dry_run:  # the 8k step's dry run keeps to a few rows, to stay short
            rows = [] if seq < 8192 else ["--configs", "none,blocks,offload"]
            return base + ["--device", "cpu", "--tiny", *rows]
        rows = [] if seq < 8192 else ["--configs", "none,blocks,blocks;overlap,torch,budget:50%,offload"]
        return base + ["--seq", str(seq), *rows]

    return argv


def _planner(ctx: Context) -> List[str]:
    argv = [ctx.python, "benchmarks/gpu_planner.py", "--json", str(ctx.out / "logs" / "planner.json")]
    return argv + (["--device", "cpu", "--tiny", "--parts", "dynamic"] if ctx.dry_run else [])


def _fsdp2(ctx: Context) -> List[str]:
    argv = [ctx.python, "benchmarks/fsdp2_ranks.py", "--ranks", "1", "--json", str(ctx.out / "logs" / "fsdp2.json")]
    if ctx.dry_run:
        return argv + ["--device", "cpu", "--width", "32", "--layers", "2"]
    # The CPU's sizes: wider, the iteration's peak is AdamW's step under every policy, and
    # no row tells the plans apart (width 1024, 8 layers: 2600.33 MiB in each).
    return argv + ["--device", "cuda"]


def _repeat_exactness(ctx: Context) -> List[str]:
    argv = [ctx.python, "scripts/repeat_exactness.py"]
    if ctx.dry_run:
        return argv + ["--device", "cpu", "--rounds", "1", "--steps", "4", "--width", "1", "--cases", "bert:padded"]
    return argv + ["--device", "cuda", "--seconds", "150"]


STEPS = (
    Step("environment", "Device and versions", "environment", lambda c: [c.python, "-c", _ENVIRONMENT], 60, 20),
    Step("install", "Install without a registry", "install",
         lambda c: [c.python, *INSTALL, *(["--dry-run"] if c.dry_run else [])], 120, 30),
    Step("cuda-tests", "CUDA tests (tests/cuda)", "tests", lambda c: _pytest(c, "cuda-tests", ["tests/cuda"]),
         360, 120, result="cuda-tests.xml"),
    Step("cpu-suite-on-cuda", "CPU suite's engine tests on CUDA", "tests",
         lambda c: _pytest(c, "cpu-suite-on-cuda", CPU_SUITE_ON_CUDA, "-p", "pytest_on_device"), 240, 60,
         env={"CKPTWRAP_TEST_DEVICE": "cuda"}, result="cpu-suite-on-cuda.xml"),
    Step("engine-bench", "Engine benchmark, bf16 autocast (benchmarks/engine.py)", "benchmark", _engine, 240, 60,
         result="engine-bench.json"),
    Step("llama-4k", "Llama-style benchmark, 4096 tokens (benchmarks/gpu_llama.py)", "benchmark", _llama(4096),
         360, 150, result="llama-4k.json"),
    Step("llama-8k", "Llama-style benchmark, 8192 tokens (benchmarks/gpu_llama.py)", "benchmark", _llama(8192),
         480, 240, result="llama-8k.json"),
    Step("planner", "The budget planner at a realistic size (benchmarks/gpu_planner.py)", "benchmark", _planner,
         300, 120, result="planner.json"),
    Step("fsdp2", "FSDP2 on the GPU, NCCL: plans and a lazy budget per rank (benchmarks/fsdp2_ranks.py)", "benchmark",
         _fsdp2, 180, 60, result="fsdp2.json"),
    Step("repeat-exactness", "A lazy budget against two plain copies, over and over (scripts/repeat_exactness.py)",
         "log", _repeat_exactness, 240, 170),
)
"""The steps in the order they run; their limits add up to 43 minutes, the ``--minutes``
deadline (25) caps the whole run, and each step keeps the later steps' reserves (on a
machine that lends less time, run them in parts with ``--steps``)."""


def run_step(step: Step, ctx: Context, limit_s: float) -> Dict[str, object]:
    """Run one step; its record (status, time, output) for the report."""
    env = dict(os.environ)
    # The checkout is importable whether or not the install step worked (it is pure
    # Python); scripts/ holds the pytest plugin that makes CUDA the default device.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "scripts"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.update(step.env)
    if ctx.dry_run and "CKPTWRAP_TEST_DEVICE" in step.env:
        env["CKPTWRAP_TEST_DEVICE"] = "cpu"
    argv = step.argv(ctx)
    log = ctx.out / "logs" / f"{step.name}.log"
    started = time.monotonic()
    with open(log, "w") as sink:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode: Optional[int] = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    seconds = time.monotonic() - started
    output = log.read_text(errors="replace")
    status = "timeout" if returncode is None else ("passed" if returncode == 0 else "failed")
    return {"name": step.name, "title": step.title, "kind": step.kind, "command": _shown(argv, step.env, ctx),
            "result": step.result,
            "status": status, "returncode": returncode, "seconds": round(seconds, 1), "limit_s": round(limit_s),
            "dry_run": ctx.dry_run, "output": output[-20000:]}


def _shown(argv: Sequence[str], env: Dict[str, str], ctx: Context) -> str:
    words = [("python" if word == ctx.python else word) for word in argv]
    if "-c" in words:
        words = words[: words.index("-c") + 1] + ["<environment probe>"]
    words = [w.replace(str(ctx.out) + os.sep, "") for w in words]
    prefix = [f"{k}={'cpu' if ctx.dry_run else v}" for k, v in env.items()]
    return " ".join(prefix + words)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the selected steps and write the report. Returns 0, or 1 if a step or a target
    failed (the report says which)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the report (created if missing)")
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU at tiny sizes; collect the CUDA-only tests")
    parser.add_argument("--steps", default=",".join(s.name for s in STEPS),
                        help="comma-separated steps to run (default: all): " + ", ".join(s.name for s in STEPS))
    parser.add_argument("--minutes", type=float, default=25.0, help="deadline for the whole run")
    parser.add_argument("--python", default=sys.executable, help="interpreter that has torch (default: this one)")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.steps.split(",") if name.strip()]
    unknown = sorted(set(chosen) - {s.name for s in STEPS})
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; the steps are {', '.join(s.name for s in STEPS)}")
    ctx = Context(Path(args.out).resolve(), args.python, args.dry_run)
    for sub in ("steps", "logs"):
        (ctx.out / sub).mkdir(parents=True, exist_ok=True)
    steps = [s for s in STEPS if s.name in chosen]
    deadline = time.monotonic() + args.minutes * 60
    for index, step in enumerate(steps):
        later = sum(s.reserve_s for s in steps[index + 1:])
        limit = min(step.limit_s, deadline - time.monotonic() - later)
        if limit < step.reserve_s:
            record = {"name": step.name, "title": step.title, "kind": step.kind, "result": step.result,
                      "command": _shown(step.argv(ctx), step.env, ctx), "status": "skipped", "returncode": None, "seconds": 0, "limit_s": 0, "dry_run": ctx.dry_run,
                      "output": f"not run: {max(limit, 0):.0f} s left within --minutes {args.minutes:g}, "
                                f"it needs at least {step.reserve_s} s"}
        else:
            print(f"[gpu-check] {step.name}: running (limit {limit:.0f} s)", flush=True)
            record = run_step(step, ctx, limit)
        record.update(_gpu_report.read_results(record, ctx.out / "logs"))
        (ctx.out / "steps" / f"{step.name}.json").write_text(json.dumps(record, indent=2))
        print(f"[gpu-check] {step.name}: {record['status']} in {record['seconds']} s", flush=True)
    report = _gpu_report.write(ctx.out, [s.name for s in STEPS])
    print(f"[gpu-check] report: {report}")
    return 0 if _gpu_report.all_passed(ctx.out) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The budget planner against torch.compile's min-cut partitioner budget: memory/time frontiers.

Per model (``benchmarks/_frontier_models.py``: the GPT stack, the conv pyramid, Hugging
Face GPT-2 and Llama) each configuration trains: ``none``, ``blocks``,
``checkpoint_sequential`` with round(sqrt(n)) segments, ``budget:`` 75/50/30 % (the
planner choosing per block down to operators, and, for comparison, ``budget:X;recompute``,
whole blocks only), ``blocks;selective``, and ``torch.compile(backend="aot_eager")`` with
``torch._functorch.config.activation_memory_budget`` 0.75/0.5/0.3 (``--inductor`` adds
inductor rows, reported but not judged; ``--quick`` compiles at 0.5 only). Dropout is off
in every model: compiled code draws its random numbers differently from eager code.

"step peak" is the peak, over one whole training step (forward and backward), of the CPU
memory the step allocated above what was allocated before it, from ``torch.profiler``'s
memory events. (``ckptwrap.measure.measure_peak`` counts storages through a dispatch mode,
and with a dispatch mode active torch.compile runs the model eagerly: it cannot measure
the compiled rows.) Memory and gradients come from one untimed step per configuration;
then the configurations take turns step by step, after warm-up rounds, and "ms" is the
median step time and "x none" the median of per-round ratios to ``none``'s step.
"predicted" is the planner's predicted step peak (every ckptwrap row plans with example
inputs and the benchmark's loss, ``loss_fn``), judged against the measured one.
"setup s" is wrap_model's planning time (with example inputs) or, for compiled rows, the
first step (compilation) minus a normal step.

Target (3) compares the two at the same memory: for every aot_eager row, a ckptwrap row
``budget:<bytes>B = compile X%`` is budgeted at exactly the step peak that row measured,
and its extra time is judged against the compiled row's wherever that row kept its own
budget (elsewhere both are printed, not judged).

    python benchmarks/frontier.py [--threads 1] [--quick] [--only gpt] [--inductor] [--plot f.png]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptwrap  # noqa: E402
from _allocator import allocator_peak  # noqa: E402
from _frontier_models import Bench, build_benches, parse_run_args  # noqa: E402

FRACTIONS = (0.75, 0.5, 0.3)
"""Budgets, as fractions of ``none``'s peak, for ckptwrap and for the compiler."""
SLACK = 0.03
"""A measured peak may pass its budget by this share of ``none``'s step peak."""
PREDICTION = 0.05
"""The planner's predicted step peak may differ from the measured one by this share."""
SAME_PEAK = 0.01
"""Peaks closer than this share of ``none``'s step peak count as equal."""
_MIB = 1024 * 1024


@dataclasses.dataclass
class Row:
    """One configuration of one model, and what was measured for it."""

    label: str
    kind: str
    """'none', 'ckptwrap', 'budget' (a ckptwrap budget), 'whole' (a budget choosing whole
    blocks only), 'matched' (a ckptwrap budget of a compiled row's measured step peak),
    'compile' (aot_eager) or 'inductor'."""
    run: Optional[Callable[..., Any]] = None
    """Calls the configuration's model; None if it could not be set up."""
    model: Optional[nn.Module] = None
    """The module whose parameters get the gradients."""
    fraction: Optional[float] = None
    plan: Any = None
    setup_s: Optional[float] = None
    error: str = ""
    compiles: Optional[List[int]] = None
    """For compiled rows, one entry per graph the backend compiled."""
    saved_bytes: Optional[int] = None
    """For compiled rows, bytes the compiled forward saved for backward."""
    step_peak: int = 0
    grads_equal: Optional[bool] = None
    max_diff: float = 0.0
    step_ms: List[float] = dataclasses.field(default_factory=list)
    ratios: List[float] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------- configurations


def _ckptwrap_row(bench: Bench, label: str, policy: str, kind: str, fraction=None) -> Row:
    model = copy.deepcopy(bench.model)
    start = time.perf_counter()
    try:
        ckptwrap.wrap_model(model, policy, example_inputs=bench.args, example_kwargs=bench.kwargs,
                            loss_fn=bench.loss)
    except ckptwrap.CheckpointError as error:
        return Row(label, kind, fraction=fraction, error=str(error).splitlines()[0][:150])
    setup = time.perf_counter() - start
    plan = getattr(model, "ckptwrap_plan", None)
    return Row(label, kind, model, model, fraction, plan, setup if policy != "none" else None)


def _sequential_row(bench: Bench) -> Row:
    label = f"checkpoint_sequential({bench.segments})"
    staged = bench.sequential(copy.deepcopy(bench.model))
    return Row(label, "ckptwrap", staged, staged.model)


def _compiled_row(bench: Bench, fraction: float, backend: str) -> Row:
    """A fresh copy of the model compiled under its own activation memory budget.

    The budget is read when the partitioner runs, at the first call, so the config patch
    covers that call. Every row compiles a function with its own code object, and
    ``fullgraph`` forbids graph breaks (whose resumed frames would share code objects):
    Dynamo's cache, which is kept per code object, can then not hand one row's graph to
    another, and ``compiles`` shows that no row recompiled later under another budget.
    """
    label = f"compile {backend} {fraction:.0%}"
    model = copy.deepcopy(bench.model)
    compiles: List[int] = []

    def counting_backend(graph, example_inputs):
        compiles.append(len(graph.graph.nodes))
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)

    def forward(*args, **kwargs):
        return model(*args, **kwargs)

    forward.__code__ = forward.__code__.replace()  # a code object of this row's own
    run = torch.compile(forward, backend=counting_backend, fullgraph=True)
    row = Row(label, backend if backend == "inductor" else "compile", run, model, fraction,
              compiles=compiles)
    try:
        # No compile caches: a cached artifact would make "setup s" not a compile time.
        with torch._functorch.config.patch(activation_memory_budget=fraction,
                                           enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            start = time.perf_counter()
            _step(bench, row, seed=0)
            first = time.perf_counter() - start
        start = time.perf_counter()
        _step(bench, row, seed=0)
        row.setup_s = first - (time.perf_counter() - start)
        row.saved_bytes = _saved_bytes(bench, row)
    except Exception as error:  # noqa: BLE001 - a compiler failure is a result to report
        row.run, row.error = None, f"{type(error).__name__}: {str(error).splitlines()[0][:140]}"
    return row


def _saved_bytes(bench: Bench, row: Row) -> int:
    """Bytes of the storages the forward saves for backward, by saved-tensor hooks."""
    seen: Dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
        return tensor

    row.model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = bench.loss(row.run(*bench.args, **bench.kwargs))
    loss.backward()
    row.model.zero_grad(set_to_none=True)
    return sum(seen.values())


def build_rows(bench: Bench, inductor: bool, compile_fractions: Sequence[float]) -> List[Row]:
    """Every configuration of one model, ``none`` first."""
    rows = [_ckptwrap_row(bench, "none", "none", "none"), _ckptwrap_row(bench, "blocks", "blocks", "ckptwrap")]
    rows.append(_sequential_row(bench))
    rows += [_ckptwrap_row(bench, f"budget:{f:.0%};recompute", f"budget:{f:.0%};recompute", "whole", f)
             for f in FRACTIONS]
    rows += [_ckptwrap_row(bench, f"budget:{f:.0%}", f"budget:{f:.0%}", "budget", f) for f in FRACTIONS]
    rows.append(_ckptwrap_row(bench, "blocks;selective", "blocks;selective", "ckptwrap"))
    rows[0].saved_bytes = _saved_bytes(bench, rows[0])
    # Compiled code of earlier models can go; this model's rows isolate themselves.
    torch._dynamo.reset()
    backends = ("aot_eager", "inductor") if inductor else ("aot_eager",)
    rows += [_compiled_row(bench, f, backend) for backend in backends for f in compile_fractions]
    return rows


def matched_rows(bench: Bench, rows: Sequence[Row]) -> List[Row]:
    """Per aot_eager row, a ckptwrap budget of exactly the step peak it measured:
    ckptwrap's step time at compile's memory, for target (3)."""
    return [
        _ckptwrap_row(bench, f"budget:{row.step_peak}B = compile {row.fraction:.0%}",
                      f"budget:{row.step_peak}B", "matched", row.fraction)
        for row in rows if row.kind == "compile" and row.run is not None
    ]


# --------------------------------------------------------------------------- measuring


def _step(bench: Bench, row: Row, *, seed: int) -> None:
    """One training step (forward and backward) from fresh gradients."""
    row.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    bench.loss(row.run(*bench.args, **bench.kwargs)).backward()


def step_peak(bench: Bench, row: Row) -> int:
    """Peak bytes a training step allocates on the CPU above what was live before it, at
    the allocator (compiled code's allocations included)."""
    row.model.zero_grad(set_to_none=True)
    return allocator_peak(lambda: _step(bench, row, seed=0))


def measure(bench: Bench, rows: List[Row]) -> None:
    """Peak and gradients of every row in its own untimed step; gradients against none's."""
    reference: Dict[str, torch.Tensor] = {}
    for row in (row for row in rows if row.run is not None):
        row.step_peak = step_peak(bench, row)
        grads = {n: p.grad for n, p in row.model.named_parameters() if p.grad is not None}
        if row.kind == "none":
            reference = {name: grad.clone() for name, grad in grads.items()}
        elif grads.keys() != reference.keys():
            row.grads_equal, row.max_diff = False, float("inf")
        else:
            row.grads_equal = all(torch.equal(grads[n], reference[n]) for n in grads)
            row.max_diff = max((grads[n] - reference[n]).abs().max().item() for n in grads)
        row.model.zero_grad(set_to_none=True)


def time_rows(bench: Bench, rows: List[Row], *, steps: int, warmup: int) -> None:
    """Configurations take turns step by step, the order rotating each round."""
    live = [row for row in rows if row.run is not None]
    for index in range(warmup + steps):
        shift = index % len(live)
        times = {}
        for row in live[shift:] + live[:shift]:
            start = time.perf_counter()
            _step(bench, row, seed=index + 1)
            times[row.label] = (time.perf_counter() - start) * 1000
            row.model.zero_grad(set_to_none=True)
        if index >= warmup:
            for row in live:
                row.step_ms.append(times[row.label])
                row.ratios.append(times[row.label] / times[live[0].label])


def _ratio(row: Row) -> float:
    return statistics.median(row.ratios)


# --------------------------------------------------------------------------- output


def format_table(rows: Sequence[Row]) -> str:
    """One line per configuration."""
    none = rows[0]
    header = ("configuration", "step peak MiB", "predicted", "% none", "median ms", "x none",
              "setup s", "grads")
    table = [header]
    for row in rows:
        if row.run is None:
            table.append((row.label, "-", "", "", "", "", "", row.error))
            continue
        if row.grads_equal is None:
            grads = "reference"
        else:
            grads = "bit-equal" if row.grads_equal else f"differ, max {row.max_diff:.1e}"
        table.append((
            row.label, f"{row.step_peak / _MIB:.1f}", _predicted(row),
            f"{row.step_peak / none.step_peak:.0%}",
            f"{statistics.median(row.step_ms):.1f}", f"{_ratio(row):.2f}",
            "-" if row.setup_s is None else f"{row.setup_s:.2f}", grads,
        ))
    widths = [max(len(line[i]) for line in table if len(line[i]) < 40) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i in (0, 7) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _predicted(row: Row) -> str:
    predicted = getattr(row.plan, "predicted_peak", None)
    return "-" if predicted is None else f"{predicted / _MIB:.1f}"


def _line(passed: Optional[bool], text: str) -> str:
    return f"  [{'n/a' if passed is None else 'pass' if passed else 'fail'}] {text}"


def targets(rows: Sequence[Row]) -> List[str]:
    """The issue's targets on one model, one line each."""
    none = rows[0].step_peak
    slack = SLACK * none
    compiled = {row.fraction: row for row in rows if row.kind == "compile"}
    lines = []
    for kind in ("budget", "whole"):
        lines += _budget_lines([row for row in rows if row.kind == kind], none, slack)
    for row in rows:
        if row.kind in ("none", "ckptwrap", "budget", "whole", "matched") and row.run is not None:
            lines.append(_prediction_line(row))
    matched = {row.fraction: row for row in rows if row.kind == "matched"}
    for fraction in FRACTIONS:
        ours, theirs = matched.get(fraction), compiled.get(fraction)
        text = (f"(3) at {fraction:.0%}: ckptwrap's extra time <= compile's, ckptwrap budgeted "
                f"at compile's measured peak")
        if theirs is None:
            lines.append(_line(None, f"{text}: no compile row at this budget"))
        elif theirs.run is None:
            lines.append(_line(None, f"{text}: compile did not run"))
        elif theirs.step_peak > fraction * none + slack:
            numbers = (f"compile {_mib(theirs.step_peak)}, {_ratio(theirs) - 1:+.0%}; ckptwrap "
                       + (f"{_mib(ours.step_peak)}, {_ratio(ours) - 1:+.0%}"
                          if ours is not None and ours.run is not None else "did not run"))
            lines.append(_line(None, f"{text}: not judged, compile missed its own budget of "
                         f"{_mib(fraction * none + slack)} ({numbers})"))
        elif ours is None or ours.run is None:
            reason = ours.error if ours is not None and ours.error else "a row did not run"
            lines.append(_line(False, f"{text}: {reason}"))
        else:
            numbers = (f"extra {_ratio(ours) - 1:+.0%} vs {_ratio(theirs) - 1:+.0%}, peak "
                       f"{_mib(ours.step_peak)} vs {_mib(theirs.step_peak)}")
            lower = ours.step_peak <= theirs.step_peak + SAME_PEAK * none
            faster = _ratio(ours) - 1 <= _ratio(theirs) - 1
            lines.append(_line(lower and faster, f"{text}: {numbers}"))
    for row in (row for row in rows if row.kind in ("compile", "inductor")):
        if row.run is None:
            lines.append(_line(False, f"(4, compile's, not ckptwrap's) {row.label}: {row.error}"))
            continue
        fits = row.step_peak <= row.fraction * none + slack
        lines.append(_line(fits, f"(4, compile's, not ckptwrap's) {row.label} within its budget: "
                     f"{_mib(row.step_peak)} {'<=' if fits else '>'} "
                     f"{_mib(row.fraction * none + slack)}; saved for backward "
                     f"{_mib(row.saved_bytes)} (none, eager: {_mib(rows[0].saved_bytes)}); "
                     f"graphs compiled {len(row.compiles)}"))
    return lines


def _budget_lines(rows: Sequence[Row], none: int, slack: float) -> List[str]:
    """Targets (1) and (2) for one kind of budget row."""
    lines = []
    for row in rows:
        label = row.label
        if row.run is None:
            lines.append(_line(False, f"(1) {label} honoured: refused ({row.error})"))
            continue
        plan, fraction = row.plan, row.fraction
        ok = plan.predicted_peak is not None and plan.predicted_peak <= plan.budget
        lines.append(_line(ok, f"(1) {label} honoured, by the planner's own prediction: "
                     f"{_mib(plan.predicted_peak)} <= budget {_mib(plan.budget)}"))
        fits = row.step_peak <= fraction * none + slack
        lines.append(_line(fits, f"(1) {label} honoured, step peak: measured "
                     f"{_mib(row.step_peak)} {'<=' if fits else '>'} {fraction:.0%} x "
                     f"{_mib(none)} + {SLACK:.0%} = {_mib(fraction * none + slack)}"))
    ran = sorted((row for row in rows if row.run is not None), key=lambda row: row.fraction)
    shown = ", ".join(f"{row.fraction:.0%}: {_mib(row.step_peak)}" for row in ran)
    monotone = all(a.step_peak <= b.step_peak for a, b in zip(ran, ran[1:]))
    kind = rows[0].label.partition(";")[2] if rows else ""
    lines.append(_line(monotone if len(ran) > 1 else None, f"(2) step peak never higher at a "
                 f"smaller budget{f' ({kind})' if kind else ''}: {shown or 'no budget ran'}"))
    return lines


def _prediction_line(row: Row) -> str:
    """Target (5): the planner's predicted step peak within 5% of the measured one."""
    predicted = getattr(row.plan, "predicted_peak", None)
    if predicted is None:
        return _line(None, f"(5) {row.label}: no prediction")
    error = predicted / max(row.step_peak, 1) - 1
    return _line(abs(error) <= PREDICTION, f"(5) {row.label} predicted within "
                 f"{PREDICTION:.0%}: {_mib(predicted)} vs measured {_mib(row.step_peak)} "
                 f"({error:+.1%})")


def _mib(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else f"{nbytes / _MIB:.2f} MiB"


def save_plot(results: Sequence[tuple], path: str) -> None:
    """Both frontiers per model, step peak % against time ratio, into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for axis, (bench, rows) in zip(axes[0], results):
        none = rows[0].step_peak
        for kinds, color, name in ((("budget", "matched"), "tab:blue", "ckptwrap budget"),
                                  (("whole",), "tab:cyan", "ckptwrap budget, whole blocks"),
                                  (("compile",), "tab:red", "compile aot_eager budget")):
            points = [(100.0, 1.0)] + [(100 * r.step_peak / none, _ratio(r))
                                       for r in rows if r.kind in kinds and r.run is not None]
            axis.plot(*zip(*sorted(points)), "-o", color=color, label=name)
        for row in rows:
            if row.kind in ("ckptwrap", "inductor") and row.run is not None:
                x, y = 100 * row.step_peak / none, _ratio(row)
                axis.plot(x, y, "s", color="tab:gray")
                axis.annotate(row.label, (x, y), xytext=(3, 3), textcoords="offset points", fontsize=6)
        axis.set_title(bench.name, fontsize=9)
        axis.set_xlabel("step peak (% of none)")
        axis.set_ylabel("step time (x none)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 1 if a ckptwrap configuration's gradients differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14, help="timed rounds per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--inductor", action="store_true", help="also inductor rows (not judged)")
    parser.add_argument("--plot", metavar="PNG", help="draw the frontiers into PNG (matplotlib)")
    args = parse_run_args(parser, argv, rounds="steps", quick_rounds=2)
    print(f"torch {torch.__version__}, CPU threads {torch.get_num_threads()}, {args.warmup} "
          f"warm-up and {args.steps} timed rounds per model; step peak from torch.profiler's "
          f"memory events; budgets judged with {SLACK:.0%} of none's step peak as slack")
    started = time.perf_counter()
    benches, notes = build_benches(args, args.only)
    for note in notes:
        print(f"note: {note}")
    results, ckptwrap_equal = [], True
    for bench in benches:
        rows = build_rows(bench, args.inductor, (0.5,) if args.quick else FRACTIONS)
        measure(bench, rows)
        matched = matched_rows(bench, rows)
        measure(bench, rows[:1] + matched)
        rows += matched
        time_rows(bench, rows, steps=args.steps, warmup=args.warmup)
        print(f"\n{bench.name}: {bench.description}\n{format_table(rows)}")
        print("targets:\n" + "\n".join(targets(rows)))
        ckptwrap_equal &= all(r.grads_equal is not False for r in rows
                              if r.kind in ("ckptwrap", "budget", "whole", "matched"))
        results.append((bench, rows))
    if args.plot:
        try:
            save_plot(results, args.plot)
            print(f"\nplot written to {args.plot}")
        except ImportError:
            print("\nnote: matplotlib is not installed, no plot")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if not ckptwrap_equal:
        print("error: a ckptwrap configuration's gradients differ from none's", file=sys.stderr)
    return 0 if ckptwrap_equal else 1


if __name__ == "__main__":
    sys.exit(main())

"""The budget planner against torch.compile's min-cut partitioner budget: memory/time frontiers.

Per model (``benchmarks/_frontier_models.py``: the GPT stack, the conv pyramid, Hugging
Face GPT-2 and Llama) each configuration trains. Eager rows: ``none``, ``blocks``,
``checkpoint_sequential`` with round(sqrt(n)) segments, ``budget:`` 75/50/30 % (the
planner choosing per block down to operators, and, for comparison, ``budget:X;recompute``,
whole blocks only) and ``blocks;selective``. Compiled rows, ``torch.compile(backend=
"aot_eager")``: ``compile (budget 1.0)``, compile's un-budgeted step
(``torch._functorch.config.activation_memory_budget`` 1.0); ``compile aot_eager X%``,
compile's own budget X; and ``compile(budget:X%)``, ckptwrap's ``budget:X%`` planned
eagerly with example inputs, then compiled. ``--inductor`` adds the same compiled rows on
inductor, reported but not judged; ``--quick`` budgets at 75% only. Dropout is off in
every model: compiled code draws its random numbers differently from eager code.

Every row has a baseline, named in the table: eager ``none`` for eager rows, ``compile
(budget 1.0)`` (of the same backend) for compiled rows, since compiling alone changes a
step's time and peak. "% none" and "x none" are always of eager ``none``; "% base" and
"x base" of the row's baseline. ckptwrap's budgets are shares of eager ``none``'s step
peak, compiled or not; compile's own budgets are judged as shares of its baseline's.

"step peak" is the peak, over one whole training step (forward and backward), of the CPU
memory the step allocated above what was allocated before it, from ``torch.profiler``'s
memory events. (``ckptwrap.measure.measure_peak`` counts storages through a dispatch mode,
and with a dispatch mode active torch.compile runs the model eagerly: it cannot measure
the compiled rows.) Memory and gradients come from one untimed step per configuration;
then the configurations take turns step by step, after warm-up rounds, and "ms" is the
median step time and "x none"/"x base" the median of per-round ratios to that row's step.
"predicted" is the planner's predicted step peak of the eager step (every ckptwrap row
plans with example inputs and the benchmark's loss, ``loss_fn``), judged against the
measured one for eager rows. "setup s" is wrap_model's planning time (with example
inputs), plus, for compiled rows, the first step (compilation) minus a normal step.

Target (3) compares ckptwrap and compile at the same memory: for every aot_eager row, an
eager ckptwrap row ``budget:<bytes>B = compile X%`` is budgeted at exactly the step peak
that row measured, and its extra time over ``none`` is judged against the compiled row's
extra time over ``compile (budget 1.0)`` wherever that row kept its own budget (elsewhere
both are printed, not judged). Target (6) compares ``compile(budget:X%)`` with compile's
own X, both over ``compile (budget 1.0)``.

    python benchmarks/frontier.py [--threads 1] [--quick] [--only gpt] [--inductor] [--plot f.png]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptwrap  # noqa: E402
from _allocator import allocator_peak  # noqa: E402
from _frontier_models import Bench, build_benches, parse_run_args  # noqa: E402
from _frontier_report import SLACK, Row, format_table, save_plot, targets  # noqa: E402

FRACTIONS = (0.75, 0.5, 0.3)
"""Budgets, as fractions of ``none``'s peak for ckptwrap, of compile's own un-budgeted
step for the compiler."""
QUICK_FRACTIONS = (0.75,)
"""The compiled budgets of ``--quick``: the one most models reach at its tiny sizes."""
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6
"""Compiled code may sum in another order: its gradients agree with ``none``'s within
these tolerances (eager ckptwrap rows must be bit-equal)."""


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


def _compile_base_row(bench: Bench, backend: str) -> Row:
    """compile's un-budgeted step, the baseline of every compiled row of ``backend``."""
    label = "compile (budget 1.0)" if backend == "aot_eager" else f"compile {backend} (budget 1.0)"
    row = Row(label, "compile-base", model=copy.deepcopy(bench.model), backend=backend)
    return _compile(bench, row, budget=1.0, fullgraph=True)


def _compile_budget_row(bench: Bench, fraction: float, base: Row) -> Row:
    """compile's own activation memory budget ``fraction``."""
    row = Row(f"compile {base.backend} {fraction:.0%}", "compile", model=copy.deepcopy(bench.model),
              fraction=fraction, backend=base.backend, base=base)
    return _compile(bench, row, budget=fraction, fullgraph=True)


def _compiled_plan_row(bench: Bench, fraction: float, base: Row) -> Row:
    """ckptwrap's ``budget:fraction``, planned eagerly on the example inputs, then compiled
    with compile's own budget left at 1.0, so that it differs from the baseline only by
    ckptwrap's plan. A plan made with example inputs compiles with ``fullgraph``, as the
    other compiled rows do.
    """
    prefix = "compile" if base.backend == "aot_eager" else f"compile {base.backend}"
    policy = f"budget:{fraction:.0%}"
    row = _ckptwrap_row(bench, f"{prefix}({policy})", policy, "compiled-budget", fraction)
    row.backend, row.base = base.backend, base
    return row if row.model is None else _compile(bench, row, budget=1.0, fullgraph=True)


def _compile(bench: Bench, row: Row, *, budget: float, fullgraph: bool) -> Row:
    """Compile ``row.model`` on ``row.backend`` under activation memory budget ``budget``;
    adds the compilation time to ``row.setup_s``.

    The budget is read when the partitioner runs, at the first call, so the config patch
    covers that call. Every row compiles a function with its own code object, and with
    ``fullgraph`` graph breaks are forbidden (their resumed frames would share code
    objects): Dynamo's cache, which is kept per code object, can then not hand one row's
    graph to another, and ``compiles`` shows that no row recompiled later under another
    budget.
    """
    model, backend, compiles = row.model, row.backend, []

    def counting_backend(graph, example_inputs):
        compiles.append(len(graph.graph.nodes))
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)

    def forward(*args, **kwargs):
        return model(*args, **kwargs)

    forward.__code__ = forward.__code__.replace()  # a code object of this row's own
    row.run = torch.compile(forward, backend=counting_backend, fullgraph=fullgraph)
    row.compiles = compiles
    try:
        # No compile caches: a cached artifact would make "setup s" not a compile time.
        with torch._functorch.config.patch(activation_memory_budget=budget,
                                           enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            start = time.perf_counter()
            _step(bench, row, seed=0)
            first = time.perf_counter() - start
        start = time.perf_counter()
        _step(bench, row, seed=0)
        row.setup_s = (row.setup_s or 0.0) + first - (time.perf_counter() - start)
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
    """Every configuration of one model: ``none`` first, then the other eager rows, then
    per backend compile's baseline, compile's own budgets and ckptwrap's under compile."""
    none = _ckptwrap_row(bench, "none", "none", "none")
    rows = [none, _ckptwrap_row(bench, "blocks", "blocks", "ckptwrap"), _sequential_row(bench)]
    rows += [_ckptwrap_row(bench, f"budget:{f:.0%};recompute", f"budget:{f:.0%};recompute", "whole", f)
             for f in FRACTIONS]
    rows += [_ckptwrap_row(bench, f"budget:{f:.0%}", f"budget:{f:.0%}", "budget", f) for f in FRACTIONS]
    rows.append(_ckptwrap_row(bench, "blocks;selective", "blocks;selective", "ckptwrap"))
    for row in rows[1:]:
        row.base = none
    none.saved_bytes = _saved_bytes(bench, none)
    # Compiled code of earlier models can go; this model's rows isolate themselves.
    torch._dynamo.reset()
    for backend in ("aot_eager", "inductor") if inductor else ("aot_eager",):
        base = _compile_base_row(bench, backend)
        rows.append(base)
        rows += [_compile_budget_row(bench, f, base) for f in compile_fractions]
        rows += [_compiled_plan_row(bench, f, base) for f in compile_fractions]
    return rows


def matched_rows(bench: Bench, rows: Sequence[Row]) -> List[Row]:
    """Per aot_eager budget row, an eager ckptwrap budget of exactly the step peak it
    measured: ckptwrap's step time at compile's memory, for target (3)."""
    matched = [
        _ckptwrap_row(bench, f"budget:{row.step_peak}B = compile {row.fraction:.0%}",
                      f"budget:{row.step_peak}B", "matched", row.fraction)
        for row in rows if row.kind == "compile" and row.backend == "aot_eager" and row.run is not None
    ]
    for row in matched:
        row.base = rows[0]
    return matched


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
            row.grads_equal, row.grads_close, row.max_diff = False, False, float("inf")
        else:
            row.grads_equal = all(torch.equal(grads[n], reference[n]) for n in grads)
            row.grads_close = all(torch.allclose(grads[n], reference[n], rtol=GRAD_RTOL,
                                                 atol=GRAD_ATOL) for n in grads)
            row.max_diff = max((grads[n] - reference[n]).abs().max().item() for n in grads)
        row.model.zero_grad(set_to_none=True)


def time_rows(bench: Bench, rows: List[Row], *, steps: int, warmup: int) -> None:
    """Configurations take turns step by step, the order rotating each round."""
    live = [row for row in rows if row.run is not None]
    for index in range(warmup + steps):
        shift = index % len(live)
        for row in live[shift:] + live[:shift]:
            start = time.perf_counter()
            _step(bench, row, seed=index + 1)
            elapsed = (time.perf_counter() - start) * 1000
            row.model.zero_grad(set_to_none=True)
            if index >= warmup:
                row.step_ms.append(elapsed)


def _gradients_agree(row: Row) -> bool:
    """Eager ckptwrap rows bit-equal to ``none``; compiled ckptwrap rows within tolerance."""
    if row.kind in ("ckptwrap", "budget", "whole", "matched"):
        return row.grads_equal is not False
    if row.kind == "compiled-budget":
        return row.grads_close is not False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 1 if a ckptwrap configuration's gradients differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14, help="timed rounds per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--inductor", action="store_true", help="also inductor rows (not judged)")
    parser.add_argument("--plot", metavar="PNG", help="draw the frontiers into PNG (matplotlib)")
    args = parse_run_args(parser, argv, rounds="steps", quick_rounds=2)
    fractions = QUICK_FRACTIONS if args.quick else FRACTIONS
    print(f"torch {torch.__version__}, CPU threads {torch.get_num_threads()}, {args.warmup} "
          f"warm-up and {args.steps} timed rounds per model; step peak from torch.profiler's "
          f"memory events. Baselines: eager rows against none, compiled rows against compile "
          f"(budget 1.0). ckptwrap's budgets are shares of none's step peak, compile's of "
          f"compile (budget 1.0)'s; each judged with {SLACK:.0%} of that peak as slack")
    started = time.perf_counter()
    benches, notes = build_benches(args, args.only)
    for note in notes:
        print(f"note: {note}")
    results, agree = [], True
    for bench in benches:
        rows = build_rows(bench, args.inductor, fractions)
        measure(bench, rows)
        matched = matched_rows(bench, rows)
        measure(bench, rows[:1] + matched)
        rows += matched
        time_rows(bench, rows, steps=args.steps, warmup=args.warmup)
        print(f"\n{bench.name}: {bench.description}\n{format_table(rows)}")
        print("targets:\n" + "\n".join(targets(rows, fractions)))
        agree &= all(_gradients_agree(row) for row in rows)
        results.append((bench, rows))
    if args.plot:
        try:
            save_plot(results, args.plot)
            print(f"\nplot written to {args.plot}")
        except ImportError:
            print("\nnote: matplotlib is not installed, no plot")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if not agree:
        print("error: a ckptwrap configuration's gradients differ from none's", file=sys.stderr)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())

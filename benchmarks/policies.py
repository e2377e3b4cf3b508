"""Checkpointing policies against the budget planner, on a uniform stack and on a pyramid.

Two models in one run: the GPT-style stack of ``benchmarks/engine.py`` (identical blocks)
and ``examples/factories.py``'s convolutional pyramid (early, high-resolution stages hold
most activation memory for a small share of compute). Each trains under ``none``,
``blocks``, ``every:2``, ``checkpoint_sequential`` with round(sqrt(n)) segments over the
GPT's blocks or the pyramid's stages, ``budget:`` 25/50/75 %, ``blocks;selective``, and
reference rows for the targets: ``first:K``, the fewest blocks whose measured step peak
fits the 50 % budget (GPT only), ``budget:`` set to the step peak checkpoint_sequential reached,
and,
when the planner refuses a budget as below the smallest step peak it can reach, ``budget:``
set to that peak: measured, it shows whether the refusal was right.

Every ckptwrap configuration plans with the workload's inputs and its loss (``loss_fn``),
so that the planner measures the same training step as the benchmark. The columns:

- "ckpt": modules the plan checkpoints; "sel": how many of them at a selective level
  (some operator outputs saved, the rest recomputed), the others whole.
- "step peak": the measured peak of one whole training step (forward, loss, backward),
  in bytes above what was allocated before it, from ``torch.profiler``'s memory events
  of the CPU allocator: activations, recomputations, activation and parameter gradients,
  backward's temporaries. "% none" is it in % of ``none``'s.
- "predicted": the plan's ``predicted_peak``, the planner's prediction of that step
  peak; "pred/meas" is it divided by the step peak.
- "act peak": informational, from a dispatch-mode meter: the peak of live storages that
  the forward or a recomputation created (activations, saved or transient); gradients,
  backward's temporaries and anything from before the step are not counted.
- "median ms", "min ms": step times. Configurations take turns step by step, the order
  rotating each round; "extra" is a configuration's fastest step minus ``none``'s
  fastest step, in ms and in % of the latter.
- "recompute ms": the median time per step spent inside the engine's recomputations,
  timed around each one: the extra work checkpointing adds. The time targets use it,
  since step-time differences on a shared CPU machine move by more than a block's
  recomputation between runs, and on the CPU an un-checkpointed step also pays for
  allocating fresh memory for every activation.

``budget:NN%`` is NN % of ``plan.plain_peak``, the predicted un-checkpointed step peak;
budgets are judged against the measured step peak, with ``FIT_SLACK`` of ``none``'s step
peak as slack, and the reference rows' budgets are step peaks too. Peaks come from
untimed steps, one per meter; gradients are compared with ``none``'s bit for bit.

    python benchmarks/policies.py [--steps 6] [--pyramid-steps 24] [--only gpt] [--plot f.png]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math
import re
import statistics
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ckptwrap
from ckptwrap.engine import _state as _engine_state

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from factories import PYRAMID_WIDTHS, ConvPyramid, conv_pyramid  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _allocator import allocator_peak  # noqa: E402

_MIB = 1024 * 1024
BUDGETS = (25, 50, 75)
"""Budgets, in % of the planner's predicted un-checkpointed step peak (``plan.plain_peak``)."""
FIT_SLACK = 0.05
"""The measured step peak may pass the budget by this share of ``none``'s measured step peak."""
PREDICTION_TOLERANCE = 0.10
"""The predicted step peak must be within this share of the measured one."""
PYRAMID_TIME_RATIO = 0.55
"""On the pyramid at 50 %, extra time at most this share of that of ``blocks``."""
TIME_TOLERANCE = 0.02
"""A 'no slower than' check allows this share of ``none``'s step time for timing noise."""
SEQUENTIAL_PEAK = "budget:<sequential's peak>"
"""Label of the row whose budget is the step peak checkpoint_sequential reached."""
LOWEST_PEAK = "budget:<smallest reachable>"
"""Label of the row planned for the smallest step peak the planner can reach, when it refuses
a budget below it: its measured step peak shows whether the refusal was right."""

Grads = Dict[str, torch.Tensor]


# --------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its inputs, and its forward with the stage list run by a given function."""

    name: str
    description: str
    model: nn.Module
    inputs: Tuple[torch.Tensor, ...]
    """Inputs of ``model.forward``; also the planner's example inputs."""
    loss: Callable[[Any], torch.Tensor]
    """The training loss, from the forward's output."""
    stages: Callable[[nn.Module], List[nn.Module]]
    """The modules checkpoint_sequential runs, in order."""
    staged_forward: Callable[..., Any]
    """``staged_forward(model, run, *inputs)``: the model's forward, with ``run(x)`` in
    place of the stage loop."""
    uniform: bool
    """Whether the candidate blocks are alike."""


def gpt_workload(args: argparse.Namespace, device: str) -> Workload:
    config = GPTConfig(width=args.width, heads=args.heads, layers=args.layers, seq_len=args.seq_len)
    torch.manual_seed(0)
    return Workload(
        "GPT stack",
        f"{config.layers} blocks, width {config.width}, {config.heads} heads, sequence "
        f"{config.seq_len}, batch {args.batch}",
        GPT(config).to(device).train(),
        synthetic_batch(config, args.batch, seed=0, device=device),
        loss=lambda loss: loss,
        stages=lambda model: list(model.blocks),
        staged_forward=_gpt_staged_forward,
        uniform=True,
    )


def _gpt_staged_forward(model: GPT, run: Callable, tokens: torch.Tensor, targets: torch.Tensor):
    # GPT.forward, with the block loop handed to ``run``.
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = run(model.drop(model.tok_emb(tokens) + model.pos_emb(positions)))
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def pyramid_workload(args: argparse.Namespace, device: str) -> Workload:
    torch.manual_seed(0)
    if args.pyramid_blocks is None:
        model = conv_pyramid()
    else:
        model = ConvPyramid(
            in_channels=3, widths=PYRAMID_WIDTHS, blocks_per_stage=args.pyramid_blocks, classes=10
        )
    generator = torch.Generator().manual_seed(0)
    size = args.image_size
    images = torch.randn(args.image_batch, 3, size, size, generator=generator).to(device)
    labels = torch.randint(10, (args.image_batch,), generator=generator).to(device)
    stages = lambda m: [getattr(m, f"stage{i}") for i in range(m.stages)]  # noqa: E731
    return Workload(
        "conv pyramid",
        f"{model.stages} stages of {len(model.stage0)} residual blocks, batch "
        f"{args.image_batch} at 3x{size}x{size}",
        model.to(device).train(),
        (images,),
        loss=lambda logits: F.cross_entropy(logits, labels),
        stages=stages,
        # ConvPyramid.forward, with the stage loop handed to ``run``.
        staged_forward=lambda m, run, x: m.head(run(m.stem(x)).mean(dim=(2, 3))),
        uniform=False,
    )


class StagedModel(nn.Module):
    """A workload's model whose stages run through ``ckptwrap.checkpoint_sequential``.

    ``chunks`` holds the segments as checkpoint_sequential cuts them, as modules sharing the
    model's parameters. With ``profiling`` on they run as plain modules, so that the planner
    can measure each segment as a candidate and predict the peak of this forward.
    """

    def __init__(self, workload: Workload, model: nn.Module, segments: int) -> None:
        super().__init__()
        self.model = model
        self.segments = segments
        self.profiling = False
        self._workload = workload
        stages = workload.stages(model)
        size = len(stages) // segments
        bounds = [i * size for i in range(segments)] + [len(stages)]
        self.chunks = nn.ModuleList(nn.Sequential(*stages[a:b]) for a, b in zip(bounds, bounds[1:]))

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self._workload.staged_forward(self.model, self._run, *inputs)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if self.profiling:
            for chunk in self.chunks:
                x = chunk(x)
            return x
        return ckptwrap.checkpoint_sequential(self._workload.stages(self.model), self.segments, x)


# --------------------------------------------------------------------------- measurement


class ActivationMeter(TorchDispatchMode):
    """Peak live bytes of the storages that the forward or a recomputation creates.

    Each storage counts from the operator that creates it until it is freed. Once ``in_backward`` is set, only storages created while
    ``ckptwrap.is_recomputing()`` count: gradients and backward's temporaries do not.
    """

    def __init__(self, device: str) -> None:
        super().__init__()
        self.in_backward = False
        self.peak_bytes = 0
        self._device_type = torch.device(device).type
        self._live = 0
        self._sizes: Dict[int, int] = {}
        self._finalizers: Dict[int, weakref.finalize] = {}
        self._freed: List[int] = []  # finalizers may fire mid-update, so they only append
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        if self.in_backward and not ckptwrap.is_recomputing():
            return out
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == self._device_type:
                key = _storage_key(leaf)
                if key is not None and key not in inputs:  # not an input, a view or in place
                    self._count(key, leaf.untyped_storage())
        return out

    def __exit__(self, exc_type, exc_value, traceback):
        for finalizer in list(self._finalizers.values()):
            finalizer.detach()
        self._finalizers.clear()
        return super().__exit__(exc_type, exc_value, traceback)

    def _count(self, key: int, storage: torch.UntypedStorage) -> None:
        with self._lock:
            if key in self._sizes:
                return
            self._sizes[key] = storage.nbytes()
            self._finalizers[key] = weakref.finalize(storage, self._release, key)
            while self._freed:
                self._live -= self._freed.pop()
            self._live += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self._live)

    def _release(self, key: int) -> None:
        self._finalizers.pop(key, None)
        self._freed.append(self._sizes.pop(key, 0))


def _storage_key(tensor: torch.Tensor) -> Optional[int]:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # sparse and wrapper tensors
        return None


# --------------------------------------------------------------------------- running


@dataclasses.dataclass
class Row:
    """One configuration of one workload, and what was measured for it."""

    label: str
    model: Optional[nn.Module] = None
    """The model its steps run (a copy of the workload's, wrapped); None if it cannot run."""
    plan: Any = None
    """The applied ``ckptwrap.Plan``; for checkpoint_sequential, the plan of its segments."""
    percent: Optional[int] = None
    """The budget in % of the predicted un-checkpointed step peak, for those rows."""
    budget: Optional[int] = None
    """The budget in bytes the measured step peak is judged against, for budget rows."""
    error: str = ""
    act_peak: int = 0
    """Peak of the storages the forward or a recomputation created (informational)."""
    step_peak: int = 0
    """Peak of the whole step's allocations above what was allocated before it."""
    grads_equal: Optional[bool] = None
    step_ms: List[float] = dataclasses.field(default_factory=list)
    recompute_ms: List[float] = dataclasses.field(default_factory=list)
    """Per timed step, the time spent inside recomputations."""

    @property
    def ran(self) -> bool:
        return self.model is not None

    @property
    def predicted(self) -> Optional[int]:
        return None if self.plan is None else self.plan.predicted_peak


def _policy_row(workload: Workload, label: str, policy: Any, *, example: bool = True, **fields) -> Row:
    """A copy of the model wrapped by ``policy``; with ``example``, the planner measures
    costs on the workload's inputs and the plan carries predictions."""
    model = copy.deepcopy(workload.model)
    try:
        ckptwrap.wrap_model(
            model, policy, example_inputs=workload.inputs if example else None, loss_fn=workload.loss
        )
    except ckptwrap.CheckpointError as error:
        return Row(label, error=str(error), **fields)
    return Row(label, model=model, plan=model.ckptwrap_plan, **fields)


def _sequential_row(workload: Workload, segments: int) -> Row:
    staged = StagedModel(workload, copy.deepcopy(workload.model), segments)
    wanted = {f"chunks.{i}" for i in range(segments - 1)}  # the last segment is not checkpointed
    staged.profiling = True
    plan = ckptwrap.plan(
        staged, lambda module, name: name in wanted, example_inputs=workload.inputs,
        loss_fn=workload.loss,
    )
    staged.profiling = False
    stages = len(workload.stages(workload.model))
    return Row(f"checkpoint_sequential({segments} of {stages})", model=staged, plan=plan)


def _step(workload: Workload, row: Row, *, seed: int, meter: Optional[ActivationMeter] = None) -> None:
    """One training step with fresh gradients and a fixed dropout seed."""
    row.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = workload.loss(row.model(*workload.inputs))
    if meter is not None:
        meter.in_backward = True
    loss.backward()


def _meter(workload: Workload, row: Row, device: str, reference: Optional[Grads]) -> Grads:
    """Measure ``row``'s peaks and compare its gradients with ``reference``.

    The step peak and the activation peak come from two untimed steps, so that neither
    meter sees the other's work; the gradients are those of the first. A step that fails
    is reported in the row, which then takes no part in the timing.
    """
    try:
        row.step_peak = _step_peak(workload, row, device)
        # A StagedModel holds the model as ``model``: compare under the same names.
        inner = row.model.model if isinstance(row.model, StagedModel) else row.model
        grads = {name: p.grad for name, p in inner.named_parameters() if p.grad is not None}
        with ActivationMeter(device) as meter:
            _step(workload, row, seed=0, meter=meter)
    except (RuntimeError, ckptwrap.CheckpointError) as error:
        if reference is None:
            raise
        row.model, row.error = None, f"step failed: {type(error).__name__}: {str(error).splitlines()[0]}"
        return {}
    row.act_peak = meter.peak_bytes
    if reference is not None:
        row.grads_equal = grads.keys() == reference.keys() and all(
            torch.equal(grads[name], reference[name]) for name in grads
        )
    row.model.zero_grad(set_to_none=True)
    return grads


def _step_peak(workload: Workload, row: Row, device: str) -> int:
    """Peak bytes one training step allocates on ``device`` above what was live before it,
    at the allocator (``_allocator.allocator_peak``): what the planner predicts. The
    step's gradients are left in the model."""
    row.model.zero_grad(set_to_none=True)
    return allocator_peak(lambda: _step(workload, row, seed=0), device)


def _fewest_blocks(workload: Workload, half: Row, device: str, reference: Grads) -> Optional[Row]:
    """``first:K`` for the least K whose measured step peak fits ``half``'s budget, or None.

    Measured, not predicted, starting from as many blocks as the planner chose. Of any K
    alike blocks the first K give the lowest peak: backward frees the later, un-checkpointed
    blocks before it recomputes the earlier ones.
    """
    total = len(ckptwrap.plan(workload.model, "blocks"))
    found: Optional[Row] = None
    k = len(half.plan)
    while 1 <= k <= total:
        row = _policy_row(workload, f"first:{k} (fewest fitting 50%)", f"first:{k}", example=False)
        _meter(workload, row, device, reference)
        if row.ran and row.step_peak <= half.budget:
            found, k = row, k - 1
        elif found is not None:
            break
        else:
            k += 1
    return found


def run_workload(workload: Workload, *, steps: int, warmup: int, device: str) -> List[Row]:
    """Plan, meter and time every configuration of one workload; ``none`` comes first."""
    rows = [_policy_row(workload, policy, policy) for policy in ("none", "blocks", "every:2")]
    sequential = _sequential_row(workload, round(math.sqrt(len(workload.stages(workload.model)))))
    rows.append(sequential)
    rows += [_policy_row(workload, f"budget:{p}%", f"budget:{p}%", percent=p) for p in BUDGETS]
    rows.append(_policy_row(workload, "blocks;selective", "blocks;selective"))
    reference = _meter(workload, rows[0], device, None)
    for row in rows[1:]:
        if row.ran:
            _meter(workload, row, device, reference)
        if row.percent is not None:
            row.budget = _percent_budget(row, rows[0])
    refused = [row for row in rows if row.percent is not None and _lowest_bytes(row.error)]
    if refused:
        lowest = _lowest_bytes(refused[0].error)
        rows.append(_policy_row(workload, LOWEST_PEAK, f"budget:{lowest}B", budget=lowest))
        if rows[-1].ran:
            _meter(workload, rows[-1], device, reference)
    half = next(row for row in rows if row.percent == 50)
    if workload.uniform and half.ran:
        fewest = _fewest_blocks(workload, half, device, reference)
        rows += [fewest] if fewest is not None else []
    peak = sequential.step_peak
    rows.append(_policy_row(workload, SEQUENTIAL_PEAK, f"budget:{peak}B", budget=peak))
    if rows[-1].ran:
        _meter(workload, rows[-1], device, reference)
    del reference
    _time(workload, [row for row in rows if row.ran], steps=steps, warmup=warmup, device=device)
    return rows


def _percent_budget(row: Row, none: Row) -> int:
    """The bytes ``budget:NN%`` stands for: NN % of the planner's predicted
    un-checkpointed step peak, as the plan (or, refused, the planner's error) states it."""
    if row.plan is not None and row.plan.budget is not None:
        return row.plan.budget
    found = re.search(r"\), that is [^(]*\((\d+) bytes\)", row.error)
    if found:
        return int(found.group(1))
    return int(row.percent / 100 * none.plan.plain_peak)


class RecomputeClock:
    """Adds up the wall time of the engine's recomputations (outermost ones, so nested
    regions are not counted twice): the extra work checkpointing costs a step."""

    def __init__(self, device: str) -> None:
        self.seconds = 0.0
        self._device = device
        self._depth = 0
        self._original = _engine_state.recomputing

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        self._depth += 1
        start = None
        if self._depth == 1:
            _synchronize(self._device)
            start = time.perf_counter()
        try:
            with self._original():
                yield
        finally:
            if start is not None:
                _synchronize(self._device)
                self.seconds += time.perf_counter() - start
            self._depth -= 1

    def __enter__(self) -> "RecomputeClock":
        _engine_state.recomputing = self._timed
        return self

    def __exit__(self, *exc: object) -> None:
        _engine_state.recomputing = self._original


def _time(workload: Workload, rows: List[Row], *, steps: int, warmup: int, device: str) -> None:
    with RecomputeClock(device) as clock:
        for round_index in range(warmup + steps):
            shift = round_index % len(rows)
            for row in rows[shift:] + rows[:shift]:
                _synchronize(device)
                clock.seconds = 0.0
                start = time.perf_counter()
                _step(workload, row, seed=round_index + 1)
                _synchronize(device)
                if round_index >= warmup:
                    row.step_ms.append((time.perf_counter() - start) * 1000)
                    row.recompute_ms.append(clock.seconds * 1000)
                row.model.zero_grad(set_to_none=True)


def _synchronize(device: str) -> None:
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()


def recompute_ms(row: Row) -> float:
    """Median time per step spent recomputing, in milliseconds: the time targets use it."""
    return statistics.median(row.recompute_ms)


def extra_ms(row: Row, none: Row) -> float:
    """The row's fastest step minus ``none``'s fastest step, in milliseconds.

    Other work on the machine only ever slows a step down, so the fastest of the rounds is
    the closest reading of a step's own cost; on a shared machine the median of per-round
    differences swung by several blocks' worth of recomputation from run to run.
    """
    return min(row.step_ms) - min(none.step_ms)


# --------------------------------------------------------------------------- targets


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether one target was met on one workload, with the numbers behind it."""

    target: str
    passed: Optional[bool]
    """None when the target cannot be judged on this run (the detail says why)."""
    detail: str

    def __str__(self) -> str:
        mark = "n/a" if self.passed is None else "pass" if self.passed else "fail"
        return f"  [{mark}] {self.target}: {self.detail}"


def judge(workload: Workload, rows: Sequence[Row]) -> List[Verdict]:
    """The issue's targets, checked on one workload's rows."""
    by_label = {row.label: row for row in rows}
    none, half = rows[0], by_label["budget:50%"]
    tolerance = TIME_TOLERANCE * min(none.step_ms)
    return [
        *_budget_verdicts(rows),
        _prediction_verdict(rows),
        _uniform_verdict(rows, half, tolerance) if workload.uniform else _pyramid_verdict(rows, half),
        _sequential_verdict(rows, by_label[SEQUENTIAL_PEAK], tolerance),
    ]


def _budget_verdicts(rows: Sequence[Row]) -> List[Verdict]:
    """Every plan fits its budget; a refused budget is one that the plan for the smallest
    reachable peak, measured, does not fit either."""
    slack = int(FIT_SLACK * rows[0].step_peak)
    budgeted = [row for row in rows if row.budget is not None]
    lowest = next((row for row in rows if row.label == LOWEST_PEAK and row.ran), None)
    details, fits = [], True
    for row in budgeted:
        if row.ran:
            fit = row.step_peak <= row.budget + slack
            sign = "<=" if fit else ">"
            details.append(f"{row.label} {_mib(row.step_peak)} {sign} {_mib(row.budget + slack)}")
        else:
            # Right to refuse only if no plan gets within the budget's allowance.
            fit = lowest is not None and lowest.step_peak > row.budget + slack
            details.append(
                f"{row.label} {_reason(row.error)}, rightly: the lowest plan measures "
                f"{_mib(lowest.step_peak)} > {_mib(row.budget + slack)}"
                if fit
                else f"{row.label} {_reason(row.error)}"
            )
        fits = fits and fit
    reached = [row for row in budgeted if row.percent is not None and row.ran]
    ordered = len(reached) > 1 and all(a.step_peak <= b.step_peak for a, b in zip(reached, reached[1:]))
    shown = ", ".join(f"{row.percent}%: {_mib(row.step_peak)}" for row in reached)
    if len(reached) < 2:
        # Whether the refusals were right is judged above; here there is nothing to order.
        ordered = None
        shown = f"cannot be checked, {len(reached)} of {len(BUDGETS)} budgets reachable ({shown or '-'})"
    return [
        Verdict(f"measured step peak <= budget + {FIT_SLACK:.0%} of none's", fits, "; ".join(details)),
        Verdict("step peak never higher at a smaller budget", ordered, shown),
    ]


def _prediction_verdict(rows: Sequence[Row]) -> Verdict:
    off = []
    for row in rows:
        if row.ran and row.predicted is not None:
            error = row.predicted / row.step_peak - 1
            if abs(error) > PREDICTION_TOLERANCE:
                off.append(f"{row.label} {_mib(row.predicted)} vs {_mib(row.step_peak)} ({error:+.0%})")
    target = f"predicted step peak within {PREDICTION_TOLERANCE:.0%} of measured"
    return Verdict(target, not off, "; ".join(off) or "every row with a prediction")


def _uniform_verdict(rows: Sequence[Row], half: Row, tolerance: float) -> Verdict:
    target = "extra (recompute) time at 50% <= that of the fewest blocks that fit"
    fewest = next((row for row in rows if "fewest" in row.label), None)
    # Not judged when there is nothing to compare: whether a refusal was right is judged
    # with the budgets.
    if not half.ran:
        return Verdict(target, None, f"budget:50% {_reason(half.error)}")
    if fewest is None:
        return Verdict(target, None, f"no first:K fits budget:50%'s {_mib(half.budget)}")
    a, b = recompute_ms(half), recompute_ms(fewest)
    detail = f"{a:.0f} ms vs {b:.0f} ms (noise allowance {tolerance:.0f} ms)"
    if _selective_count(half.plan):
        # Part of a selective block is recomputed: block counts do not compare, times do.
        return Verdict(target, a <= b + tolerance, f"{detail}; {_blocks(half.plan)} vs {len(fewest.plan)} whole")
    # The blocks are alike, so how many are recomputed reads the same thing without noise.
    count, least = len(half.plan), len(fewest.plan)
    detail += f"; {count} vs {least} blocks"
    return Verdict(target, a <= b + tolerance and count <= least, detail)


def _selective_count(plan: Any) -> int:
    """How many of the plan's modules are checkpointed at a selective level (a budget's
    per-module choice, or every one under the ``selective`` tier)."""
    if plan.tier == "selective":
        return len(plan)
    return sum(1 for entry in plan.selected if entry.option not in (None, "recompute", "segment"))


def _blocks(plan: Any) -> str:
    """The plan's modules, as "N whole" or "N whole + M selective"."""
    selective = _selective_count(plan)
    whole = f"{len(plan) - selective} whole"
    return f"{whole} + {selective} selective" if selective else whole


def _pyramid_verdict(rows: Sequence[Row], half: Row) -> Verdict:
    target = f"extra (recompute) time at 50% <= {PYRAMID_TIME_RATIO} x that of blocks"
    if not half.ran:  # whether the refusal was right is judged with the budgets
        return Verdict(target, None, f"budget:50% {_reason(half.error)}")
    blocks = next(row for row in rows if row.label == "blocks")
    a, b = recompute_ms(half), recompute_ms(blocks)
    detail = f"{a:.0f} ms vs {PYRAMID_TIME_RATIO} x {b:.0f} ms (ratio {a / b:.2f})"
    return Verdict(target, a <= PYRAMID_TIME_RATIO * b, detail)


def _sequential_verdict(rows: Sequence[Row], planned: Row, tolerance: float) -> Verdict:
    target = "at checkpoint_sequential's peak, the planner recomputes no longer"
    if not planned.ran:
        return Verdict(target, False, _reason(planned.error))
    sequential = next(row for row in rows if row.label.startswith("checkpoint_sequential"))
    a, b = recompute_ms(planned), recompute_ms(sequential)
    detail = (
        f"{a:.0f} ms vs {b:.0f} ms (noise allowance {tolerance:.0f} ms), peaks "
        f"{_mib(planned.step_peak)} vs {_mib(sequential.step_peak)}"
    )
    return Verdict(target, a <= b + tolerance, detail)


def _lowest_bytes(error: str) -> Optional[int]:
    """The smallest reachable peak, in bytes, that the planner states when it refuses a budget."""
    found = re.search(r"smallest reachable peak [^(]*\((\d+) bytes\)", error)
    return int(found.group(1)) if found else None


def _reason(error: str) -> str:
    """Why a row did not run: the planner's smallest reachable peak, or the error."""
    marker = "smallest reachable peak "
    if marker in error:
        amount = error.split(marker, 1)[1].split(" (")[0].split(",")[0]
        return f"unreachable: smallest reachable {amount}"
    return error[:160]


def _mib(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f} MiB"


# --------------------------------------------------------------------------- output


def format_table(rows: Sequence[Row]) -> str:
    """One line per configuration: peaks in MiB, times in ms, shares of ``none``'s."""
    none = rows[0]
    base_ms = min(none.step_ms)
    header = (
        "configuration", "ckpt", "sel", "step peak", "% none", "predicted", "pred/meas",
        "act peak", "median ms", "min ms", "extra ms", "extra %", "recompute ms", "grads",
    )
    table, notes = [header], {}
    for row in rows:
        if not row.ran:
            notes[len(table)] = _reason(row.error)
            table.append((row.label, "-") + ("",) * (len(header) - 2))
            continue
        extra, predicted = extra_ms(row, none), row.predicted
        table.append((
            row.label,
            str(len(row.plan)),
            str(_selective_count(row.plan)),
            f"{row.step_peak / _MIB:.1f}",
            f"{row.step_peak / none.step_peak:.0%}",
            "-" if predicted is None else f"{predicted / _MIB:.1f}",
            "-" if predicted is None else f"{predicted / row.step_peak:.2f}",
            f"{row.act_peak / _MIB:.1f}",
            f"{statistics.median(row.step_ms):.0f}",
            f"{min(row.step_ms):.0f}",
            f"{extra:.0f}",
            f"{extra / base_ms:.0%}",
            f"{recompute_ms(row):.0f}",
            "reference" if row is none else ("equal" if row.grads_equal else "DIFFER"),
        ))
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = []
    for index, line in enumerate(table):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        # A row that did not run has its reason across the other columns.
        lines.append("  ".join(cells[:2] + [notes[index]]) if index in notes else "  ".join(cells))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _frontier_points(rows: Sequence[Row]) -> List[Tuple[Row, float, float]]:
    """(row, step peak in % of none's, recompute time in % of none's step) per row that ran."""
    none = rows[0]
    base_ms = min(none.step_ms)
    return [
        (row, 100 * row.step_peak / none.step_peak, 100 * recompute_ms(row) / base_ms)
        for row in rows
        if row.ran
    ]


def ascii_frontier(rows: Sequence[Row], *, width: int = 60, height: int = 12) -> str:
    """Recompute time against measured step peak, both in % of ``none``'s, as text."""
    points = _frontier_points(rows)
    top = max(10.0, max(y for _, _, y in points) * 1.1)
    grid = [[" "] * (width + 1) for _ in range(height + 1)]
    legend = []
    for mark, (row, x, y) in zip("abcdefghijklmnopqrstuvwxyz", points):
        line = height - round(min(max(y, 0.0), top) / top * height)
        column = round(min(max(x, 0.0), 105.0) / 105 * width)
        grid[line][column] = mark if grid[line][column] == " " else "*"
        legend.append(f"{mark} {row.label}")
    lines = ["recompute time (% of none's step)"]
    for index, cells in enumerate(grid):
        axis = f"{top * (height - index) / height:5.0f} |" if index % 3 == 0 else "      |"
        lines.append(axis + "".join(cells).rstrip())
    ticks = [" "] * (width + 4)
    for value in range(0, 101, 25):
        column = round(value / 105 * width)
        ticks[column : column + len(str(value))] = str(value)
    lines.append("      +" + "-" * (width + 1))
    lines.append("       " + "".join(ticks).rstrip() + "  step peak (% of none's)")
    lines.append("       " + "; ".join(legend) + " (* = several)")
    return "\n".join(lines)


def save_plot(results: Sequence[Tuple[Workload, List[Row]]], path: str) -> None:
    """Both workloads' frontiers side by side in one PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for axis, (workload, rows) in zip(axes[0], results):
        points = _frontier_points(rows)
        planner = [(x, y) for row, x, y in points if _planned(row, rows)]
        axis.plot(*zip(*sorted(planner)), "-o", color="tab:blue", alpha=0.6, label="budget planner")
        for row, x, y in points:
            if not _planned(row, rows):
                axis.plot(x, y, "s", color="tab:orange")
            axis.annotate(row.label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        axis.set_title(f"{workload.name}: {workload.description}", fontsize=8)
        axis.set_xlabel("measured step peak (% of none)")
        axis.set_ylabel("recompute time per step (% of none's step)")
        axis.set_xlim(0, 110)
        axis.margins(y=0.15)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _planned(row: Row, rows: Sequence[Row]) -> bool:
    """Whether ``row`` lies on the planner's frontier: a budget row, or ``none``."""
    return row is rows[0] or row.label.startswith("budget")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the workloads, print their tables, targets and plots.

    Returns:
        0, or 1 if some gradients differ from ``none``'s (or, with ``--strict``, a target
        is missed).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or another accelerator")
    parser.add_argument("--steps", type=int, default=6, help="timed rounds on the GPT")
    parser.add_argument("--pyramid-steps", type=int, default=24, help="timed rounds on the pyramid")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    parser.add_argument("--only", choices=("gpt", "pyramid"), help="run one workload")
    parser.add_argument("--layers", type=int, default=12, help="GPT blocks")
    parser.add_argument("--width", type=int, default=256, help="GPT hidden size")
    parser.add_argument("--heads", type=int, default=4, help="GPT attention heads")
    parser.add_argument("--seq-len", type=int, default=256, help="GPT tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="GPT sequences per step")
    parser.add_argument("--image-batch", type=int, default=8, help="pyramid images per step")
    parser.add_argument("--image-size", type=int, default=128, help="pyramid image side")
    parser.add_argument(
        "--pyramid-blocks", type=int, default=None,
        help="residual blocks per pyramid stage (default: examples/factories.py's conv_pyramid)",
    )
    parser.add_argument("--plot", metavar="PNG", help="also draw the frontiers into PNG (matplotlib)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if min(args.steps, args.pyramid_steps, args.threads) < 1 or args.warmup < 0:
        parser.error(
            f"need --steps, --pyramid-steps and --threads >= 1 and --warmup >= 0; got "
            f"{args.steps}, {args.pyramid_steps}, {args.threads} and {args.warmup}"
        )
    # On a machine shared with other work, one thread per process gives the steadiest times.
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.device}, CPU threads: {torch.get_num_threads()}; "
        f"{args.warmup} warm-up round(s), then {args.steps} timed rounds on the GPT and "
        f"{args.pyramid_steps} on the pyramid.\nstep peak: the whole training step's peak "
        f"above what was allocated before it, from torch.profiler's allocator events, in MiB; "
        f"predicted: the plan's predicted step peak (planned with the workload's loss); act "
        f"peak: peak of live storages created by forward or recomputation (informational). "
        f"Budgets: % of the planner's predicted un-checkpointed step peak, judged against the "
        f"measured step peak with {FIT_SLACK:.0%} of none's as slack."
    )
    started = time.perf_counter()
    workloads = {"gpt": (gpt_workload, args.steps), "pyramid": (pyramid_workload, args.pyramid_steps)}
    results, verdicts = [], []
    for key, (build, steps) in workloads.items():
        if args.only in (None, key):
            workload = build(args, args.device)
            rows = run_workload(workload, steps=steps, warmup=args.warmup, device=args.device)
            _report(workload, rows, verdicts)
            results.append((workload, rows))
    missed = [f"{name}: {verdict.target}" for name, verdict in verdicts if verdict.passed is False]
    judged = [verdict for _, verdict in verdicts if verdict.passed is not None]
    unjudged = len(verdicts) - len(judged)
    print(
        f"\nsummary: {len(judged) - len(missed)} of {len(judged)} targets met"
        + (f" ({unjudged} not judged on this run)" if unjudged else "")
        + "".join(f"\n  missed: {line}" for line in missed)
    )
    if args.plot:
        save_plot(results, args.plot)
        print(f"plot written to {args.plot}")
    print(f"total {time.perf_counter() - started:.0f} s")
    all_equal = all(row.grads_equal is not False for _, rows in results for row in rows)
    if not all_equal:
        print("error: some gradients differ from the un-checkpointed run", file=sys.stderr)
    return 0 if all_equal and (not args.strict or not missed) else 1


def _report(workload: Workload, rows: List[Row], verdicts: List[Tuple[str, Verdict]]) -> None:
    """Print one workload's header, table, targets and text plot; collect its verdicts."""
    none = rows[0]
    grads = sum(p.numel() * p.element_size() for p in workload.model.parameters() if p.requires_grad)
    plain, saved = none.plan.plain_peak, none.plan.activation_bytes
    print(f"\n{workload.name}: {workload.description}")
    print(
        f"un-checkpointed step peak {_mib(none.step_peak)} measured, {_mib(plain)} predicted "
        f"(plain_peak, the base of budget:NN%); activations saved for backward "
        f"{_mib(saved)}; parameter gradients {_mib(grads)}"
    )
    print(format_table(rows))
    found = judge(workload, rows)
    print("\n".join(str(verdict) for verdict in found))
    print(ascii_frontier(rows))
    verdicts += [(workload.name, verdict) for verdict in found]


if __name__ == "__main__":
    sys.exit(main())

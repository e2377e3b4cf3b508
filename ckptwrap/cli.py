"""The command line, ``python -m ckptwrap``.

``plan`` builds a model from a factory function, profiles it on random inputs of a given
shape and prints what a policy would checkpoint; ``--pareto`` also draws the trade-off
between activation memory and recompute time (needs the ``plot`` extra, matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import math
import operator
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._errors import CheckpointError
from .measure import profile_modules
from .policy import Blocks, Intersection, Policy, as_policy, split_modifiers
from .policy._solver import CostItem, predicted_peak, smallest_reachable_peak, solve_budget
from .wrap import plan

__all__ = ["main"]

_PROG = "python -m ckptwrap"
_PLOT_HINT = "install the plot extra: pip install 'ckptwrap[plot]'"
_FRONTIER_POINTS = 25
_MIB = float(1 << 20)
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "long": torch.int64,
    "int64": torch.int64,
    "int32": torch.int32,
}


class _UsageError(Exception):
    """A mistake in the command line; reported as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class _Point:
    """One way to checkpoint the candidates, as the cost model predicts it."""

    label: str
    """What the point stands for, for the legend."""
    peak: int
    """Predicted activation peak, bytes."""
    time: float
    """Recompute time per training step, seconds."""
    names: Tuple[str, ...]
    """Qualified names of the checkpointed candidates."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line.

    Args:
        argv: The arguments after the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 2 for a bad command line or policy.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (_UsageError, CheckpointError) as error:
        print(f"{_PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG, description="Activation checkpointing for PyTorch: plan from the command line."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub = commands.add_parser(
        "plan",
        help="profile a model and print what a policy would checkpoint",
        description=(
            "Build a model from a factory, profile it on random inputs and print the plan "
            "of a policy. Example: %s plan examples/factories.py:conv_pyramid "
            "--input-shape 8,3,128,128 --policy budget:50%%" % _PROG
        ),
    )
    sub.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="an importable module (pkg.models) or a .py file, and a callable in it that "
        "returns an nn.Module when called with no arguments",
    )
    sub.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="N,N,...",
        help="shape of one positional input of the model's forward; repeat for several inputs",
    )
    sub.add_argument(
        "--input-dtype",
        choices=sorted(_DTYPES),
        help="dtype of the inputs (default: float32, or long with --input-high)",
    )
    sub.add_argument(
        "--input-high",
        "--vocab",
        type=int,
        metavar="N",
        help="draw integer inputs (token ids) uniformly from [0, N)",
    )
    sub.add_argument("--policy", default="blocks", help="policy string (default: blocks)")
    sub.add_argument("--device", default="cpu", help="device to profile on (default: cpu)")
    sub.add_argument("--seed", type=int, default=0, help="seed for the model and the inputs")
    sub.add_argument(
        "--use-reentrant", action="store_true", help="plan for the re-entrant engine"
    )
    sub.add_argument(
        "--nested", action="store_true", help="keep selected modules inside selected ones"
    )
    sub.add_argument("--json", action="store_true", help="print the plan as JSON")
    sub.add_argument(
        "--pareto",
        metavar="OUT.png",
        help="also draw predicted activation memory against recompute time (needs matplotlib)",
    )
    sub.set_defaults(run=_run_plan)
    return parser


def _run_plan(args: argparse.Namespace) -> int:
    shapes = [_parse_shape(text) for text in args.input_shape]
    dtype = _input_dtype(args.input_dtype, args.input_high)
    device = _device(args.device)
    figure = _figure_module(args.pareto) if args.pareto else None
    if args.pareto and not shapes:
        raise _UsageError("--pareto needs measured costs: give --input-shape")

    torch.manual_seed(args.seed)
    model = _build_model(args.factory)
    try:
        model.to(device)
    except (RuntimeError, AssertionError) as error:  # torch asserts on a missing backend
        raise _UsageError(f"cannot move the model to --device {args.device}: {error}") from None
    model.train()  # profile what a training step keeps
    inputs = _make_inputs(shapes, dtype, args.input_high, device, args.seed)
    if inputs:
        _try_forward(model, inputs)

    measured = {"example_inputs": inputs} if inputs else {}
    result = plan(
        model, args.policy, nested=args.nested, use_reentrant=args.use_reentrant, **measured
    )
    out = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result)
    if figure is not None:
        points = _pareto_points(model, inputs, args.policy, result.names, nested=args.nested)
        title = f"{args.factory}, input {' + '.join('x'.join(map(str, s)) for s in shapes)}"
        _draw(figure, args.pareto, *points, title=title)
        print(f"saved the memory/time frontier to {args.pareto}", file=out)
    return 0


# --------------------------------------------------------------------------- model and inputs


def _build_model(spec: str) -> nn.Module:
    factory = _load_factory(spec)
    try:
        inspect.signature(factory).bind()
    except TypeError as error:
        raise _UsageError(
            f"{spec} cannot be called with no arguments ({error}); give a factory whose "
            f"parameters all have defaults"
        ) from None
    except ValueError:
        pass  # no signature to check (some builtins); the call itself will tell
    model = factory()
    if not isinstance(model, nn.Module):
        raise _UsageError(
            f"{spec} returned {type(model).__name__}, expected an nn.Module"
        )
    return model


def _load_factory(spec: str) -> Callable[..., Any]:
    module_part, colon, attribute = spec.rpartition(":")
    if not colon or not module_part or not attribute:
        raise _UsageError(
            f"expected MODULE:FACTORY, such as examples/factories.py:gpt_small or "
            f"mypackage.models:build, got {spec!r}"
        )
    module = _import(module_part)
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            available = sorted(
                name for name, value in vars(module).items()
                if callable(value) and not name.startswith("_")
                and getattr(value, "__module__", None) == module.__name__
            )
            raise _UsageError(
                f"{module_part} has no {attribute!r}; callables defined there: "
                f"{', '.join(available) or '(none)'}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise _UsageError(
            f"{spec} is a {type(target).__name__}, not a callable that returns an nn.Module"
        )
    return target


def _import(module_part: str) -> ModuleType:
    is_path = module_part.endswith(".py") or "/" in module_part or os.sep in module_part
    try:
        if not is_path:
            return importlib.import_module(module_part)
        return _import_file(Path(module_part))
    except ImportError as error:
        raise _UsageError(f"cannot import {module_part!r}: {error}") from None


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise _UsageError(f"no such file: {str(path)!r} (give a .py file or a module name)")
    # As `python file.py` would, let the file import its siblings.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = f"_ckptwrap_factory_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _UsageError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _parse_shape(text: str) -> Tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise _UsageError(
            f"bad --input-shape {text!r}: expected positive integers separated by commas, "
            f"such as 8,256 or 8,3,128,128"
        )
    return tuple(int(part) for part in parts)


def _input_dtype(name: Optional[str], high: Optional[int]) -> torch.dtype:
    if high is not None and high < 1:
        raise _UsageError(f"--input-high must be at least 1, got {high}")
    if name is None:
        return torch.int64 if high is not None else torch.float32
    dtype = _DTYPES[name]
    if dtype.is_floating_point and high is not None:
        raise _UsageError(
            f"--input-high draws integer ids, but --input-dtype is {name}; use --input-dtype "
            f"long (or int32), or drop --input-high"
        )
    if not dtype.is_floating_point and high is None:
        raise _UsageError(
            f"--input-dtype {name} needs --input-high N (or --vocab N) to draw ids in [0, N)"
        )
    return dtype


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise _UsageError(f"bad --device {name!r}: {error}") from None


def _make_inputs(
    shapes: Sequence[Tuple[int, ...]],
    dtype: torch.dtype,
    high: Optional[int],
    device: torch.device,
    seed: int,
) -> Tuple[torch.Tensor, ...]:
    # A private generator on the CPU: the same inputs on every device and run.
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        made = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
    else:
        made = [torch.randint(high, shape, generator=generator, dtype=dtype) for shape in shapes]
    return tuple(tensor.to(device) for tensor in made)


def _try_forward(model: nn.Module, inputs: Tuple[torch.Tensor, ...]) -> None:
    """Run one forward without autograd, so a wrong input shape or dtype reads as one line
    rather than as a traceback from deep inside the profiler."""
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as error:  # whatever the model raises on inputs it cannot take
        described = ", ".join(
            f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs
        )
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise _UsageError(
            f"{type(model).__name__} failed on inputs {described}: "
            f"{type(error).__name__}: {first_line} (check --input-shape, --input-dtype "
            f"and --input-high)"
        ) from None


# --------------------------------------------------------------------------- the frontier


def _pareto_points(
    model: nn.Module,
    inputs: Tuple[torch.Tensor, ...],
    policy: str,
    chosen: Sequence[str],
    *,
    nested: bool,
) -> Tuple[List[_Point], List[_Point]]:
    """Profile the candidates once; return the budget frontier and the reference points."""
    candidates = _candidate_policy(as_policy(policy))
    names = plan(model, candidates, nested=nested).names
    if not names:
        raise _UsageError(f"--policy {policy!r} leaves no candidates to draw a frontier over")
    profile = profile_modules(model, names, inputs)
    costs = [profile[name] for name in names]
    items = [CostItem(c.name, c.kept_bytes, c.input_bytes, c.forward_time) for c in costs]
    base = profile.base_bytes
    references = _reference_points(items, base=base, candidates=str(candidates))
    index = {name: i for i, name in enumerate(names)}
    if all(name in index for name in chosen):
        references.append(_point(f"--policy {policy}", items, [index[n] for n in chosen], base))
    return _frontier(items, base=base), references


def _candidate_policy(policy: Policy) -> Policy:
    """What the frontier chooses among: the policy's set terms, else the blocks."""
    rest = split_modifiers(policy)[0]
    if isinstance(rest, Intersection):
        sets = rest.sets
    else:
        sets = () if rest._is_picker else (rest,)
    return functools.reduce(operator.and_, sets) if sets else Blocks()


def _frontier(
    items: Sequence[CostItem], *, base: int, points: int = _FRONTIER_POINTS
) -> List[_Point]:
    """The least recompute time at each predicted peak, from the smallest reachable one to
    checkpointing nothing: solved at ``points`` evenly spaced budgets, dominated plans
    dropped, sorted by peak (so time only falls as memory grows)."""
    low = smallest_reachable_peak(items, base=base)
    high = predicted_peak(items, (), base=base)
    budgets = sorted({low + (high - low) * k // max(points - 1, 1) for k in range(points)})
    solved = []
    for budget in budgets:
        solution = solve_budget(items, budget, base=base)
        names = tuple(items[i].name for i in solution.selected)
        label = f"budget:{100 * budget / max(high, 1):.0f}%"
        solved.append(_Point(label, solution.predicted_peak, solution.recompute_time, names))
    frontier: List[_Point] = []
    # A coarse solver axis can return a plan that another budget beats; keep only the best.
    for point in sorted(solved, key=lambda p: (p.peak, p.time)):
        if not frontier or point.time < frontier[-1].time:
            frontier.append(point)
    return frontier


def _reference_points(items: Sequence[CostItem], *, base: int, candidates: str) -> List[_Point]:
    """Fixed policies to compare with the frontier: all candidates, every other one, and
    ``checkpoint_sequential`` with about sqrt(n) segments."""
    n = len(items)
    return [
        _point(f"{candidates} (all {n})", items, range(n), base),
        _point("every:2", items, range(0, n, 2), base),
        _sequential_point(items, base),
    ]


def _point(label: str, items: Sequence[CostItem], selected: Sequence[int], base: int) -> _Point:
    selected = list(selected)
    return _Point(
        label,
        predicted_peak(items, selected, base=base),
        math.fsum(items[i].time for i in selected),
        tuple(items[i].name for i in selected),
    )


def _sequential_point(items: Sequence[CostItem], base: int) -> _Point:
    """``checkpoint_sequential`` as the cost model sees it: each checkpointed segment keeps
    its first module's inputs and recomputes all of its modules at once; the last segment,
    as in ``checkpoint_sequential``, is not checkpointed."""
    n = len(items)
    segments = max(1, round(math.sqrt(n)))
    size = n // segments
    bounds = [k * size for k in range(segments)] + [n]
    merged = [
        CostItem(
            f"segment {k}",
            kept=sum(item.kept for item in items[bounds[k] : bounds[k + 1]]),
            inputs=items[bounds[k]].inputs,
            time=math.fsum(item.time for item in items[bounds[k] : bounds[k + 1]]),
        )
        for k in range(segments)
    ]
    point = _point(f"checkpoint_sequential, {segments} segments", merged, range(segments - 1), base)
    names = tuple(item.name for item in items[: bounds[segments - 1]])
    return dataclasses.replace(point, names=names)


def _figure_module(path: str) -> ModuleType:
    """matplotlib's ``Figure`` module, checked before the slow part, with the target folder."""
    try:
        importlib.import_module("matplotlib")
        figure = importlib.import_module("matplotlib.figure")
    except ImportError:
        raise _UsageError(f"--pareto draws with matplotlib, which is not installed; {_PLOT_HINT}") from None
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise _UsageError(f"cannot save --pareto {path!r}: the folder {str(folder)!r} does not exist")
    return figure


def _draw(
    figure: ModuleType, path: str, frontier: List[_Point], references: List[_Point], *, title: str
) -> None:
    # The Figure API, not pyplot: no global backend or window state is touched.
    fig = figure.Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    xs = [p.peak / _MIB for p in frontier]
    ys = [p.time * 1e3 for p in frontier]
    ax.step(xs, ys, where="post", color="C0", label=f"budget frontier ({len(frontier)} plans)")
    ax.plot(xs, ys, "o", color="C0", markersize=3)
    for k, point in enumerate(references):
        mib, ms = point.peak / _MIB, point.time * 1e3
        ax.plot(
            [mib], [ms], marker="sD^v*P"[k % 6], color=f"C{k + 1}", linestyle="none",
            markersize=8, label=f"{point.label}: {mib:.1f} MiB, {ms:.1f} ms",
        )
    ax.set_xlabel("predicted activation peak (MiB)")
    ax.set_ylabel("recompute time per step (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as error:  # unwritable file, unknown image format
        raise _UsageError(f"cannot save --pareto {path!r}: {error}") from None

"""The command line, ``python -m ckptwrap``.

``plan`` builds a model from a factory function, profiles it on random inputs of a given
shape and prints what a policy would checkpoint; ``--pareto`` also draws the trade-off
between activation memory and recompute time (needs the ``plot`` extra, matplotlib).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._errors import CheckpointError
from ._frontier import Point, pareto_points
from .wrap import plan

__all__ = ["main"]

_PROG = "python -m ckptwrap"
_PLOT_HINT = "install the plot extra: pip install 'ckptwrap[plot]'"
_MIB = float(1 << 20)
_WHOLE_NUMBER = re.compile(r"[0-9]+")
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line.

    Args:
        argv: The arguments after the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 2 for a bad command line or policy.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"]:
        from .diagnostics import main as doctor_main  # it parses its own arguments

        return doctor_main(argv[1:])
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (_UsageError, CheckpointError) as error:
        print(f"{_PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG, description="Activation checkpointing for PyTorch: plan and diagnose from the command line."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser(
        "doctor",
        help="run a checkpointed and a plain training step and report problems, each with "
        "its fix (%s doctor --help)" % _PROG,
    )
    sub = commands.add_parser(
        "plan",
        help="profile a model and print what a policy would checkpoint",
        description=(
            "Build a model from a factory, profile it on random inputs and print the plan "
            "of a policy. Example: %s plan examples/factories.py:gpt_small "
            "--input-shape 8,128 --vocab 512 --policy budget:50%%" % _PROG
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

    result = plan(
        model,
        args.policy,
        nested=args.nested,
        example_inputs=inputs or None,
        use_reentrant=args.use_reentrant,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    if figure is not None:
        points = pareto_points(model, inputs, args.policy, result.names, nested=args.nested)
        title = f"{args.factory}, input {' + '.join('x'.join(map(str, s)) for s in shapes)}"
        _draw(figure, args.pareto, *points, title=title)
        # Kept off standard output when that carries JSON for another program.
        print(
            f"saved the memory/time frontier to {args.pareto}",
            file=sys.stderr if args.json else sys.stdout,
        )
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
        raise _UsageError(f"{spec} returned {type(model).__name__}, expected an nn.Module")
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
            f"{spec} is not callable (it is {type(target).__name__} {target!r:.40}); give a "
            f"function or class that returns an nn.Module"
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
    if not all(_WHOLE_NUMBER.fullmatch(part) and int(part) > 0 for part in parts):
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


# --------------------------------------------------------------------------- drawing


def _figure_module(path: str) -> ModuleType:
    """matplotlib's ``figure`` module; it and the target folder are checked before the
    slow profiling starts."""
    try:
        importlib.import_module("matplotlib")
        figure = importlib.import_module("matplotlib.figure")
    except ImportError:
        raise _UsageError(
            f"--pareto draws with matplotlib, which is not installed; {_PLOT_HINT}"
        ) from None
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise _UsageError(
            f"cannot save --pareto {path!r}: the folder {str(folder)!r} does not exist"
        )
    return figure


def _draw(
    figure: ModuleType, path: str, frontier: List[Point], references: List[Point], *, title: str
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

"""What the two commands of ``python -m ckptwrap`` share: the model and input flags, loading
a factory, and making random inputs. Both ``plan`` (``ckptwrap.cli``) and ``doctor``
(``ckptwrap.diagnostics``) import it; it imports neither.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["DTYPES", "UsageError", "add_model_arguments", "build_model", "parse_dtype", "prepare"]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "long": torch.int64,
    "int64": torch.int64,
    "int32": torch.int32,
}
"""Input dtypes by the name ``--input-dtype`` (and an input's ``:DTYPE``) takes."""

_WHOLE_NUMBER = re.compile(r"[0-9]+")


class UsageError(Exception):
    """A mistake in the command line; reported as one line, exit status 2."""


def add_model_arguments(parser: argparse.ArgumentParser, *, device_help: str) -> None:
    """Add the factory argument and the input, device and seed flags to ``parser``."""
    parser.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="an importable module (pkg.models) or a .py file, and a callable in it that "
        "returns an nn.Module when called with no arguments; for plan, also hf:ConfigClass "
        "or hf:path/config.json (transformers, nothing downloaded)",
    )
    parser.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="N,N,...[:DTYPE]",
        help="shape of one positional input of the model's forward, and its own dtype after a "
        "colon (e.g. 2,300:long for a graph's edge_index beside float features); repeat for "
        "several inputs",
    )
    parser.add_argument(
        "--input-dtype",
        choices=sorted(DTYPES),
        help="dtype of the inputs that name none of their own (default: float32; long with "
        "--input-high when no input names its own)",
    )
    parser.add_argument(
        "--input-high",
        "--vocab",
        type=int,
        metavar="N",
        help="draw integer inputs (token ids, indices) uniformly from [0, N)",
    )
    parser.add_argument("--device", default="cpu", help=device_help)
    parser.add_argument("--seed", type=int, default=0, help="seed for the model and the inputs")


def prepare(
    args: argparse.Namespace,
    build: Optional[Callable[[], nn.Module]] = None,
    keyword: Optional[Callable[[nn.Module, torch.device], Dict[str, torch.Tensor]]] = None,
) -> Tuple[nn.Module, Tuple[torch.Tensor, ...], Dict[str, torch.Tensor], List[Tuple[int, ...]]]:
    """The model in train mode on ``--device`` and its random inputs, from the flags of
    :func:`add_model_arguments`; the inputs have run through one forward already.
    ``build`` makes the model instead of the factory; ``keyword(model, device)`` makes its
    keyword inputs.

    Returns:
        The model, its positional inputs (empty without ``--input-shape``), its keyword
        inputs and the positional inputs' shapes.

    Raises:
        UsageError: For a bad flag, a factory that cannot be loaded or called, or inputs
            the model cannot take.
    """
    parsed = [_parse_input_shape(text) for text in args.input_shape]
    shapes = [shape for shape, _ in parsed]
    dtypes = _input_dtypes([own for _, own in parsed], args.input_dtype, args.input_high)
    device = _device(args.device)
    torch.manual_seed(args.seed)
    make = build if build is not None else functools.partial(build_model, args.factory)
    if device.type == "meta":
        # Built there, nothing allocated; the inputs stay real, on the CPU, so that code
        # reading their values runs when the step is planned on fake tensors.
        with device:
            model = make().train()
        cpu = torch.device("cpu")
        kwargs = keyword(model, cpu) if keyword is not None else {}
        return model, _make_inputs(shapes, dtypes, args.input_high, cpu, args.seed), kwargs, shapes
    model = make()
    try:
        model.to(device)
    except (RuntimeError, AssertionError) as error:  # torch asserts on a missing backend
        raise UsageError(f"cannot move the model to --device {args.device}: {error}") from None
    model.train()  # what a training step keeps is what both commands look at
    inputs = _make_inputs(shapes, dtypes, args.input_high, device, args.seed)
    kwargs = keyword(model, device) if keyword is not None else {}
    if inputs or kwargs:
        _try_forward(model, inputs, kwargs)
    return model, inputs, kwargs, shapes


# --------------------------------------------------------------------------- the model


def build_model(spec: str) -> nn.Module:
    """The model the factory ``MODULE:FACTORY`` returns."""
    if spec.startswith("hf:"):
        raise UsageError(f"{spec}: a model from a transformers configuration is built by the plan command only")
    factory = _load_factory(spec)
    try:
        inspect.signature(factory).bind()
    except TypeError as error:
        raise UsageError(
            f"{spec} cannot be called with no arguments ({error}); give a factory whose "
            f"parameters all have defaults"
        ) from None
    except ValueError:
        pass  # no signature to check (some builtins); the call itself will tell
    model = factory()
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec} returned {type(model).__name__}, expected an nn.Module")
    return model


def _load_factory(spec: str) -> Callable[..., Any]:
    module_part, colon, attribute = spec.rpartition(":")
    if not colon or not module_part or not attribute:
        raise UsageError(
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
            raise UsageError(
                f"{module_part} has no {attribute!r}; callables defined there: "
                f"{', '.join(available) or '(none)'}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(
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
        raise UsageError(f"cannot import {module_part!r}: {error}") from None


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise UsageError(f"no such file: {str(path)!r} (give a .py file or a module name)")
    # As `python file.py` would, let the file import its siblings.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = f"_ckptwrap_factory_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the inputs


def _parse_input_shape(text: str) -> Tuple[Tuple[int, ...], Optional[str]]:
    """``N,N,...`` and, after a colon, the input's own dtype (a name of :data:`DTYPES`)."""
    shape, colon, dtype = text.partition(":")
    if colon:
        parse_dtype(dtype, f"--input-shape {text!r}")
    parts = [part.strip() for part in shape.split(",")]
    if not all(_WHOLE_NUMBER.fullmatch(part) and int(part) > 0 for part in parts):
        raise UsageError(
            f"bad --input-shape {text!r}: expected positive integers separated by commas, "
            f"such as 8,256 or 8,3,128,128 (and, for an input of its own dtype, :DTYPE after "
            f"them, such as 2,300:long)"
        )
    return tuple(int(part) for part in parts), (dtype.strip() if colon else None)


def parse_dtype(name: str, where: str) -> torch.dtype:
    """The dtype an input names after its shape's colon."""
    dtype = DTYPES.get(name.strip())
    if dtype is None:
        raise UsageError(
            f"bad {where}: the dtype after the colon must be one of {', '.join(sorted(DTYPES))}, "
            f"got {name.strip()!r}"
        )
    return dtype


def _input_dtypes(own: Sequence[Optional[str]], name: Any, high: Any) -> List[torch.dtype]:
    """Each positional input's dtype: its own (``N,N:DTYPE``), else ``--input-dtype``'s,
    else float32, or long with ``--input-high`` when no input names its own."""
    if high is not None and high < 1:
        raise UsageError(f"--input-high must be at least 1, got {high}")
    default = DTYPES[name] if name is not None else torch.float32
    if not any(own):
        if name is None:
            return [torch.int64 if high is not None else torch.float32] * len(own)
        if default.is_floating_point and high is not None:
            raise UsageError(
                f"--input-high draws integer ids, but --input-dtype is {name}; use --input-dtype "
                f"long (or int32), or drop --input-high"
            )
        if not default.is_floating_point and high is None:
            raise UsageError(
                f"--input-dtype {name} needs --input-high N (or --vocab N) to draw ids in [0, N)"
            )
        return [default] * len(own)
    dtypes = [DTYPES[mine] if mine else default for mine in own]
    integer = [i for i, dtype in enumerate(dtypes) if not dtype.is_floating_point]
    if integer and high is None:
        raise UsageError(
            f"input {integer[0]} is of an integer dtype ({str(dtypes[integer[0]]).replace('torch.', '')}), "
            f"which needs --input-high N (or --vocab N) to draw ids in [0, N)"
        )
    if not integer and high is not None:
        raise UsageError(
            "--input-high draws integer ids, but every input is floating-point; give an "
            "integer input its dtype (N,N:long), or drop --input-high"
        )
    return dtypes


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise UsageError(f"bad --device {name!r}: {error}") from None


def _make_inputs(
    shapes: Sequence[Tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    high: Any,
    device: torch.device,
    seed: int,
) -> Tuple[torch.Tensor, ...]:
    # A private generator on the CPU: the same inputs on every device and run.
    generator = torch.Generator().manual_seed(seed)
    made = [
        torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point
        else torch.randint(high, shape, generator=generator, dtype=dtype)
        for shape, dtype in zip(shapes, dtypes)
    ]
    return tuple(tensor.to(device) for tensor in made)


def _try_forward(model: nn.Module, inputs: Tuple[torch.Tensor, ...], kwargs: Dict[str, torch.Tensor]) -> None:
    """Run one forward without autograd, so a wrong input shape or dtype reads as one line
    rather than as a traceback from deep inside the profiler or the doctor."""
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    except Exception as error:  # whatever the model raises on inputs it cannot take
        described = ", ".join(
            [f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs]
            + [f"{name}={tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for name, t in kwargs.items()]
        )
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise UsageError(
            f"{type(model).__name__} failed on inputs {described}: "
            f"{type(error).__name__}: {first_line} (check --input-shape, --input, "
            f"--input-dtype and --input-high)"
        ) from None

"""``python -m ckptwrap doctor MODULE:FACTORY ...``: build a model from a factory, wrap it
with a policy if one is given, run :func:`doctor` on random inputs and print the report.

Model loading and input making are those of ``python -m ckptwrap plan``.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import ModuleType
from typing import Any, List, Optional, Sequence

import torch

from .._errors import CheckpointError
from ._doctor import doctor

__all__ = ["main"]

_PROG = "python -m ckptwrap doctor"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``doctor`` command.

    Args:
        argv: The arguments after ``doctor``; ``None`` reads ``sys.argv[2:]``.

    Returns:
        The exit status: 0 when the report has nothing to fix, 1 when it has (an error, or
        a warning unless ``--fail-on error``), 2 for a bad command line, factory or policy.
    """
    from .. import cli  # here, not at the top: the CLI imports this module to dispatch

    arguments = list(sys.argv[2:] if argv is None else argv)
    parser = _build_parser(sorted(cli._DTYPES))
    try:
        args = parser.parse_args(arguments)
    except SystemExit as exit:  # --help, or argparse's own usage error (status 2)
        return int(exit.code or 0)
    try:
        return _run(args, cli)
    except (cli._UsageError, CheckpointError) as error:
        print(f"{_PROG}: error: {error}", file=sys.stderr)
        return 2


def _build_parser(dtypes: List[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description=(
            "Build a model from a factory, run one checkpointed and one plain training step "
            "on random inputs and report what is wrong with its checkpointing, each problem "
            "with its fix. Exit status 1 when there is something to fix. Example: %s "
            "examples/factories.py:gpt_small --input-shape 2,64 --vocab 512 --policy blocks"
            % _PROG
        ),
    )
    parser.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="an importable module (pkg.models) or a .py file, and a callable in it that "
        "returns an nn.Module when called with no arguments",
    )
    parser.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="N,N,...",
        help="shape of one positional input of the model's forward; repeat for several inputs",
    )
    parser.add_argument(
        "--input-dtype", choices=dtypes,
        help="dtype of the inputs (default: float32, or long with --input-high)",
    )
    parser.add_argument(
        "--input-high", "--vocab", type=int, metavar="N",
        help="draw integer inputs (token ids) uniformly from [0, N)",
    )
    parser.add_argument(
        "--policy",
        help="wrap the model with this policy first (default: check the model as the "
        "factory returns it, marked by CheckpointWrapper or @checkpointed)",
    )
    parser.add_argument("--use-reentrant", action="store_true", help="wrap with the re-entrant engine")
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model and the inputs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--fail-on",
        choices=("warning", "error"),
        default="warning",
        help="lowest severity that makes the exit status 1 (default: warning)",
    )
    return parser


def _run(args: argparse.Namespace, cli: ModuleType) -> int:
    if not args.input_shape:
        raise cli._UsageError(
            "doctor runs a training step, so it needs inputs: give --input-shape N,N,... "
            "(once per positional input), e.g. --input-shape 8,128 --vocab 512"
        )
    if args.use_reentrant and args.policy is None:
        raise cli._UsageError(
            "--use-reentrant applies to the wrapping by --policy; give a policy, or drop it"
        )
    shapes = [cli._parse_shape(text) for text in args.input_shape]
    dtype = cli._input_dtype(args.input_dtype, args.input_high)
    device = cli._device(args.device)

    torch.manual_seed(args.seed)
    model = cli._build_model(args.factory)
    try:
        model.to(device)
    except (RuntimeError, AssertionError) as error:  # torch asserts on a missing backend
        raise cli._UsageError(
            f"cannot move the model to --device {args.device}: {error}"
        ) from None
    model.train()
    inputs = cli._make_inputs(shapes, dtype, args.input_high, device, args.seed)
    cli._try_forward(model, inputs)
    if args.policy is not None:
        _wrap(model, args.policy, inputs, args.use_reentrant)

    report = doctor(model, inputs)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    failing = list(report.errors)
    if args.fail_on == "warning":
        failing += report.warnings
    return 1 if failing else 0


def _wrap(model: Any, policy: str, inputs: Any, use_reentrant: bool) -> None:
    from ..policy import as_policy, split_modifiers
    from ..wrap import wrap_model

    # Only a budget needs measured costs; other policies wrap without profiling.
    needs_costs = split_modifiers(as_policy(policy))[1] is not None
    wrap_model(
        model,
        policy,
        example_inputs=inputs if needs_costs else None,
        use_reentrant=use_reentrant,
    )

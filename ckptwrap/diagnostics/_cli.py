"""``python -m ckptwrap doctor MODULE:FACTORY ...``: build a model from a factory, wrap it
with a policy if one is given, run :func:`doctor` on random inputs and print the report.

Model loading and input making are those of ``python -m ckptwrap plan``, shared through
``ckptwrap._cli_common``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .._cli_common import UsageError, add_model_arguments, prepare
from .._errors import CheckpointError
from ..policy import as_policy, split_modifiers
from ..wrap import wrap_model
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
    arguments = list(sys.argv[2:] if argv is None else argv)
    parser = _build_parser()
    try:
        args = parser.parse_args(arguments)
    except SystemExit as exit:  # --help, or argparse's own usage error (status 2)
        return int(exit.code or 0)
    try:
        return _run(args)
    except (UsageError, CheckpointError) as error:
        print(f"{_PROG}: error: {error}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
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
    add_model_arguments(parser, device_help="device to run on (default: cpu)")
    parser.add_argument(
        "--policy",
        help="wrap the model with this policy first (default: check the model as the "
        "factory returns it, marked by CheckpointWrapper or @checkpointed)",
    )
    parser.add_argument("--use-reentrant", action="store_true", help="wrap with the re-entrant engine")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--fail-on",
        choices=("warning", "error"),
        default="warning",
        help="lowest severity that makes the exit status 1 (default: warning)",
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    if not args.input_shape:
        raise UsageError(
            "doctor runs a training step, so it needs inputs: give --input-shape N,N,... "
            "(once per positional input), e.g. --input-shape 8,128 --vocab 512"
        )
    if args.use_reentrant and args.policy is None:
        raise UsageError(
            "--use-reentrant applies to the wrapping by --policy; give a policy, or drop it"
        )
    if args.device.strip().lower().startswith("meta"):
        raise UsageError(
            "doctor compares real training steps, and on --device meta nothing runs for real: "
            "give the device the model trains on, or plan there without the hardware with "
            "'plan --device meta'"
        )
    model, inputs, _, _ = prepare(args)
    if args.policy is not None:
        # Only a budget needs measured costs; other policies wrap without profiling.
        needs_costs = split_modifiers(as_policy(args.policy))[1] is not None
        wrap_model(model, args.policy, example_inputs=inputs if needs_costs else None, use_reentrant=args.use_reentrant)

    report = doctor(model, inputs)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    failing = list(report.errors)
    if args.fail_on == "warning":
        failing += report.warnings
    return 1 if failing else 0


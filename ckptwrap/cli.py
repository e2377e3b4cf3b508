"""The command line, ``python -m ckptwrap``.

``plan`` builds a model from a factory function, profiles it on random inputs of a given
shape and prints what a policy would checkpoint; ``--pareto`` also draws the trade-off
between activation memory and recompute time (needs the ``plot`` extra, matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ._cli_common import DTYPES, UsageError, add_model_arguments, build_model, prepare
from ._cli_models import CONFIG_PREFIX, build_from_config, keyword_inputs
from ._cli_ranks import RankPlan, beyond_reach, parse_ranks, plan_ranks, sharding_options
from ._errors import CheckpointConfigError, CheckpointError
from ._frontier import Point, frontier_candidates, pareto_points
from .diagnostics import main as doctor_main
from .planner import OPTIMIZERS, Plan, format_bytes
from .policy import Budget, as_policy, split_modifiers
from .wrap import plan_and_profile, profile_modules

__all__ = ["main"]

_PROG = "python -m ckptwrap"
_PLOT_HINT = "install matplotlib: pip install matplotlib (in a clone of ckptwrap: pip install -e '.[plot]')"
_MIB = float(1 << 20)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line.

    Args:
        argv: The arguments after the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 2 for a bad command line or policy.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"]:
        return doctor_main(argv[1:])  # it parses its own arguments
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, CheckpointError) as error:
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
            "Build a model from a factory or a transformers configuration, profile it on "
            "random inputs and print the plan of a policy. Examples: %s plan "
            "examples/factories.py:gpt_small --input-shape 8,128 --vocab 512 --policy "
            "budget:50%%; %s plan hf:LlamaConfig --set num_hidden_layers=16 --input "
            "input_ids=1,8192 --labels --dtype bfloat16 --device meta --device-rates h100-sxm"
            % (_PROG, _PROG)
        ),
    )
    add_model_arguments(
        sub,
        device_help="device to profile on (default: cpu); meta builds the model there and plans "
        "it on fake tensors, allocating nothing",
    )
    sub.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=N,N,...[:DTYPE]",
        help="a keyword input of the forward and its shape, e.g. input_ids=1,8192 (ids drawn "
        "below --vocab or the model's vocab_size; *mask ones), and its own dtype after a colon "
        "(edge_index=2,300:long); repeat for several",
    )
    sub.add_argument("--labels", action="store_true", help="labels: a copy of input_ids")
    sub.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="the model's parameters' dtype"
    )
    sub.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with hf:CONFIG, a field of the configuration (value read as JSON where it "
        "parses), e.g. num_hidden_layers=16; repeat for several",
    )
    sub.add_argument(
        "--model-class",
        metavar="NAME",
        help="with hf:CONFIG, the transformers class to build (default: the configuration's "
        "first architecture, else AutoModelForCausalLM)",
    )
    sub.add_argument(
        "--device-rates",
        metavar="NAME",
        help="with --device meta, the device whose rates price the step's times (h100-sxm, "
        "a100-80gb, l4, ... or cpu; default: cpu)",
    )
    sub.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="the whole device's memory, e.g. 80GiB (or 'device': the device's free memory "
        "now, or with --device meta --device-rates' device's, less 5%%): the policy's modules "
        "are chosen by budget:total=SIZE so that parameters, optimizer state, the step and the "
        "optimizer's step fit; prints whether it fits and each part",
    )
    sub.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        help="the optimizer whose state and step count in the device's memory (default: none counted)",
    )
    sub.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="N",
        help="micro-steps per optimizer step (gradient accumulation): the device's memory is "
        "planned for the micro-steps that start with the gradients held (default: 1)",
    )
    sub.add_argument(
        "--ranks",
        metavar="N[,N...]",
        help="plan one rank of N under FSDP2: the model built on fake tensors and sharded with "
        "fully_shard (each block, then the root) over a fake process group of N, nothing "
        "allocated; with several counts and --device-memory, the smallest that fits "
        "(e.g. --ranks 1,2,4,8)",
    )
    sub.add_argument(
        "--keep-gathered",
        action="store_true",
        help="with --ranks: FSDP2's reshard_after_forward=False, each block's gathered parameters "
        "kept from its forward to its backward",
    )
    sub.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="R",
        help="with --ranks: HSDP, the ranks as R replicas of FSDP groups of N/R ranks each "
        "(parameters sharded within a group, gradients all-reduced across them)",
    )
    sub.add_argument(
        "--gather-dtype",
        choices=["bfloat16", "float16"],
        help="with --ranks: FSDP2's mixed precision, parameters gathered and computed in this dtype, "
        "gradients reduced in the parameters' own (MixedPrecisionPolicy(param_dtype, reduce_dtype))",
    )
    sub.add_argument("--policy", default="blocks", help="policy string (default: blocks)")
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
    figure = _figure_module(args.pareto) if args.pareto else None
    if args.pareto and not args.input_shape:
        raise UsageError("--pareto needs measured costs: give --input-shape")
    config = args.factory.startswith(CONFIG_PREFIX)
    if (args.set or args.model_class) and not config:
        raise UsageError("--set and --model-class build a model from hf:CONFIG; give hf:ConfigClass or hf:config.json")
    dtype = DTYPES[args.dtype] if args.dtype else None
    build = None
    if config:
        build = functools.partial(build_from_config, args.factory, args.set, args.model_class, dtype)
    elif dtype is not None:
        build = functools.partial(_in_dtype, args.factory, dtype)
    keyword = None
    if args.input or args.labels:
        keyword = functools.partial(_keyword_inputs, args)
    policy = _with_device_memory(args.policy, args.device_memory)
    if args.ranks is not None:
        return _run_ranks(args, build, keyword, policy)
    if args.keep_gathered or args.gather_dtype or args.replicas != 1:
        raise UsageError("--keep-gathered, --gather-dtype and --replicas shard the model with FSDP2: give --ranks N")
    model, inputs, kwargs, shapes = prepare(args, build, keyword)
    if not inputs and not kwargs and config and "budget:" in policy:
        raise UsageError("a budget is planned from measured costs: give --input NAME=N,N,... (and --labels)")

    # With --pareto, one profile of the frontier's candidates serves the plan and the
    # drawing, so that the legend shows what the table says.
    frontier_profile = (
        profile_modules(
            model, frontier_candidates(model, args.policy, nested=args.nested), inputs, step=True
        )
        if figure is not None
        else None
    )
    try:
        result = _plan(args, policy, model, inputs, kwargs, profile=frontier_profile)
    except CheckpointConfigError as error:
        if args.device_memory is None or error.needed is None:
            raise
        # The answer to "does it fit?" is no: said as the answer, not as a usage error.
        answer = {"fits": False, "needed_bytes": error.needed, "why": str(error)}
        print(json.dumps(answer, indent=2) if args.json else f"does NOT fit: {error}")
        return 1
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    if figure is not None:
        line, references = pareto_points(
            model, inputs, args.policy, nested=args.nested, profile=frontier_profile
        )
        points = (line, _with_plan_point(references, result))
        title = f"{args.factory}, input {' + '.join('x'.join(map(str, s)) for s in shapes)}"
        _draw(figure, args.pareto, *points, title=title)
        # Kept off standard output when that carries JSON for another program.
        print(
            f"saved the memory/time frontier to {args.pareto}",
            file=sys.stderr if args.json else sys.stdout,
        )
    return 0


def _run_ranks(args: argparse.Namespace, build: Any, keyword: Any, policy: str) -> int:
    """``plan --ranks``: one rank of each count under FSDP2 (``_cli_ranks``), printed as
    the plan of the smallest count that fits, or what a rank would need at the most."""
    if args.replicas < 1:
        raise UsageError(f"bad --replicas {args.replicas}: expected 1 or more (HSDP's replicas of FSDP groups)")
    counts = parse_ranks(args.ranks, replicas=args.replicas)
    if len(counts) > 1 and args.device_memory is None:
        raise UsageError(
            f"--ranks {args.ranks}: several counts are tried for the smallest that fits, which needs "
            f"the device's memory: give --device-memory SIZE (or device, with --device-rates)"
        )
    if args.device not in ("cpu", "meta"):
        raise UsageError(
            f"--ranks plans on fake tensors, nothing allocated; --device {args.device} has no use there "
            f"(name the device's speed and memory with --device-rates and --device-memory)"
        )
    if args.pareto:
        raise UsageError("--pareto draws one device's frontier: give it without --ranks")
    # The inputs, real and on the CPU, from a model built on the meta device; each count
    # builds one of its own on fake tensors.
    _, inputs, kwargs, _ = prepare(argparse.Namespace(**{**vars(args), "device": "meta"}), build, keyword)
    if not inputs and not kwargs:
        raise UsageError("--ranks plans a training step: give --input NAME=N,N,... (and --labels) or --input-shape")
    make = build if build is not None else functools.partial(build_model, args.factory)
    own = DTYPES[args.dtype] if args.dtype else torch.get_default_dtype()
    gathered = DTYPES[args.gather_dtype] if args.gather_dtype else None
    options = sharding_options(args.keep_gathered, gathered, reduce_dtype=own)
    found = plan_ranks(
        counts, make, inputs, kwargs, functools.partial(_plan, args, policy), options, smallest=args.device_memory is not None,
        replicas=args.replicas,
    )
    last = found[-1]
    tried = [
        {"ranks": each.ranks, "fits": each.plan is not None, "needed_bytes": each.needed} for each in found
    ]
    memory = (args.device_memory or "").strip()
    named = memory.lower() == "device"
    kind = (args.device_rates or "device") if named else f"devices of {memory}"

    def devices(count: int) -> str:
        if named:
            return f"{count} x {kind}"
        return f"{count} {kind}" if count > 1 else f"1 device of {memory}"

    if last.plan is None:
        least = beyond_reach(found)
        answer = {
            "fits": False, "ranks": last.ranks, "needed_bytes": last.needed, "why": last.why, "tried": tried,
            "least_needed_bytes": least,
        }
        if args.json:
            print(json.dumps(answer, indent=2))
            return 1
        if least is not None:
            print(
                f"does NOT fit on any number of {kind} under FSDP2: one rank would need at least "
                f"{format_bytes(least)} at any count (what FSDP2 does not shard: the step's activations, "
                f"the blocks' gathered parameters and gradients)"
            )
        else:
            print(
                f"does NOT fit on {devices(last.ranks)} under FSDP2: one rank would need "
                f"{format_bytes(last.needed)} ({last.needed} B)"
            )
        print(_tried(found[:-1]) + last.why)
        return 1
    if args.json:
        print(json.dumps(
            {**last.plan.to_dict(), "ranks": last.ranks, "replicas": args.replicas, "tried": tried}, indent=2
        ))
        return 0
    how = "FSDP2" if args.replicas == 1 else f"HSDP, {args.replicas} replicas of {last.ranks // args.replicas}"
    head = f"one rank of {last.ranks} under {how} ({last.why})"
    if memory:
        head = f"fits on {devices(last.ranks)}: " + head
    print(head)
    if len(found) > 1:
        print(_tried(found[:-1]).rstrip())
    print(last.plan)
    return 0


def _plan(args: argparse.Namespace, policy: str, model: nn.Module, inputs: Any, kwargs: Any, **more: Any) -> Plan:
    """The plan of ``policy`` for ``model`` on these inputs, with the command line's options."""
    result, _ = plan_and_profile(
        model, policy, nested=args.nested, example_inputs=tuple(inputs) or None, example_kwargs=kwargs or None,
        device_rates=args.device_rates, optimizer=args.optimizer, accumulation=args.accumulate,
        use_reentrant=args.use_reentrant, **more,
    )
    return result


def _tried(found: Sequence[RankPlan]) -> str:
    """The counts that did not fit, each with what one rank would need, one per line."""
    return "".join(
        f"  {each.ranks} rank{'s' if each.ranks > 1 else ''}: does not fit, one rank would need "
        f"{format_bytes(each.needed)}\n"
        for each in found
    )


def _with_device_memory(policy: str, memory: Optional[str]) -> str:
    """``policy`` with ``budget:total=SIZE`` (or ``budget:device``) for ``--device-memory``."""
    if memory is None:
        return policy
    if split_modifiers(as_policy(policy))[1] is not None:
        raise UsageError(
            f"--device-memory {memory} is a budget, and --policy {policy!r} has one already: "
            f"give one of them (budget:total=SIZE in the policy is --device-memory SIZE)"
        )
    term = "budget:device" if memory.strip().lower() == "device" else f"budget:total={memory.strip()}"
    Budget(term[len("budget:"):])  # a malformed size is refused now, named
    return f"{policy};{term}"


def _with_plan_point(references: List[Point], result: Plan) -> List[Point]:
    """The reference points and the plan's own, with the plan's predictions as printed
    (its segments included), unless a reference point is the very same."""
    if result.predicted_peak is None or result.recompute_time is None or not result.names:
        return references
    own = Point(f"policy {result.policy}", result.predicted_peak, result.recompute_time, tuple(result.names))
    if any((p.names, p.peak) == (own.names, own.peak) for p in references):
        return references
    return [*references, own]


# --------------------------------------------------------------------------- drawing


def _figure_module(path: str) -> ModuleType:
    """matplotlib's ``figure`` module; it and the target folder are checked before the
    slow profiling starts."""
    try:
        importlib.import_module("matplotlib")
        figure = importlib.import_module("matplotlib.figure")
    except ImportError:
        raise UsageError(
            f"--pareto draws with matplotlib, which is not installed; {_PLOT_HINT}"
        ) from None
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise UsageError(
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
        raise UsageError(f"cannot save --pareto {path!r}: {error}") from None


def _in_dtype(factory: str, dtype: torch.dtype) -> nn.Module:
    return build_model(factory).to(dtype)


def _keyword_inputs(args: argparse.Namespace, model: nn.Module, device: torch.device) -> Dict[str, Any]:
    return keyword_inputs(args.input, model, args.input_high, args.labels, args.seed, device)

"""Train a small GPT under several activation-checkpointing policies, and compare.

Every configuration starts from the same weights and the same RNG seeds, so dropout
masks agree and the gradients must be equal bit for bit. Prints, per policy, how many
modules were wrapped, peak memory, step time and whether the first step's gradients
equal those of the un-checkpointed run; exits non-zero if any differ.

    python examples/train_gpt.py                                   # the demo's policies
    python examples/train_gpt.py --activation-checkpointing every:2 --ac-use-reentrant
    CKPTWRAP_POLICY="type:Block;last:2" python examples/train_gpt.py
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from typing import Dict, List, Sequence

import torch

import ckptwrap.config
from ckptwrap.config import ActivationCheckpointingConfig
from ckptwrap.measure import measure_peak
from gpt import GPT, GPTConfig, synthetic_batch

_MIB = 1024 * 1024


def demo_configurations(layers: int) -> Dict[str, ActivationCheckpointingConfig]:
    """The policies ``make demo`` compares, by the label printed in the table."""
    last = max(1, layers // 2)
    settings = [
        ckptwrap.config.from_config({"policy": spec, "use_reentrant": reentrant})
        for spec, reentrant in (
            ("none", False),
            ("blocks", False),
            ("blocks", True),
            ("every:2", False),
            (f"type:Block;last:{last}", False),
        )
    ]
    return {label(setting): setting for setting in settings}


def label(setting: ActivationCheckpointingConfig) -> str:
    """A configuration's row label: its policy, marked when it runs on the re-entrant engine."""
    return setting.policy + (" (re-entrant)" if setting.options.use_reentrant else "")


@dataclasses.dataclass
class RunResult:
    """What one configuration's training run measured."""

    name: str
    wrapped: int
    """Modules checkpointed after the last step (a ``budget:`` plan measures its first step
    under the plan of least memory, then applies the plan solved from it)."""
    peak_bytes: int
    step_ms: List[float]
    first_grads: Dict[str, torch.Tensor]
    losses: List[float]


class Trainer:
    """Trains one configuration: its own copy of the model and its own optimizer.

    Args:
        name: Name of the configuration, for the result.
        template: The model to copy; it is not changed.
        setting: The policy and engine options, applied with ``wrap_model``.
        device: Where to train.
    """

    def __init__(
        self, name: str, template: GPT, setting: ActivationCheckpointingConfig, *, device: str = "cpu"
    ) -> None:
        self.device = device
        self.model = setting.apply(copy.deepcopy(template).to(device).train())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.result = RunResult(
            name=name, wrapped=_checkpointed(self.model), peak_bytes=0, step_ms=[], first_grads={}, losses=[]
        )

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, *, seed: int, measure: bool) -> None:
        """One training step on ``(tokens, targets)`` with dropout seeded by ``seed``.

        A measured step records the peak memory of its forward and backward and keeps its
        gradients; any other step is timed. No timed step runs under the memory meter,
        which slows every operator down.
        """
        torch.manual_seed(seed)  # the same dropout masks in every configuration
        self.optimizer.zero_grad(set_to_none=True)
        if measure:
            with measure_peak(self.device) as peak:
                loss = self.model(tokens, targets)
                loss.backward()
            self.result.peak_bytes = peak.peak_bytes
            self.result.first_grads = {
                name: param.grad.detach().clone() for name, param in self.model.named_parameters()
            }
            self.optimizer.step()
        else:
            _synchronize(self.device)
            start = time.perf_counter()
            loss = self.model(tokens, targets)
            loss.backward()
            self.optimizer.step()
            _synchronize(self.device)
            self.result.step_ms.append((time.perf_counter() - start) * 1000)
        self.result.losses.append(loss.item())
        # A budget: plan measures its first training step, then applies the plan solved.
        self.result.wrapped = _checkpointed(self.model)


def grads_equal(reference: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor]) -> bool:
    """True when both runs have the same parameters and bit-identical gradients."""
    return reference.keys() == other.keys() and all(
        torch.equal(reference[name], other[name]) for name in reference
    )


def format_table(results: Sequence[RunResult]) -> str:
    """The comparison table; the first result is the un-checkpointed reference."""
    reference = results[0]
    rows = [("policy", "wrapped", "peak MiB", "vs none", "median ms", "grads equal")]
    for result in results:
        if result is reference:
            same = "(reference)"
        else:
            same = "yes" if grads_equal(reference.first_grads, result.first_grads) else "NO"
        rows.append(
            (
                result.name,
                str(result.wrapped),
                f"{result.peak_bytes / _MIB:.1f}",
                f"{result.peak_bytes / max(reference.peak_bytes, 1):.2f}",
                f"{statistics.median(result.step_ms):.1f}",
                same,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(_align(row, widths)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def run(
    config: GPTConfig,
    *,
    steps: int,
    batch: int,
    seed: int = 0,
    device: str = "cpu",
    configurations: Dict[str, ActivationCheckpointingConfig] | None = None,
) -> List[RunResult]:
    """Train every configuration from the same initial weights on the same data.

    The configurations take turns step by step, so that a slow spell of the machine
    slows all of them alike. The first step of each is measured for peak memory and
    its gradients are kept; the others are timed.

    Args:
        config: Sizes of the model.
        steps: Training steps per configuration, at least 2.
        batch: Sequences per step.
        seed: Seed of the weights, the data and the dropout masks.
        device: Where to train.
        configurations: Labels and settings; the first is the reference. Defaults to
            :func:`demo_configurations`.

    Returns:
        One result per configuration, in order.

    Raises:
        ValueError: If ``steps`` is below 2.
    """
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (one measured, one timed), got {steps}")
    torch.manual_seed(seed)
    template = GPT(config)
    if configurations is None:
        configurations = demo_configurations(config.layers)
    trainers = [Trainer(name, template, setting, device=device) for name, setting in configurations.items()]
    for step in range(steps):
        tokens, targets = synthetic_batch(config, batch, seed=seed + step, device=device)
        shift = step % len(trainers)
        for trainer in trainers[shift:] + trainers[:shift]:
            trainer.step(tokens, targets, seed=seed + step, measure=step == 0)
    return [trainer.result for trainer in trainers]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per configuration (>= 2)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=128, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and dropout")
    parser.add_argument("--device", default="cpu", help="device to train on, e.g. cpu or cuda")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="CPU threads for torch; 0 for torch's choice (default: 1, so that step times compare)",
    )
    ckptwrap.config.add_argparse_args(parser)
    args = parser.parse_args(argv)
    if args.threads < 0:
        parser.error(f"--threads must be 0 (torch's choice) or more, got {args.threads}")
    # Several threads on a small model, on a machine shared with other work, make the
    # threads of one operator wait on each other: step times then move by more than the
    # policies differ, and the time column ranks them by noise.
    threads = args.threads or torch.get_num_threads()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (one measured, one timed), got {args.steps}")
    try:
        config = GPTConfig(
            width=args.width, heads=args.heads, layers=args.layers, seq_len=args.seq_len, dropout=args.dropout
        )
    except ValueError as error:
        parser.error(str(error))
    print(
        f"GPT: {config.layers} blocks, width {config.width}, {config.heads} heads, sequence "
        f"{config.seq_len}, batch {args.batch}, dropout {config.dropout}; {args.steps} steps "
        f"on {args.device}, CPU threads: {threads} (--threads); peak memory of step 1, "
        f"median time of steps 2-{args.steps}"
    )
    chosen = ckptwrap.config.from_args(args)
    configurations = None  # with no policy asked for, compare the demo's policies
    if chosen.policy != "none":
        configurations = {"none": ActivationCheckpointingConfig(), label(chosen): chosen}
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = run(
            config, steps=args.steps, batch=args.batch, seed=args.seed, device=args.device,
            configurations=configurations,
        )
    except ckptwrap.CheckpointError as error:
        parser.error(str(error))
    finally:
        torch.set_num_threads(previous_threads)  # main() also runs inside other programs (tests)
    print(format_table(results))
    reference = results[0].first_grads
    if all(grads_equal(reference, result.first_grads) for result in results[1:]):
        return 0
    print("error: some gradients differ from the un-checkpointed run", file=sys.stderr)
    return 1


def _checkpointed(model: torch.nn.Module) -> int:
    """How many modules the model's applied plan checkpoints (0 while a plan is pending:
    until then nothing is)."""
    plan = model.ckptwrap_plan
    return 0 if plan.pending else len(plan)


def _synchronize(device: str) -> None:
    """Wait for queued device work, so that a step's time includes it."""
    device = torch.device(device)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _align(row: Sequence[str], widths: Sequence[int]) -> List[str]:
    """Left-align the first cell (a name) and right-align the others (numbers)."""
    return [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]


if __name__ == "__main__":
    sys.exit(main())

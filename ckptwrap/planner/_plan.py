"""``Plan``: what ``wrap_model`` does or would do, printable as a table."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..engine import CheckpointOptions
from ._peak_model import format_bytes as shown

if TYPE_CHECKING:
    from ._device_memory import DeviceMemory

__all__ = ["BOUNDS", "Plan", "PlanEntry"]

_MIB = float(1 << 20)

BOUNDS = ("bounded", "scaled")
"""The sources of costs (``Plan.costs_from``) that are bounds from a measured shape."""


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One module the plan checkpoints."""

    name: str
    """Qualified name in the model."""
    kind: str
    """Class name of the module."""
    saved_bytes: Optional[int] = None
    """Predicted activation memory saved: what its forward keeps minus its inputs (measured)."""
    recompute_time: Optional[float] = None
    """Predicted extra time per step, seconds: its measured forward time."""
    joins: Optional[str] = None
    """The selected module just before it whose checkpointed region it runs in, as one
    segment that keeps only the segment's first input; None when it has its own region."""
    option: Optional[str] = None
    """How a measured plan checkpoints it: ``recompute`` (all of it), a selective level's
    label (``save mm x3, addmm x2``: those operators' outputs are saved, the rest
    recomputed) or ``segment`` (in one region with its neighbours); None when unmeasured
    or for the ``selective`` and ``offload`` tiers."""
    saved_ops: Tuple[Tuple[str, int], ...] = ()
    """For a selective level: ``(operator packet, occurrence)`` of each operator call of
    its forward whose output is saved; empty otherwise."""

    def __post_init__(self) -> None:
        # Kept as tuples of (str, int) whatever was given (JSON lists, say), so that
        # entries compare equal across a round trip.
        ops = tuple((str(name), int(index)) for name, index in self.saved_ops)
        object.__setattr__(self, "saved_ops", ops)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The modules a policy selects in one model, and those it left out, with reasons.

    Iterating a plan yields the selected qualified names in model order; ``print(plan)``
    shows a table. Plans made from measured costs (a ``budget:`` policy, or
    ``example_inputs``) also carry predictions per module and in total.
    """

    policy: str
    """The policy, in its string form."""
    options: CheckpointOptions
    """Engine options for every selected module."""
    selected: Tuple[PlanEntry, ...]
    """Modules to checkpoint, in model order."""
    dropped: Tuple[Tuple[str, str], ...] = ()
    """(qualified name, reason) for modules the policy matched but the plan leaves out."""
    nested: bool = False
    """Whether selected modules inside other selected modules are kept (nested checkpoints)."""
    tier: str = "recompute"
    """How the selected modules save memory: ``recompute``, ``selective`` or ``offload``."""
    selective_ops: Tuple[str, ...] = ()
    """Operators whose outputs are saved, for the ``selective`` tier."""
    budget: Optional[int] = None
    """The budget in bytes, for a ``budget:`` policy: a cap on ``predicted_peak``."""
    activation_bytes: Optional[int] = None
    """Measured activation memory of the un-checkpointed model, bytes: what its forward
    saves for backward."""
    predicted_peak: Optional[int] = None
    """Predicted peak of one training step (forward, loss and backward) with this plan,
    in bytes above what was allocated before the step: activations, recomputations,
    gradients of activations, backward temporaries and parameter gradients."""
    plain_peak: Optional[int] = None
    """Predicted peak of the same step with nothing checkpointed, bytes; ``budget:NN%``
    is a share of it."""
    pending: bool = False
    """True while the plan waits for the first training forward to measure costs."""
    costs_from: Optional[str] = None
    """For a plan a ``budget:`` solved at a training forward's shape, where its costs came
    from: ``measured`` at that shape, ``fitted`` over the shapes measured, or a bound from
    a measured shape (``bounded``: a larger shape's costs; ``scaled``: a smaller one's,
    scaled up), whose ``predicted_peak`` and ``plain_peak`` are then at or above the
    step's own."""

    priced_at: Optional[str] = None
    """For a plan from a step run on fake tensors (a model on the meta device or made of
    fake tensors), the device whose rates its times were priced at, from FLOPs and bytes;
    None where they were measured."""
    step_time: Optional[float] = None
    """For a plan from a step run on fake tensors, the priced seconds of one training step
    (forward, loss, backward) with this plan: the step with nothing checkpointed plus
    ``recompute_time``."""
    device_memory: Optional["DeviceMemory"] = None
    """For a budget in a device's terms (``budget:total=SIZE``, ``budget:device``) or a plan
    given an optimizer: the device's memory and what the model holds in it besides the
    step (parameters, buffers, gradients, the optimizer's state and step)."""

    @property
    def device_peak(self) -> Optional[int]:
        """The device's predicted peak over a training iteration with this plan: what is held
        and the step's peak, or the optimizer's step, whichever is higher."""
        if self.device_memory is None or self.predicted_peak is None:
            return None
        return self.device_memory.whole_peak(self.predicted_peak)

    @property
    def fits(self) -> Optional[bool]:
        """Whether the iteration fits the device's memory (``device_peak`` within it); None
        where no device's memory is known (a budget of the step, or none)."""
        peak = self.device_peak
        if peak is None or self.device_memory is None or self.device_memory.total is None:
            return None
        return peak <= self.device_memory.total

    @property
    def from_bound(self) -> bool:
        """Whether the plan was solved from a bound (``costs_from``): its predictions are
        at or above the step's own."""
        return self.costs_from in BOUNDS

    @property
    def names(self) -> List[str]:
        """Selected qualified names, in model order."""
        return [entry.name for entry in self.selected]

    @property
    def recompute_time(self) -> Optional[float]:
        """Predicted extra time per step, seconds (sum over the selected modules)."""
        times = [entry.recompute_time for entry in self.selected]
        return None if any(t is None for t in times) else float(sum(times))  # type: ignore[arg-type]

    @property
    def saved_bytes(self) -> Optional[int]:
        """Predicted activation memory saved in total, bytes (before the recompute peak)."""
        saved = [entry.saved_bytes for entry in self.selected]
        return None if any(s is None for s in saved) else int(sum(saved))  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.selected)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-friendly description of the plan."""
        options = {
            name: value
            for name, value in self.options.as_kwargs().items()
            if name != "context_fn"
        }
        return {
            "policy": self.policy,
            "options": options,
            "tier": self.tier,
            "selective_ops": list(self.selective_ops),
            "nested": self.nested,
            "pending": self.pending,
            "selected": [dataclasses.asdict(entry) for entry in self.selected],
            "dropped": [{"name": name, "reason": reason} for name, reason in self.dropped],
            "budget": self.budget,
            "activation_bytes": self.activation_bytes,
            "predicted_peak": self.predicted_peak,
            "plain_peak": self.plain_peak,
            "costs_from": self.costs_from,
            "priced_at": self.priced_at,
            "saved_bytes": self.saved_bytes,
            "recompute_time": self.recompute_time,
            "step_time": self.step_time,
            "device_memory": None if self.device_memory is None else self.device_memory.to_dict(),
            "device_peak": self.device_peak,
            "fits": self.fits,
        }

    def __str__(self) -> str:
        head = f"ckptwrap plan for policy {self.policy!r}: {len(self.selected)} module(s)"
        if self.pending:
            head += " (pending: costs are measured on the first training forward)"
        lines = [head]
        changed = {
            name: value
            for name, value in self.options.as_kwargs().items()
            if value != getattr(CheckpointOptions, name)
            and not (name == "context_fn" and self.tier == "selective")
        }
        if self.tier != "recompute":
            changed["tier"] = self.tier + (f" ({', '.join(self.selective_ops)})" if self.selective_ops else "")
        if changed:
            lines.append("options: " + ", ".join(f"{k}={v}" for k, v in changed.items()))
        measured = self.selected and all(e.saved_bytes is not None for e in self.selected)
        if measured:
            rows = [
                (_shown(e), e.kind, f"{e.saved_bytes / _MIB:.2f}", f"{e.recompute_time * 1e3:.2f}")
                for e in self.selected
            ]
            rows.append(("total", "", f"{self.saved_bytes / _MIB:.2f}", f"{self.recompute_time * 1e3:.2f}"))
            header: Tuple[str, ...] = ("module", "class", "saves MiB", "recompute ms")
            if any(e.option is not None for e in self.selected):
                header += ("option",)
                rows = [(*row, e.option or "") for row, e in zip(rows, self.selected)] + [(*rows[-1], "")]
            lines += _table(header, rows)
        else:
            lines += _table(("module", "class"), [(_shown(e), e.kind) for e in self.selected])
        if measured and self.priced_at is not None:
            lines.append(
                f"(recompute times priced at {self.priced_at}'s peak rates from FLOPs and bytes: "
                f"the step ran on fake tensors)"
            )
        if any(e.joins for e in self.selected):
            lines.append("(+ runs in one region with the module above it: a segment)")
        if self.activation_bytes is not None and self.predicted_peak is not None:
            plain = self.plain_peak if self.plain_peak is not None else self.activation_bytes
            summary = (
                f"training step peak: {plain / _MIB:.2f} MiB predicted without checkpointing, "
                f"{self.predicted_peak / _MIB:.2f} MiB with this plan "
                f"({self.predicted_peak / max(plain, 1):.0%})"
            )
            if self.budget is not None and self.device_memory is not None and self.device_memory.total is not None:
                summary += f"; {self.budget / _MIB:.2f} MiB left for it on the device"
            elif self.budget is not None:
                summary += f"; budget {self.budget / _MIB:.2f} MiB"
            if self.from_bound:
                summary += " (from a bound: at or above the step's own)"
            lines.append(summary)
            lines.append(
                f"(activations saved for backward without checkpointing: "
                f"{self.activation_bytes / _MIB:.2f} MiB)"
            )
        if self.step_time is not None and self.recompute_time is not None:
            lines.append(
                f"training step time: {_seconds(self.step_time)} priced at {self.priced_at}'s peak rates "
                f"({_seconds(self.step_time - self.recompute_time)} with nothing checkpointed)"
            )
        if self.device_memory is not None and self.predicted_peak is not None:
            lines += _device_lines(self.device_memory, self.predicted_peak)
        if self.dropped:
            lines.append("left out:")
            lines += _table(("module", "reason"), list(self.dropped))
        return "\n".join(lines)


def _device_lines(memory: "DeviceMemory", step_peak: int) -> List[str]:
    """The device's memory part by part, and whether the iteration fits."""
    optimizer = memory.optimizer or "none given"
    rows = [
        ("parameters", shown(memory.parameters)),
        ("buffers", shown(memory.buffers)),
        (f"optimizer state ({optimizer})", shown(memory.optimizer_state)),
        ("the step's inputs (the batch)", shown(memory.inputs)),
        *([("gradients held from the micro-step before", shown(memory.held_gradients))] if memory.held_gradients else []),
        ("training step peak (this plan)", shown(step_peak)),
        ("= held at the step's peak", shown(memory.held + memory.inputs + memory.held_gradients + step_peak)),
        ("gradients, in the optimizer step", shown(memory.gradients)),
        ("optimizer step temporaries", shown(memory.optimizer_step)),
        ("= held at the optimizer step's peak", shown(memory.optimizer_peak)),
    ]
    peak = memory.whole_peak(step_peak)
    head = f"device memory: {shown(peak)} predicted at the iteration's peak"
    if memory.total is not None:
        verdict = "fits" if peak <= memory.total else "does NOT fit"
        head += f"; {verdict} in {shown(memory.total)} ({memory.source})"
    return [head] + _table(("part", "bytes"), rows)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _shown(entry: PlanEntry) -> str:
    return f"+ {entry.name}" if entry.joins else entry.name


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    if not rows:
        return ["  (none)"]
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [cells[0].ljust(widths[0])]
        # Text columns left-aligned, number columns right-aligned.
        for cell, width, sample in zip(cells[1:], widths[1:], rows[0][1:]):
            numeric = sample.replace(".", "", 1).isdigit()
            parts.append(cell.rjust(width) if numeric else cell.ljust(width))
        return "  " + "  ".join(parts).rstrip()

    return [line(header), "  " + "  ".join("-" * w for w in widths)] + [line(row) for row in rows]

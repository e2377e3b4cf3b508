"""The whole training step's memory, phase by phase, for the planner's step-peak model.

One step runs with every outermost candidate checkpointed, the plan that holds the least
between forward and backward, and a meter (``_phases``) cuts the step into phases: each
candidate's forward (with the code before it), the end of the forward (the rest of the
forward, the loss, the output's gradient, the backward of the code after the last
candidate), then per candidate its recomputation and its backward proper. What each
phase reached beyond the activations the planner accounts for is the same under any
plan: gradients flowing through, backward temporaries, parameter gradients accumulated
so far (``_moments.step_terms`` takes them out). Each phase keeps its moments too, so that the
cost model can follow each of them across input shapes rather than only their maximum.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from .._hf import cache_free_arguments, fresh_caches
from ..engine import checkpoint, graph_nodes, is_recomputing, reaches_reentrant
from ..measure import differentiable, tensors
from ._phases import Phase, PhaseMeter
from ._timing import RngState

__all__ = ["StepPeaks", "measure_step"]

END = "end"
"""The key of the end of the forward in :attr:`StepPeaks.moments` and ``seconds``."""


@dataclasses.dataclass(frozen=True)
class StepPeaks:
    """Bytes a training step with every candidate checkpointed reached in each phase, above
    what was allocated before the step.

    The step backpropagates from the model's loss: a scalar output, or the ``loss`` of
    an output that has one (a Hugging Face ``ModelOutput`` given labels); otherwise from
    every floating-point output that requires grad, with gradients of ones, as a loss
    computed outside the model would hand back a gradient of each output's size.
    Parameter gradients are taken as fresh (``zero_grad(set_to_none=True)``): they are
    allocated during the backward.

    A candidate called several times keeps the highest of its calls' peaks, the sum of
    their seconds, and their moments as runs: calls whose phases had as many moments (the
    same code) share a run, the highest of each moment.
    """

    forward: Dict[str, int]
    """Per candidate: the highest point of the forward from the end of the candidate
    before it (the start of the step, for the first) to the end of its own forward."""
    end: int
    """The highest point from the end of the last candidate's forward to the first
    recomputation: the rest of the forward, the loss, and the backward of the code after
    the last candidate."""
    recompute: Dict[str, int]
    """Per candidate: the highest point while its recomputation ran."""
    backward: Dict[str, int]
    """Per candidate: the highest point from the end of its recomputation until the next
    recomputation began (or the step ended): its backward, and that of any code between
    it and the candidate before it."""
    total: int
    """The step's peak."""
    moments: Dict[str, Tuple[Tuple[int, ...], ...]] = dataclasses.field(default_factory=dict)
    """Per phase, keyed ``forward:NAME``, ``recompute:NAME``, ``backward:NAME`` or
    ``end``: the bytes at each point where the phase can peak (see ``_phases.Phase``), in
    runs of as many moments, shortest first (one run but for candidates called several
    times)."""
    seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    """Per phase, keyed as ``moments``: how long it took."""
    at_allocator: bool = True
    """Whether the peaks were read at the allocator (else operators' outputs only)."""

    def __post_init__(self) -> None:
        # From JSON (``to_dict``), the moments come back as lists.
        moments = {
            key: tuple(tuple(int(v) for v in run) for run in runs) for key, runs in self.moments.items()
        }
        object.__setattr__(self, "moments", moments)

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)


class _Marked:
    """A candidate's forward that starts and ends its phases, in the forward and when it
    is recomputed."""

    def __init__(self, forward: Any, name: str, phases: PhaseMeter) -> None:
        self.forward, self.name, self.phases = forward, name, phases

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_recomputing():
            self.phases.cut(f"forward:{self.name}")
            output = self.forward(*args, **kwargs)
            self.phases.cut(f"after:{self.name}")
            return output
        self.phases.cut(f"recompute:{self.name}")
        output = self.forward(*args, **kwargs)
        self.phases.cut(f"backward:{self.name}")
        return output


def measure_step(
    model: nn.Module,
    targets: Sequence[Tuple[str, nn.Module]],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    device: torch.device,
    loss_fn: Optional[Any] = None,
    save_policy: Optional[Any] = None,
    preserve_rng_state: bool = True,
) -> StepPeaks:
    """Run one training step of ``model`` with each of ``targets`` checkpointed (the
    non-re-entrant engine, recomputing each whole forward) and measure its phases.

    ``loss_fn(output)`` gives the loss to backpropagate from; without it, see
    :class:`StepPeaks`. With ``save_policy`` (the selective tier's), the targets are
    checkpointed selectively, as the plan would run them. ``targets`` must not nest.
    Parameter gradients are returned by ``autograd.grad``, not accumulated, so the model's
    ``.grad`` fields are left as they were; the RNG states are put back, and the caller
    restores buffers and training flags. ``preserve_rng_state`` is the plan's engine
    option: on the CPU each region keeps the generator's state, which counts.
    """
    phases = PhaseMeter(device)
    context_fn = None
    if save_policy is not None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, save_policy)
    originals: List[Tuple[nn.Module, Any]] = []
    devices = [device] if device.type != "cpu" else []
    try:
        for name, module in targets:
            originals.append((module, module.__dict__.get("forward")))
            marked = _Marked(module.forward, name, phases)
            module.forward = functools.partial(
                _checkpointed, module, marked, context_fn, preserve_rng_state
            )
        with RngState(devices).kept():
            call_args, call_kwargs = fresh_caches(args, kwargs)
            with phases, torch.enable_grad():
                output = model(*call_args, **call_kwargs)
                roots, grads = _loss(output if loss_fn is None else loss_fn(output))
                del output
                wanted = [p for p in model.parameters() if p.requires_grad]
                if roots and wanted and reaches_reentrant(roots):
                    _backward_keeping_grads(roots, grads, wanted)
                elif roots and wanted:
                    # Returned, not accumulated: the caller's .grad fields stay as they were.
                    torch.autograd.grad(roots, wanted, grads, allow_unused=True)
                del roots, grads
    finally:
        for module, forward in originals:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
    return _by_phase(phases.phases, phases.at_allocator)


def _backward_keeping_grads(
    roots: List[torch.Tensor], grads: List[Optional[torch.Tensor]], parameters: List[torch.Tensor]
) -> None:
    """Backward from ``roots`` through a re-entrant region (a checkpoint inside the model
    with ``use_reentrant=True``, which ``torch.autograd.grad`` cannot pass): accumulated
    into fresh ``.grad`` fields, as a step from zeroed gradients does, then put back as
    the caller had them. A re-entrant region's own parameters are reached only by the
    backward it runs inside, so every parameter is kept besides the leaves in the graph."""
    leaves = list({id(t): t for t in [*parameters, *_leaves(roots)]}.values())
    kept = [(leaf, leaf.grad) for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    try:
        torch.autograd.backward(roots, grads)
    finally:
        for leaf, grad in kept:
            leaf.grad = grad


def _leaves(roots: List[torch.Tensor]) -> List[torch.Tensor]:
    """The leaf tensors whose ``.grad`` a backward from ``roots`` accumulates into."""
    found = (getattr(node, "variable", None) for node in graph_nodes(roots))
    return list({id(t): t for t in found if isinstance(t, torch.Tensor)}.values())


def _by_phase(phases: List[Phase], at_allocator: bool) -> StepPeaks:
    """Phases, as cut in time order, gathered per candidate: the gaps between candidates'
    forwards go to the forward after them, or to the end of the forward."""
    merged: Dict[str, List[Phase]] = {}
    pending: List[Phase] = []  # since the last candidate's forward ended, not yet assigned
    for phase in phases:
        kind, _, name = phase.label.partition(":")
        if not kind:
            continue  # the label after the last cut: no phase
        if kind in ("head", "after"):
            pending.append(phase)
            continue
        if kind == "forward":
            phase, pending = _joined(phase.label, [*pending, phase]), []
        elif pending:  # the first recomputation closes the forward
            merged.setdefault(END, []).append(_joined(END, pending))
            pending = []
        merged.setdefault(phase.label, []).append(phase)
    if pending:
        merged.setdefault(END, []).append(_joined(END, pending))
    tables: Dict[str, Dict[str, int]] = {"forward": {}, "recompute": {}, "backward": {}}
    for key, calls in merged.items():
        kind, _, name = key.partition(":")
        if name:
            tables[kind][name] = max(phase.peak for phase in calls)
    end = max((phase.peak for phase in merged.get(END, ())), default=0)
    total = max([end, *(v for table in tables.values() for v in table.values())])
    return StepPeaks(
        tables["forward"], end, tables["recompute"], tables["backward"], total,
        moments={key: _runs(calls) for key, calls in merged.items()},
        seconds={key: sum(phase.seconds for phase in calls) for key, calls in merged.items()},
        at_allocator=at_allocator,
    )


def _joined(label: str, parts: List[Phase]) -> Phase:
    """Consecutive phases as one."""
    return Phase(
        label,
        max(part.peak for part in parts),
        tuple(moment for part in parts for moment in part.moments),
        sum(part.seconds for part in parts),
    )


def _runs(calls: List[Phase]) -> Tuple[Tuple[int, ...], ...]:
    """The moments of the calls of one phase, those of as many moments as one run of the
    highest of each."""
    runs: Dict[int, Tuple[int, ...]] = {}
    for phase in calls:
        known = runs.get(len(phase.moments))
        moments = phase.moments if known is None else tuple(map(max, known, phase.moments))
        runs[len(phase.moments)] = moments
    return tuple(runs[length] for length in sorted(runs))


def _checkpointed(
    module: nn.Module,
    forward: _Marked,
    context_fn: Optional[Any],
    preserve_rng_state: bool,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """One checkpointed call, with KV-cache writes off as in a checkpointed training call."""
    rewritten = cache_free_arguments(module, args, kwargs)
    if rewritten is not None:
        args, kwargs = rewritten
    # Without early stop, each recomputation runs to its end, where the phase is cut.
    return checkpoint(
        forward, *args, early_stop=False, context_fn=context_fn,
        preserve_rng_state=preserve_rng_state, **kwargs,
    )


def _loss(output: Any) -> Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]:
    """What the step backpropagates from, and the gradients it starts with."""
    loss = output if isinstance(output, torch.Tensor) else _loss_attribute(output)
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
        return [loss], [None]
    roots = [t for t in tensors(output) if t.requires_grad and differentiable(t)]
    return roots, [torch.ones_like(t) for t in roots]


def _loss_attribute(output: Any) -> Any:
    if isinstance(output, dict) or hasattr(output, "keys"):
        try:
            return output.get("loss")
        except (AttributeError, TypeError):
            return None
    return getattr(output, "loss", None)

"""The cost record: what one operator costs (:class:`OpCost`), the phases a training step
is cut into and the meter that cuts it (:class:`PhaseMeter`), the whole step's memory
phase by phase (:class:`StepPeaks`), and what each candidate module costs in one step
(:class:`ModuleCost`, :class:`ModelProfile`). Measured once (``_metering``), read by the
fits over shapes, the peak model and the solver; ``profile_modules`` gives a profile.

In this module, in order:

1. **Operators.** What each operator of one candidate call costs: the dispatch-level
   record (:class:`OpRecorder`) that the budget planner turns into selective levels (save
   some operators' outputs, recompute the rest). Operators are named as selective
   checkpointing names them, by overload packet and by occurrence among the calls of that
   packet within one call of the module, skipping those it ignores, so a recorded ``(op,
   occurrence)`` is the one a selective policy sees in a checkpointed call of the same
   module.
2. **Phases.** A step measured with every outermost candidate checkpointed (the plan
   that holds the least between forward and backward) is cut into phases: each
   candidate's forward (with the code before it), the end of the forward (the rest of the
   forward, the loss, the output's gradient, the backward of the code after the last
   candidate), then per candidate its recomputation and its backward proper. Each phase
   keeps its peak, its duration and its moments (the points at which its memory can
   peak), so that the cost model can follow each of them across input shapes rather than
   only their maximum. Moments are counted in the order the program makes them, so the
   same code at another shape gives as many in the same order: in the forward and in
   each recomputation at operators' outputs, through a dispatch mode (``_peak``'s storage
   counter, which also tells the candidates' recorders each operator: one mode, however
   many listen); in the backward, which runs with no dispatch mode (one would make
   autograd accumulate gradients out of place), one per node of the graph, at the most it
   held (``_span``'s ``StepSpan``). On accelerators each phase's peak is also read at the
   allocator (its peak statistics, reset at each cut), so that memory no operator returns
   (a kernel's workspace) counts too, the matrix libraries' own made before the meter
   starts (``ready_libraries``). On the CPU, which keeps no such statistics, the peak is
   the moments' highest, a node's as ``_span`` reads it; ``torch.profiler`` is never
   started, so a meter inside a training step disturbs neither the caller's profiler nor
   another thread's. A step the meter follows may be the user's own: started in the
   forward's pre-hook, left when the forward returns, carried through the backward node
   by node, cut by the candidates as they run and are recomputed, and finished where the
   backward ends, inside autograd's engine.
3. **The step's memory** (:class:`StepPeaks`): what each phase reached beyond the
   activations the planner accounts for is the same under any plan: gradients flowing
   through, backward temporaries, parameter gradients accumulated so far, and whatever
   the caller keeps alive through the backward (``_peak_model.step_terms`` takes them
   out).
4. **A candidate's cost and the profile** (:class:`ModuleCost`, :class:`ModelProfile`):
   the costs of each candidate module in one forward of the model, and of all of them
   with the training step. ``ModuleCost`` is the one record of a candidate's cost from
   the step that measures it to the solver; each of its fields says how a fit over input
   shapes takes it (``ModuleCost.terms``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry

from ._peak import StorageCounter, outputs_of, ready_libraries
from ._span import StepSpan
from ._storages import StorageMap, Tally, tensor_storages, tensors
from ..policy import draws_random

__all__ = [
    "END",
    "ModelProfile",
    "ModuleCost",
    "OpCost",
    "OpRecorder",
    "PhaseMeter",
    "StepPeaks",
    "Window",
    "by_phase",
    "merge_calls",
    "op_flops",
    "packet_name",
    "region_bytes",
]


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One operator call in a candidate's forward (summed over the candidate's calls).

    Example:
        >>> OpCost("mm", 0, bytes=4096, saved=True, flops=65536, time=2e-06)
        OpCost(op='mm', occurrence=0, bytes=4096, saved=True, flops=65536, time=2e-06, mutated=False, random=False)
    """

    op: str
    """Overload packet name, e.g. ``mm`` or ``_scaled_dot_product_flash_attention_for_cpu``."""
    occurrence: int
    """How many calls of the same packet came before it in the same module call, from 0."""
    bytes: int
    """Bytes of the storages among its outputs that no tensor had before it: 0 for a view
    or an in-place operator."""
    saved: bool
    """Whether autograd saved one of those new storages for backward during the forward."""
    flops: int = 0
    """Floating-point operations, as ``torch.utils.flop_counter`` counts them."""
    time: float = 0.0
    """Seconds it took: the median over the timed repeats; 0 when not timed."""
    mutated: bool = False
    """Whether a later operator wrote into one of its new storages in place (dropout's
    mask, filled after ``empty_like``): selective checkpointing cannot save such an
    output, since the copy it keeps would no longer be the one the forward used."""
    random: bool = False
    """Whether it drew random numbers (dropout, attention with dropout; see
    ``ckptwrap.policy.draws_random``): never saved, so that the recomputation draws what
    the forward drew."""

    @property
    def instance(self) -> Tuple[str, int]:
        """``(op, occurrence)``: how a selective policy names this call."""
        return (self.op, self.occurrence)


Listener = Callable[[Any, Tuple[Any, ...], Dict[str, Any], Any], None]
"""Told an operator the phase meter counted: ``(func, args, kwargs, out)``."""


@functools.lru_cache(maxsize=None)
def packet_name(func: Any) -> str:
    """The name of an operator's overload packet: how profiler and selective policy name
    an operator, so that their numbering agrees."""
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "__name__", str(packet))


class OpRecorder:
    """Records the operators of one module call with autograd on: new output bytes, FLOPs,
    and, through ``tally`` (the saved-tensors tally of the same forward), what autograd saves.

    It is no dispatch mode of its own: the phase meter's counter, which every operator of a
    measured forward passes through already, tells it each operator after counting it,
    while it listens (:meth:`PhaseMeter.recording`). Calls are numbered per packet as
    selective checkpointing numbers them. A storage is new if no tensor met so far (an
    operator's argument or output) had it: views and in-place results are not new.
    Outputs are never kept alive here, so the forward's memory is as it would be without
    the recorder.
    """

    def __init__(self, tally: Tally) -> None:
        self._tally = tally
        self._counts: Dict[str, int] = defaultdict(int)
        # Every storage met so far, with the entry of the operator that created it (None
        # for those the module was given).
        self._seen: StorageMap[Optional[List[Any]]] = StorageMap()
        self._ops: List[List[Any]] = []  # [name, occurrence, bytes, saved, flops, mutated, random]
        self.flops = 0
        """FLOPs of the operators recorded, as ``FlopCounterMode`` counts them."""
        self.created_bytes = 0
        """Bytes of the new storages the operators made, freed or not."""

    def __call__(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        """``func`` ran on ``args`` and ``kwargs`` and returned ``out``: record it."""
        if func in SAC_IGNORED_OPS:
            return
        name = packet_name(func)
        occurrence = self._counts[name]
        self._counts[name] = occurrence + 1
        fresh = outputs_of(func)
        if fresh is None:
            # The schema does not tell new outputs from inputs: every input is met.
            for tensor in tensors((args, kwargs)):
                for storage in tensor_storages(tensor):
                    self._seen.setdefault(storage, None)
        for tensor in _written(func, args, kwargs):
            for storage in tensor_storages(tensor):
                owner = self._seen.get(storage)
                if owner is not None:
                    owner[5] = True
        entry = [name, occurrence, 0, False, op_flops(func, out, args, kwargs), False, draws_random(func, args, kwargs)]
        self.flops += entry[4]
        if fresh is not False:
            # New storages: outputs no tensor had before (an output of the schema's
            # views and in-place operators never is one).
            for tensor in (out,) if type(out) is torch.Tensor else tensors(out):
                for storage in tensor_storages(tensor):
                    if storage in self._seen:
                        continue
                    self._seen[storage] = entry
                    entry[2] += storage.nbytes()
                    self.created_bytes += storage.nbytes()
                    # Autograd saves after the operator returns: the tally counts the
                    # storage then, and tells us through the claim.
                    self._tally.claims[storage] = functools.partial(_mark_saved, entry)
        self._ops.append(entry)

    def ops(self) -> List[OpCost]:
        """What was recorded, in call order."""
        return [OpCost(*entry[:5], mutated=entry[5], random=entry[6]) for entry in self._ops]


def _mark_saved(entry: List[Any], nbytes: int) -> None:
    """A tally claim (with ``entry`` bound) that marks an operator's entry as saved."""
    entry[3] = True


def _written(func: Any, args: Any, kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """The tensor arguments ``func`` writes into (in-place and ``out=`` operators)."""
    written = []
    for position, name in _writes(func):
        value = kwargs.get(name) if position is None or position >= len(args) else args[position]
        written += tensors(value)
    return written


@functools.lru_cache(maxsize=None)
def _writes(func: Any) -> Tuple[Tuple[Optional[int], str], ...]:
    """(position, or None for keyword-only, and name) of each argument ``func`` writes into."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple(
        (None if argument.kwarg_only else position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def op_flops(func: Any, out: Any, args: Any, kwargs: Dict[str, Any]) -> int:
    """FLOPs of one operator call, as torch's FLOP counter counts them (0 where it has
    no formula). Its formulas read shapes alone: each operator and set of shapes is
    counted once (the counter's own walk over the arguments costs more than most small
    operators), up to :data:`_FLOPS_KEPT` of them at a time."""
    counter = flop_registry.get(getattr(func, "overloadpacket", func))
    if counter is None:
        return 0
    try:
        key = (func, _shapes(args), _shapes(kwargs.values()), tuple(kwargs))
        known = _FLOPS.get(key)
    except (TypeError, RuntimeError):  # a symbolic size, or a tensor with none: no key
        return int(counter(*args, **kwargs, out_val=out))
    if known is None:
        if len(_FLOPS) >= _FLOPS_KEPT:
            _FLOPS.clear()
        known = _FLOPS[key] = int(counter(*args, **kwargs, out_val=out))
    return known


_FLOPS: Dict[Tuple[Any, ...], int] = {}
_FLOPS_KEPT = 4096


def _shapes(values: Any) -> Tuple[Any, ...]:
    """``values`` with each tensor as its shape: what a FLOP formula reads."""
    return tuple(
        value.shape if isinstance(value, torch.Tensor)
        else _shapes(value) if isinstance(value, (list, tuple))
        else value
        for value in values
    )


def merge_calls(so_far: Optional[List[OpCost]], call: List[OpCost], first: bool) -> Optional[List[OpCost]]:
    """The ops of a module's calls so far, with one more call added.

    Selective levels name operators per module call, so they apply to every call only if
    every call runs the same operators: otherwise the result is ``None`` (no levels).
    """
    if first:
        return call
    if so_far is None or [op.instance for op in so_far] != [op.instance for op in call]:
        return None
    return [
        OpCost(
            a.op, a.occurrence, a.bytes + b.bytes, a.saved or b.saved, a.flops + b.flops, a.time,
            a.mutated or b.mutated, a.random or b.random,
        )
        for a, b in zip(so_far, call)
    ]


class Phase(NamedTuple):
    """One phase as the meter saw it; bytes are above what was allocated when the meter
    started."""

    label: str
    peak: int
    """The most bytes allocated at one time during the phase."""
    moments: Tuple[int, ...]
    """Bytes allocated at the phase's start and after each allocation in it: the points
    at which it can reach its peak, in order. Runs of the same code at other sizes give
    as many, in the same order."""
    seconds: float


class PhaseMeter:
    """Cuts the work between :meth:`start` and :meth:`finish` into phases: call
    :meth:`cut` with the next phase's label at each boundary; :attr:`phases` is filled by
    :meth:`finish` (the first phase is labelled ``head``). Between them, its :attr:`span`
    (a ``StepSpan``, None before :meth:`start`) carries it from the forward into the
    backward. As a context manager it counts the block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: List[Phase] = []
        self._labels = ["head"]
        self._times: List[float] = []
        self.span: Optional[StepSpan] = None
        self._module = None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)
        self._counted: List[Tuple[int, Tuple[int, ...]]] = []
        self._start = 0
        self.finished = False

    @property
    def at_allocator(self) -> bool:
        """Whether the peaks are the allocator's (else operators' outputs only)."""
        return self._module is not None

    def start(self) -> "PhaseMeter":
        if self._module is not None:
            ready_libraries(self.device)
            self._module.synchronize(self.device)
            self._start = self._module.memory_allocated(self.device)
            self._module.reset_peak_memory_stats(self.device)
        self.span = StepSpan(_PhaseCounter(self.device.type))
        self.span.enter()
        self._times.append(time.perf_counter())
        return self

    def __enter__(self) -> "PhaseMeter":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.finish()

    def finish(self) -> None:
        """End the last phase and stop counting; nothing stays on any mode stack."""
        if self.finished or self.span is None:
            return
        self.cut("")
        self.finished = True
        self.span.close()
        seconds = [b - a for a, b in zip(self._times, self._times[1:])]
        self.phases = [
            Phase(label, peak, moments, spent)
            for label, (peak, moments), spent in zip(self._labels, self._counted, seconds)
        ]

    def cut(self, label: str) -> None:
        """End the phase in progress and begin ``label``."""
        if self.finished or self.span is None:
            return
        if self._module is not None:
            self._module.synchronize(self.device)
        self.span.settle()  # what the node in progress held so far is this phase's
        peak, moments = self.span.counter.cut()
        if self._module is not None:
            peak = max(peak, self._module.max_memory_allocated(self.device) - self._start)
            self._module.reset_peak_memory_stats(self.device)
        self._counted.append((max(0, peak), moments))
        self._times.append(time.perf_counter())
        self._labels.append(label)

    @property
    def phase(self) -> int:
        """The index of the phase in progress (0: the head, before the first cut)."""
        return len(self._labels) - 1

    def adopt(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage from now until it is freed, as if an operator had
        made it (a tensor made outside the dispatcher: the generator state a region keeps)."""
        if self.span is not None and not self.finished:
            self.span.counter.adopt(tensor)

    @contextlib.contextmanager
    def recording(self, *listeners: Optional[Listener]) -> Iterator[None]:
        """Tell ``listeners`` (those not None) every operator the meter counts in the
        block, after counting it, with its arguments and output; nothing once finished."""
        listening = [listener for listener in listeners if listener is not None]
        if self.span is None or self.finished or not listening:
            yield
            return
        counter = self.span.counter
        counter.listeners.extend(listening)
        try:
            yield
        finally:
            for listener in listening:
                counter.listeners.remove(listener)


class Window:
    """What one stretch inside the phase in progress of a :class:`PhaseMeter` (a
    candidate's recomputation) created and held: followed from its making, on the meter's
    ``span``, until :meth:`close`, which fills in the fields and returns it."""

    peak: int
    """The most bytes its own allocations held at once, above its start."""
    moments: Tuple[int, ...]
    """Its moments, above its start."""
    seconds: float
    ops: int
    """How many operators ran in it (the meter's own cost grows with them)."""

    def __init__(self, span: StepSpan) -> None:
        # What a reading open already saw is the phase's, not the window's: read before the
        # window starts, a reading's highest could lie before it (a nested candidate's
        # recomputation under a save policy, whose outputs come back from the policy's
        # cache, read the sibling outputs recomputed before it as its own, or not, as the
        # allocator reused their blocks).
        span.settle()
        counter = span.counter
        self._span = span
        self._start = counter.live_bytes
        self._ops = counter.ops
        self._moments: List[int] = []
        self._time = time.perf_counter()
        counter.windows.append(self)

    def close(self) -> "Window":
        self.seconds = time.perf_counter() - self._time
        counter = self._span.counter
        if self in counter.windows:
            self._span.settle()  # what the allocator held inside it, beyond the outputs
        with counter._lock:
            if self in counter.windows:
                counter.windows.remove(self)
        self.moments = tuple(max(0, m - self._start) for m in self._moments)
        self.peak = max(self.moments, default=0)
        self.ops = counter.ops - self._ops
        return self


class _PhaseCounter(StorageCounter):
    """The storage counter, with the moments of the phase in progress and of any open
    windows, that tells its listeners (``OpRecorder``, ``policy_listener``) each operator
    it counted: one dispatch mode per operator, however many listen."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, trace=True, workspaces=device_type == "cpu")
        self._phase_peak = 0
        self._phase_start = 0
        self.windows: List[Window] = []
        self.listeners: List[Listener] = []

    def _record(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        StorageCounter._record(self, func, out, args, kwargs)
        for listener in self.listeners:
            listener(func, args, kwargs, out)

    def _add(self, nbytes: int) -> None:
        # Once per storage an operator makes: kept to plain statements.
        StorageCounter._add(self, nbytes)
        live = self._live
        if live > self._phase_peak:
            self._phase_peak = live
        for window in self.windows:
            window._moments.append(live)

    def _peak_at(self, nbytes: int) -> None:
        super()._peak_at(nbytes)
        self._phase_peak = max(self._phase_peak, nbytes)
        for window in self.windows:
            window._moments.append(nbytes)

    def cut(self) -> Tuple[int, Tuple[int, ...]]:
        with self._lock:
            while self._freed:
                self._live -= self._freed.pop()
            moments = (self._phase_start, *self.moments)
            peak = max(self._phase_peak, self._phase_start)
            self.moments.clear()
            self._phase_peak = self._phase_start = self._live
        return peak, moments


END = "end"
"""The key of the end of the forward in :attr:`StepPeaks.moments` and ``seconds``."""


@dataclasses.dataclass(frozen=True)
class StepPeaks:
    """Bytes a training step with every candidate checkpointed reached in each phase, above
    what was allocated before the step.

    A step of the caller's own backpropagates from whatever the caller does with the
    output; one run on example inputs (``profile_modules``), from the model's loss: a
    scalar output, the ``loss`` of an output that has one (a Hugging Face ``ModelOutput``
    given labels), else every floating-point output with gradients of ones. Parameter
    gradients are taken as fresh (``zero_grad(set_to_none=True)``): a step that
    accumulated into existing ones is read as if they had been allocated in it.

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
    ``end``: the bytes at each point where the phase can peak (see :class:`Phase`), in
    runs of as many moments, shortest first (one run but for candidates called several
    times)."""
    seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    """Per phase, keyed as ``moments``: how long it took."""
    at_allocator: bool = True
    """Whether the peaks were read at the allocator (else operators' outputs only)."""

    def __post_init__(self) -> None:
        # From JSON (``ModelProfile.to_dict``), the moments come back as lists.
        moments = {
            key: tuple(tuple(int(v) for v in run) for run in runs) for key, runs in self.moments.items()
        }
        object.__setattr__(self, "moments", moments)


def by_phase(phases: List[Phase], at_allocator: bool) -> StepPeaks:
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


def region_bytes(device: torch.device, preserve_rng_state: bool = True) -> int:
    """What the engine keeps per checkpointed call besides its inputs, in the memory the
    budget caps of a step on ``device``: on the CPU, the generator state it replays (an
    accelerator's is kept in host memory)."""
    if not preserve_rng_state or device.type != "cpu":
        return 0
    return _generator_state_bytes()


@functools.lru_cache(maxsize=1)
def _generator_state_bytes() -> int:
    return torch.get_rng_state().untyped_storage().nbytes()


def _term(kind: str, default: Any = dataclasses.MISSING) -> Any:
    """A field of :class:`ModuleCost` and how a fit over input shapes takes it (see
    :meth:`ModuleCost.terms`)."""
    return dataclasses.field(default=default, metadata={"term": kind})


@dataclasses.dataclass(frozen=True)
class ModuleCost:
    """What one candidate module costs in one forward of the model.

    A module that runs several times in one forward (a shared layer, a recurrent cell
    stepped over time) gets the sum over its calls in every figure but those named per
    call, and ``calls`` says how many there were.

    This one record carries a candidate's cost from the step that measures it (added up
    call by call) through the fits over shapes to the solver; each field says how a fit
    takes it (:meth:`terms`), so that a new term is declared here alone.
    """

    name: str
    """Qualified name, as in ``model.named_modules()``."""
    kind: str = _term("shape")
    """Class name of the module."""
    kept_bytes: int = _term("size")
    """Bytes of the distinct storages its forward saves for backward, other than the model's
    parameters and buffers, the model's inputs and the module's own inputs."""
    input_bytes: int = _term("size")
    """Bytes of the distinct storages of its tensor inputs (args and kwargs, nested), other
    than parameters, buffers and the model's own inputs (those were there before the
    step); a checkpoint of the module keeps these. An input that the calls of other
    candidates take too (a mask or position embeddings every layer takes) is alive through
    the forward whatever is checkpointed: it is counted in the base instead, once."""
    output_bytes: int = _term("size")
    """Bytes of the distinct storages of its tensor outputs, other than parameters and buffers."""
    forward_time: float
    """Seconds for its forward with autograd on: the median over the repeats."""
    flops: int = _term("size")
    """Floating-point operations of its forward, as ``FlopCounterMode`` counts them."""
    self_saved_input_bytes: int = _term("size", 0)
    """The part of ``input_bytes`` its own forward saves for backward (counted in the
    profile's base bytes): a checkpoint of it keeps these at no extra cost."""
    called: bool = _term("shape", True)
    """False if the model's forward never called it; every figure is then zero."""
    calls: int = _term("count", 1)
    """How many times the model's forward called it (recursive calls of itself not counted)."""
    forward_peak_bytes: int = _term("size", 0)
    """The most bytes that storages created by one call of its forward held at one time:
    saved tensors, temporaries and outputs; what a recomputation of it needs at its
    highest."""
    forward_moments: Tuple[int, ...] = ()
    """The bytes its forward's own storages held after each operator that created one
    (the highest of its calls' where their operators line up): the points at which
    ``forward_peak_bytes`` can be reached, which the cost model follows across input
    shapes."""
    call_kept_bytes: int = _term("size", 0)
    """The most one call's forward saves for backward (``kept_bytes`` for one call)."""
    call_input_bytes: int = _term("size", 0)
    """The most bytes of one call's inputs (``input_bytes`` for one call)."""
    created_bytes: int = _term("size", 0)
    """Bytes of every storage its forward created, freed or not: the memory traffic its
    time grows with, beside ``flops``."""
    forward_ops: int = 0
    """Operator calls its forward ran, over all its calls (those selective checkpointing
    numbers): each costs a dispatch beside its work. 0: not counted (as many as ``ops``
    per call is taken)."""
    handed_over_bytes: int = _term("size", 0)
    """The part of ``kept_bytes`` (its own saved outputs) that the forward after it saves
    as well, the next block's first layer for one: counted in the profile's base bytes,
    since a checkpoint of this module does not free it."""
    joins_previous: bool = _term("shape", False)
    """Whether its only input was the output of the candidate called just before it, and
    nothing after it saves that input again: the two can run as one checkpointed segment,
    which frees the input (``self_saved_input_bytes``). Both must be called once."""
    base_before_bytes: Optional[int] = None
    """The part of the profile's base bytes saved before its (last) call began, its own
    saved inputs included: what of the base is still alive when backward reaches it. None
    if it was never called outside another candidate."""
    position: int = _term("count", -1)
    """Where its (last) call comes among the candidates' calls that are not nested in
    another candidate's, from 0; -1 if there is none."""
    first_position: int = _term("count", -1)
    """Where its first such call comes; ``position - first_position + 1 == calls`` when
    its calls follow each other with no other candidate's between them."""
    policy_saved_bytes: int = _term("size", 0)
    """With a save policy: bytes of the outputs of the operators it saves, which a selective
    checkpoint of the module keeps until backward."""
    policy_saved_kept_bytes: int = _term("size", 0)
    """The part of ``policy_saved_bytes`` that the plain forward saves for backward too
    (in ``kept_bytes``): a selective recomputation need not rebuild it."""
    selective_overhead: float = 0.0
    """Seconds torch's selective checkpointing adds to one forward of it: the dispatch mode
    it runs over every operator (the forward measured under it, saving nothing, less the
    plain forward)."""
    recompute_time: Optional[float] = None
    """With a save policy: seconds its forward takes when the saved outputs are replayed,
    what a selective recomputation costs; None without one (``forward_time`` then)."""
    ops: Tuple[OpCost, ...] = ()
    """Its forward's operators in call order, as selective checkpointing numbers them
    (summed over its calls); empty if its calls ran different operators or it was not
    called. The planner derives selective levels from them."""

    @classmethod
    def terms(cls, kind: str) -> Tuple[str, ...]:
        """The fields a fit over input shapes takes as ``kind``: ``"size"``, bytes and
        FLOPs, fitted over the shapes and scaled with a scaled profile; ``"count"``, calls
        and positions, fitted but never scaled; ``"shape"``, what must be the same at
        every shape for profiles to be fitted together. The others (times, moments,
        operators, the base's share) are fitted each in its own way."""
        return tuple(field.name for field in dataclasses.fields(cls) if field.metadata.get("term") == kind)

    def __post_init__(self) -> None:
        # From JSON (``to_dict``), the operators and moments come back as lists of dicts.
        ops = tuple(op if isinstance(op, OpCost) else OpCost(**op) for op in self.ops)
        object.__setattr__(self, "ops", ops)
        moments = self.forward_moments
        if not (type(moments) is tuple and all(type(m) is int for m in moments)):
            # Kept as they are when already a tuple of ints (a record replaced call by call).
            object.__setattr__(self, "forward_moments", tuple(int(m) for m in moments))

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """The costs of the candidate modules of one model on one example input.

    ``total_activation_bytes == base_bytes + sum of (kept_bytes - handed_over_bytes)`` over
    the candidates whose calls are not nested inside another candidate's call.
    """

    modules: Tuple[ModuleCost, ...]
    """One cost per candidate, in the order of ``model.named_modules()``."""
    total_activation_bytes: int
    """Bytes of the distinct storages a plain forward with autograd on saves for backward,
    other than parameters, buffers and the model's inputs."""
    base_bytes: int
    """The part of the total that no checkpoint frees: storages saved outside the candidates,
    candidate inputs that the candidates save (a checkpoint would keep those as well), and
    candidate outputs that the forward after them saves again."""
    step: Optional[StepPeaks] = None
    """With ``step=True``: the memory of one whole training step with every outermost
    candidate checkpointed, phase by phase; what the step peak is predicted from."""
    priced_at: Optional[str] = None
    """For a step run on fake tensors, the rates its times were priced at (a device's
    name); None where they were measured."""
    step_time: Optional[float] = None
    """For a step run on fake tensors, the priced seconds of one training step with
    nothing checkpointed (forward, loss, backward); None elsewhere."""
    _index: Dict[str, ModuleCost] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "_index", {cost.name: cost for cost in self.modules})

    def __getitem__(self, name: str) -> ModuleCost:
        try:
            return self._index[name]
        except KeyError:
            shown = ", ".join(repr(cost.name) for cost in self.modules[:5])
            more = ", ..." if len(self.modules) > 5 else ""
            raise KeyError(f"{name!r} was not profiled; profiled modules: {shown}{more}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-friendly dict that :meth:`from_dict` turns back into an equal profile."""
        return {
            "modules": [cost.to_dict() for cost in self.modules],
            "total_activation_bytes": self.total_activation_bytes,
            "base_bytes": self.base_bytes,
            "step": None if self.step is None else dataclasses.asdict(self.step),
            "priced_at": self.priced_at,
            "step_time": self.step_time,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """Rebuild a profile from :meth:`to_dict` output (for example, loaded from JSON)."""
        return cls(
            modules=tuple(ModuleCost(**cost) for cost in data["modules"]),
            total_activation_bytes=int(data["total_activation_bytes"]),
            base_bytes=int(data["base_bytes"]),
            step=None if data.get("step") is None else StepPeaks(**data["step"]),
            priced_at=data.get("priced_at"),
            step_time=data.get("step_time"),
        )

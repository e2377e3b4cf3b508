"""Measuring one training step into a :class:`ModelProfile`.

The step runs with every outermost candidate checkpointed (the plan of least memory,
whose phases can be told apart), and a recorder (:class:`StepRecorder`), fed by the
candidates as they run and are recomputed, learns what each would keep, take and cost if
it were plain, and what the step held phase by phase. The step may be the user's own (a
training forward, the user's loss, the user's backward: whatever they keep alive counts)
or one run on example inputs (:func:`measure_inputs`: ``plan``,
``wrap_model(..., example_inputs=...)``, the doctor, the command line), whose loss is
backpropagated with ``torch.autograd.grad`` (the model's ``.grad`` fields untouched; a
model sharded by FSDP2, or one with a re-entrant region, backpropagates into fresh
``.grad`` fields put back after, FSDP2's counted storage by storage through its hooks).

Nothing runs that the step would not run: a candidate's saved tensors are seen as its
region drops them (``engine.observe_saved``), its operators through the phase meter's
dispatch mode inside its forward, and its working set as it is recomputed (through the
same mode, put on the stack for the recomputation alone: the backward around it runs
with none, as an unmetered one does). Bookkeeping never raises into the step: a failure
ends the recording (``failed``) and the step goes on as it would have.

In this module, in order:

1. What an operator costs in time beyond its work under a measuring dispatch mode
   (``dispatch_cost``, ``recording_cost``, ``selective_cost``), so that metered times are
   told apart from the work itself; and the prices the solver weighs recomputations at
   (:class:`RecomputePrices`), from what they run (operators, FLOPs, bytes), so that a
   run's timing noise decides no plan.
2. The account of one step's candidate calls (:class:`CallBook`): per candidate its
   :class:`Record` (its ``ModuleCost`` itself, added up call by call, and the step's own
   bookkeeping beside it); per call what it takes, saves and returns (:class:`Call`);
   across calls the storages outside every candidate (the base), which inputs are shared
   (:class:`InputLedger`) and which calls chain; at the end, each candidate's
   ``ModuleCost``.
3. The recorder (:class:`StepRecorder`), which sees the calls as they happen and cuts
   the step into phases.
4. The step run on given inputs (:func:`measure_inputs`), the model, its random number
   generators and Python's collector left as they were.
5. A small text progress bar on standard error for long measurements
   (:class:`ProgressBar`), drawn only on a terminal or when asked.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import gc
import math
import sys
import time
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from .. import _torch_private
from .._errors import CheckpointConfigError
from .._hf import fresh_caches
from .._warn import note
from ..engine import CheckpointOptions, graph_nodes, is_recomputing, observe_saved, reaches_reentrant, saved_observer
from ._storages import SavePolicy, StorageMap, Tally, differentiable, policy_listener, tensor_storages, tensors
from ._costs import ModelProfile, ModuleCost, OpCost, OpRecorder, PhaseMeter, Window, by_phase, merge_calls
from ._unreal import measure_unreal, step_device, unreal

_MEASURING: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptwrap_measuring", default=False)


def is_measuring() -> bool:
    """Whether the model runs to be measured on given inputs (:func:`measure_inputs`): a
    forward hook that plans must then leave it alone (the forward is not a training
    forward of the caller's)."""
    return _MEASURING.get()


RegionRunner = Callable[[nn.Module, Callable[..., Any], Tuple[Any, ...], Dict[str, Any], CheckpointOptions], Any]
"""How the marking layer runs a module's forward as a checkpointed region:
``run_region(module, call, args, kwargs, options)``."""

__all__ = [
    "ProgressBar",
    "RegionRunner",
    "RecomputePrices",
    "StepRecorder",
    "dispatch_cost",
    "is_measuring",
    "measure_inputs",
    "recording_cost",
    "resolve_targets",
    "should_show",
    "selective_cost",
]


_CALIBRATION_OPS = 400


@functools.lru_cache(maxsize=1)
def dispatch_cost() -> float:
    """Seconds one operator spends in a measuring dispatch mode (the phase meter's storage
    counter, following moments) beyond running: measured once per process on tiny CPU
    tensors, where an operator's own time is negligible. Times of a metered step are
    corrected by it (times only rank plans; bytes are exact)."""
    return _added_per_op(lambda: PhaseMeter(torch.device("cpu")))


@functools.lru_cache(maxsize=1)
def recording_cost() -> float:
    """:func:`dispatch_cost` with a candidate's operator recorder listening: what one
    operator of a measured forward costs beyond running."""

    @contextlib.contextmanager
    def recorded() -> Iterator[None]:
        with PhaseMeter(torch.device("cpu")) as meter, meter.recording(OpRecorder(Tally())):
            yield

    return _added_per_op(recorded)


@functools.lru_cache(maxsize=1)
def selective_cost() -> float:
    """Seconds torch's selective checkpointing adds to one operator of a forward (its
    dispatch mode, saving nothing): measured once per process on tiny CPU tensors. A
    selective level pays it twice per operator (forward and recomputation)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def nothing(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    return _added_per_op(lambda: create_selective_checkpoint_contexts(nothing)[0])


def _added_per_op(context: Callable[[], ContextManager[Any]]) -> float:
    """Seconds the context made by ``context()`` adds to one tiny CPU operator (read
    outside any dispatch mode in force, a fake step's included: it is kept per process)."""

    def work() -> float:
        start = time.perf_counter()
        value = x
        for _ in range(_CALIBRATION_OPS):
            value = value + 1.0
        return time.perf_counter() - start

    with _torch_private.disable_current_modes():
        x = torch.zeros(1)
        work()
        plain = min(work() for _ in range(3))
        with context():
            inside = min(work() for _ in range(3))
    return max(0.0, (inside - plain) / _CALIBRATION_OPS)


# --------------------------------------------------------------------------- prices


@dataclasses.dataclass(frozen=True)
class OperatorRates:
    """What running operators costs in time on a kind of device: the terms a
    recomputation is priced at from what it runs (a fixed cost per operator, and their
    work), not from how long it once took (see :func:`_priced`)."""

    name: str
    """What the rates are of, for messages."""
    operator: float
    """Seconds each operator costs beyond its work: its dispatch, its launch, autograd's
    bookkeeping."""
    flops_per_second: float
    """Floating-point operations per second (per intra-op thread where ``threaded``)."""
    bytes_per_second: float
    """Bytes of new storage per second: allocated, written and read again."""
    selective: float
    """Seconds torch's selective checkpointing mode adds to each operator of a pass (the
    forward, or the recomputation)."""
    threaded: bool = False
    """Whether FLOPs run on torch's intra-op threads (the CPU): the rate is then per thread."""

    def flop_rate(self) -> float:
        """FLOPs per second at torch's thread count now."""
        return self.flops_per_second * (max(1, torch.get_num_threads()) if self.threaded else 1)


CPU_RATES = OperatorRates(
    "cpu", operator=4e-6, flops_per_second=2e11, bytes_per_second=2.5e9, selective=1.5e-5, threaded=True
)
"""A CPU core running eager PyTorch: fitted to the recomputations (autograd on) of seven
of the catalogue's architectures (GPT-2, Llama, BERT, T5, ViT, Whisper, Mamba) at three
widths and two shapes each, single-threaded, every one within 1.4 times of its measured
time; the selective mode's cost is the median of theirs (12 to 20 microseconds an operator)."""

ACCELERATOR_RATES = OperatorRates(
    "accelerator", operator=1.5e-5, flops_per_second=2e14, bytes_per_second=2e12, selective=1.6e-5
)
"""An H100-class GPU in eager PyTorch: the host's time per operator and what the selective
mode adds to it as measured in docs/gpu.md (a 0.95B Llama at 4096 tokens, where the step
is bound by the launches), kernels at a realistic share of the bfloat16 peak."""


class RecomputePrices:
    """The seconds the budget solver weighs for recomputing each candidate of one profile,
    and for each of its operators and the selective mode's cost: priced from counts that
    repeat exactly from run to run (its operators, their FLOPs, the bytes they create) at
    the rates of the device's kind (:data:`CPU_RATES`, :data:`ACCELERATOR_RATES`), never
    from a candidate's own measured time.

    A measured time is one sample of a busy machine: the same block of the same model
    measured 12 ms in one process and 195 ms in the next while another process ran
    beside it, so any choice a measured time enters (one candidate against another, a
    selective level against recomputing all of a block) was decided by that noise, and
    each process planned otherwise. Priced, the same computation costs the same in every
    process, a first or last block that holds a few bytes more costs what the others do
    (ties go to the earlier in model order), and a level pays where its operators' work
    outweighs the selective mode's cost, by the same counts everywhere.

    Measured times only calibrate: one factor (all measured seconds over all priced ones,
    rounded to 6 significant bits) takes the prices to the measured scale, for the plan's
    recompute times; a factor common to every price changes no choice. Profiles stepped
    on fake tensors come priced at a device's rates already and are kept so (but for the
    CPU's rates, measured in each process: the CPU's kind priced, calibrated to them); a
    profile without times (``repeats=0``) prices everything at zero.

    Prices are whole multiples of one quantum (each rounded to 30 significant bits of the
    profile's largest), so that sums of them are exact and equal plans tie exactly.

    Args:
        profile: The profile, each candidate with its counts (``ops``, ``forward_ops``,
            ``flops``, ``created_bytes``) and measured (or priced) times.
    """

    def __init__(self, profile: Any) -> None:
        measured = profile.priced_at is None
        refit = measured or profile.priced_at == CPU_RATES.name
        rates = CPU_RATES
        if measured and profile.step is not None and profile.step.at_allocator:
            rates = ACCELERATOR_RATES
        flop_rate = rates.flop_rate()
        raw = {
            cost.name: _priced(cost, rates, flop_rate) if refit else _as_priced(cost)
            for cost in profile.modules
        }
        scale = _scale(profile.modules, raw) if refit else 1.0
        largest = max((price for price, _, _ in raw.values()), default=0.0)
        # 2**30 quanta for the largest price: sums of many stay exact in a float's 53 bits.
        tick = math.ldexp(1.0, math.frexp(largest)[1] - 30) if largest > 0 else 1.0
        quantum = _rounded(scale) * tick
        self._prices: Dict[str, Tuple[float, Tuple[float, ...], float]] = {}
        for name, (price, ops, selective) in raw.items():
            units = [round(op / tick) for op in ops]
            whole = sum(units) if units else round(price / tick)
            self._prices[name] = (
                quantum * whole,
                tuple(quantum * unit for unit in units),
                quantum * round(selective / tick),
            )

    def time(self, name: str) -> float:
        """Seconds the recomputation of candidate ``name`` is priced at: the sum of its
        operators' where it has them."""
        return self._prices[name][0]

    def op_times(self, name: str) -> Tuple[float, ...]:
        """Seconds each of its operators (as in its ``ops``) is priced at."""
        return self._prices[name][1]

    def selective(self, name: str) -> float:
        """Seconds the selective mode adds to one pass of it (0 where none was measured)."""
        return self._prices[name][2]


def _priced(cost: Any, rates: OperatorRates, flop_rate: float) -> Tuple[float, List[float], float]:
    """A candidate's price at ``rates``, each operator's, and the selective mode's."""
    calls = max(1, int(cost.calls))
    ops = cost.ops or ()
    # Each operator entry stands for one call of it per call of the candidate.
    fixed, per_byte = calls * rates.operator, 1.0 / rates.bytes_per_second
    per_flop = 1.0 / flop_rate
    prices = [fixed + op.flops * per_flop + op.bytes * per_byte for op in ops]
    operators = int(getattr(cost, "forward_ops", 0) or 0) or calls * len(ops)
    if prices:
        whole = math.fsum(prices)
    else:
        whole = operators * rates.operator + cost.flops * per_flop + cost.created_bytes * per_byte
    # Charged where the step measured the mode's cost at all (a step measured without
    # times, or told the mode is free, measured none).
    selective = operators * rates.selective if cost.selective_overhead > 0 else 0.0
    return whole, prices, selective


def _as_priced(cost: Any) -> Tuple[float, List[float], float]:
    """A candidate of a profile priced already (a step on fake tensors), as it is."""
    time = cost.forward_time if cost.recompute_time is None else cost.recompute_time
    return float(time), [float(op.time) for op in cost.ops], float(cost.selective_overhead)


def _scale(costs: Any, raw: Dict[str, Tuple[float, List[float], float]]) -> float:
    """Measured seconds per priced second, over every candidate (0 if none was timed)."""
    measured = math.fsum(
        float(cost.forward_time if cost.recompute_time is None else cost.recompute_time) for cost in costs
    )
    priced = math.fsum(price for price, _, _ in raw.values())
    return measured / priced if measured > 0 and priced > 0 else 0.0


def _rounded(value: float) -> float:
    """``value`` to 6 significant bits: its product with a whole number of quanta is exact."""
    if value <= 0:
        return 0.0
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 64), exponent - 6)


@dataclasses.dataclass
class Record:
    """One candidate's :class:`ModuleCost` as its calls add up to it (``cost``), and what
    the measurement needs besides."""

    module: nn.Module
    cost: ModuleCost
    ops: Optional[List[OpCost]] = None  # summed over its calls; None when they differ
    outer_kept: int = 0  # kept bytes of calls not nested in another candidate's: the total
    joined: Optional["Record"] = None  # the record of the call it continues a chain from
    depth: int = 0  # > 1 while the module is inside a call of itself
    forward_seconds: float = 0.0  # its forwards, as metered
    recompute_seconds: float = 0.0  # its recomputations, the meter's cost taken off
    recomputed: int = 0  # how many of its calls were recomputed

    @classmethod
    def of(cls, name: str, module: nn.Module) -> "Record":
        """A candidate not called yet."""
        return cls(module, ModuleCost(name, type(module).__name__, 0, 0, 0, 0.0, 0, called=False, calls=0))

    @property
    def name(self) -> str:
        return self.cost.name

    def add(self, **terms: int) -> None:
        """Add ``terms`` to the cost's fields of those names."""
        cost = self.cost
        self.cost = dataclasses.replace(cost, **{field: getattr(cost, field) + n for field, n in terms.items()})

    def most(self, **terms: int) -> None:
        """Raise the cost's fields of those names to ``terms`` (figures per call)."""
        cost = self.cost
        self.cost = dataclasses.replace(cost, **{field: max(getattr(cost, field), n) for field, n in terms.items()})

    def put(self, **values: Any) -> None:
        """Set the cost's fields of those names."""
        self.cost = dataclasses.replace(self.cost, **values)


class InputLedger:
    """Which input storages the outermost candidate calls took, counted once.

    An input that an earlier outermost call took too (an attention mask, or position
    embeddings, that every layer takes) is alive through the whole forward; held after
    it by an operator that saves it, it is counted once, in the base, from the first
    call that took it, and in no call's inputs. One no operator saves (a causal video
    convolution's feature cache, or a tensor a candidate's forward stores in a list every
    call takes, which the next chunk replaces) is freed in a plain step once replaced, and
    held after the forward only by checkpoints that took it: it stays in the first call's
    inputs until something saves it. Another call of the same module taking one
    again (a mask every call of a shared layer takes) holds it no longer: counted in the
    first call's inputs only.

    Args:
        excluded: Storages that are no inputs (parameters, buffers, the model's inputs).
        base: The profile's base tally, which shared inputs move to.
        records: Every candidate's record, whose ``base_before_bytes`` a move raises.
    """

    def __init__(self, excluded: StorageMap[Any], base: Tally, records: List["Record"]) -> None:
        self._excluded, self._base, self._records = excluded, base, records
        # Per input storage: the first record and outermost call that took it.
        self._owner: StorageMap[Tuple[Record, int]] = StorageMap()
        self._counted_by: Dict[int, StorageMap[None]] = {}  # per record
        self._shared: StorageMap[None] = StorageMap()

    def add(self, record: "Record", inputs: List[torch.Tensor], saved: List[torch.Tensor], position: int) -> None:
        """Add the inputs of ``record``'s outermost call at ``position``, those of them
        the call saves itself (``saved``) as self-saved."""
        saved_here = StorageMap.of(saved)
        counted_by_record = self._counted_by.setdefault(id(record), StorageMap())
        counted = saved_bytes = 0
        for tensor in inputs:
            for storage in tensor_storages(tensor):
                if storage in self._excluded or storage in counted_by_record:
                    continue
                counted_by_record.setdefault(storage, None)
                owner = self._owner.get(storage)
                if owner is None:
                    self._owner[storage] = (record, position)
                    counted += storage.nbytes()
                    if storage in saved_here:
                        saved_bytes += storage.nbytes()
                    continue
                self._share(storage, *owner)
        record.add(input_bytes=counted, self_saved_input_bytes=saved_bytes)
        record.most(call_input_bytes=counted)

    def _share(self, storage: torch.UntypedStorage, first: "Record", position: int) -> None:
        """``storage``, an input of the outermost call at ``position`` (of ``first``), is
        an input of a later call too: once the base takes it (an operator saves it),
        move it from that call's inputs to the base."""
        if storage in self._shared:
            return
        self._shared.setdefault(storage, None)
        if storage in self._base:
            return  # saved by that call or before it: counted in the base already
        # Taken by several calls is not yet held through the backward: a plain step holds
        # it only once an operator saves it (see the class).
        earlier = self._base.claims.pop(storage)

        def saved(nbytes: int) -> None:
            if earlier is not None:
                earlier(nbytes)
            first.add(input_bytes=-nbytes)
            for record in self._records:
                if record.cost.base_before_bytes is not None and record.cost.position >= position:
                    record.add(base_before_bytes=nbytes)

        self._base.claims[storage] = saved


def highest_each(known: Tuple[int, ...], new: Tuple[int, ...]) -> Tuple[int, ...]:
    """Two calls' moments as one: the higher of each where they line up, else the moments
    of the call that peaked higher."""
    if not known:
        return new
    if len(known) == len(new):
        return tuple(max(a, b) for a, b in zip(known, new))
    return new if max(new, default=0) > max(known, default=0) else known


@dataclasses.dataclass
class Call:
    """A candidate call whose forward is in progress.

    The region's function holds its frame (``StepRecorder.region``), and the engine keeps
    that function until the region's backward, for the recomputation: once the forward
    has ended, :meth:`release` lets go of what the frame held of the call.
    """

    record: Record
    nested: bool
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    inputs: List[torch.Tensor]
    tally: Tally
    policy_tally: Tally
    ops: OpRecorder
    started: float
    listening: Any = None  # a nested call's: the meter's recording of its operators

    def release(self) -> None:
        """Drop the call's arguments and input tensors. Held until the region's backward,
        they would keep alive what the caller lets go of in the meantime, which a step
        unmetered frees: Wan's VAE hands its causal convolutions a list of the last
        chunk's frames and replaces the list with a fresh one at the end of its encode and
        of its decode; each region's call kept the old list and the frames it last held
        (+1.7% of the plain peak above ``blocks`` unmetered, at the end of the forward)."""
        self.args, self.kwargs, self.inputs = (), {}, []


class CallBook:
    """The account of one step's candidate calls (see the module).

    Args:
        targets: ``(qualified name, module)`` of every candidate, in model order.
        bar: A progress bar to move as candidates are measured.
    """

    def __init__(self, targets: Sequence[Tuple[str, nn.Module]], bar: Optional[ProgressBar] = None) -> None:
        self.records = {id(module): Record.of(name, module) for name, module in targets}
        self.order = [self.records[id(module)] for _, module in targets]
        self.state_storages: StorageMap[None] = StorageMap()
        self.excluded: StorageMap[None] = StorageMap()
        self.base = Tally(self.excluded)
        self._ledger = InputLedger(self.excluded, self.base, self.order)
        self.stack: List[Call] = []
        self._positions = 0  # outermost candidate calls so far
        # The last outermost call's output, held weakly: the step keeps it alive only as
        # long as the model's forward does.
        self._last_output: Optional[Tuple[Record, "weakref.ref[torch.Tensor]"]] = None
        self._bar = bar
        self._seen: set = set()

    def exclude(self, tensor: torch.Tensor, *, state: bool = False) -> None:
        """A tensor there before the step (a model input; with ``state``, a parameter or
        buffer): its storages never count."""
        for storage in tensor_storages(tensor):
            if state:
                self.state_storages.setdefault(storage, None)
            self.excluded.setdefault(storage, None)

    def gathered(self, module: nn.Module) -> None:
        """``module`` is called: its parameters and buffers as they are now (an FSDP2
        unit's as gathered for the call) are state, never counted (see :meth:`exclude`)."""
        for tensor in [*module.parameters(), *module.buffers()]:
            self.exclude(tensor, state=True)

    def base_saved(self, tensor: torch.Tensor) -> None:
        """A tensor the forward saves outside every region: kept by a candidate called
        outside any region (the model itself, as a candidate), else by the base."""
        self.saved(tensor)
        if not self.stack:
            self.base.add_tensors((tensor,))

    def begin(self, record: Record, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Call]:
        record.depth += 1
        if record.depth > 1:
            return None  # inside a call of itself: measured as part of the outer call
        # A module's parameters and buffers as it is called (FSDP2 gathers them just
        # before): its state, never an activation it keeps.
        self.gathered(record.module)
        inputs = tensors((args, kwargs))
        input_storages = StorageMap.of(inputs)
        tally = Tally(self.excluded, inputs=input_storages)
        frame = Call(
            record, bool(self.stack), args, kwargs, inputs, tally,
            Tally(self.excluded.union(input_storages)), OpRecorder(tally), time.perf_counter(),
        )
        self.stack.append(frame)
        if self._bar is not None and id(record) not in self._seen:
            self._seen.add(id(record))
            self._bar.update()
        return frame

    def saved(self, tensor: torch.Tensor) -> None:
        """A tensor an outermost region saves: kept by every call open."""
        for open_call in self.stack:
            open_call.tally.add_tensors((tensor,))

    def end(self, frame: Call, output: Any) -> None:
        """The forward of ``frame``'s call has returned ``output``: its costs added to its
        record, and the frame released (see :meth:`Call.release`)."""
        try:
            self._end(frame, output)
        finally:
            frame.release()

    def _end(self, frame: Call, output: Any) -> None:
        record = frame.record
        if frame in self.stack:
            self.stack.remove(frame)
        record.depth -= 1
        outputs = tensors(output)
        tally = frame.tally
        ops = frame.ops.ops()
        record.add(
            calls=1,
            output_bytes=Tally(self.state_storages).add_tensors(outputs).bytes,
            kept_bytes=tally.bytes,
            created_bytes=frame.ops.created_bytes,
            flops=frame.ops.flops,
            policy_saved_bytes=frame.policy_tally.bytes,
            policy_saved_kept_bytes=frame.policy_tally.shared_bytes(tally),
            forward_ops=len(ops),
        )
        record.most(call_kept_bytes=tally.bytes)
        record.ops = merge_calls(record.ops, ops, first=record.cost.calls == 1)
        record.forward_seconds += time.perf_counter() - frame.started
        if frame.nested:
            call_inputs = Tally(self.excluded).add_tensors(frame.inputs).bytes
            record.add(input_bytes=call_inputs)
            record.most(call_input_bytes=call_inputs)
            return
        # Inputs the call saves itself stay alive in a plain forward too, as the base's.
        saved = [t for t in frame.inputs if tally.input_hits.holds(t)]
        self._ledger.add(record, frame.inputs, saved, self._positions)
        self._note_join(record, frame.args, frame.kwargs, saved)
        self.base.add_tensors(saved)
        # Backward reaches this call once everything saved after it is freed.
        record.put(base_before_bytes=self.base.bytes, position=self._positions)
        if record.cost.first_position < 0:
            record.put(first_position=self._positions)
        self._positions += 1
        record.outer_kept += tally.bytes
        for tensor in outputs:
            if tally.holds(tensor):
                self._hand_over(tensor, record)
        self._last_output = (record, weakref.ref(output)) if isinstance(output, torch.Tensor) else None

    def _note_join(self, record: Record, args: Any, kwargs: Any, saved: List[torch.Tensor]) -> None:
        """Whether this call continues a chain: its only input is the output the previous
        candidate call handed to the model's forward; if anything after it saves that
        input as well, a segment through both would not free it."""
        previous, self._last_output = self._last_output, None
        joins = bool(
            previous is not None
            and record.cost.calls == 1
            and previous[0].cost.calls == 1
            and not kwargs
            and len(args) == 1
            and args[0] is previous[1]()
        )
        record.put(joins_previous=joins)
        if not joins:
            return
        record.joined = previous[0]  # type: ignore[index]

        def seen_again() -> None:
            record.put(joins_previous=False)

        for storage in (s for tensor in saved for s in tensor_storages(tensor)):
            self.base.watched[storage] = seen_again

    def _hand_over(self, output: torch.Tensor, record: Record) -> None:
        """An output the call saves is in its kept bytes. If what follows saves it too,
        checkpointing the module does not free it: counted in the base, handed over."""

        def claim(nbytes: int) -> None:
            record.add(handed_over_bytes=nbytes)
            record.outer_kept -= nbytes

        for storage in tensor_storages(output):
            self.base.claims.setdefault(storage, claim)

    def recomputed(self, record: Record, window: Window) -> None:
        cost = record.cost
        record.put(
            forward_moments=highest_each(cost.forward_moments, window.moments),
            forward_peak_bytes=max(cost.forward_peak_bytes, window.peak),
        )
        # The meter's own cost per operator taken off: the recomputation as it runs unmetered.
        record.recompute_seconds += max(0.1 * window.seconds, window.seconds - window.ops * dispatch_cost())
        record.recomputed += 1
        if self._bar is not None:
            self._bar.update()

    def finish_joins(self) -> None:
        """A chain needs both ends called once: a later call may have shown otherwise."""
        for record in self.order:
            joined = record.joined
            if record.cost.joins_previous and (record.cost.calls != 1 or joined is None or joined.cost.calls != 1):
                record.put(joins_previous=False)

    def cost(self, record: Record, *, timed: bool, policy: bool) -> ModuleCost:
        """A finished record's cost, with its times."""
        cost = record.cost
        # A forward measured: counted and recorded operator by operator.
        forward = max(0.1 * record.forward_seconds, record.forward_seconds - cost.forward_ops * recording_cost())
        recompute = record.recompute_seconds if record.recomputed else forward
        if not timed or not cost.calls:
            forward = recompute = 0.0
        ops = tuple(record.ops or ())
        return dataclasses.replace(
            cost,
            called=cost.calls > 0,
            forward_time=recompute if not policy else forward,
            recompute_time=recompute if policy else None,
            ops=_timed_ops(ops, recompute if timed else 0.0),
            selective_overhead=selective_cost() * len(ops) if timed else 0.0,
        )


_SPREAD = 0.2
"""The share of a candidate's time spread evenly over its operators (each one's dispatch
and launch); the rest goes by each one's work."""


def _timed_ops(ops: Tuple[Any, ...], seconds: float) -> Tuple[Any, ...]:
    """Each operator's share of the candidate's time: an even part, and a part by its work
    (FLOPs and bytes made)."""
    if not ops:
        return ops
    work = [op.flops + 8 * op.bytes for op in ops]
    total = sum(work)
    even = seconds * (_SPREAD if total > 0 else 1.0) / len(ops)
    by_work = seconds * (1 - _SPREAD)
    return tuple(
        dataclasses.replace(op, time=even + (by_work * w / total if total > 0 else 0.0))
        for op, w in zip(ops, work)
    )


class StepRecorder:
    """Learns a profile from one step (see the module).

    Args:
        model: The model whose step is measured.
        targets: ``(qualified name, module)`` of every candidate, in model order; those
            nested in another are measured inside it, through forward hooks.
        device: Where the step allocates.
        save_policy: The selective tier's policy, if the candidates run under it.
        timed: Whether to keep times (a step run for its bytes alone keeps none).
        bar: A progress bar to move as candidates are measured.
        watch_base: Whether to follow what the forward saves outside the candidates
            through saved-tensor hooks of the model's forward (see ``begin``).
    """

    def __init__(
        self,
        model: nn.Module,
        targets: Sequence[Tuple[str, nn.Module]],
        device: torch.device,
        *,
        save_policy: Optional[SavePolicy] = None,
        timed: bool = True,
        bar: Optional[ProgressBar] = None,
        watch_base: bool = True,
    ) -> None:
        self.model = model
        self.phases = PhaseMeter(device)
        self.failed: Optional[str] = None
        self._policy = save_policy
        self._timed = timed
        self._watch_base = watch_base
        self._book = CallBook(targets, bar)
        names = [name for name, _ in targets]
        self.outermost = [
            (name, module) for name, module in targets
            if name and not any(name.startswith(other + ".") for other in names if other)
        ]
        outer = {id(module) for _, module in self.outermost}
        self._nested = [(name, module) for name, module in targets if id(module) not in outer]
        self._handles: List[Any] = []
        self._windows: Dict[int, List[Any]] = {}  # per nested module: windows open in recomputation
        self._base_hooks: Any = None
        self._outer_hooks: Any = None
        self._accumulated: List[Tuple[int, int]] = []  # (phase index, bytes) of grads that existed
        self.done = False

    # ------------------------------------------------------------------ the step

    def begin(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Start measuring, just before the model's forward runs on these inputs.

        Parameters, buffers and the inputs were there before the step: their storages
        never count. What the forward saves outside the candidates is seen through
        saved-tensor hooks pushed here and popped by :meth:`forward_done`; they hand each
        tensor on unchanged (to the hooks already in force, if any)."""
        model = self.model
        self._book.gathered(model)
        for tensor in tensors((args, kwargs)):
            self._book.exclude(tensor)
        for name, module in self._nested:
            self._handles.append(module.register_forward_pre_hook(self._nested_pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._nested_post, always_call=True))
        for unit in _torch_private.fsdp2_units(model):
            # After FSDP2's own pre-hook (put first), which gathers the unit's parameters.
            self._handles.append(unit.register_forward_pre_hook(self._unit_gathered))
        for param in model.parameters():
            if param.requires_grad and param.grad is not None:
                # Accumulating into an existing gradient: a step from fresh gradients
                # would hold it from here on (see ``_grown``).
                self._handles.append(param.register_post_accumulate_grad_hook(self._grad_accumulated))
        self.phases.start()
        if self._watch_base and _torch_private.saved_tensors_hooks_enabled():
            self._outer_hooks = _torch_private.top_saved_tensors_hooks()
            self._base_hooks = torch.autograd.graph.saved_tensors_hooks(self._base_pack, self._base_unpack)
            self._base_hooks.__enter__()

    def forward_done(self, output: Any = None, *, follow: bool = True) -> None:
        """The model's forward returned ``output`` (or raised): stop following what it
        saves, leave the caller's mode stack and, with ``follow``, count the backward from
        the output's tensors that need grad (see ``StepSpan.follow``)."""
        hooks, self._base_hooks = self._base_hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        span = self.phases.span
        if span is None:
            return
        span.leave()
        if follow and output is not None and self.failed is None:
            span.follow([t for t in tensors(output) if t.requires_grad])

    def finish(self) -> Optional[ModelProfile]:
        """The step's backward has ended: the profile it gives, or None if the recording
        failed."""
        self._stop()
        if self.failed is not None:
            return None
        try:
            return self._profile()
        except Exception as error:  # noqa: BLE001 - a recording must never break the step
            self._fail(error)
            return None

    def abandon(self, why: str) -> None:
        """End without a profile (the step never finished, or failed); nothing once
        finished."""
        if self.done:
            return
        if self.failed is None:
            self.failed = why
        self._stop()

    # ------------------------------------------------------------------ candidates' regions

    def region(
        self,
        module: nn.Module,
        call: Callable[..., Any],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        run: Callable[[Callable[..., Any]], Any],
    ) -> Any:
        """One call of an outermost candidate: ``run(fn)`` runs ``fn`` (``call``, watched)
        as the checkpointed region, with ``args`` and ``kwargs``."""
        record = self._book.records.get(id(module))
        if record is None or self.failed is not None or is_recomputing() or self.phases.finished:
            return run(call)
        self.phases.cut(f"forward:{record.name}")
        frame = self._guarded(self._book.begin, record, args, kwargs)
        observer = None if frame is None else self._saved
        with observe_saved(observer, self.phases.adopt):
            output = run(functools.partial(self._run_watched, record, frame, call))
        if frame is not None:
            self._guarded(self._book.end, frame, output)
        self.phases.cut(f"after:{record.name}")
        return output

    def _run_watched(self, record: Record, frame: Optional[Call], call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The region's function: in the forward, the candidate's operators recorded; in
        the recomputation, its phase cut and its working set followed."""
        if is_recomputing():
            if self.failed is not None or self.phases.finished:
                return call(*args, **kwargs)
            self.phases.cut(f"recompute:{record.name}")
            window = Window(self.phases.span)
            try:
                # A forward inside a node of the backward: counted by operators, as the
                # forward was (the backward itself runs with no dispatch mode).
                with self.phases.span.counting():
                    return call(*args, **kwargs)
            finally:
                self._guarded(self._book.recomputed, record, window.close())
                self.phases.cut(f"backward:{record.name}")
        if frame is None:
            return call(*args, **kwargs)
        with self._recording(frame):
            return call(*args, **kwargs)

    def _recording(self, frame: Call) -> Any:
        """The meter tells the call's recorders each operator of its forward."""
        return self.phases.recording(frame.ops, policy_listener(self._policy, frame.policy_tally))

    def _nested_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        record = self._book.records[id(module)]
        if self.failed is not None or self.phases.finished:
            return None
        if is_recomputing():
            self._windows.setdefault(id(module), []).append(Window(self.phases.span))
            return None
        frame = self._guarded(self._book.begin, record, tuple(args), dict(kwargs))
        if frame is not None:
            frame.listening = self._recording(frame)
            frame.listening.__enter__()
        return None

    def _nested_post(self, module: nn.Module, args: Any, output: Any) -> None:
        record = self._book.records[id(module)]
        windows = self._windows.get(id(module))
        if is_recomputing():
            if windows:
                self._guarded(self._book.recomputed, record, windows.pop().close())
            return None
        frame = next((f for f in reversed(self._book.stack) if f.record is record), None)
        if frame is None:
            return None
        if frame.listening is not None:
            frame.listening.__exit__(None, None, None)
        self._guarded(self._book.end, frame, output)
        return None

    # ------------------------------------------------------------------ bookkeeping

    def _guarded(self, work: Callable[..., Any], *args: Any) -> Any:
        if self.failed is not None:
            return None
        try:
            return work(*args)
        except Exception as error:  # noqa: BLE001 - a recording must never break the step
            self._fail(error)
            return None

    def _fail(self, error: BaseException) -> None:
        self.failed = f"{type(error).__name__}: {error}"
        note(f"ckptwrap stopped measuring a step of {type(self.model).__name__}: {self.failed}")

    def _saved(self, tensor: torch.Tensor) -> None:
        """A tensor an outermost region saves."""
        self._guarded(self._book.saved, tensor)

    def _base_pack(self, tensor: torch.Tensor) -> Any:
        """Note what the forward saves outside the candidates, and hand it on: packed by
        the hooks in force, if any, else detached (autograd gives it back its ``grad_fn``
        when it unpacks it). Kept as it is, an operator's own output saved by its node
        (``exp`` saves its result) would hold that node through its ``grad_fn``: a cycle
        through C++ that no garbage collection breaks, freed only if the backward runs the
        node. An output the loss never reads then outlived the step, unlike unmetered
        (Wan's VAE: its posterior's ``std`` and ``var``, and through them the moments they
        came from: 6,144 bytes)."""
        # While a region saves its own inputs on entry, it is that region keeping them.
        if self.failed is None and saved_observer() is None and not is_recomputing():
            self._guarded(self._book.base_saved, tensor)
        outer = self._outer_hooks
        return tensor.detach() if outer is None else outer[0](tensor)

    def _base_unpack(self, packed: Any) -> torch.Tensor:
        outer = self._outer_hooks
        return packed if outer is None else outer[1](packed)

    def _unit_gathered(self, module: nn.Module, args: Any) -> None:
        """An FSDP2 unit is called, its parameters gathered by FSDP2 just before: they are
        its state, as a candidate's are (``CallBook.begin``), never activations.

        Its operators save them (a linear layer's weight, for its input's gradient), and
        what the forward saves outside the candidates is counted at the bytes it has
        when saved, as held to the backward. But FSDP2 frees a unit's gathered parameters
        after its forward (``resize_(0)`` of their storages) and gathers them again for
        its backward: with no candidate around a unit, every unit's gathered parameters
        were counted as activations held at once. Under ``none``, whose peak is the
        larger of that count and the step's measured one, a rank of Llama-8B sharded per
        layer over 8 ranks read 41,553 MiB at 32 layers and 4,096 tokens where the step
        holds 34,669 (all 32 layers' 416 MiB counted; at 16 layers +1%, the logits and
        their gradient outweighing most of them). The step itself counts them while they
        are gathered, as the counter follows the resizes."""
        self._guarded(self._book.gathered, module)

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        self._accumulated.append((self.phases.phase, param.nbytes))

    def _stop(self) -> None:
        """Stop following the step: the meter finished, every hook removed."""
        self.done = True
        self.forward_done(follow=False)
        self.phases.finish()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for windows in self._windows.values():
            for window in windows:
                window.close()
        self._windows.clear()

    # ------------------------------------------------------------------ the profile

    def _profile(self) -> ModelProfile:
        book = self._book
        book.finish_joins()
        phases = _grown(self.phases.phases, self._accumulated)
        step = by_phase(phases, self.phases.at_allocator)
        if not self._timed:
            step = dataclasses.replace(step, seconds={})
        kept = sum(record.outer_kept for record in book.order)
        policy = self._policy is not None
        return ModelProfile(
            modules=tuple(book.cost(record, timed=self._timed, policy=policy) for record in book.order),
            total_activation_bytes=book.base.bytes + kept,
            base_bytes=book.base.bytes,
            step=step,
        )


def _grown(phases: List[Any], accumulated: List[Tuple[int, int]]) -> List[Any]:
    """Phases as a step from fresh gradients would have held them: a gradient that
    existed before the step was accumulated into, where a fresh step would have kept the
    new one from then on."""
    if not accumulated:
        return phases
    grown = []
    extra = 0
    for index, phase in enumerate(phases):
        extra += sum(nbytes for at, nbytes in accumulated if at == index)
        if extra:
            phase = phase._replace(peak=phase.peak + extra, moments=tuple(m + extra for m in phase.moments))
        grown.append(phase)
    return grown


def measure_inputs(
    model: nn.Module,
    targets: Sequence[Tuple[str, nn.Module]],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    *,
    run_region: RegionRunner,
    loss_fn: Optional[Callable[[Any], Any]] = None,
    save_policy: Optional[SavePolicy] = None,
    preserve_rng_state: bool = True,
    timed: bool = True,
    bar: Optional[ProgressBar] = None,
    train: bool = True,
    rates: Any = None,
    fake: bool = False,
) -> ModelProfile:
    """One step on given inputs, measured (see ``wrap``'s ``profile_modules``); the model
    is left as it was, and :func:`is_measuring` is true while it runs. Every outermost
    candidate runs as a checkpointed region through ``run_region(module, call, args,
    kwargs, options)``, the marking layer's runner, so a measured region runs as a plan's
    does (statistics kept, buffers replayed, caches copied), told to the recorder. With
    ``train``, a model in eval mode is measured in train mode (dropout on), as it will
    train. A model on the meta device or made of fake tensors, or any with ``fake``, runs
    on fake tensors, its times priced at ``rates`` (``_unreal``).

    Raises:
        CheckpointConfigError: If the recording failed (it says why), or a step on fake
            tensors needs a tensor's values.
    """
    options = dict(
        loss_fn=loss_fn, save_policy=save_policy, preserve_rng_state=preserve_rng_state, bar=bar, train=train,
        run_region=run_region,
    )
    why = unreal(model, args, kwargs) or ("planned on fake tensors, as asked" if fake else None)
    token = _MEASURING.set(True)
    try:
        if why is not None:
            return measure_unreal(
                lambda *step: _measure(*step, targets, timed=False, **options), model, args, kwargs, why, rates,
            )
        return _measure(model, args, kwargs, targets, timed=timed, **options)
    finally:
        _MEASURING.reset(token)


def _measure(
    model: nn.Module,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    targets: Sequence[Tuple[str, nn.Module]],
    *,
    loss_fn: Optional[Callable[[Any], Any]],
    save_policy: Optional[SavePolicy],
    preserve_rng_state: bool,
    timed: bool,
    bar: Optional[ProgressBar],
    train: bool,
    run_region: RegionRunner,
) -> ModelProfile:
    device = step_device(model, args, kwargs)
    recorder = StepRecorder(model, targets, device, save_policy=save_policy, timed=timed, bar=bar)
    state = _ModelState(model)
    grad_mode = torch.is_grad_enabled()
    context_fn = None
    if save_policy is not None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, save_policy)
    options = CheckpointOptions(preserve_rng_state=preserve_rng_state, context_fn=context_fn)
    originals: List[Tuple[nn.Module, Any]] = []
    try:
        if train and not model.training:
            model.train()
        for _, module in recorder.outermost:
            originals.append((module, module.__dict__.get("forward")))
            module.forward = _Region(recorder, module, options, run_region)
        with _generators_kept(device), _collector_held():
            call_args, call_kwargs = fresh_caches(args, kwargs)
            torch.set_grad_enabled(True)
            recorder.begin(call_args, call_kwargs)
            output = None
            try:
                output = model(*call_args, **call_kwargs)
            finally:
                recorder.forward_done(output, follow=False)
            # Without a loss function the output stays alive through the backward, as in
            # the loop people write around a model that returns its loss (``out =
            # model(**batch); out.loss.backward()``): logits and caches count. With one,
            # as in ``loss_fn(model(x)).backward()``, only what the loss keeps does.
            with recorder.phases.span.counting():
                roots, grads = _loss(output if loss_fn is None else loss_fn(output))
            if loss_fn is not None:
                del output
            recorder.phases.span.follow(roots)
            wanted = [p for p in model.parameters() if p.requires_grad]
            # A model sharded by FSDP2 backpropagates into fresh .grad fields, FSDP2's to
            # reduce-scatter (``_backward_keeping_grads``), with the counter on the stack
            # for the whole backward, as under modes already (a step on fake tensors): what
            # FSDP2's hooks between nodes allocate and free counts (a layer's all-gather in
            # a tensor hook, before any node's pre-hook; its reduce-scatter after), and so
            # do the resizes that free gathered storages. Followed node by node, a real
            # step missed the all-gathers (7-33% under FSDPMemTracker on two gloo ranks,
            # ``benchmarks/fsdp2_ranks.py``; now within 0.7%), and took a gathered gradient
            # FSDP2 frees in its hook as held to the end.
            under = _torch_private.dispatch_modes_active()
            sharded = _torch_private.fsdp2_params(model)
            if roots and wanted and not sharded and reaches_reentrant(roots):
                _backward_keeping_grads(roots, grads, wanted)
            elif roots and wanted:
                # Returned, not accumulated: the caller's .grad fields stay as they were
                # (but for FSDP2's, above).
                with recorder.phases.span.counting() if under or sharded else contextlib.nullcontext():
                    if sharded:
                        _backward_keeping_grads(roots, grads, wanted, sharded)
                    else:
                        torch.autograd.grad(roots, wanted, grads, allow_unused=True)
            del roots, grads
            profile = recorder.finish()
    finally:
        recorder.abandon("the step raised")
        for module, forward in originals:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
        torch.set_grad_enabled(grad_mode)
        state.restore()
    if profile is None:
        raise CheckpointConfigError(
            f"measuring {type(model).__name__} on the given inputs failed: {recorder.failed}"
        )
    return profile


class _Region:
    """An outermost candidate's forward while a step on given inputs is measured: a
    checkpointed region run by the marking layer's runner, as a plan's regions run, that
    tells the recorder what it does."""

    copies_caches = True
    """It runs on copies of the caches it is given, as a checkpointed forward does
    (``wrap``'s ``CacheWritesOff`` leaves it to them)."""

    def __init__(self, recorder: StepRecorder, module: nn.Module, options: CheckpointOptions, run_region: RegionRunner) -> None:
        self.recorder, self.module, self.options, self.run_region = recorder, module, options, run_region
        self.previous = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, options = self.module, self.options
        call = self.previous or functools.partial(type(module).forward, module)
        return self.recorder.region(
            module, call, args, kwargs, lambda watched: self.run_region(module, watched, args, kwargs, options)
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


def _backward_keeping_grads(
    roots: List[torch.Tensor],
    grads: List[Optional[torch.Tensor]],
    parameters: List[torch.Tensor],
    sharded: Sequence[Any] = (),
) -> None:
    """Backward from ``roots`` accumulated into fresh ``.grad`` fields, as a step from
    zeroed gradients does, then put back as the caller had them.

    Two steps are measured so. One through a re-entrant region (a checkpoint inside the
    model with ``use_reentrant=True``, which ``torch.autograd.grad`` cannot pass): a
    re-entrant region's own parameters are reached only by the backward it runs inside,
    so every parameter is kept besides the leaves in the graph. And one of a model
    sharded by FSDP2 (``sharded``: its ``FSDPParam``s, ``_torch_private.fsdp2_params``),
    whose backward is FSDP2's as much as autograd's: a layer's gradients are computed into
    the ``.grad`` of its gathered parameters (the graph's leaves, never the model's
    registered parameters but for the root's, gathered through the step), and the layer's
    post-backward hook copies them into a reduce-scatter input, reduce-scatters that into
    each sharded parameter's ``.grad`` and frees the gathered ones. Asked for the
    registered parameters' gradients alone, ``torch.autograd.grad`` computed none of a
    layer's, so none of that ran: the sharded gradients of the layers done and the
    reduce-scatter input FSDP2 keeps in flight were missing from the end of the backward
    (2.2% of a rank's peak at 2 ranks, Llama of width 512, 512 tokens). Here the backward is
    FSDP2's, as in training (the counter following every storage its hooks make and
    free, on fake tensors and real: see ``_measure``), and every gradient it leaves is
    put back: each sharded parameter's ``.grad`` (FSDP2 accumulates into one it finds,
    so it is cleared first, as ``zero_grad`` would), each gathered one's (kept without a
    sync) and any unreduced gradient FSDP2 accumulates of its own."""
    held = [
        tensor
        for fsdp_param in sharded
        for tensor in (fsdp_param.sharded_param, getattr(fsdp_param, "_unsharded_param", None))
        if isinstance(tensor, torch.Tensor)
    ]
    # With the leaves whose ``.grad`` a backward from ``roots`` accumulates into.
    in_graph = (getattr(node, "variable", None) for node in graph_nodes(roots))
    leaves = list({id(t): t for t in [*parameters, *held, *in_graph] if isinstance(t, torch.Tensor)}.values())
    kept = [(leaf, leaf.grad) for leaf in leaves]
    unreduced = [
        (fsdp_param, fsdp_param.unsharded_accumulated_grad)
        for fsdp_param in sharded
        if hasattr(fsdp_param, "unsharded_accumulated_grad")
    ]
    for leaf in leaves:
        leaf.grad = None
    for fsdp_param, _ in unreduced:
        fsdp_param.unsharded_accumulated_grad = None
    try:
        torch.autograd.backward(roots, grads)
    finally:
        for leaf, grad in kept:
            leaf.grad = grad
        for fsdp_param, grad in unreduced:
            fsdp_param.unsharded_accumulated_grad = grad


def resolve_targets(model: nn.Module, names: Sequence[str]) -> List[Tuple[str, nn.Module]]:
    """Check ``names`` against the model and return them, without repeats, in model order."""
    if isinstance(names, str):
        raise CheckpointConfigError(
            f"names must be a sequence of qualified module names, got the string {names!r}; "
            f"pass [{names!r}] to profile one module"
        )
    names = list(names)
    odd = [name for name in names if not isinstance(name, str)]
    if odd:
        raise CheckpointConfigError(
            f"names must be qualified module names (strings), got {odd[0]!r} among them"
        )
    modules = dict(model.named_modules())
    wanted = list(dict.fromkeys(names))
    unknown = [name for name in wanted if name not in modules]
    if unknown:
        raise CheckpointConfigError(_unknown_names_message(model, unknown, list(modules)))
    order = {name: index for index, name in enumerate(modules)}
    return [(name, modules[name]) for name in sorted(wanted, key=order.__getitem__)]


def _unknown_names_message(model: nn.Module, unknown: List[str], valid: List[str]) -> str:
    shown = ", ".join(repr(name) for name in unknown[:5])
    if len(unknown) > 5:
        shown += f" and {len(unknown) - 5} more"
    close: List[str] = []
    for name in unknown[:3]:
        close += difflib.get_close_matches(name, valid, n=3)
    if close:
        hint = "did you mean " + ", ".join(repr(name) for name in dict.fromkeys(close)) + "?"
    else:
        hint = "valid names include " + ", ".join(repr(name) for name in valid[1:6] or valid)
    return (
        f"profile_modules got module names not in {type(model).__name__}.named_modules(): "
        f"{shown}; {hint} ({len(valid)} modules in all, '' is the model itself)"
    )


class _ModelState:
    """Training flags and buffers of every submodule, to undo what profiling forwards change
    (BatchNorm running statistics, for one)."""

    def __init__(self, model: nn.Module) -> None:
        modules = list(model.modules())
        self._training = [(module, module.training) for module in modules]
        with torch.no_grad():
            self._buffers = [
                (module, name, buffer, buffer.clone())
                for module in modules
                for name, buffer in module._buffers.items()
                if buffer is not None
            ]

    def restore(self) -> None:
        for module, training in self._training:
            module.training = training
        with torch.no_grad():
            for module, name, buffer, saved in self._buffers:
                module._buffers[name] = buffer
                buffer.copy_(saved)


@contextlib.contextmanager
def _collector_held() -> Any:
    """Python's cyclic collector held off for the block, then as it was. The recorder's
    bookkeeping (objects per operator that live to the step's end) set off full
    collections of the whole process: 0.30 s inside one plan on a GPU whose step takes
    0.04; on the CPU the worst of ten plans of a small GPT-2 took 325 ms against 161 held,
    and no full collection came at all, as the bookkeeping is freed by reference counting
    when the step ends. (Only here, where the block is ours: a lazy budget's measured
    step spans the caller's forward and backward, and one never finished would hold the
    collector off for good.)"""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _generators_kept(device: torch.device) -> Any:
    """A block after which the CPU generator, and ``device``'s if it is an accelerator's,
    are as they were before it: a measured step draws nothing from the caller's stream."""
    module = None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)
    if module is None or not hasattr(module, "get_rng_state"):
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else module.current_device()
    return torch.random.fork_rng(devices=[index], device_type=device.type)


# Below this many items a measurement is quick enough that a bar is only noise.
_MIN_ITEMS = 20
_WIDTH = 28
# Redrawing on every step would slow down profiles of models with thousands of modules.
_MIN_INTERVAL = 0.1


def should_show(progress: Optional[bool], items: int, *, stream: Optional[TextIO] = None) -> bool:
    """Whether to draw a bar: as forced by ``progress``, else on a terminal for many items.

    Args:
        progress: ``True`` or ``False`` to force the bar on or off; ``None`` to decide.
        items: How many items the work goes through.
        stream: Where the bar would be drawn; standard error by default.

    Returns:
        ``progress`` if it is not ``None``; otherwise whether there are more than
        about twenty items and ``stream`` is a terminal.
    """
    if progress is not None:
        return bool(progress)
    if items <= _MIN_ITEMS:
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed or detached stream
        return False


class ProgressBar:
    """A one-line bar that is redrawn in place, e.g. ``profiling |#####     | 12/40 3.1s``.

    A disabled bar does nothing, so callers need no ``if`` around each update.

    Args:
        total: The number of steps that make a full bar.
        label: Text shown before the bar.
        enabled: Whether to draw at all, on standard error (looked up now, not at import).
    """

    def __init__(self, total: int, *, label: str, enabled: bool) -> None:
        self._total = max(int(total), 0)
        self._label = label
        self._enabled = enabled
        self._stream = sys.stderr
        self._done = 0
        self._start = time.perf_counter()
        self._last_draw = float("-inf")
        self._drawn: Optional[str] = None  # the line on screen now

    def update(self) -> None:
        """Advance by one step (never past the total) and redraw if it is time to."""
        self._done = min(self._done + 1, self._total)
        if not self._enabled:
            return
        now = time.perf_counter()
        if self._done >= self._total or now - self._last_draw >= _MIN_INTERVAL:
            self._draw(now)

    def close(self) -> None:
        """Finish the line, so that later output starts on a fresh one."""
        if self._enabled and self._drawn is not None:
            self._draw(time.perf_counter())
            self._stream.write("\n")
            self._stream.flush()
        self._enabled = False

    def _draw(self, now: float) -> None:
        filled = _WIDTH * self._done // self._total if self._total else _WIDTH
        bar = "#" * filled + " " * (_WIDTH - filled)
        line = f"{self._label} |{bar}| {self._done}/{self._total} {now - self._start:.1f}s"
        if line == self._drawn:
            return
        # Blank out what is left of a longer line drawn before (a longer label, say).
        padding = " " * max(len(self._drawn or "") - len(line), 0)
        self._stream.write(f"\r{line}{padding}")
        self._stream.flush()
        self._last_draw = now
        self._drawn = line

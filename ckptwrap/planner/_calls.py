"""The account a measured step keeps of its candidates' calls: per call, what it takes,
saves and returns; across calls, the storages outside every candidate (the base), which
inputs are shared, which calls chain; and, at the end, each candidate's ``ModuleCost``.

Fed by the step recorder (``_recorder``), which sees the calls as they happen.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..measure import StorageMap, Tally, tensor_storages, tensors
from ._module_costs import ModuleCost
from ._ops import OpRecorder, merge_calls
from ._phases import Window
from ._progress import ProgressBar
from ._records import InputLedger, Record, highest_each
from ._timing import dispatch_cost, selective_cost

__all__ = ["Call", "CallBook"]


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
    policy_mode: Any = None

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
        self.records = {id(module): Record(name, module, kind=type(module).__name__) for name, module in targets}
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
            if state and storage not in self.state_storages:
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
        for open_call in self.stack:
            open_call.tally.add_tensors((tensor,))
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
        record.calls += 1
        record.output_bytes += Tally(self.state_storages).add_tensors(outputs).bytes
        record.kept_bytes += tally.bytes
        record.call_kept_bytes = max(record.call_kept_bytes, tally.bytes)
        record.created_bytes += frame.ops.created_bytes
        record.flops += frame.ops.flops
        record.policy_saved_bytes += frame.policy_tally.bytes
        record.policy_saved_kept_bytes += frame.policy_tally.shared_bytes(tally)
        ops = frame.ops.ops()
        record.ops = merge_calls(record.ops, ops, first=record.calls == 1)
        record.forward_seconds += time.perf_counter() - frame.started
        record.forward_ops += len(ops)
        if frame.nested:
            call_inputs = Tally(self.excluded).add_tensors(frame.inputs).bytes
            record.input_bytes += call_inputs
            record.call_input_bytes = max(record.call_input_bytes, call_inputs)
            return
        # Inputs the call saves itself stay alive in a plain forward too, as the base's.
        saved = [t for t in frame.inputs if tally.input_hits.holds(t)]
        self._ledger.add(record, frame.inputs, saved, self._positions)
        self._note_join(record, frame.args, frame.kwargs, saved)
        self.base.add_tensors(saved)
        # Backward reaches this call once everything saved after it is freed.
        record.base_before_bytes, record.position = self.base.bytes, self._positions
        if record.first_position < 0:
            record.first_position = self._positions
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
        record.joins_previous = bool(
            previous is not None
            and record.calls == 1
            and previous[0].calls == 1
            and not kwargs
            and len(args) == 1
            and args[0] is previous[1]()
        )
        if not record.joins_previous:
            return
        record.joined = previous[0]  # type: ignore[index]

        def seen_again() -> None:
            record.joins_previous = False

        for storage in (s for tensor in saved for s in tensor_storages(tensor)):
            self.base.watched[storage] = seen_again

    def _hand_over(self, output: torch.Tensor, record: Record) -> None:
        """An output the call saves is in its kept bytes. If what follows saves it too,
        checkpointing the module does not free it: counted in the base, handed over."""

        def claim(nbytes: int) -> None:
            record.handed_over_bytes += nbytes
            record.outer_kept -= nbytes

        for storage in tensor_storages(output):
            self.base.claims.setdefault(storage, claim)

    def recomputed(self, record: Record, window: Window) -> None:
        record.forward_moments = highest_each(record.forward_moments, window.moments)
        record.forward_peak_bytes = max(record.forward_peak_bytes, window.peak)
        # The meter's own cost per operator taken off: the recomputation as it runs unmetered.
        record.recompute_seconds += max(0.1 * window.seconds, window.seconds - window.ops * dispatch_cost())
        record.recomputed += 1
        if self._bar is not None:
            self._bar.update()

    def finish_joins(self) -> None:
        """A chain needs both ends called once: a later call may have shown otherwise."""
        for record in self.order:
            joined = record.joined
            record.joins_previous = (
                record.joins_previous and record.calls == 1 and joined is not None and joined.calls == 1
            )

    def cost(self, record: Record, *, timed: bool, policy: bool) -> ModuleCost:
        """The frozen cost of a finished record (they share their fields' names)."""
        values = {
            field.name: getattr(record, field.name)
            for field in dataclasses.fields(ModuleCost)
            if hasattr(record, field.name)
        }
        # A forward measured inside two dispatch modes (the meter and the recorder).
        forward = max(0.1 * record.forward_seconds, record.forward_seconds - 2 * record.forward_ops * dispatch_cost())
        recompute = record.recompute_seconds if record.recomputed else forward
        if not timed or not record.calls:
            forward = recompute = 0.0
        ops = tuple(record.ops or ())
        values.update(
            called=record.calls > 0,
            forward_time=recompute if not policy else forward,
            recompute_time=recompute if policy else None,
            ops=_timed_ops(ops, recompute if timed else 0.0),
            selective_overhead=selective_cost() * len(ops) if timed else 0.0,
        )
        return ModuleCost(**values)



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

"""What each operator of one candidate call costs: the dispatch-level record that the
budget planner turns into selective levels (save some operators' outputs, recompute the
rest).

Operators are named as selective checkpointing names them: by overload packet and by
occurrence among the calls of that packet within one call of the module, skipping the
operators torch's selective checkpointing ignores, so a recorded ``(op, occurrence)`` is
the one a selective policy sees in a checkpointed call of the same module.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry

from ..measure import StorageMap, Tally, outputs_of, tensor_storages, tensors
from ..policy import draws_random

__all__ = ["merge_calls", "op_flops", "OpCost", "OpRecorder", "packet_name"]


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

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=None)
def packet_name(func: Any) -> str:
    """The name of an operator's overload packet: how profiler and selective policy name
    an operator, so that their numbering agrees."""
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "__name__", str(packet))


class _Counted(TorchDispatchMode):
    """Runs every operator, numbering each call per packet as selective checkpointing does."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never compiled: no wrapper around every operator

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self._counts: Dict[str, int] = defaultdict(int)

    def _number(self, func: Any) -> Tuple[str, int]:
        name = packet_name(func)
        occurrence = self._counts[name]
        self._counts[name] += 1
        return name, occurrence


class OpRecorder(_Counted):
    """Records the operators of one module call with autograd on: new output bytes, FLOPs,
    and, through ``tally`` (the saved-tensors tally of the same forward), what autograd saves.

    A storage is new if no tensor met so far (an operator's argument or output) had it:
    views and in-place results are not new. Outputs are never kept alive here, so the
    forward's memory is as it would be without the recorder.
    """

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self._tally = tally
        # Every storage met so far, with the entry of the operator that created it (None
        # for those the module was given).
        self._seen: StorageMap[Optional[List[Any]]] = StorageMap()
        self._ops: List[List[Any]] = []  # [name, occurrence, bytes, saved, flops, mutated, random]
        self.flops = 0
        """FLOPs of the operators recorded, as ``FlopCounterMode`` counts them."""
        self.created_bytes = 0
        """Bytes of the new storages the operators made, freed or not."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        name, occurrence = self._number(func)
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
                    self._tally.claims[storage] = _Saved(entry)
        self._ops.append(entry)
        return out

    def ops(self) -> List[OpCost]:
        """What was recorded, in call order."""
        return [OpCost(*entry[:5], mutated=entry[5], random=entry[6]) for entry in self._ops]


class _Saved:
    """A tally claim that marks an operator's entry as saved."""

    __slots__ = ("_entry",)

    def __init__(self, entry: List[Any]) -> None:
        self._entry = entry

    def __call__(self, nbytes: int) -> None:
        self._entry[3] = True


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
    no formula)."""
    counter = flop_registry.get(getattr(func, "overloadpacket", func))
    if counter is None:
        return 0
    return int(counter(*args, **kwargs, out_val=out))


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

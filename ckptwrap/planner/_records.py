"""What a measured step keeps per candidate while it runs: its :class:`Record` (the
fields of its ``ModuleCost``, added up call by call), and the ledger of which storages
are the inputs of which outermost calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..measure import StorageMap, Tally, tensor_storages
from ._ops import OpCost

__all__ = ["highest_each", "InputLedger", "Record"]

_NONE: StorageMap[None] = StorageMap()


@dataclasses.dataclass
class Record:
    """What the calls of one candidate have added up to so far: the fields of its
    ``ModuleCost`` (same names, same meaning), and what the passes need besides."""

    name: str
    module: nn.Module
    kind: str = ""
    calls: int = 0
    kept_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    flops: int = 0
    forward_time: float = 0.0
    self_saved_input_bytes: int = 0
    forward_peak_bytes: int = 0
    forward_moments: Tuple[int, ...] = ()
    call_kept_bytes: int = 0
    call_input_bytes: int = 0
    created_bytes: int = 0
    handed_over_bytes: int = 0
    joins_previous: bool = False
    base_before_bytes: Optional[int] = None
    position: int = -1
    first_position: int = -1
    policy_saved_bytes: int = 0
    policy_saved_kept_bytes: int = 0
    selective_overhead: float = 0.0
    recompute_time: float = 0.0  # with a save policy: the forward replaying the saved outputs
    ops: Optional[List[OpCost]] = None  # summed over its calls; None when they differ
    # What the measurement needs besides.
    outer_kept: int = 0  # kept bytes of calls not nested in another candidate's: the total
    joined: Optional["Record"] = None  # the record of the call it continues a chain from
    depth: int = 0  # > 1 while the module is inside a call of itself
    forward_seconds: float = 0.0  # its forwards, as metered
    forward_ops: int = 0  # operators its forwards ran
    recompute_seconds: float = 0.0  # its recomputations, the meter's cost taken off
    recomputed: int = 0  # how many of its calls were recomputed


class InputLedger:
    """Which input storages the outermost candidate calls took, counted once.

    An input that an earlier outermost call took too (an attention mask, or position
    embeddings, that every layer takes) is alive through the whole forward; held after
    it by an operator that saves it, it is counted once, in the base, from the first
    call that took it, and in no call's inputs. One no operator saves (a causal video
    convolution's feature cache, which every block takes and the next chunk replaces)
    is held after the forward only by checkpoints that took it: it stays in the first
    call's inputs until something saves it. Another call of the same module taking one
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
        counted = saved_bytes = 0
        for tensor in inputs:
            for storage in tensor_storages(tensor):
                if storage in self._excluded or storage in self._counted_by.get(id(record), _NONE):
                    continue
                self._counted_by.setdefault(id(record), StorageMap()).setdefault(storage, None)
                owner = self._owner.get(storage)
                if owner is None:
                    self._owner[storage] = (record, position)
                    counted += storage.nbytes()
                    if storage in saved_here:
                        saved_bytes += storage.nbytes()
                    continue
                self._share(storage, *owner)
        record.input_bytes += counted
        record.call_input_bytes = max(record.call_input_bytes, counted)
        record.self_saved_input_bytes += saved_bytes

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
        # it only if an operator saves it. One no operator saves (a causal convolution's
        # feature cache, a tensor a candidate's forward stores in a list every call takes,
        # replaced by the next chunk) is freed in a plain step once replaced, and held by
        # the checkpoints that took it alone: it stays in the first call's inputs, and
        # moves to the base only when something saves it (the base takes it).
        earlier = self._base.claims.pop(storage)

        def saved(nbytes: int) -> None:
            if earlier is not None:
                earlier(nbytes)
            first.input_bytes -= nbytes
            for record in self._records:
                if record.base_before_bytes is not None and record.position >= position:
                    record.base_before_bytes += nbytes

        self._base.claims[storage] = saved


def highest_each(known: Tuple[int, ...], new: Tuple[int, ...]) -> Tuple[int, ...]:
    """Two calls' moments as one: the higher of each where they line up, else the moments
    of the call that peaked higher."""
    if not known:
        return new
    if len(known) == len(new):
        return tuple(max(a, b) for a, b in zip(known, new))
    return new if max(new, default=0) > max(known, default=0) else known

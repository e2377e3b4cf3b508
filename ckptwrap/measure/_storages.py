"""Telling tensor storages apart, and counting the distinct bytes of those saved for backward.

A storage is known by the address of its C++ object. Every map of storages here pins the
addresses it holds, so a storage allocated where a freed one was is never taken for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Generic, Iterable, Iterator, List, Optional, Tuple, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, SelectiveCheckpointContext

__all__ = [
    "SavePolicy",
    "StorageMap",
    "Tally",
    "differentiable",
    "policy_listener",
    "tensor_storages",
    "tensors",
]

SavePolicy = Callable[..., CheckpointPolicy]
"""A selective-checkpointing policy: ``policy(ctx, op, *args, **kwargs)`` says whether the
output of ``op`` is saved (``MUST_SAVE``/``PREFER_SAVE``) or recomputed."""
_SAVES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

_V = TypeVar("_V")
_DEPTH = 8
"""How deep ``tensors`` opens dataclasses within dataclasses."""


def tensor_storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``tensor``; a wrapper subclass (DTensor...) by its inner tensors
    (the attributes it flattens to that are tensors: a DTensor's device mesh is not)."""
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(tensor, attr, None)
            if isinstance(inner, torch.Tensor):
                yield from tensor_storages(inner)
        return
    try:
        yield tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        # Sparse and some other layouts have no single storage; they are rare as
        # activations, and counting them some other way would not be comparable.
        return


def tensors(value: Any, depth: int = 0) -> List[torch.Tensor]:
    """The tensors among the leaves of a nested structure (containers pytree opens, and
    dataclasses), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        # An operator's arguments: tensors, numbers and lists of them, without the
        # general tree walk (it runs for every operator a meter sees).
        found: List[torch.Tensor] = []
        for item in value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple, dict)) or dataclasses.is_dataclass(item):
                found.extend(tensors(item, depth))
        return found
    if type(value) is dict:
        return tensors(list(value.values()), depth)
    found = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and depth < _DEPTH:
            # A model's own output class (a dataclass pytree does not open).
            fields = [getattr(leaf, field.name, None) for field in dataclasses.fields(leaf)]
            found.extend(tensors(fields, depth + 1))
    return found


def differentiable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can require grad (floating point or complex)."""
    return tensor.is_floating_point() or tensor.is_complex()


class StorageMap(Generic[_V]):
    """A value per storage, the storage known by the address of its C++ object.

    Each entry holds a weak reference to its storage. It frees the memory no later than
    otherwise, but keeps the C++ object, and so its address, from being reused while the
    entry exists: a storage allocated after one in the map was freed can never match it.
    (An address alone could: the profiler's results then changed from run to run.)
    """

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[StorageWeakRef, _V]] = {}

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor]) -> "StorageMap[None]":
        """The storages behind ``tensors``, as a set."""
        found: StorageMap[None] = StorageMap()
        for tensor in tensors:
            for storage in tensor_storages(tensor):
                found.setdefault(storage, None)
        return found

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._entries

    def __setitem__(self, storage: torch.UntypedStorage, value: _V) -> None:
        self._entries[storage._cdata] = (StorageWeakRef(storage), value)

    def get(self, storage: torch.UntypedStorage, default: Optional[_V] = None) -> Optional[_V]:
        entry = self._entries.get(storage._cdata)
        return default if entry is None else entry[1]

    def setdefault(self, storage: torch.UntypedStorage, value: _V) -> _V:
        entry = self._entries.get(storage._cdata)
        if entry is None:
            self[storage] = value
            return value
        return entry[1]

    def pop(self, storage: torch.UntypedStorage, default: Optional[_V] = None) -> Optional[_V]:
        entry = self._entries.pop(storage._cdata, None)
        return default if entry is None else entry[1]

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether a storage behind ``tensor`` is in the map."""
        return any(storage in self for storage in tensor_storages(tensor))

    def union(self, other: "StorageMap[_V]") -> "StorageMap[_V]":
        """A new map with the entries of both; ``other``'s value wins for a shared storage."""
        merged: StorageMap[_V] = StorageMap()
        merged._entries = {**self._entries, **other._entries}
        return merged

    def shared_values(self, other: "StorageMap[Any]") -> List[_V]:
        """This map's values for the storages that ``other`` holds too."""
        return [self._entries[key][1] for key in self._entries.keys() & other._entries.keys()]


_NOTHING: StorageMap[None] = StorageMap()


class Tally:
    """Distinct storages, with their total bytes.

    Args:
        excluded: Storages never counted (parameters, buffers, the model's inputs).
        inputs: Storages of the measured call's own inputs: noted in ``input_hits`` when
            met, never counted.
    """

    def __init__(
        self, excluded: StorageMap[Any] = _NOTHING, inputs: StorageMap[Any] = _NOTHING
    ) -> None:
        self.bytes = 0
        self.input_hits: StorageMap[None] = StorageMap()
        self._excluded = excluded
        self._inputs = inputs
        self._seen: StorageMap[int] = StorageMap()
        # Storages another tally counted first, and what to tell it if this one takes them.
        self.claims: StorageMap[Callable[[int], None]] = StorageMap()
        # Storages to report when they are met again after being counted.
        self.watched: StorageMap[Callable[[], None]] = StorageMap()

    def add(self, storage: torch.UntypedStorage, *, count: bool = True) -> None:
        if storage in self._seen:
            seen_again = self.watched.get(storage)
            if seen_again is not None:
                seen_again()
            return
        if storage in self._excluded:
            return
        if storage in self._inputs:
            self.input_hits.setdefault(storage, None)
            return
        nbytes = storage.nbytes() if count else 0
        self._seen[storage] = nbytes
        if count:
            self.bytes += nbytes
            claim = self.claims.pop(storage)
            if claim is not None:
                claim(nbytes)

    def add_tensors(self, tensors: Iterable[torch.Tensor], *, count: bool = True) -> "Tally":
        for tensor in tensors:
            for storage in tensor_storages(tensor):
                self.add(storage, count=count)
        return self

    def holds(self, tensor: torch.Tensor) -> bool:
        return self._seen.holds(tensor)

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return storage in self._seen

    def shared_bytes(self, other: "Tally") -> int:
        """Bytes of the storages counted both here and in ``other``."""
        return sum(self._seen.shared_values(other._seen))


class _PolicyTally:
    """Notes in ``tally`` the outputs of the operators that ``policy`` would save."""

    def __init__(self, policy: SavePolicy, tally: Tally) -> None:
        self._policy, self._tally = policy, tally
        self._context = SelectiveCheckpointContext(is_recompute=False)

    def __call__(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        if func in SAC_IGNORED_OPS:  # never asked of the policy by the engine either
            return
        if self._policy(self._context, func, *args, **kwargs) in _SAVES:
            self._tally.add_tensors(tensors(out))


def policy_listener(policy: Optional[SavePolicy], tally: Tally) -> Optional[Callable[..., None]]:
    """A listener of the phase meter's (``PhaseMeter.recording``) that notes in ``tally``
    what ``policy`` saves; None without a policy."""
    return None if policy is None else _PolicyTally(policy, tally)

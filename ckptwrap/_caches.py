"""What a checkpointed region is given that holds state: caches and the like (:class:`GivenCaches`).

A region's forward writes into a cache it receives (keys and values appended, a conv
window shifted, a recurrent state replaced), and its recomputation would read what the
forward wrote: the keys twice over, a state that has seen the sequence already (a
Mamba mixer recomputed on its own cache convolves 68 positions where its forward
convolved 64). Taking the cache away instead, as transformers' own gradient
checkpointing does, changes the code the layer runs: Jamba's, Bamba's and Zamba2's
Mamba layers slice and copy through the cache when they have one, and their gradients
then differ in the last bits from the model's own.

So a recomputation runs on a copy of such an object as the region's call found it (a
snapshot taken before the forward). Its containers are copied, a few small objects per
layer; its tensors are shared, except those it had changed in place before (a conv or
a recurrent state), which are cloned, since the region changes them in place again.

What the forward runs on depends on what the object is. A transformers cache in a
training forward is only written for calls to come (generation), so, as with
transformers' own gradient checkpointing, it keeps nothing a checkpointed layer writes:
the forward too runs on a copy, and neither the cache nor what the snapshots keep grows
with the layers' keys and values. Any other object (a cache outside training, another
library's state, a record a later layer reads within the same forward) is written by
the forward as without checkpointing, and only the recomputations run on copies.
"""

from __future__ import annotations

import copy
import enum
import itertools
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import _torch_private
from ._errors import CheckpointConfigError
from ._hf import cache_class

__all__ = ["GivenCaches", "given_caches"]


_MOST_NESTED = 12
"""Containers inside an object deeper than this are shared, not copied."""

_STATEFUL: Dict[type, bool] = {}
_NOT_STATE = (torch.Tensor, nn.Module, type, tuple, list, dict, set, frozenset, enum.Enum, BaseException)


def _stateful_class(cls: type) -> bool:
    """Whether instances of ``cls`` hold state of their own: of a class outside Python,
    its standard library and torch, and neither a tensor, a module, a container, an
    enumeration, an exception nor something called."""
    known = _STATEFUL.get(cls)
    if known is None:
        top = cls.__module__.split(".")[0]
        known = _STATEFUL[cls] = not (
            top in sys.stdlib_module_names
            or top == "torch"
            or issubclass(cls, _NOT_STATE)
            or any("__call__" in vars(base) for base in cls.__mro__)
        )
    return known


def _holds_state(value: Any) -> bool:
    return _stateful_class(type(value)) and hasattr(value, "__dict__")


def _version(tensor: torch.Tensor) -> Optional[int]:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor: nothing changes it in a training step
        return None


def _state(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` was changed in place before (a cache's conv or recurrent state)."""
    return _version(tensor) not in (0, None)


def _never(tensor: torch.Tensor) -> bool:
    return False


_Versions = List[Tuple[torch.Tensor, Optional[int]]]

_ATOMIC = frozenset((type(None), bool, int, float, complex, str, bytes, torch.device, torch.dtype, torch.Size))
"""Values a copy shares as they are, at a glance."""

_PLAIN: Dict[type, bool] = {}


def _plainly_copied(cls: type) -> bool:
    """Whether ``copy.copy`` of an instance of ``cls`` is a new instance with the same
    ``__dict__`` entries (no ``__copy__``, ``__reduce__``, ``__new__`` or slots of its
    own), which :func:`_plain_copy` makes without the pickle protocol's detour."""
    known = _PLAIN.get(cls)
    if known is None:
        known = _PLAIN[cls] = (
            getattr(cls, "__copy__", None) is None
            and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__
            and cls.__new__ is object.__new__
            and not any(vars(base).get("__slots__") for base in cls.__mro__)
        )
    return known


def _plain_copy(value: Any) -> Any:
    result = object.__new__(type(value))
    result.__dict__.update(value.__dict__)
    return result


class _Copier:
    """Structural copies: containers and objects that hold state copied, tensors shared,
    or cloned where ``cloned`` says so. An object reached twice is copied once."""

    def __init__(self, cloned: Callable[[torch.Tensor], bool]) -> None:
        self.cloned = cloned
        self.memo: Dict[int, Any] = {}
        self.shared: _Versions = []
        """The tensors shared with the originals, with their versions."""
        self.clones: set = set()
        """The ids of the clones made."""

    def copy(self, value: Any, depth: int = 0) -> Any:
        cls = type(value)
        if cls in _ATOMIC:
            return value
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if depth > _MOST_NESTED:
            return value
        depth += 1
        if isinstance(value, tuple):
            return _rebuilt(value, [self.copy(item, depth) for item in value])
        if isinstance(value, (list, dict, set)):
            result = self.memo[key] = copy.copy(value)
            if isinstance(value, list):
                result[:] = [self.copy(item, depth) for item in value]
            elif isinstance(value, dict):
                for name, item in value.items():
                    result[name] = self.copy(item, depth)
            return result
        if not _holds_state(value):
            return value
        try:
            result = _plain_copy(value) if _plainly_copied(cls) else copy.copy(value)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is shared as it is
            return value
        self.memo[key] = result
        fields = vars(result)
        for name, item in fields.items():
            if type(item) not in _ATOMIC:
                fields[name] = self.copy(item, depth)
        return result

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.cloned(tensor):
            # Outside any dispatch mode of the region (selective checkpointing's would save
            # the forward's clone and hand it, changed, to the recomputation), and kept in
            # autograd, so an entry that requires grad still passes its gradient back.
            with _torch_private.disable_current_modes():
                result = tensor.clone()
            self.clones.add(id(result))
        else:
            result = tensor
            self.shared.append((tensor, _version(tensor)))
        self.memo[id(tensor)] = result
        return result


def _rebuilt(value: tuple, items: List[Any]) -> tuple:
    """``value`` itself if ``items`` are its items, else a tuple of its type holding them."""
    if all(new is old for new, old in zip(items, value)):
        return value
    if type(value) is tuple:
        return tuple(items)
    return value._make(items) if hasattr(value, "_make") else type(value)(items)


def _changed(tensors: _Versions) -> Optional[torch.Tensor]:
    """The first of ``tensors`` changed in place since its version was read, if any."""
    return next((t for t, version in tensors if version is not None and _version(t) != version), None)


def _replaced(value: Any, objects: Dict[int, Any]) -> Any:
    """``value`` with each object ``objects`` maps (by identity) replaced, inside tuples too."""
    if id(value) in objects:
        return objects[id(value)]
    if isinstance(value, tuple):
        return _rebuilt(value, [_replaced(item, objects) for item in value])
    return value


def _all_replaced(
    args: Tuple[Any, ...], kwargs: Dict[str, Any], objects: Dict[int, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    return tuple(_replaced(a, objects) for a in args), {name: _replaced(v, objects) for name, v in kwargs.items()}


def _found(value: Any, into: List[Any], depth: int = 0) -> None:
    if _holds_state(value):
        into.append(value)
    elif isinstance(value, tuple) and depth < 2:
        for item in value:
            if not isinstance(item, torch.Tensor):
                _found(item, into, depth + 1)


class GivenCaches:
    """The objects holding state among the arguments of one call of a checkpointed
    region (its caches), as the call found them, and the runs of the region on them.

    :meth:`arguments` gives the call's arguments with each object replaced by its
    snapshot: what the engine keeps for the recomputation, so that it holds neither the
    caller's object nor anything written into it later. :meth:`around` wraps the
    region's function: the forward runs on a copy of a transformers cache in training
    (:attr:`copied`), on the object itself otherwise; each recomputation on a copy.
    """

    def __init__(self, places: List[Tuple[Any, Any]], training: bool) -> None:
        kind = cache_class() if training else None
        objects = list({id(value): value for _, value in places}.values())
        self.places = [(place, type(value).__name__) for place, value in places]
        """Where each object came: (its position or keyword, its class's name)."""
        self.copied = {id(value) for value in objects if kind is not None and isinstance(value, kind)}
        """The ids of the objects even the forward runs on a copy of (transformers caches in training)."""
        self.types = sorted({name for _, name in self.places})
        # A tensor changed in place before the call (a state) is cloned for each run. The
        # forward writes the other objects themselves, so their snapshot keeps such
        # tensors cloned already, as they were before.
        snapshot = _Copier(cloned=_state)
        self._snapshots: Dict[int, Any] = {}
        for value in objects:
            snapshot.cloned = _never if id(value) in self.copied else _state
            self._snapshots[id(value)] = snapshot.copy(value)
        self._states = snapshot.clones | {id(t) for t, version in snapshot.shared if version not in (0, None)}
        """The ids of the snapshots' tensors each run clones."""
        self._read = snapshot.shared
        self._given: Optional[Dict[int, Any]] = {
            id(self._snapshots[id(value)]): value for value in objects if id(value) not in self.copied
        }

    def arguments(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """``args`` and ``kwargs`` (the call's, while the caller holds its objects) with
        each object replaced by its snapshot."""
        return _all_replaced(args, kwargs, self._snapshots)

    def around(self, call: Callable[..., Any], region: Any) -> Callable[..., Any]:
        """``call`` run on the objects as :class:`GivenCaches` says (``region`` names the
        region in errors)."""
        return _OnCopies(call, self, region)

    def one_run(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The call's arguments for its one run, which nothing recomputes (a module the
        plan leaves un-checkpointed): copies of the transformers caches in training (their
        snapshots, copies already, unless they hold tensors changed in place before, which
        a run gets clones of), the other objects themselves."""
        snapshots = {key: self._snapshots[key] for key in self.copied}
        if self._states:
            copier = self._run_copier()
            snapshots = {key: copier.copy(snapshot) for key, snapshot in snapshots.items()}
        return _all_replaced(args, kwargs, snapshots)

    def _run_copier(self) -> _Copier:
        """A copier for one run: the states among the snapshots cloned, the rest shared."""
        return _Copier(cloned=lambda tensor: id(tensor) in self._states)

    def run_on(self, region: Any) -> Tuple[Dict[int, Any], _Versions]:
        """What one run gets for each snapshot (by the snapshot's id): the object itself
        for the first run of one the forward writes, else a copy; and the tensors shared
        with what the call was given, with their versions, to check after the run."""
        changed = _changed(self._read)
        if changed is not None:
            raise CheckpointConfigError(
                f"an object given to the checkpointed {_named(region)} ({', '.join(self.types)}) had a tensor "
                f"of shape {tuple(changed.shape)} changed in place after the region's forward began, before "
                f"its backward; the recomputation would read the new values. Don't write into it in place "
                f"between the forward and the backward, or keep this module out of the policy."
            )
        given, self._given = self._given or {}, None  # the forward writes them; the recomputations don't
        copier = self._run_copier()
        objects = {
            key: given[key] if key in given else copier.copy(snapshot)
            for key, snapshot in ((id(s), s) for s in self._snapshots.values())
        }
        return objects, copier.shared + (self._read if given else [])


class _OnCopies:
    """A region's function, run on the objects :meth:`GivenCaches.run_on` gives each run."""

    __slots__ = ("call", "caches", "region")

    def __init__(self, call: Callable[..., Any], caches: GivenCaches, region: Any) -> None:
        self.call, self.caches, self.region = call, caches, region

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        objects, shared = self.caches.run_on(self.region)
        args, kwargs = _all_replaced(args, kwargs, objects)
        out = self.call(*args, **kwargs)
        changed = _changed(shared)
        if changed is not None:
            raise CheckpointConfigError(
                f"the checkpointed {_named(self.region)} changed in place a tensor of shape "
                f"{tuple(changed.shape)} in an object it was given ({', '.join(self.caches.types)}) that had not "
                f"been changed in place before; its recomputation could not start from it as the forward "
                f"found it. Run without it (for a cache, use_cache=False), or keep this module out of the policy."
            )
        return out


def _named(region: Any) -> str:
    if isinstance(region, nn.Module):
        return type(region).__name__
    return getattr(region, "__qualname__", None) or type(region).__name__


def given_caches(args: Tuple[Any, ...], kwargs: Dict[str, Any], *, training: bool) -> Optional[GivenCaches]:
    """The objects holding state among a call's arguments (also inside tuples), or None
    where there are none: a look at each argument, as most calls have none. ``training``:
    whether the region's module is training (a transformers cache then keeps nothing the
    region writes)."""
    places: List[Tuple[Any, Any]] = []
    for place, value in itertools.chain(enumerate(args), kwargs.items()):
        if not isinstance(value, torch.Tensor):
            found: List[Any] = []
            _found(value, found)
            places.extend((place, each) for each in found)
    if not places:
        return None
    return GivenCaches(places, training)

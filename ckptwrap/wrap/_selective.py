"""Selective checkpointing: save chosen operators' outputs, recompute everything else.

``SelectiveContexts`` (the ``selective`` tier) saves every call of the named operators;
``SavedInstances`` (a budget plan's selective level) saves chosen calls, named by operator
and occurrence. Both build on torch's ``create_selective_checkpoint_contexts`` and are
handed to the engine as ``context_fn``; small classes rather than closures, so wrapped
models still pickle.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, ContextManager, Dict, Iterable, Tuple

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..planner import packet_name
from ..policy import resolve_ops

__all__ = ["SavedInstances", "SelectiveContexts"]


class _ByValue(functools.partial):
    """A ``context_fn`` in the form ``torch.compile`` accepts (a ``functools.partial``) that
    compares, hashes and pickles by ``value``, the one argument its class is built from,
    so equal options stay equal and wrapped models still pickle."""

    @property
    def value(self) -> Any:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.value)

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(self), (self.value,))


class SelectiveContexts(_ByValue):
    """``context_fn`` that saves the outputs of ``ops`` and recomputes the rest."""

    def __new__(cls, ops: Tuple[str, ...]) -> "SelectiveContexts":
        return super().__new__(cls, create_selective_checkpoint_contexts, _SavePolicy(tuple(ops)))

    @property
    def ops(self) -> Tuple[str, ...]:
        return self.args[0].ops

    value = ops

    def __repr__(self) -> str:
        return f"selective({', '.join(self.ops)})"


class _SavePolicy:
    """Saves the outputs of the named operators; holds names so that it pickles."""

    __slots__ = ("ops", "_packets")

    def __init__(self, ops: Tuple[str, ...]) -> None:
        self.ops = ops
        self._packets = resolve_ops(ops)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(op, "overloadpacket", op) in self._packets:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_SavePolicy, (self.ops,))


Instance = Tuple[str, int]


class SavedInstances(_ByValue):
    """``context_fn`` that saves the outputs of chosen operator calls, named as
    ``(packet, occurrence)``: ``("mm", 2)`` is the third ``aten.mm`` call of the region.

    Occurrences count per packet within one region's forward, afresh for every call of
    ``context_fn`` (each checkpointed call gets its own), exactly as the profiler numbered
    them (``measure._ops``).

    Example:
        >>> checkpoint(block, x, use_reentrant=False,
        ...            context_fn=SavedInstances((("addmm", 0), ("mm", 1))))  # doctest: +SKIP
    """

    def __new__(cls, instances: Iterable[Instance]) -> "SavedInstances":
        normal = tuple(sorted((str(name), int(index)) for name, index in instances))
        return super().__new__(cls, _instance_contexts, normal)

    @property
    def instances(self) -> Tuple[Instance, ...]:
        return self.args[0]

    value = instances

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}#{index}" for name, index in self.instances)
        return f"saved_instances({shown})"


def _instance_contexts(instances: Tuple[Instance, ...]) -> Tuple[ContextManager, ContextManager]:
    return create_selective_checkpoint_contexts(_InstancePolicy(instances))


class _InstancePolicy:
    """Numbers the calls of each packet and saves the listed ones.

    Forward and recomputation keep separate counts: torch versions that consult the
    policy during recomputation too must see the same numbering there.
    """

    __slots__ = ("_wanted", "_counts")

    def __init__(self, instances: Tuple[Instance, ...]) -> None:
        self._wanted = frozenset(instances)
        self._counts: Dict[bool, Dict[str, int]] = {False: defaultdict(int), True: defaultdict(int)}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = packet_name(op)
        counts = self._counts[bool(getattr(ctx, "is_recompute", False))]
        index = counts[name]
        counts[name] += 1
        if (name, index) in self._wanted:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

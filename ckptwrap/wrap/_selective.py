"""The ``selective`` tier: save chosen operators' outputs, recompute everything else.

Built on torch's ``create_selective_checkpoint_contexts`` and handed to the engine as
``context_fn``. A small class rather than a closure, so wrapped models still pickle.
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..policy._ops import resolve_ops

__all__ = ["SelectiveContexts"]


class SelectiveContexts(functools.partial):
    """``context_fn`` that saves the outputs of ``ops`` and recomputes the rest.

    A ``functools.partial`` (the form ``torch.compile`` accepts as a checkpoint's
    ``context_fn``) that compares by its operators, so equal options stay equal.
    """

    def __new__(cls, ops: Tuple[str, ...]) -> "SelectiveContexts":
        return super().__new__(cls, create_selective_checkpoint_contexts, _SavePolicy(tuple(ops)))

    @property
    def ops(self) -> Tuple[str, ...]:
        return self.args[0].ops

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SelectiveContexts) and other.ops == self.ops

    def __hash__(self) -> int:
        return hash(self.ops)

    def __repr__(self) -> str:
        return f"selective({', '.join(self.ops)})"

    def __reduce__(self) -> Tuple[Any, ...]:
        return (SelectiveContexts, (self.ops,))


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

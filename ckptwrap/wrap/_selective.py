"""The ``selective`` tier: save chosen operators' outputs, recompute everything else.

Built on torch's ``create_selective_checkpoint_contexts`` and handed to the engine as
``context_fn``. A small class rather than a closure, so wrapped models still pickle.
"""

from __future__ import annotations

from typing import Any, ContextManager, Tuple

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..policy._ops import resolve_ops

__all__ = ["SelectiveContexts"]


class SelectiveContexts:
    """``context_fn`` that saves the outputs of ``ops`` and recomputes the rest."""

    __slots__ = ("ops",)

    def __init__(self, ops: Tuple[str, ...]) -> None:
        self.ops = tuple(ops)

    def __call__(self) -> Tuple[ContextManager, ContextManager]:
        return create_selective_checkpoint_contexts(_SavePolicy(resolve_ops(self.ops)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SelectiveContexts) and other.ops == self.ops

    def __hash__(self) -> int:
        return hash(self.ops)

    def __repr__(self) -> str:
        return f"selective({', '.join(self.ops)})"

    def __reduce__(self) -> Tuple[Any, ...]:
        return (SelectiveContexts, (self.ops,))


class _SavePolicy:
    __slots__ = ("packets",)

    def __init__(self, packets: Any) -> None:
        self.packets = packets

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(op, "overloadpacket", op) in self.packets:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

"""Operator logs for ``debug=True``: what ran in the forward and in the recomputation."""

from __future__ import annotations

from typing import Any, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpRecorder", "describe_ops"]

_MAX_LISTED = 200
_DETACH = torch.ops.aten.detach.default


class OpRecorder(TorchDispatchMode):
    """Records each aten operator with the shapes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __enter__(self) -> "OpRecorder":
        # A recomputation may run more than once (one per backward call); keep the latest.
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not _DETACH:  # the engine's own detaches would only add noise to the diff
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.ops.append(f"{func}{shapes}" if shapes else str(func))
        return func(*args, **(kwargs or {}))


def describe_ops(forward: List[str], recompute: List[str]) -> str:
    """Both operator lists side by side, with the first position where they differ."""
    first_difference = next(
        (i for i, (a, b) in enumerate(zip(forward, recompute)) if a != b),
        min(len(forward), len(recompute)),
    )
    lines = [
        f"Operators in the forward ({len(forward)}) and in the recomputation ({len(recompute)});"
        f" first difference at #{first_difference}:",
        "  forward:",
    ]
    lines += [f"    #{i} {op}" for i, op in enumerate(forward[:_MAX_LISTED])]
    lines.append("  recomputation:")
    lines += [f"    #{i} {op}" for i, op in enumerate(recompute[:_MAX_LISTED])]
    if max(len(forward), len(recompute)) > _MAX_LISTED:
        lines.append(f"  (lists cut at {_MAX_LISTED} operators)")
    return "\n".join(lines)

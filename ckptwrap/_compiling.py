"""Code that must run eagerly, outside a graph ``torch.compile`` traces."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["outside_graph"]


def outside_graph(fn: Callable[..., Any], reason: str) -> Callable[..., Any]:
    """``fn``, run eagerly where the compiler meets it: a graph break, and under
    ``fullgraph=True`` the compiler's error, which then carries ``reason``."""
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # a torch whose disable() takes no reason
        return torch.compiler.disable(fn)

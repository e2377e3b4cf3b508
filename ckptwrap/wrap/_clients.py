"""Adaptations for model libraries whose layers keep state across calls.

Hugging Face decoder layers write new keys and values into a KV cache passed to them. A
recomputation would write them a second time and corrupt the cache, so, exactly as
transformers' own gradient checkpointing does, a checkpointed layer in training runs with
``use_cache=False`` and without the cache unless the layer declares that it only reads it.
The profiler runs candidate layers the same way (``measure._clients``).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from torch import nn

from .._warn import note
from .._hf import cache_free_arguments

__all__ = ["without_cache_writes"]

_noted: set = set()


def without_cache_writes(
    module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``args`` and ``kwargs`` with KV-cache writes turned off, for layers that would write
    in training; notes once per layer class that it does so (the ``ckptwrap`` logger, at
    INFO: routine, as transformers' own gradient checkpointing does the same)."""
    if not isinstance(module, nn.Module) or not module.training:
        return args, kwargs
    rewritten = cache_free_arguments(module, args, kwargs)
    if rewritten is None:
        return args, kwargs
    if type(module) not in _noted:
        _noted.add(type(module))
        note(
            f"{type(module).__name__} is checkpointed in training, so it runs without writing "
            f"the KV cache (use_cache=False), as with transformers' own gradient checkpointing."
        )
    return rewritten

"""Adaptations for model libraries whose layers keep state across calls.

Hugging Face decoder layers write new keys and values into a KV cache passed to them. A
recomputation would write them a second time and corrupt the cache, so, exactly as
transformers' own gradient checkpointing does, a checkpointed layer in training runs with
``use_cache=False`` and without the cache unless the layer declares that it only reads it.
The profiler runs candidate layers the same way (``measure._clients``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Tuple

import torch
from torch import nn

from .._warn import note
from .._hf import cache_free_arguments, is_hf_layer_class

__all__ = ["CacheWritesOff", "cache_writes_off", "cache_writes_on", "without_cache_writes"]

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


class CacheWritesOff:
    """Forward pre-hook of a candidate layer under a ``budget:`` policy: in training, the
    layer runs without writing the KV cache whether the plan checkpoints it or not. A
    checkpointed layer never writes it (see :func:`without_cache_writes`); a plain one
    would, and then the step's memory would depend on which layers the plan picks: off for
    all, the model's own forward (its masks, its cache object) runs as it does plain."""

    def __call__(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not torch.is_grad_enabled():
            return None
        rewritten = without_cache_writes(module, args, kwargs)
        return None if rewritten[0] is args and rewritten[1] is kwargs else rewritten


def cache_writes_off(layers: Iterable[nn.Module]) -> None:
    """Register :class:`CacheWritesOff` on those of ``layers`` that write a KV cache."""
    for layer in layers:
        if is_hf_layer_class(type(layer)) and not any(isinstance(h, CacheWritesOff) for h in layer._forward_pre_hooks.values()):
            layer.register_forward_pre_hook(CacheWritesOff(), with_kwargs=True)


def cache_writes_on(layers: Iterable[nn.Module]) -> None:
    """Remove the hooks :func:`cache_writes_off` registered."""
    for layer in layers:
        for key, hook in list(layer._forward_pre_hooks.items()):
            if isinstance(hook, CacheWritesOff):
                del layer._forward_pre_hooks[key]
                layer._forward_pre_hooks_with_kwargs.pop(key, None)

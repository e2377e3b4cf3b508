"""Adaptations for model libraries whose layers keep state across calls.

Hugging Face decoder layers (subclasses of ``GradientCheckpointingLayer``) write new keys
and values into a KV cache passed to them. A recomputation would write them a second
time and corrupt the cache, so, exactly as transformers' own gradient checkpointing does,
a checkpointed layer in training runs with ``use_cache=False`` and without the cache
unless the layer declares that it only reads it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Dict, Tuple

from torch import nn

__all__ = ["without_cache_writes"]

_CACHE_ARGUMENTS = ("past_key_values", "layer_past")
_warned: set = set()


_HF_LAYER_CLASSES: Dict[type, bool] = {}


def _is_hf_checkpointing_layer(cls: type) -> bool:
    # Checked by name so that transformers is never imported on our account; once per
    # class, since every checkpointed forward asks (a plain dict, which the compiler reads).
    known = _HF_LAYER_CLASSES.get(cls)
    if known is None:
        known = _HF_LAYER_CLASSES[cls] = any(
            base.__name__ == "GradientCheckpointingLayer"
            and base.__module__.startswith("transformers")
            for base in cls.__mro__
        )
    return known


def without_cache_writes(
    module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``args`` and ``kwargs`` with KV-cache writes turned off, for layers that would write.

    The cache may come by keyword or by position (GPT-2 passes it second), so arguments
    are matched to the layer's forward signature by name.
    """
    if not isinstance(module, nn.Module) or not module.training:
        return args, kwargs
    if not _is_hf_checkpointing_layer(type(module)):
        return args, kwargs
    signature = _signature(type(module))
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError:
        return args, kwargs  # let the layer itself report the bad call
    changed = False
    if bound.arguments.get("use_cache"):
        bound.arguments["use_cache"] = False
        changed = True
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in _CACHE_ARGUMENTS:
            if bound.arguments.get(name) is not None:
                bound.arguments[name] = None
                changed = True
    if not changed:
        return args, kwargs
    if type(module) not in _warned:
        _warned.add(type(module))
        warnings.warn(
            f"{type(module).__name__} is checkpointed in training, so it runs without writing "
            f"the KV cache (use_cache=False), as with transformers' own gradient checkpointing.",
            stacklevel=5,
        )
    return bound.args[1:], bound.kwargs


@functools.lru_cache(maxsize=None)
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)

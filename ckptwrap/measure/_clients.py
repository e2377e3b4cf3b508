"""Layers of model libraries that write into state passed to them, run more than once.

Hugging Face decoder layers (subclasses of ``GradientCheckpointingLayer``) write new keys
and values into a KV cache passed to them. A second run of such a layer, a recomputation
or a measurement, would write them again and corrupt the cache. transformers' own gradient
checkpointing runs a checkpointed layer with ``use_cache=False`` and without the cache
unless the layer declares that it only reads it; :func:`cache_free_arguments` does the same.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Optional, Tuple

from torch import nn

from .._hf import is_hf_layer_class

__all__ = ["cache_free_arguments"]

_CACHE_ARGUMENTS = ("past_key_values", "layer_past")


def cache_free_arguments(
    module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """``args`` and ``kwargs`` with KV-cache writes turned off, for a layer that would write;
    ``None`` when there is nothing to turn off (not such a layer, or no cache passed).

    The cache may come by keyword or by position (GPT-2 passes it second), so arguments
    are matched to the layer's forward signature by name.
    """
    if not isinstance(module, nn.Module) or not is_hf_layer_class(type(module)):
        return None
    try:
        bound = _signature(type(module)).bind(module, *args, **kwargs)
    except TypeError:
        return None  # let the layer itself report the bad call
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
        return None
    return bound.args[1:], bound.kwargs


@functools.lru_cache(maxsize=None)
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)

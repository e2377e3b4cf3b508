"""Adaptations for model libraries whose layers keep state across calls: the caches (and
other objects holding state) a checkpointed region is given.

A layer writes into the cache it receives (a KV cache's keys and values, a Mamba layer's
conv and recurrent states, both in a hybrid model's cache, whatever the configuration's
``use_cache``), and a recomputation would write again and read what the forward wrote.
Each recomputation runs on a copy of the cache as the region's call found it
(``GivenCaches``), so the region computes exactly what it computes un-checkpointed. In
training a transformers cache keeps nothing a checkpointed region writes, as with
transformers' own gradient checkpointing, which passes no cache at all (and so makes
Mamba layers take other code, their gradients differing from the model's own); any other
object is written by the forward as without checkpointing.

Under a ``budget:`` policy every candidate transformers hands a cache to runs on a copy
of it in training, checkpointed or not (:class:`CacheWritesOff`): otherwise the cache, and
the step's memory, would depend on which modules the plan picks.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Iterable, List, Tuple

import torch
from torch import nn

from .._warn import note
from .._caches import GivenCaches, given_caches
from .._hf import cache_free_arguments, is_hf_layer_class, library_of

__all__ = ["CacheWritesOff", "cache_writes_off", "cache_writes_on", "on_cache_copies", "without_cache_writes"]

_noted: set = set()


def on_cache_copies(
    owner: Any, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Callable[..., Any], Tuple[Any, ...], Dict[str, Any]]:
    """``call``, ``args`` and ``kwargs`` of a checkpointed region such that each
    recomputation runs on its own copy of the caches the region was given, as the call
    found them, and so does the forward of a training module on a transformers cache;
    unchanged where it was given none. Notes once per class what it does (the
    ``ckptwrap`` logger, at INFO).

    The arguments returned hold the caches' snapshots instead of the caches: the engine
    keeps them for the recomputation, and keeps nothing written into the caches later.
    Under ``torch.compile`` the compiled graph recomputes, never calling back here, and a
    transformers layer runs without its cache as before (:func:`without_cache_writes`).
    """
    if torch.compiler.is_compiling():
        args, kwargs = without_cache_writes(owner, args, kwargs)
        return call, args, kwargs
    module = isinstance(owner, nn.Module)
    caches = given_caches(args, kwargs, training=module and owner.training)
    if caches is None:
        return call, args, kwargs
    region = owner if module else call
    _note(region, caches, "checkpointed")
    return (caches.around(call, region), *caches.arguments(args, kwargs))


def without_cache_writes(
    module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``args`` and ``kwargs`` of a transformers layer in training with its cache taken
    away (``use_cache=False``, ``past_key_values=None``), as transformers' own gradient
    checkpointing does; what a compiled region does (:func:`on_cache_copies`). Notes once
    per layer class what it changed."""
    if not isinstance(module, nn.Module) or not module.training:
        return args, kwargs
    rewritten = cache_free_arguments(module, args, kwargs)
    if rewritten is None:
        return args, kwargs
    if (type(module), "without") not in _noted:
        _noted.add((type(module), "without"))
        names = _parameters(type(module))
        before = dict(zip(names, args), **kwargs)
        after = dict(zip(names, rewritten[0]), **rewritten[1])
        changed = ", ".join(f"{name}={after.get(name)!r}" for name in before if before[name] is not after.get(name))
        note(
            f"{type(module).__name__} is checkpointed in training, so it runs without the cache it was "
            f"given ({changed}: no KV cache entries or states written), as with transformers' own "
            f"gradient checkpointing."
        )
    return rewritten


class CacheWritesOff:
    """Forward pre-hook of a candidate module under a ``budget:`` policy (see the module):
    in training, while autograd records, a module the plan leaves plain runs on a copy of
    the transformers cache it is given, as a checkpointed one does (:func:`on_cache_copies`)."""

    handle: Any = None  # its registration on the module (a RemovableHandle)

    def __call__(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not torch.is_grad_enabled() or not module.training or torch.compiler.is_compiling():
            return None
        if getattr(module.__dict__.get("forward"), "copies_caches", False):
            # Checkpointed now (by the plan, or on a step measured): its region copies the
            # caches itself, telling a state changed in place before by its version, which
            # a clone made here would reset.
            return None
        caches = given_caches(args, kwargs, training=True)
        if caches is None or not caches.copied:
            return None
        _note(module, caches, "candidate")
        return caches.one_run(args, kwargs)


def cache_writes_off(layers: Iterable[nn.Module]) -> None:
    """Register :class:`CacheWritesOff` (once) on those of ``layers`` that transformers
    hands its caches to: its checkpointable layers and the other modules it defines (a
    Mamba mixer, an attention)."""
    for layer in layers:
        if not (is_hf_layer_class(type(layer)) or library_of(layer) == "transformers"):
            continue
        if not any(isinstance(h, CacheWritesOff) for h in layer._forward_pre_hooks.values()):
            hook = CacheWritesOff()
            hook.handle = layer.register_forward_pre_hook(hook, with_kwargs=True)


def cache_writes_on(layers: Iterable[nn.Module]) -> None:
    """Remove the hooks :func:`cache_writes_off` registered."""
    for layer in layers:
        for hook in list(layer._forward_pre_hooks.values()):
            if isinstance(hook, CacheWritesOff):
                hook.handle.remove()


_SAID = {
    ("checkpointed", True): (
        "is checkpointed in training and given a cache ({caches}): its forward and each "
        "recomputation run on their own copy of the cache as the call found it, so it computes what "
        "it computes un-checkpointed, and the cache keeps nothing it writes (no KV cache entries, no "
        "states)."
    ),
    ("checkpointed", False): (
        "is checkpointed and given objects that hold state ({caches}): its forward writes them as "
        "without checkpointing, and each recomputation runs on its own copy of them as the forward "
        "found them, so it computes what the forward computed and writes nothing twice."
    ),
    ("candidate", True): (
        "is a candidate of the budget and given a cache ({caches}): in training, checkpointed or not, "
        "it runs on a copy of the cache as the call found it, so that neither the cache nor the step's "
        "memory depends on the plan; the cache keeps nothing it writes (no KV cache entries, no states)."
    ),
}


def _note(region: Any, caches: GivenCaches, role: str) -> None:
    """Say once per module class (or function), role and kind how the region treats what
    it is given."""
    module = isinstance(region, nn.Module)
    copied = bool(caches.copied)
    key = (type(region) if module else getattr(region, "__qualname__", type(region)), role, copied)
    if key in _noted:
        return
    _noted.add(key)
    names = _parameters(type(region)) if module else []
    described = ", ".join(
        f"{names[place] if isinstance(place, int) and place < len(names) else place}: {kind}"
        for place, kind in caches.places
    )
    name = type(region).__name__ if module else getattr(region, "__qualname__", type(region).__name__)
    note(f"{name} " + _SAID[role, copied].format(caches=described))


@functools.lru_cache(maxsize=None)
def _parameters(cls: type) -> List[str]:
    """The names of ``cls.forward``'s positional parameters after ``self``."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

"""Hugging Face transformers' checkpointable layers and KV caches, recognised without
importing it.

transformers marks the layers its own gradient checkpointing checkpoints as subclasses of
``GradientCheckpointingLayer``. A model built by transformers has imported the module
that defines it; when that module is absent, no module can be such a layer, and importing
transformers on our account would cost seconds.

Also here: the flags by which transformers, diffusers and timm modules switch their own
gradient checkpointing on (:data:`_FLAGS`), torch's ``CheckpointWrapper`` switched the same
way (:data:`_WRAPPER_SWITCH`), and how to keep each library's off.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn


__all__ = [
    "cache_class",
    "cache_free_arguments",
    "checkpointing_flagged",
    "call_directly",
    "checkpointing_on",
    "describe_flags",
    "flags_on",
    "flagged",
    "fresh_caches",
    "hf_layer_class",
    "how_to_keep_off",
    "is_hf_layer_class",
    "library_of",
    "owners",
    "switch_off",
]

def _loaded(module: str, name: str) -> Optional[type]:
    """The class ``name`` of ``module``, if that module is loaded."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def cache_class() -> Optional[type]:
    """transformers' ``Cache``, if transformers is loaded."""
    return _loaded("transformers.cache_utils", "Cache")


# Per class, since every checkpointed forward asks. Sound because a class can only derive
# from the layer class once it exists.
_KNOWN: Dict[type, bool] = {}


def hf_layer_class() -> Optional[type]:
    """transformers' ``GradientCheckpointingLayer``, if transformers is loaded."""
    return _loaded("transformers.modeling_layers", "GradientCheckpointingLayer")


def is_hf_layer_class(cls: type) -> bool:
    """Whether instances of ``cls`` are layers transformers checkpoints itself."""
    if torch.compiler.is_compiling():
        return _looked_up_eagerly(cls)
    return _looked_up(cls)


def _looked_up(cls: type) -> bool:
    known = _KNOWN.get(cls)
    if known is None:
        layer_class = hf_layer_class()
        known = _KNOWN[cls] = layer_class is not None and issubclass(cls, layer_class)
    return known


# Under torch.compile, called eagerly and its answer built into the graph: traced, the
# look-up in sys.modules would guard on its size, and any later import would recompile.
_looked_up_eagerly = torch.compiler.assume_constant_result(_looked_up)


_FLAGS = ("gradient_checkpointing", "grad_checkpointing")
"""Attributes by which a module says it checkpoints itself or parts of itself:
transformers' layers and stacks and diffusers' blocks (``gradient_checkpointing``), timm's
models and stages (``grad_checkpointing``)."""

_SWITCHES = {
    "transformers": (
        "model.gradient_checkpointing_disable() (no gradient_checkpointing_enable()), "
        "TrainingArguments(gradient_checkpointing=False), and with TRL, whose SFTConfig turns "
        "it on by default, SFTConfig(gradient_checkpointing=False)"
    ),
    "diffusers": "no model.enable_gradient_checkpointing() (or model.disable_gradient_checkpointing())",
    "timm": "no model.set_grad_checkpointing() (or model.set_grad_checkpointing(False))",
    "torch": (
        "no checkpoint_wrapper() or apply_activation_checkpointing() on a model ckptwrap wraps "
        "(ckptwrap keeps the wrappers, so no parameter is renamed, and calls their modules directly)"
    ),
}

_WRAPPER_SWITCH = "checkpoint_fn"
"""The attribute through which torch's ``CheckpointWrapper`` checkpoints its module: while
ckptwrap checkpoints the model it is :func:`call_directly`, as a flag would be off."""


def call_directly(function: Any, *args: Any, **kwargs: Any) -> Any:
    """What a switched-off torch ``CheckpointWrapper`` runs instead of torch's checkpoint."""
    return function(*args, **kwargs)


def _torch_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is torch's ``CheckpointWrapper`` (``checkpoint_wrapper``,
    ``apply_activation_checkpointing``), looked up only where torch has loaded it."""
    wrapper = _loaded("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper")
    return wrapper is not None and isinstance(module, wrapper) and hasattr(module, _WRAPPER_SWITCH)


def flagged(module: nn.Module) -> bool:
    """Whether ``module`` carries a library's own checkpointing flag (``_FLAGS``)."""
    return any(isinstance(getattr(module, flag, None), bool) for flag in _FLAGS)


def checkpointing_flagged(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The modules of ``model`` that carry a library's own checkpointing flag, and torch's
    ``CheckpointWrapper`` modules, by qualified name."""
    return [(name, m) for name, m in model.named_modules() if flagged(m) or _torch_wrapper(m)]


def checkpointing_on(module: nn.Module) -> bool:
    """Whether a library's own gradient checkpointing is on for ``module`` (asked before
    every training forward of a wrapped model: no list is built)."""
    return any(getattr(module, flag, None) is True for flag in _FLAGS) or _wrapper_on(module)


def flags_on(module: nn.Module) -> List[str]:
    """The checkpointing flags that are on in ``module`` (:data:`_WRAPPER_SWITCH` for a
    torch ``CheckpointWrapper`` that checkpoints)."""
    on = [flag for flag in _FLAGS if getattr(module, flag, None) is True]
    return on + [_WRAPPER_SWITCH] if _wrapper_on(module) else on


def _wrapper_on(module: nn.Module) -> bool:
    return _torch_wrapper(module) and getattr(module, _WRAPPER_SWITCH) is not call_directly


def switch_off(module: nn.Module, flag: str) -> Any:
    """Turn ``flag`` off in ``module``; returns what turns it back on."""
    before = getattr(module, flag)
    setattr(module, flag, call_directly if flag == _WRAPPER_SWITCH else False)
    return before


def describe_flags(flags: List[str]) -> str:
    """``its gradient_checkpointing flag is on``, or that a torch wrapper checkpoints."""
    named = [flag for flag in flags if flag != _WRAPPER_SWITCH]
    parts = [f"its {' / '.join(named)} flag is on"] if named else []
    if _WRAPPER_SWITCH in flags:
        parts.append("torch's CheckpointWrapper is on")
    return "; ".join(parts)


def library_of(module: nn.Module) -> str:
    """The library ``module``'s class comes from (its top package), e.g. ``diffusers``."""
    return type(module).__module__.split(".")[0]


def owners(libraries: List[str]) -> str:
    """``transformers'``, ``timm's``, ``diffusers' and timm's``: whose checkpointing."""
    return " and ".join(name + ("'" if name.endswith("s") else "'s") for name in libraries)


def how_to_keep_off(libraries: List[str]) -> str:
    """How to leave these libraries' own checkpointing off, in their terms."""
    known = [_SWITCHES[name] for name in libraries if name in _SWITCHES]
    return "; ".join(known) if known else "switch the library's own gradient checkpointing off"


def fresh_caches(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``args`` and ``kwargs`` with every transformers KV cache among them deep-copied.

    A run of the model that is not the caller's own (a measurement) writes keys and values
    into the cache it is given; on a copy, the caller's cache stays as the caller left it
    and the next run does not find it written already.
    """
    kind = cache_class()
    if kind is None:
        return args, kwargs
    memo: Dict[int, Any] = {}  # one cache passed twice stays one object

    def fresh(value: Any) -> Any:
        return copy.deepcopy(value, memo) if isinstance(value, kind) else value

    return tuple(fresh(a) for a in args), {key: fresh(value) for key, value in kwargs.items()}


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

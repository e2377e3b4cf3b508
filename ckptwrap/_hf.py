"""Hugging Face transformers' checkpointable layers, recognised without importing it.

transformers marks the layers its own gradient checkpointing checkpoints as subclasses of
``GradientCheckpointingLayer``. A model built by transformers has imported the module
that defines it; when that module is absent, no module can be such a layer, and importing
transformers on our account would cost seconds.
"""

from __future__ import annotations

import sys
from typing import Dict, Optional

__all__ = ["hf_layer_class", "is_hf_layer_class"]

_LAYERS_MODULE = "transformers.modeling_layers"
_LAYER_CLASS = "GradientCheckpointingLayer"

# Per class, since every checkpointed forward asks (a plain dict, which the compiler
# reads). Sound because a class can only derive from the layer class once it exists.
_KNOWN: Dict[type, bool] = {}


def hf_layer_class() -> Optional[type]:
    """transformers' ``GradientCheckpointingLayer``, if transformers is loaded."""
    layers = sys.modules.get(_LAYERS_MODULE)
    layer_class = getattr(layers, _LAYER_CLASS, None)
    return layer_class if isinstance(layer_class, type) else None


def is_hf_layer_class(cls: type) -> bool:
    """Whether instances of ``cls`` are layers transformers checkpoints itself."""
    known = _KNOWN.get(cls)
    if known is None:
        layer_class = hf_layer_class()
        known = _KNOWN[cls] = layer_class is not None and issubclass(cls, layer_class)
    return known

"""``max_shapes``: the largest shapes a model's inputs will take, checked against what
its forward takes and against example inputs, before anything is planned."""

from __future__ import annotations

import inspect
from typing import Any, Dict, Mapping, Optional, Set, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..planner import read_layout

__all__ = ["check_max_shapes"]


def check_max_shapes(model: nn.Module, max_shapes: Any, example: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = None) -> None:
    """Refuse a ``max_shapes`` that cannot describe this model's inputs: not a mapping, a
    key its forward does not take, a shape that is not positive whole sizes; with
    ``example`` inputs, a key that is not one tensor of theirs or a shape of another rank.

    Raises:
        CheckpointConfigError: Naming the key and the value, and what is allowed.
    """
    if max_shapes is None:
        return
    if not isinstance(max_shapes, Mapping):
        raise CheckpointConfigError(
            f"max_shapes must map an input's keyword (or position, an int) to its largest "
            f"shape, such as {{'input_ids': (8, 1024)}}; got {type(max_shapes).__name__}."
        )
    keywords, positions = _forward_parameters(model)
    for key, shape in max_shapes.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise CheckpointConfigError(
                f"max_shapes keys are the forward's keyword names or positions (ints); got "
                f"{key!r} ({type(key).__name__})."
            )
        if isinstance(key, str) and keywords is not None and key not in keywords:
            raise CheckpointConfigError(
                f"max_shapes names {key!r}, which {type(model).__name__}.forward does not take; "
                f"its arguments are {', '.join(sorted(keywords)) or 'none'}."
            )
        if isinstance(key, int) and (key < 0 or (positions is not None and key >= positions)):
            raise CheckpointConfigError(
                f"max_shapes names position {key}, but {type(model).__name__}.forward takes "
                f"{positions} positional argument(s) (positions 0 to {max(0, (positions or 0) - 1)})."
            )
        sizes = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise CheckpointConfigError(
                f"max_shapes[{key!r}] must be a shape of whole sizes of at least 1, such as "
                f"(8, 1024); got {shape!r}."
            )
    if example is not None:
        read_layout(*example).declared(max_shapes)


def _forward_parameters(model: nn.Module) -> Tuple[Optional[Set[str]], Optional[int]]:
    """The keyword names and the number of positional arguments the model's forward takes;
    None for either where it takes any (``**kwargs``, ``*args``) or cannot be read."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None, None
    kinds = inspect.Parameter
    names: Optional[Set[str]] = set()
    positions: Optional[int] = 0
    for parameter in signature.parameters.values():
        if parameter.kind is kinds.VAR_KEYWORD:
            names = None
        elif parameter.kind is kinds.VAR_POSITIONAL:
            positions = None
        else:
            if names is not None and parameter.kind is not kinds.POSITIONAL_ONLY:
                names.add(parameter.name)
            if positions is not None and parameter.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD):
                positions += 1
    return names, positions

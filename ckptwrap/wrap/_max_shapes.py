"""``max_shapes``: the largest shapes a model's inputs will take, checked against what
its forward takes and against example inputs, before anything is planned; and against the
first training forward's inputs, where the forward takes any keyword (``**kwargs``)."""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..planner import read_layout

__all__ = ["check_max_shapes", "unreceived"]


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


def unreceived(
    model: nn.Module, max_shapes: Mapping[Any, Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Optional[str]:
    """What to say where ``max_shapes`` names an input that this training forward did not
    receive as one tensor of that shape's rank (a forward that takes ``**kwargs`` lets any
    key through :func:`check_max_shapes`): the planner could not apply that key, ever, so
    it would be ignored without a word. None where every key applies."""
    layout = read_layout(args, kwargs)
    problems: List[str] = []
    for key, shape in max_shapes.items():
        try:
            layout.declared({key: shape})
        except CheckpointConfigError as error:
            problems.append(_why_unreceived(model, key, args, kwargs, str(error)))
    if not problems:
        return None
    received = [f"{len(args)} positional input(s) (0 to {len(args) - 1})"] if args else ["no positional input"]
    received.append(f"keywords {', '.join(map(repr, kwargs))}" if kwargs else "no keyword input")
    return (
        f"max_shapes does not apply to the inputs of {type(model).__name__}'s training forward, "
        f"which received {' and '.join(received)}: {'; '.join(problems)}. Those keys are "
        f"ignored, and the budget is read at the shapes seen; key max_shapes by the names the "
        f"forward receives (or positions, as ints)."
    )


def _why_unreceived(model: nn.Module, key: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], declared: str) -> str:
    """Why one key does not apply: not received, received by position, or not one tensor
    of that rank (the layout's own words)."""
    if isinstance(key, str) and key not in kwargs:
        position = _position_of(model, key, args)
        if position is not None:
            return f"{key!r} was received by position, as input {position}: key it {position}"
        return f"{key!r} was not received"
    if isinstance(key, int) and key >= len(args):
        return f"position {key} was not received"
    return declared.rstrip(".")


def _position_of(model: nn.Module, name: str, args: Tuple[Any, ...]) -> Optional[int]:
    """The position among ``args`` that the forward's parameter ``name`` takes, if given."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    positional = [p.name for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    if name in positional and positional.index(name) < len(args):
        return positional.index(name)
    return None

"""The modules a library's own gradient checkpointing checkpoints, read from its code.

diffusers, timm and some transformers models switch their checkpointing on with a flag
on the modules that do it (``gradient_checkpointing``, timm's ``grad_checkpointing``),
and those modules' forwards hand the units to a checkpoint function: diffusers'
``self._gradient_checkpointing_func(resnet, hidden_states, temb)``, timm's
``checkpoint_seq(self.blocks, x)`` or ``checkpoint(blk, x)``, torch's
``checkpoint(create_custom_forward(layer), ...)``. No list of class names says which
modules those are, and the model is never run to find out: the forward's source is
parsed once per class, and the first argument of each checkpoint call is followed back
to the module's own children (``self.mid_block``), or to the members of a container the
forward loops over (``for resnet, attn in zip(self.resnets, self.attentions)``).

A call whose unit cannot be followed back (built elsewhere, passed in) is left out, and
so is a class whose source cannot be read: the ``blocks`` term then falls back on what
repeats.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Dict, List, Optional, Sequence, Set, Tuple

from torch import nn

from .._hf import FLAGS

__all__ = ["library_units"]

_UNIT_CALLS = frozenset({"_gradient_checkpointing_func", "checkpoint", "checkpoint_module"})
"""Functions whose first argument is one checkpointed unit."""
_SEQUENCE_CALLS = frozenset({"checkpoint_seq", "checkpoint_sequential"})
"""Functions that checkpoint the members of the container given first (timm's
``checkpoint_seq`` one by one by default; torch's ``checkpoint_sequential`` in segments,
taken here member by member)."""

Unit = Tuple[str, Optional[Tuple[Optional[int], Optional[int]]]]
"""``(attr, None)``: the child module ``attr`` is a unit; ``(attr, (start, stop))``: each
member of the container child ``attr`` in that slice is one (``self.resnets[1:]``;
``(None, None)`` for all of them)."""

_ALL = (None, None)


def library_units(named: Sequence[Tuple[str, nn.Module]]) -> Set[str]:
    """Qualified names of the modules (never the root) that the libraries' own gradient
    checkpointing would checkpoint, for ``named`` (``model.named_modules()``, root first)."""
    known = {name for name, _ in named}
    found: Set[str] = set()
    for name, module in named:
        if not any(isinstance(getattr(module, flag, None), bool) for flag in FLAGS):
            continue
        prefix = f"{name}." if name else ""
        for attr, members in _units_of(type(module)):
            child = getattr(module, attr, None)
            if not isinstance(child, nn.Module):
                continue
            if members is None:
                names = [prefix + attr]
            else:
                keys = [key for key, _ in child.named_children()][slice(*members)]
                names = [f"{prefix}{attr}.{key}" for key in keys]
            found.update(each for each in names if each in known and each)
    return found


@functools.lru_cache(maxsize=None)
def _units_of(cls: type) -> Tuple[Unit, ...]:
    """What the forward of ``cls`` hands to a checkpoint function (see the module)."""
    forward = getattr(cls, "forward", None)
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()
    function = next((node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if function is None or not function.args.args:
        return ()
    own = function.args.args[0].arg  # ``self``
    loops = _loop_sources(function, own)
    units: List[Unit] = []
    for node in ast.walk(function):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        called = _called_name(node.func)
        if called in _SEQUENCE_CALLS:
            found = _own_members(node.args[0], own)
            if found is not None:
                units.append(found)
        elif called in _UNIT_CALLS:
            units.extend(_resolve(_unwrapped(node.args[0]), own, loops))
    return tuple(dict.fromkeys(units))


def _called_name(func: ast.expr) -> Optional[str]:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _unwrapped(value: ast.expr) -> ast.expr:
    """The module behind ``create_custom_forward(m)``, ``partial(m, ...)``,
    ``m.__call__`` or ``m.forward``."""
    while True:
        if isinstance(value, ast.Call) and value.args and not isinstance(value.func, ast.Lambda):
            name = _called_name(value.func) or ""
            if "custom_forward" in name or name == "partial":
                value = value.args[0]
                continue
        if isinstance(value, ast.Attribute) and value.attr in ("__call__", "forward"):
            value = value.value
            continue
        return value


def _own_attribute(value: ast.expr, own: str) -> Optional[str]:
    """``attr`` for ``self.attr``."""
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == own:
        return value.attr
    return None


def _own_members(value: ast.expr, own: str) -> Optional[Unit]:
    """The members ``value`` names: ``self.attr`` (all of them), ``self.attr[1:]``,
    ``self.attr[0]`` (constant bounds), ``self.attr[i]`` (any of them: all)."""
    bounds = _ALL
    if isinstance(value, ast.Subscript):
        index = value.slice
        if isinstance(index, ast.Slice) and index.step is None:
            bounds = (_constant(index.lower), _constant(index.upper))
        elif isinstance(_constant(index), int):
            first = _constant(index)
            bounds = (first, None if first == -1 else first + 1)  # type: ignore[operator]
        value = value.value
    attr = _own_attribute(value, own)
    return None if attr is None else (attr, bounds)


def _constant(node: Optional[ast.expr]) -> Optional[int]:
    """An int written in the source (``1``, ``-1``); None for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constant(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _resolve(value: ast.expr, own: str, loops: Dict[str, Unit]) -> List[Unit]:
    if isinstance(value, ast.Attribute):
        attr = _own_attribute(value, own)
        return [] if attr is None else [(attr, None)]
    if isinstance(value, ast.Subscript):
        found = _own_members(value, own)
        return [] if found is None else [found]
    if isinstance(value, ast.Name) and value.id in loops:
        return [loops[value.id]]
    return []


def _loop_sources(function: ast.AST, own: str) -> Dict[str, Unit]:
    """Per loop variable of ``function``, the container child it runs over: ``for b in
    self.blocks``, ``for i, b in enumerate(self.blocks)``, ``for r, a in
    zip(self.resnets, self.attentions)``, also through a name assigned such an iterable
    (``blocks = list(zip(...))``) and ``list``, ``tuple`` or ``reversed`` around it."""
    assigned = {
        node.targets[0].id: node.value
        for node in ast.walk(function)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }
    found: Dict[str, Unit] = {}

    def bind(target: ast.expr, source: ast.expr, depth: int = 0) -> None:
        if depth > 8:
            return
        if isinstance(source, ast.Name) and source.id in assigned:
            bind(target, assigned[source.id], depth + 1)
            return
        called = _called_name(source.func) if isinstance(source, ast.Call) else None
        if called in ("list", "tuple", "reversed") and len(source.args) == 1:  # type: ignore[union-attr]
            bind(target, source.args[0], depth + 1)  # type: ignore[union-attr]
        elif called == "enumerate" and source.args and isinstance(target, ast.Tuple) and len(target.elts) == 2:  # type: ignore[union-attr]
            bind(target.elts[1], source.args[0], depth + 1)  # type: ignore[union-attr]
        elif called == "zip" and isinstance(target, ast.Tuple):
            for each, over in zip(target.elts, source.args):  # type: ignore[union-attr]
                bind(each, over, depth + 1)
        elif isinstance(target, ast.Name):
            members = _own_members(source, own)
            if members is not None:
                found[target.id] = members

    for node in ast.walk(function):
        if isinstance(node, (ast.For, ast.comprehension)):
            bind(node.target, node.iter)
    return found

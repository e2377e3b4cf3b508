"""The modules a library's own gradient checkpointing checkpoints, read from its code.

diffusers, timm and some transformers models switch their checkpointing on with a flag
on the modules that do it (``gradient_checkpointing``, timm's ``grad_checkpointing``),
and those modules' forwards hand the units to a checkpoint function: diffusers'
``self._gradient_checkpointing_func(resnet, hidden_states, temb)``, timm's
``checkpoint_seq(self.blocks, x)`` or ``checkpoint(blk, x)``, torch's
``checkpoint(create_custom_forward(layer), ...)``. No list of class names says which
modules those are, and the model is never run to find out: the forward's source, and
that of the methods it calls on itself (timm's ``forward_features``), is parsed once per
class, and the first argument of each checkpoint call is followed back
to the module's own children (``self.mid_block``), or to the members of a container the
forward loops over (``for resnet, attn in zip(self.resnets, self.attentions)``), or to
the members ``checkpoint_seq`` runs (``self.children()``, ``flatten=True``: the members'
members, ``skip_last=True``: all but the last).

A call whose unit cannot be followed back (built elsewhere, passed in) is left out, and
so is a class whose source cannot be read: the ``blocks`` term then falls back on what
repeats.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

from torch import nn

from .._hf import flagged

__all__ = ["code_units", "library_units"]

_UNIT_CALLS = frozenset({"_gradient_checkpointing_func", "checkpoint", "checkpoint_module"})
"""Functions whose first argument is one checkpointed unit."""
_SEQUENCE_CALLS = frozenset({"checkpoint_seq", "checkpoint_sequential"})
"""Functions that checkpoint the members of the container given first (timm's
``checkpoint_seq`` one by one by default; torch's ``checkpoint_sequential`` in segments,
taken here member by member)."""

class Unit(NamedTuple):
    """What one checkpoint call hands over, relative to the module whose forward makes it."""

    attr: str
    """The child named so; ``""`` for the module itself (``checkpoint_seq(self.children(), x)``)."""
    members: Optional[Tuple[Optional[int], Optional[int]]] = None
    """None: the child is the unit; ``(start, stop)``: each of its members in that slice
    is one (``self.resnets[1:]``; ``(None, None)`` for all of them)."""
    flatten: bool = False
    """Each member's own members are the units (timm's ``checkpoint_seq(..., flatten=True)``)."""
    but_last: bool = False
    """The last of those units is run unchecked (``skip_last=True``)."""


_ALL = (None, None)
_MAX_METHODS = 16
"""Methods read per class: the forward and those it calls on ``self``, transitively."""


def library_units(named: Sequence[Tuple[str, nn.Module]]) -> Set[str]:
    """Qualified names of the modules (never the root) that the libraries' own gradient
    checkpointing would checkpoint, for ``named`` (``model.named_modules()``, root first)."""
    known = {name for name, _ in named}
    found: Set[str] = set()
    for name, module in named:
        if flagged(module):
            for unit in _units_of(type(module)):
                found.update(each for each in _names_of(unit, module, name) if each in known and each)
    return found


def code_units(named: Sequence[Tuple[str, nn.Module]]) -> Dict[str, str]:
    """Modules the model's own code checkpoints, with no library flag to switch it off: a
    forward (or a method it calls) that hands them to ``torch.utils.checkpoint`` (or any
    function of those names), unless it does so only under ``if self.flag:`` with the flag
    off now. Each qualified name, with the qualified name of the module whose code does it
    (``""``: the model itself)."""
    known = {name for name, _ in named}
    found: Dict[str, str] = {}
    for name, module in named:
        if flagged(module) or type(module).__module__.split(".")[0] == "ckptwrap":
            continue
        for unit, guards in _guarded_units_of(type(module)):
            if _may_run(guards, module):
                for each in _names_of(unit, module, name):
                    if each in known and each:
                        found.setdefault(each, name)
    return found


def _names_of(unit: Unit, module: nn.Module, name: str) -> List[str]:
    """The qualified names ``unit`` stands for in ``module`` (named ``name``)."""
    child = getattr(module, unit.attr, None) if unit.attr else module
    if not isinstance(child, nn.Module):
        return []
    base = (f"{name}." if name else "") + unit.attr if unit.attr else name
    return [base] if unit.members is None else _member_names(base, child, unit)


_SWITCHES = ("set_grad_checkpointing", "gradient_checkpointing_enable", "enable_gradient_checkpointing")
"""Methods by which timm, transformers and diffusers models switch their checkpointing on."""


def switchable(module: nn.Module) -> bool:
    """Whether a library switches checkpointing on for ``module``: a flag on it, or a
    method that sets its parts' flags (timm's ``set_grad_checkpointing``)."""
    return flagged(module) or any(callable(getattr(type(module), name, None)) for name in _SWITCHES)


def _member_names(base: str, container: nn.Module, unit: Unit) -> List[str]:
    prefix = f"{base}." if base else ""
    members = list(container.named_children())[slice(*unit.members)]  # type: ignore[misc]
    if unit.flatten:
        names = [f"{prefix}{key}.{inner}" for key, member in members for inner, _ in member.named_children()]
    else:
        names = [prefix + key for key, _ in members]
    return names[:-1] if unit.but_last else names


Guard = Tuple[ast.expr, bool, str]
"""An ``if`` around a checkpoint call: its test, whether the call is in its body (else in
its ``else``), and the name ``self`` has in that method."""


@functools.lru_cache(maxsize=None)
def _units_of(cls: type) -> Tuple[Unit, ...]:
    """What the forward of ``cls``, and the methods it calls on itself (timm's
    ``forward_features``), hand to a checkpoint function (see the module)."""
    return tuple(dict.fromkeys(unit for unit, _ in _guarded_units_of(cls)))


@functools.lru_cache(maxsize=None)
def _guarded_units_of(cls: type) -> Tuple[Tuple[Unit, Tuple[Guard, ...]], ...]:
    """:func:`_units_of`, each unit with the ``if`` tests around the call that hands it over."""
    units: List[Tuple[Unit, Tuple[Guard, ...]]] = []
    queue, read = ["forward"], set()
    while queue and len(read) < _MAX_METHODS:
        method = queue.pop(0)
        if method in read:
            continue
        read.add(method)
        function = _parsed(getattr(cls, method, None))
        if function is None or not function.args.args:
            continue
        own = function.args.args[0].arg  # ``self``
        units.extend(_units_in(function, own))
        queue.extend(_own_calls(function, own))
    return tuple(units)


def _guarded_calls(node: ast.AST, guards: Tuple[Guard, ...], own: str) -> Iterator[Tuple[ast.Call, Tuple[Guard, ...]]]:
    """Every call under ``node``, with the ``if`` tests it runs under."""
    if isinstance(node, (ast.If, ast.IfExp)):
        yield from _guarded_calls(node.test, guards, own)
        body = node.body if isinstance(node.body, list) else [node.body]
        orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
        for child in body:
            yield from _guarded_calls(child, guards + ((node.test, True, own),), own)
        for child in orelse:
            yield from _guarded_calls(child, guards + ((node.test, False, own),), own)
        return
    if isinstance(node, ast.Call):
        yield node, guards
    for child in ast.iter_child_nodes(node):
        yield from _guarded_calls(child, guards, own)


def _may_run(guards: Tuple[Guard, ...], module: nn.Module) -> bool:
    """Whether no test around a call is known to send the run past it, reading the
    module's boolean attributes (``self.use_checkpoint``) as they are now."""
    return all(_known(test, module, own) in (None, body) for test, body, own in guards)


def _known(test: ast.expr, module: nn.Module, own: str) -> Optional[bool]:
    """The value of ``test`` where the module's boolean attributes decide it, else None."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _known(test.operand, module, own)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        values = [_known(value, module, own) for value in test.values]
        decisive = isinstance(test.op, ast.Or)  # True decides an ``or``, False an ``and``
        if decisive in values:
            return decisive
        return (not decisive) if all(value is not None for value in values) else None
    attr = _own_attribute(test, own)
    value = getattr(module, attr, None) if attr and attr != "training" else None
    return value if isinstance(value, bool) else None


def _parsed(method: object) -> Optional[ast.FunctionDef]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    return next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)), None)


def _own_calls(function: ast.FunctionDef, own: str) -> List[str]:
    """Methods ``function`` calls on ``self`` (``self.forward_features(x)``)."""
    return [
        node.func.attr for node in ast.walk(function)
        if isinstance(node, ast.Call) and _own_attribute(node.func, own) is not None
    ]


def _units_in(function: ast.FunctionDef, own: str) -> List[Tuple[Unit, Tuple[Guard, ...]]]:
    loops = _loop_sources(function, own)
    units: List[Tuple[Unit, Tuple[Guard, ...]]] = []
    for node, guards in _guarded_calls(function, (), own):
        if not node.args:
            continue
        called = _called_name(node.func)
        if called in _SEQUENCE_CALLS:
            units.extend((unit, guards) for unit in _sequence_units(node, own))
        elif called in _UNIT_CALLS:
            units.extend((unit, guards) for unit in _resolve(_unwrapped(node.args[0]), own, loops))
    return units


def _sequence_units(call: ast.Call, own: str) -> List[Unit]:
    """The units of ``checkpoint_seq(first, x, flatten=..., skip_last=...)``: the members
    of ``self.blocks`` or of ``self.children()``, each of ``[self.s1, self.s2]``; with
    ``flatten=True`` their members; with ``skip_last=True`` all but the last."""
    keywords = {kw.arg: kw.value for kw in call.keywords if kw.arg}
    flatten = _true(keywords.get("flatten"))
    skip_last = _true(keywords.get("skip_last"))
    first = call.args[0]
    if isinstance(first, (ast.List, ast.Tuple)):
        attrs = [_own_attribute(each, own) for each in first.elts]
        if None in attrs:
            return []
        # flatten runs the listed containers' members one by one
        units = [Unit(attr, _ALL) if flatten else Unit(attr) for attr in attrs]  # type: ignore[arg-type]
        if skip_last and units:
            if flatten:  # the last container's last member runs unchecked
                units[-1] = units[-1]._replace(but_last=True)
            else:
                units.pop()
        return units
    if isinstance(first, ast.Call) and isinstance(first.func, ast.Attribute) and first.func.attr == "children":
        holder = first.func.value
        attr = "" if _own_name(holder, own) else _own_attribute(holder, own)
        found = None if attr is None else Unit(attr, _ALL)
    else:
        found = _own_members(first, own)
    if found is None:
        return []
    return [found._replace(flatten=flatten, but_last=skip_last and found.members is not None)]


def _true(node: Optional[ast.expr]) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _own_name(value: ast.expr, own: str) -> bool:
    return isinstance(value, ast.Name) and value.id == own


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
    return None if attr is None else Unit(attr, bounds)


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
        return [] if attr is None else [Unit(attr)]
    if isinstance(value, ast.Subscript):
        found = _own_members(value, own)
        return [] if found is None else [found]
    if isinstance(value, ast.Name) and value.id in loops:
        return [loops[value.id]]
    return []


def _loop_sources(function: ast.FunctionDef, own: str) -> Dict[str, Unit]:
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

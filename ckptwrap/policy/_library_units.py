"""The modules a library's own gradient checkpointing checkpoints, read from its code.

diffusers, timm and some transformers models switch their checkpointing on with a flag
on the modules that do it (``gradient_checkpointing``, timm's ``grad_checkpointing``),
and those modules' forwards hand the units to a checkpoint function: diffusers'
``self._gradient_checkpointing_func(resnet, hidden_states, temb)``, timm's
``checkpoint_seq(self.blocks, x)`` or ``checkpoint(blk, x)``, torch's
``checkpoint(create_custom_forward(layer), ...)``. No list of class names says which
modules those are, and the model is never run to find out: the forward's source, and
that of the methods it calls on itself (timm's ``forward_features``), is parsed once per
class, and the first argument of each checkpoint call is followed back to the modules it
can stand for, as a path from the module itself: its children (``self.mid_block``,
``self.mid.block_1``), members of its containers (``self.resnets[1:]``,
``self.up[i].block[j]``, ``self.resnets[i + 1]``: all but the first), and the variables of the loops around the call, each bound to
what its own loop runs over (``for block in self.transformer_blocks``, then ``for block
in self.single_transformer_blocks``: both lists, whatever the variable is called; ``for
resnet, attn in zip(self.resnets, self.attentions)``; a loop over a loop's variable's
members), or of ``checkpoint_seq`` (``self.children()``, ``flatten=True``: the members'
members, ``skip_last=True``: all but the last).

A call whose unit cannot be followed back (built elsewhere, passed in) is left out, and
so is a class whose source cannot be read: the ``blocks`` term then falls back on what
repeats.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Dict, FrozenSet, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

from torch import nn

from .._hf import flagged

__all__ = ["code_units", "decides", "library_units", "unfollowed_calls"]

_UNIT_CALLS = frozenset({"_gradient_checkpointing_func", "checkpoint", "checkpoint_module"})
"""Functions whose first argument is one checkpointed unit."""
_SEQUENCE_CALLS = frozenset({"checkpoint_seq", "checkpoint_sequential"})
"""Functions that checkpoint the members of the container given first (timm's
``checkpoint_seq`` one by one by default; torch's ``checkpoint_sequential`` in segments,
taken here member by member)."""

Step = Union[str, Tuple[Optional[int], Optional[int]]]
"""One step from a module to those a unit names: an attribute, or ``(start, stop)`` for
each of its members in that slice (``(None, None)``: all of them)."""
Path = Tuple[Step, ...]

_ALL: Step = (None, None)


class Unit(NamedTuple):
    """What one checkpoint call hands over, relative to the module whose forward makes it."""

    path: Path
    """The steps from that module to the unit, or to each unit (``()``: the module itself)."""
    but_last: bool = False
    """The last of those units is run unchecked (``skip_last=True``)."""


_MAX_METHODS = 16
"""Methods read per class: the forward and those it calls on ``self``, transitively."""
_MAX_DEPTH = 8
"""How far a variable is followed through the assignments that made it."""


def library_units(named: Sequence[Tuple[str, nn.Module]]) -> Set[str]:
    """Qualified names of the modules (never the root) that the libraries' own gradient
    checkpointing would checkpoint, for ``named`` (``model.named_modules()``, root first)."""
    names = _names_by_identity(named)
    found: Set[str] = set()
    for name, module in named:
        if flagged(module):
            for unit in _units_of(type(module)):
                found.update(each for each in _names_of(unit, module, names) if each)
    return found


def code_units(named: Sequence[Tuple[str, nn.Module]]) -> Dict[str, str]:
    """Modules the model's own code checkpoints, with no library flag to switch it off: a
    forward (or a method it calls) that hands them to ``torch.utils.checkpoint`` (or any
    function of those names), unless it does so only under ``if self.flag:`` with the flag
    off now. Each qualified name, with the qualified name of the module whose code does it
    (``""``: the model itself)."""
    names = _names_by_identity(named)
    found: Dict[str, str] = {}
    for name, module in named:
        if flagged(module) or type(module).__module__.split(".")[0] == "ckptwrap":
            continue
        for unit, guards in _read(type(module))[0]:
            if _may_run(guards, module):
                for each in _names_of(unit, module, names):
                    if each:
                        found.setdefault(each, name)
    return found


_SWITCHES = ("set_grad_checkpointing", "gradient_checkpointing_enable", "enable_gradient_checkpointing")
"""Methods by which timm, transformers and diffusers models switch their checkpointing on."""
_SUPPORT_FLAGS = ("_supports_gradient_checkpointing", "supports_gradient_checkpointing")
"""Class attributes by which diffusers and transformers models say whether that switch works."""


def decides(module: nn.Module) -> bool:
    """Whether a library decides what is checkpointed inside ``module``: it carries a
    library's flag and its own forward (or a method it calls) hands units to a
    checkpoint function, or it has a method that switches its parts' flags (timm's
    ``set_grad_checkpointing``) that its class does not refuse. A flag alone decides
    nothing: a diffusers ``UNet3DConditionModel`` refuses the switch and its blocks
    carry flags they never read; only the transformers inside them checkpoint, each its
    own blocks."""
    if flagged(module) and _units_of(type(module)):
        return True
    if any(getattr(type(module), flag, None) is False for flag in _SUPPORT_FLAGS):
        return False
    return any(callable(getattr(type(module), name, None)) for name in _SWITCHES)


def _names_by_identity(named: Sequence[Tuple[str, nn.Module]]) -> Dict[int, str]:
    """Each module's qualified name, by identity: a module reached by an attribute that
    is not its registered name (an alias) is still named, as ``named_modules()`` names it."""
    names: Dict[int, str] = {}
    for name, module in named:
        names.setdefault(id(module), name)
    return names


def _names_of(unit: Unit, module: nn.Module, names: Dict[int, str]) -> List[str]:
    """The qualified names ``unit`` stands for in ``module``."""
    reached: List[nn.Module] = [module]
    for step in unit.path:
        if isinstance(step, str):
            children = (getattr(each, step, None) for each in reached)
            reached = [child for child in children if isinstance(child, nn.Module)]
        else:
            reached = [child for each in reached for child in list(each.children())[slice(*step)]]
    found = [names[id(each)] for each in reached if id(each) in names]
    return found[:-1] if unit.but_last else found


Guard = Tuple[ast.expr, bool, str]
"""An ``if`` around a checkpoint call: its test, whether the call is in its body (else in
its ``else``), and the name ``self`` has in that method."""
Guards = Tuple[Guard, ...]


@functools.lru_cache(maxsize=None)
def _units_of(cls: type) -> Tuple[Unit, ...]:
    """What the forward of ``cls``, and the methods it calls on itself (timm's
    ``forward_features``), hand to a checkpoint function (see the module)."""
    return tuple(dict.fromkeys(unit for unit, _ in _read(cls)[0]))


def unfollowed_calls(cls: type) -> Tuple[str, ...]:
    """The checkpoint calls in the forward of ``cls`` (and the methods it calls on itself)
    whose unit could not be followed back to its modules, as written."""
    return _read(cls)[1]


@functools.lru_cache(maxsize=None)
def _read(cls: type) -> Tuple[Tuple[Tuple[Unit, Guards], ...], Tuple[str, ...]]:
    """The units of :func:`_units_of`, each with the ``if`` tests around the call that hands
    it over, and the calls of :func:`unfollowed_calls`."""
    units: List[Tuple[Unit, Guards]] = []
    unfollowed: List[str] = []
    queue, read = ["forward"], set()
    while queue and len(read) < _MAX_METHODS:
        method = queue.pop(0)
        if method in read:
            continue
        read.add(method)
        function = _parsed(getattr(cls, method, None))
        if function is None or not function.args.args:
            continue
        own = function.args.args[0].arg  # ``self``, which stands for the module
        reader = _Reader(own)
        reader.statements(function.body, _Scope({own: frozenset({()})}, {}), ())
        units.extend(reader.found)
        unfollowed.extend(reader.unfollowed)
        queue.extend(_own_calls(function, own))
    return tuple(units), tuple(unfollowed)


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


# ------------------------------------------------------------------ reading a method


@dataclasses.dataclass(frozen=True, eq=False)
class _Scope:
    """What the names of a method stand for at one point of it: the modules a variable
    can hold (paths from ``self``), and the expression last assigned to it, to follow
    when the variable is looped over (``blocks = list(zip(self.a, self.b))``)."""

    modules: Dict[str, FrozenSet[Path]]
    values: Dict[str, Tuple[ast.expr, "_Scope"]]

    def bind(self, name: str, paths: FrozenSet[Path], value: Optional[Tuple[ast.expr, "_Scope"]] = None) -> "_Scope":
        """This scope with ``name`` rebound: to nothing known where ``paths`` is empty
        (an inner loop's variable hides an outer one of the same name)."""
        modules = {key: found for key, found in self.modules.items() if key != name}
        values = {key: found for key, found in self.values.items() if key != name}
        if paths:
            modules[name] = paths
        if value is not None:
            values[name] = value
        return _Scope(modules, values)

    def merged(self, other: "_Scope") -> "_Scope":
        """After an ``if``: a name may hold what either branch left in it."""
        modules = {
            key: self.modules.get(key, frozenset()) | other.modules.get(key, frozenset())
            for key in set(self.modules) | set(other.modules)
        }
        return _Scope(modules, {**other.values, **self.values})


class _Reader:
    """Walks one method in the order it runs, keeping each variable bound to what the
    assignment or loop that made it holds, and records each checkpoint call's units with
    the ``if`` tests around it."""

    def __init__(self, own: str) -> None:
        self.own = own
        self.found: List[Tuple[Unit, Guards]] = []
        self.unfollowed: List[str] = []

    def statements(self, body: Iterable[ast.stmt], scope: _Scope, guards: Guards) -> _Scope:
        for statement in body:
            scope = self.statement(statement, scope, guards)
        return scope

    def statement(self, node: ast.stmt, scope: _Scope, guards: Guards) -> _Scope:
        if isinstance(node, (ast.For, ast.AsyncFor)):
            self.expression(node.iter, scope, guards)
            self.statements(node.body, self.looped(node.target, node.iter, scope), guards)
            self.statements(node.orelse, scope, guards)
            return scope
        if isinstance(node, ast.If):
            self.expression(node.test, scope, guards)
            taken = self.statements(node.body, scope, guards + ((node.test, True, self.own),))
            other = self.statements(node.orelse, scope, guards + ((node.test, False, self.own),))
            return taken.merged(other)
        if isinstance(node, ast.Assign):
            self.expression(node.value, scope, guards)
            for target in node.targets:
                scope = self.assigned(target, node.value, scope)
            return scope
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            self.expression(node.value, scope, guards)
            return self.assigned(node.target, node.value, scope) if isinstance(node, ast.AnnAssign) else scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            # a closure (``def custom_forward(*inputs)``) sees the names around it
            self.statements(node.body, scope, guards)
            return scope
        nested = [
            field for field in ("body", "handlers", "orelse", "finalbody")
            if isinstance(getattr(node, field, None), list)
        ]
        if nested:  # while, with, try: their parts in order, each seeing what came before
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expression(child, scope, guards)
            for field in nested:
                for part in getattr(node, field):
                    if isinstance(part, ast.ExceptHandler):
                        scope = self.statements(part.body, scope, guards)
                    elif isinstance(part, ast.stmt):
                        scope = self.statement(part, scope, guards)
            return scope
        self.expression(node, scope, guards)
        return scope

    def expression(self, node: ast.AST, scope: _Scope, guards: Guards) -> None:
        """Records the checkpoint calls in ``node`` (``a if self.flag else b`` guards ``a``)."""
        if isinstance(node, ast.IfExp):
            self.expression(node.test, scope, guards)
            self.expression(node.body, scope, guards + ((node.test, True, self.own),))
            self.expression(node.orelse, scope, guards + ((node.test, False, self.own),))
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for generator in node.generators:
                self.expression(generator.iter, scope, guards)
                scope = self.looped(generator.target, generator.iter, scope)
            for part in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
                self.expression(part, scope, guards)
            return
        if isinstance(node, ast.Call):
            self.call(node, scope, guards)
        for child in ast.iter_child_nodes(node):
            self.expression(child, scope, guards)

    def call(self, node: ast.Call, scope: _Scope, guards: Guards) -> None:
        if not node.args:
            return
        called = _called_name(node.func)
        if called in _SEQUENCE_CALLS:
            units = self.sequence_units(node, scope)
        elif called in _UNIT_CALLS:
            units = [Unit(path) for path in sorted(self.paths(_unwrapped(node.args[0]), scope), key=repr)]
        else:
            return
        self.found.extend((unit, guards) for unit in units)
        if not units:
            self.unfollowed.append(ast.unparse(node.args[0]))

    def assigned(self, target: ast.expr, value: ast.expr, scope: _Scope) -> _Scope:
        if isinstance(target, ast.Name):
            return scope.bind(target.id, self.paths(value, scope), (value, scope))
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for each, part in zip(target.elts, value.elts):  # ``a, b = self.a, self.b``
                    scope = self.assigned(each, part, scope)
            else:
                scope = _unbound(target, scope)
        return scope

    def looped(self, target: ast.expr, source: ast.expr, scope: _Scope, depth: int = 0) -> _Scope:
        """``scope`` inside ``for target in source``: each name of the target bound to the
        members of what it runs over, through ``enumerate``, ``zip``, ``list``,
        ``tuple``, ``reversed``, ``.items()``, ``.values()``, and variables assigned those."""
        if depth > _MAX_DEPTH:
            return _unbound(target, scope)
        if isinstance(source, ast.Name) and source.id in scope.values and source.id not in scope.modules:
            value, made_in = scope.values[source.id]
            inner = self.looped(target, value, made_in, depth + 1)
            return _rebound(target, inner, scope)
        called = _called_name(source.func) if isinstance(source, ast.Call) else None
        arguments = source.args if isinstance(source, ast.Call) else []
        if called in ("list", "tuple", "reversed", "sorted") and len(arguments) == 1:
            return self.looped(target, arguments[0], scope, depth + 1)
        if called == "enumerate" and arguments and _pair(target):
            scope = _unbound(target.elts[0], scope)  # type: ignore[attr-defined]
            return self.looped(target.elts[1], arguments[0], scope, depth + 1)  # type: ignore[attr-defined]
        if called == "zip" and isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == len(arguments):
            for each, over in zip(target.elts, arguments):
                scope = self.looped(each, over, scope, depth + 1)
            return scope
        if called == "items" and _pair(target) and isinstance(source.func, ast.Attribute):  # type: ignore[union-attr]
            values = self.members(source.func.value, scope)  # type: ignore[union-attr]
            scope = _unbound(target.elts[0], scope)  # type: ignore[attr-defined]
            return self.bound(target.elts[1], values, scope)  # type: ignore[attr-defined]
        return self.bound(target, self.members(source, scope), scope)

    def bound(self, target: ast.expr, paths: FrozenSet[Path], scope: _Scope) -> _Scope:
        if isinstance(target, ast.Name):
            return scope.bind(target.id, paths)
        return _unbound(target, scope)

    def members(self, source: ast.expr, scope: _Scope) -> FrozenSet[Path]:
        """The modules a loop over ``source`` yields."""
        if isinstance(source, ast.Subscript) and isinstance(source.slice, ast.Slice):
            return self.paths(source, scope)  # a slice's members, already one by one
        holder = source.func if isinstance(source, ast.Call) else None
        if isinstance(holder, ast.Attribute) and holder.attr in ("values", "children"):  # ModuleDict, children()
            return frozenset(path + (_ALL,) for path in self.paths(holder.value, scope))
        return frozenset(path + (_ALL,) for path in self.paths(source, scope))

    def paths(self, value: ast.expr, scope: _Scope, depth: int = 0) -> FrozenSet[Path]:
        """The modules ``value`` can be, as paths from ``self``: ``self.attr``,
        ``self.attr[1:]``, ``self.attr[0]`` (constant bounds), ``self.attr[i]`` (any of
        them), ``block.attentions`` for a loop variable ``block``, ``a if c else b``."""
        if depth > _MAX_DEPTH:
            return frozenset()
        if isinstance(value, ast.Name):
            return scope.modules.get(value.id, frozenset())
        if isinstance(value, ast.Attribute):
            inner = self.paths(value.value, scope, depth + 1)
            if value.attr in ("__call__", "forward"):
                return inner
            return frozenset(path + (value.attr,) for path in inner)
        if isinstance(value, ast.Subscript):
            step = _members_step(value.slice)
            return frozenset(path + (step,) for path in self.paths(value.value, scope, depth + 1))
        if isinstance(value, ast.IfExp):
            return self.paths(value.body, scope, depth + 1) | self.paths(value.orelse, scope, depth + 1)
        if isinstance(value, ast.Call) and _called_name(value.func) == "getattr" and len(value.args) >= 2:
            name = value.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                return frozenset(path + (name.value,) for path in self.paths(value.args[0], scope, depth + 1))
        return frozenset()

    def sequence_units(self, call: ast.Call, scope: _Scope) -> List[Unit]:
        """The units of ``checkpoint_seq(first, x, flatten=..., skip_last=...)``: the members
        of ``self.blocks`` or of ``self.children()``, each of ``[self.s1, self.s2]``; with
        ``flatten=True`` their members; with ``skip_last=True`` all but the last."""
        keywords = {kw.arg: kw.value for kw in call.keywords if kw.arg}
        flatten = _true(keywords.get("flatten"))
        skip_last = _true(keywords.get("skip_last"))
        first = call.args[0]
        if isinstance(first, (ast.List, ast.Tuple)):
            parts = [self.paths(each, scope) for each in first.elts]
            if not all(len(paths) == 1 for paths in parts):
                return []
            # flatten runs the listed containers' members one by one
            units = [Unit(next(iter(paths)) + ((_ALL,) if flatten else ())) for paths in parts]
            if skip_last and units:
                if flatten:  # the last container's last member runs unchecked
                    units[-1] = units[-1]._replace(but_last=True)
                else:
                    units.pop()
            return units
        found = sorted(self.members(first, scope), key=repr)
        if len(found) != 1:
            return []
        path = found[0] + ((_ALL,) if flatten else ())
        return [Unit(path, but_last=skip_last)]


def _members_step(index: ast.expr) -> Step:
    """The members ``container[index]`` names: a slice with constant bounds, one constant
    position, those from k on for ``i + k`` (``self.resnets[i + 1]``: all but the first),
    or any of them (``self.blocks[i]``)."""
    if isinstance(index, ast.Slice):
        return (_constant(index.lower), _constant(index.upper)) if index.step is None else _ALL
    first = _constant(index)
    if first is None:
        offset = _offset(index)
        return (offset, None) if offset else _ALL
    return (first, None if first == -1 else first + 1)


def _offset(index: ast.expr) -> Optional[int]:
    """k for ``i + k`` or ``k + i``, a positive constant added to a counter."""
    if not (isinstance(index, ast.BinOp) and isinstance(index.op, ast.Add)):
        return None
    for counter, added in ((index.left, index.right), (index.right, index.left)):
        k = _constant(added)
        if k is not None and k > 0 and _constant(counter) is None:
            return k
    return None


def _pair(target: ast.expr) -> bool:
    return isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == 2


def _names(target: ast.expr) -> Iterator[str]:
    for node in ast.walk(target):
        if isinstance(node, ast.Name):
            yield node.id


def _unbound(target: ast.expr, scope: _Scope) -> _Scope:
    """``scope`` with the names in ``target`` bound to nothing known."""
    for name in _names(target):
        scope = scope.bind(name, frozenset())
    return scope


def _rebound(target: ast.expr, inner: _Scope, outer: _Scope) -> _Scope:
    """``outer`` with the names in ``target`` bound as in ``inner``."""
    for name in _names(target):
        outer = outer.bind(name, inner.modules.get(name, frozenset()))
    return outer


# ------------------------------------------------------------------- guards and names


def _may_run(guards: Guards, module: nn.Module) -> bool:
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


def _true(node: Optional[ast.expr]) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


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


def _constant(node: Optional[ast.expr]) -> Optional[int]:
    """An int written in the source (``1``, ``-1``); None for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constant(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None

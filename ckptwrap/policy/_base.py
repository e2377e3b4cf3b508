"""The policy base class and the three ways to combine policies: ``&``, ``|`` and ``~``.

A policy is either a *set term*, which names a set of modules on its own (``blocks``,
``type:``, a module class, a predicate), or a *picker*, which picks among an ordered list
of candidates (``every:``, ``first:``, ``last:``, ``fraction:``). Combining with ``&``
intersects the set terms into the candidates, then intersects what each picker picks.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, FrozenSet, List, Sequence, Tuple

from torch import nn

from .._errors import CheckpointConfigError
from ._index import ModelIndex, NoMatch

__all__ = [
    "Complement",
    "install_operand_converter",
    "Intersection",
    "Names",
    "Picker",
    "Policy",
    "SetTerm",
    "split_terms",
    "Union",
]

Names = FrozenSet[str]


class Policy(abc.ABC):
    """Decides which submodules of a model to checkpoint.

    Concrete policies are frozen dataclasses: hashable, comparable and picklable.
    Combine them with ``&`` (every part selects the module), ``|`` (either part does)
    and ``~`` (the opposite); the other operand may be anything :func:`as_policy` takes.

    Example:
        >>> policy = Type("GPT2Block") & Last(6)
        >>> str(policy)
        'type:GPT2Block;last:6'
        >>> policy.select(model)  # doctest: +SKIP
        ['transformer.h.6', 'transformer.h.7', ..., 'transformer.h.11']
    """

    def select(self, model: nn.Module) -> List[str]:
        """The qualified names of the modules this policy selects from ``model``.

        The selection depends on the model alone: calling twice, or on a deep copy,
        gives the same names.

        Args:
            model: The model to select from.

        Returns:
            Qualified names as in ``model.named_modules()``, in that order, never the
            model itself (""). May be empty, e.g. for ``none``.

        Raises:
            CheckpointConfigError: If ``model`` is not an ``nn.Module``, or a term
                matches nothing in it (a ``type:`` or ``name:`` that names no module,
                ``blocks`` in a model without repeated blocks).
        """
        index = ModelIndex(model)
        try:
            chosen = self._select(index)
        except NoMatch as error:
            # Re-raised as the public class, with the whole policy and the model named.
            raise CheckpointConfigError(
                f"policy '{self.describe()}' cannot be applied to "
                f"{type(model).__name__}: {error}"
            ) from None
        return list(index.ordered(chosen))

    @abc.abstractmethod
    def describe(self) -> str:
        """The policy as a policy string, such as ``type:GPT2Block;last:6``.

        Parts with no string form (module classes, predicates, ``|``, ``~``) are written
        as Python-like expressions, which :func:`parse_policy` does not read back.
        """

    def __str__(self) -> str:
        return self.describe()

    def __and__(self, other: Any) -> Policy:
        return _intersect(self, _operand_to_policy(other))

    def __rand__(self, other: Any) -> Policy:
        return _intersect(_operand_to_policy(other), self)

    def __or__(self, other: Any) -> Policy:
        return Union(_union_parts(self) + _union_parts(_operand_to_policy(other)))

    def __ror__(self, other: Any) -> Policy:
        return Union(_union_parts(_operand_to_policy(other)) + _union_parts(self))

    def __invert__(self) -> Policy:
        return Complement(self)

    @property
    def _is_picker(self) -> bool:
        """True for a picker, which picks among candidates; False for a set term."""
        raise NotImplementedError

    def _select(self, index: ModelIndex) -> Names:
        if self._is_picker:
            return self._pick(index.default_candidates(self.describe()))
        return self._members(index)

    def _members(self, index: ModelIndex) -> Names:
        """The modules a set term selects (set terms only)."""
        raise NotImplementedError

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        """The candidates a picker picks (pickers only)."""
        raise NotImplementedError


class SetTerm(Policy):
    """A policy that names a set of modules on its own."""

    _is_picker = False


class Picker(Policy):
    """A policy that picks among candidates given in model order."""

    _is_picker = True


@dataclasses.dataclass(frozen=True)
class Intersection(Policy):
    """Modules every part selects: what ``a & b`` and ``"a;b"`` build.

    The set terms intersect into the candidates (the repeated blocks if there is no set
    term); each picker picks from those same candidates, and the picks intersect. So
    ``every:2;last:3`` over 12 blocks selects block 10 only. With no set term this is a
    picker itself, and ``type:X & (every:2 & last:3)`` equals ``type:X;every:2;last:3``.
    """

    sets: Tuple[Policy, ...] = ()
    """Set terms whose selections intersect into the candidates."""
    pickers: Tuple[Policy, ...] = ()
    """Pickers applied to the candidates."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sets", tuple(self.sets))
        object.__setattr__(self, "pickers", tuple(self.pickers))
        _check_parts("Intersection.sets", self.sets, picker=False)
        _check_parts("Intersection.pickers", self.pickers, picker=True)
        if not self.sets and not self.pickers:
            raise CheckpointConfigError("Intersection needs at least one part")

    def describe(self) -> str:
        return ";".join(_describe_within(p, Intersection) for p in self.sets + self.pickers)

    @property
    def _is_picker(self) -> bool:
        return not self.sets

    def _candidates(self, index: ModelIndex) -> Tuple[str, ...]:
        if not self.sets:
            return index.default_candidates(self.describe())
        # Every set term is evaluated, even once the intersection is empty, so that a
        # misspelt type or name is reported wherever it stands.
        selections = [term._members(index) for term in self.sets]
        return index.ordered(frozenset.intersection(*selections))

    def _members(self, index: ModelIndex) -> Names:
        candidates = self._candidates(index)
        return self._pick(candidates) if self.pickers else frozenset(candidates)

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        return frozenset(candidates).intersection(*(p._pick(candidates) for p in self.pickers))


@dataclasses.dataclass(frozen=True)
class Union(Policy):
    """Modules any part selects: what ``a | b`` builds.

    A union of pickers is a picker (``type:X & (first:2 | last:2)`` picks the first two
    and the last two modules of class X); any other union is a set term, in which each
    picker part picks from the repeated blocks. Each part must match something, as it
    must on its own, so that a misspelt part is reported rather than ignored.
    """

    parts: Tuple[Policy, ...]
    """The policies whose selections are joined."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        _check_parts("Union.parts", self.parts)
        if not self.parts:
            raise CheckpointConfigError("Union needs at least one part")

    def describe(self) -> str:
        return " | ".join(_describe_within(p, Union) for p in self.parts)

    @property
    def _is_picker(self) -> bool:
        return all(p._is_picker for p in self.parts)

    def _members(self, index: ModelIndex) -> Names:
        return frozenset().union(*(p._select(index) for p in self.parts))

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        return frozenset().union(*(p._pick(candidates) for p in self.parts))


@dataclasses.dataclass(frozen=True)
class Complement(Policy):
    """The opposite of a policy: what ``~policy`` builds.

    Of a set term: every module except the model itself that it does not select. Of a
    picker: the candidates it does not pick (still a picker). Of an intersection with
    set terms and pickers: its candidates that its pickers leave out, so
    ``~(type:X;last:2)`` is every module of class X but the last two. ``~~p`` is ``p``.
    """

    inner: Policy
    """The policy whose selection is inverted."""

    def __post_init__(self) -> None:
        _check_parts("Complement.inner", (self.inner,))

    def describe(self) -> str:
        inner = self.inner.describe()
        simple = isinstance(self.inner, (SetTerm, Picker))
        return f"~{inner}" if simple else f"~({inner})"

    def __invert__(self) -> Policy:
        return self.inner

    @property
    def _is_picker(self) -> bool:
        return self.inner._is_picker

    def _members(self, index: ModelIndex) -> Names:
        inner = self.inner
        if isinstance(inner, Intersection) and inner.pickers:
            candidates = inner._candidates(index)
            return frozenset(candidates) - inner._pick(candidates)
        return frozenset(index.names) - inner._members(index)

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        return frozenset(candidates) - self.inner._pick(candidates)


# How the operators turn their other operand (a string, a class, a predicate) into a
# policy. The grammar knows every form, and builds on the terms, which build on this
# module; so rather than import it (a circle), this module lets the grammar install
# as_policy here when it is imported, which importing the package always does.
_operand_to_policy: Callable[[Any], Policy]


def install_operand_converter(convert: Callable[[Any], Policy]) -> None:
    """Make ``convert`` turn the non-Policy operands of ``&`` and ``|`` into policies."""
    global _operand_to_policy
    _operand_to_policy = convert


def split_terms(policy: Policy) -> Tuple[Tuple[Policy, ...], Tuple[Policy, ...]]:
    """The set terms and pickers that ``policy`` contributes to an intersection."""
    if isinstance(policy, Intersection):
        return policy.sets, policy.pickers
    return ((), (policy,)) if policy._is_picker else ((policy,), ())


def _intersect(left: Policy, right: Policy) -> Intersection:
    left_sets, left_pickers = split_terms(left)
    right_sets, right_pickers = split_terms(right)
    return Intersection(sets=left_sets + right_sets, pickers=left_pickers + right_pickers)


def _union_parts(policy: Policy) -> Tuple[Policy, ...]:
    return policy.parts if isinstance(policy, Union) else (policy,)


def _describe_within(part: Policy, outer: type) -> str:
    """A part's description, bracketed where it is itself a different combination."""
    text = part.describe()
    if isinstance(part, (Intersection, Union)) and not isinstance(part, outer):
        return f"({text})"
    return text


def _check_parts(field: str, parts: Sequence[Any], *, picker: bool | None = None) -> None:
    for part in parts:
        if not isinstance(part, Policy):
            raise CheckpointConfigError(
                f"{field} takes Policy objects; got {type(part).__name__} {part!r:.60}; "
                f"convert other forms with as_policy()"
            )
        if picker is not None and part._is_picker != picker:
            kind = "pickers (every, first, last, fraction)" if picker else "set terms"
            raise CheckpointConfigError(f"{field} takes only {kind}; got {part!r}")

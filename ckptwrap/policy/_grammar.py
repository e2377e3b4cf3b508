"""Policy strings, as given on the command line or in a config, and the other forms a
policy may take (:func:`as_policy`). Everything here is checked before any model is seen.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
from typing import Any, Callable, Dict, Optional, Tuple

from torch import nn

from .._errors import CheckpointConfigError
from ._base import Policy, install_operand_converter
from ._modifiers import Budget, Offload, Overlap, Recompute, Selective
from ._numbers import abbreviate, check_fraction, parse_count, parse_decimal
from ._terms import (
    All,
    Blocks,
    Every,
    First,
    Fraction,
    Instance,
    Last,
    Name,
    Nothing,
    Predicate,
    Type,
)

__all__ = ["as_policy", "parse_policy"]

_ALLOWED_FORMS = (
    "a policy string such as 'blocks' or 'type:GPT2Block;last:6', an nn.Module subclass, "
    "a tuple of nn.Module subclasses, a predicate fn(module, qualified_name) -> bool, "
    "or a Policy"
)


@dataclasses.dataclass(frozen=True)
class _Syntax:
    """How one term keyword is written and what it builds."""

    usage: str
    """The term as the documentation writes it, e.g. ``every:N``."""
    build: Callable[[Optional[str]], Policy]
    """Builds the term from its value (None for terms that take no value)."""

    optional: bool = False
    """Whether the value may be left out (``selective`` alone uses default operators)."""

    @property
    def takes_value(self) -> bool:
        return ":" in self.usage


def _fraction(value: str) -> Policy:
    try:
        exact = parse_decimal(value)
    except ValueError:
        raise CheckpointConfigError(
            f"fraction:{abbreviate(value)} is malformed: P must be a decimal number with "
            f"0 < P <= 1, such as fraction:0.5"
        ) from None
    return Fraction(check_fraction(exact, shown=abbreviate(value)))


def _listed(value: str) -> Tuple[str, ...]:
    """The names of ``type:`` and ``selective:``, joined by ``,``."""
    return tuple(name.strip() for name in value.split(","))


_SYNTAX: Dict[str, _Syntax] = {
    "none": _Syntax("none", lambda _: Nothing()),
    "blocks": _Syntax("blocks", lambda _: Blocks()),
    "all": _Syntax("all", lambda _: All()),
    "type": _Syntax("type:NAME[,NAME...]", lambda value: Type(_listed(value))),
    "name": _Syntax("name:GLOB", Name),
    "every": _Syntax("every:N", lambda value: Every(parse_count("every", "N", value))),
    "first": _Syntax("first:K", lambda value: First(parse_count("first", "K", value))),
    "last": _Syntax("last:K", lambda value: Last(parse_count("last", "K", value))),
    "fraction": _Syntax("fraction:P", _fraction),
    "budget": _Syntax("budget:X", Budget),
    "recompute": _Syntax("recompute", lambda _: Recompute()),
    "selective": _Syntax(
        "selective[:OP,...]", lambda value: Selective() if value is None else Selective(_listed(value)), optional=True
    ),
    "offload": _Syntax("offload", lambda _: Offload()),
    "overlap": _Syntax("overlap", lambda _: Overlap()),
}

_VALID_TERMS = ", ".join(syntax.usage for syntax in _SYNTAX.values())


def parse_policy(spec: str) -> Policy:
    """Read a policy string: terms joined by ``;``, all of which must select a module.

    Terms: ``none``, ``blocks``, ``all``, ``type:NAME[,NAME...]``, ``name:GLOB`` (set
    terms, which name modules) and ``every:N``, ``first:K``, ``last:K``, ``fraction:P``
    (pickers, which pick among the modules the set terms name, or among the repeated
    blocks if there is no set term). Whitespace around terms and values is ignored;
    keywords and class names are case-sensitive. ``none`` with other terms selects
    nothing (the others are still checked against the model, so typos surface).
    ``budget:X`` (choose among the candidates from measured costs so that the training
    step's peak fits X), ``recompute``, ``selective[:OP,...]`` and ``offload`` (how the chosen modules
    save memory) and ``overlap`` (recompute each one ahead of the backward, beside it)
    join with ``;`` only; :func:`ckptwrap.plan` acts on them. A budget plan
    may recompute a module whole or save some of its operators' outputs (a selective
    level), whichever costs less time; ``recompute`` limits it to whole modules
    (``budget:50%;recompute``).

    Args:
        spec: The policy string, e.g. ``"blocks"`` or ``"type:GPT2Block;last:6"``.

    Returns:
        The policy; ``parse_policy(str(policy)) == policy``.

    Raises:
        CheckpointConfigError: If the string is empty, names an unknown term, lacks a
            value a term needs, or has a malformed or out-of-range number.

    Example:
        >>> parse_policy("type:GPT2Block; last:6")
        Intersection(sets=(Type(names=('GPT2Block',)),), pickers=(Last(k=6),))
    """
    if not isinstance(spec, str):
        raise CheckpointConfigError(
            f"a policy string must be a str; got {type(spec).__name__}; valid terms: {_VALID_TERMS}"
        )
    if not spec.strip():
        raise CheckpointConfigError(
            f"the policy string is empty; give one or more terms joined by ';' "
            f"(valid terms: {_VALID_TERMS}), or 'none' to checkpoint nothing"
        )
    try:
        terms = [_parse_term(text.strip()) for text in spec.split(";")]
    except CheckpointConfigError as error:
        raise CheckpointConfigError(f"in policy {abbreviate(repr(spec))}: {error}") from None
    return functools.reduce(operator.and_, terms)


def as_policy(obj: Any) -> Policy:
    """Turn any accepted form of policy into a :class:`Policy`.

    Args:
        obj: A policy string (see :func:`parse_policy`), an ``nn.Module`` subclass or a
            tuple of them (modules that are instances), a predicate
            ``fn(module, qualified_name) -> bool``, or a :class:`Policy` (returned as is).

    Returns:
        The policy.

    Raises:
        CheckpointConfigError: If ``obj`` is none of these, or is a malformed string.

    Example:
        >>> as_policy(nn.TransformerEncoderLayer) & as_policy("last:2")  # doctest: +SKIP
    """
    if isinstance(obj, Policy):
        return obj
    if isinstance(obj, str):
        return parse_policy(obj)
    if isinstance(obj, type):
        if issubclass(obj, nn.Module):
            return Instance((obj,))
        raise CheckpointConfigError(
            f"cannot use the class {obj.__name__} as a policy: it is not an nn.Module "
            f"subclass; allowed: {_ALLOWED_FORMS}"
        )
    if isinstance(obj, tuple):
        if obj and all(isinstance(c, type) and issubclass(c, nn.Module) for c in obj):
            return Instance(obj)
        raise CheckpointConfigError(
            f"cannot use the tuple {obj!r:.80} as a policy: a tuple must hold one or more "
            f"nn.Module subclasses; allowed: {_ALLOWED_FORMS}"
        )
    if callable(obj) and not isinstance(obj, nn.Module):
        return Predicate(obj)
    hint = ""
    if isinstance(obj, list):
        hint = "; pass a tuple of classes, not a list"
    elif isinstance(obj, nn.Module):
        hint = f"; to select modules of this class, pass the class {type(obj).__name__}"
    raise CheckpointConfigError(
        f"cannot use {type(obj).__name__} {obj!r:.60} as a policy; allowed: {_ALLOWED_FORMS}{hint}"
    )


def _parse_term(text: str) -> Policy:
    if not text:
        raise CheckpointConfigError("empty term: terms are joined by single ';' with none empty")
    keyword, colon, value = (part.strip() for part in text.partition(":"))
    syntax = _SYNTAX.get(keyword)
    if syntax is None:
        raise CheckpointConfigError(
            f"unknown term {text!r}{_suggest(keyword)}; valid terms: {_VALID_TERMS}"
        )
    if not colon and (syntax.optional or not syntax.takes_value):
        return syntax.build(None)
    if not syntax.takes_value:
        raise CheckpointConfigError(f"{keyword} takes no value; got {text!r}; write {keyword!r}")
    if not value:
        raise CheckpointConfigError(f"{keyword} needs a value, as in {syntax.usage}; got {text!r}")
    return syntax.build(value)


def _suggest(keyword: str) -> str:
    close = difflib.get_close_matches(keyword.lower(), list(_SYNTAX), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# The operators of Policy accept every form as_policy does (see _base).
install_operand_converter(as_policy)

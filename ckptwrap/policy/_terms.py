"""The policy terms: set terms that name modules, and pickers that pick among candidates.

Each term of the policy-string grammar is one frozen dataclass here, plus the two forms
only Python callers can give: module classes (:class:`Instance`) and :class:`Predicate`.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import inspect
from typing import Any, Callable, List, Tuple

from torch import nn

from .._errors import CheckpointConfigError
from ._base import Names, Picker, SetTerm
from ._index import ModelIndex, NoMatch
from ._numbers import check_count, check_fraction

__all__ = [
    "All",
    "Blocks",
    "Every",
    "First",
    "Fraction",
    "Instance",
    "Last",
    "Name",
    "Nothing",
    "Predicate",
    "Type",
]


# --------------------------------------------------------------------------- set terms


@dataclasses.dataclass(frozen=True)
class Nothing(SetTerm):
    """``none``: selects no module, and nothing when combined with other terms.

    The other terms are still checked against the model, so a misspelt type is reported.
    """

    def describe(self) -> str:
        return "none"

    def _members(self, index: ModelIndex) -> Names:
        return frozenset()


@dataclasses.dataclass(frozen=True)
class Blocks(SetTerm):
    """``blocks``: the repeated blocks found by :func:`find_blocks`, such as transformer layers."""

    def describe(self) -> str:
        return "blocks"

    def _members(self, index: ModelIndex) -> Names:
        if not index.blocks:
            raise NoMatch(
                f"blocks matches nothing: {index.no_blocks_reason()}; select modules "
                f"with 'type:NAME' or 'name:GLOB' instead"
            )
        return frozenset(index.blocks)


@dataclasses.dataclass(frozen=True)
class All(SetTerm):
    """``all``: every direct child of the model that holds parameters or submodules."""

    def describe(self) -> str:
        return "all"

    def _members(self, index: ModelIndex) -> Names:
        # Qualified names without a dot are the model's direct children.
        chosen = frozenset(
            name
            for name, module in index.modules.items()
            if "." not in name and _holds_something(module)
        )
        if not chosen:
            raise NoMatch(
                f"all matches nothing: no direct child of {type(index.model).__name__} "
                f"holds parameters or submodules"
            )
        return chosen


@dataclasses.dataclass(frozen=True)
class Type(SetTerm):
    """``type:NAME[,NAME...]``: modules whose class is named NAME (exactly, not subclasses).

    Example:
        >>> Type("GPT2Block"), Type(("Attention", "MLP"))
        (Type(names=('GPT2Block',)), Type(names=('Attention', 'MLP')))
    """

    names: Tuple[str, ...]
    """Class names (``__name__``, case-sensitive); a module of any of them is selected."""

    def __post_init__(self) -> None:
        names = (self.names,) if isinstance(self.names, str) else self.names
        if isinstance(names, type) or not isinstance(names, (tuple, list)) or not names:
            raise CheckpointConfigError(
                f"type: takes one or more class names as strings; got {self.names!r}; "
                f"to select by isinstance, pass the class itself as the policy"
            )
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise CheckpointConfigError(
                    f"type: takes class names such as 'GPT2Block'; {name!r} is not one "
                    f"(terms of a policy string are joined by ';', names by ',')"
                )
        object.__setattr__(self, "names", tuple(names))

    def describe(self) -> str:
        return "type:" + ",".join(self.names)

    def _members(self, index: ModelIndex) -> Names:
        present = {type(module).__name__ for module in index.modules.values()}
        missing = [name for name in self.names if name not in present]
        if missing:
            raise NoMatch(self._missing_message(missing, index))
        return frozenset(
            name for name, module in index.modules.items() if type(module).__name__ in self.names
        )

    def _missing_message(self, missing: List[str], index: ModelIndex) -> str:
        model_class = type(index.model).__name__
        message = f"{self.describe()} matches no module of class {', '.join(missing)}"
        if model_class in missing:
            message += f" ({model_class} is the model itself, which is never selected)"
        close = difflib.get_close_matches(missing[0], index.class_names(), n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
        return f"{message}; {index.classes_phrase()}"


@dataclasses.dataclass(frozen=True)
class Name(SetTerm):
    """``name:GLOB``: modules whose qualified name matches GLOB (``fnmatch``, case-sensitive).

    ``*`` also matches dots, so ``encoder.layers.*`` selects the layers and everything
    inside them; ``encoder.layers.*;type:Layer`` keeps the layers only.
    """

    pattern: str
    """The glob, e.g. ``encoder.layers.*`` or ``h.[0-5]``."""

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise CheckpointConfigError(
                f"name: takes a glob over qualified names such as 'encoder.layers.*'; "
                f"got {self.pattern!r}"
            )

    def describe(self) -> str:
        return f"name:{self.pattern}"

    def _members(self, index: ModelIndex) -> Names:
        chosen = frozenset(n for n in index.names if fnmatch.fnmatchcase(n, self.pattern))
        if not chosen:
            raise NoMatch(
                f"{self.describe()} matches no qualified name; names in "
                f"{type(index.model).__name__} look like {index.sample_names()}"
            )
        return chosen


@dataclasses.dataclass(frozen=True, repr=False)
class Instance(SetTerm):
    """Modules that are instances of the given classes (subclasses count).

    What a module class or a tuple of classes becomes in :func:`as_policy`; it has no
    policy-string form, since a string can name a class but not import it.
    """

    classes: Tuple[type, ...]
    """``nn.Module`` subclasses, as for ``isinstance``."""

    def __post_init__(self) -> None:
        classes = (self.classes,) if isinstance(self.classes, type) else self.classes
        if (
            not isinstance(classes, tuple)
            or not classes
            or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes)
        ):
            raise CheckpointConfigError(
                f"Instance takes an nn.Module subclass or a non-empty tuple of them; "
                f"got {self.classes!r}"
            )
        object.__setattr__(self, "classes", classes)

    def __repr__(self) -> str:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in self.classes)
        return f"Instance(classes=({names}{',' if len(self.classes) == 1 else ''}))"

    def describe(self) -> str:
        return f"isinstance({', '.join(c.__name__ for c in self.classes)})"

    def _members(self, index: ModelIndex) -> Names:
        chosen = frozenset(n for n, m in index.modules.items() if isinstance(m, self.classes))
        if not chosen:
            raise NoMatch(
                f"{self.describe()} matches no module; {index.classes_phrase()}"
            )
        return chosen


@dataclasses.dataclass(frozen=True, repr=False)
class Predicate(SetTerm):
    """Modules for which ``fn(module, qualified_name)`` is true.

    ``fn`` is called once per module except the model itself, on every selection; it
    must depend on its arguments only (keep no counters), so selections stay repeatable.
    """

    fn: Callable[[nn.Module, str], Any]
    """The test; its result is read as a bool."""

    def __post_init__(self) -> None:
        if not callable(self.fn) or isinstance(self.fn, type):
            raise CheckpointConfigError(
                f"Predicate takes a function fn(module, qualified_name) -> bool; "
                f"got {type(self.fn).__name__}"
            )
        _check_signature(self.fn)

    def __repr__(self) -> str:
        return f"Predicate(fn={_callable_name(self.fn)})"

    def describe(self) -> str:
        return f"predicate({_callable_name(self.fn)})"

    def _members(self, index: ModelIndex) -> Names:
        chosen = frozenset(n for n, m in index.modules.items() if self.fn(m, n))
        if not chosen:
            raise NoMatch(
                f"{self.describe()} is false for every module of {type(index.model).__name__}"
            )
        return chosen


# ----------------------------------------------------------------------------- pickers


@dataclasses.dataclass(frozen=True)
class Every(Picker):
    """``every:N``: the candidates at indices 0, N, 2N, ... in model order."""

    n: int
    """The step, at least 1."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", check_count("every", "N", self.n))

    def describe(self) -> str:
        return f"every:{self.n}"

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        return frozenset(candidates[:: self.n])


@dataclasses.dataclass(frozen=True)
class First(Picker):
    """``first:K``: the first K candidates (all of them if there are fewer)."""

    k: int
    """How many, at least 1."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", check_count("first", "K", self.k))

    def describe(self) -> str:
        return f"first:{self.k}"

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        return frozenset(candidates[: self.k])


@dataclasses.dataclass(frozen=True)
class Last(Picker):
    """``last:K``: the last K candidates (all of them if there are fewer)."""

    k: int
    """How many, at least 1."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", check_count("last", "K", self.k))

    def describe(self) -> str:
        return f"last:{self.k}"

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        return frozenset(candidates[-self.k :])


@dataclasses.dataclass(frozen=True)
class Fraction(Picker):
    """``fraction:P``: ``k = round(P * n)`` of the n candidates, evenly spaced.

    The j-th pick (j = 0 .. k-1) is the candidate at index ``floor((j + 0.5) * n / k)``,
    the middle of the j-th of k equal slices, so the picks are distinct and spread over
    the whole model: 6 of 12 picks indices 1, 3, 5, 7, 9, 11; 1 of 12 picks index 6.
    ``round`` is Python's, which rounds halves to even, and k may be 0 for small n.
    """

    p: float
    """The fraction, 0 < P <= 1."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", check_fraction(self.p))

    def describe(self) -> str:
        return f"fraction:{self.p!r}"

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        n = len(candidates)
        k = round(self.p * n)
        # Integer arithmetic keeps the indices exact; slices are n/k >= 1 wide, so the
        # floors of their midpoints differ.
        return frozenset(candidates[(2 * j + 1) * n // (2 * k)] for j in range(k))


# ----------------------------------------------------------------------------- helpers


def _holds_something(module: nn.Module) -> bool:
    return (
        next(module.parameters(), None) is not None or next(module.children(), None) is not None
    )


def _check_signature(fn: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature to check
        return
    try:
        signature.bind(nn.Identity(), "")
    except TypeError:
        raise CheckpointConfigError(
            f"a predicate is called as fn(module, qualified_name); "
            f"{_callable_name(fn)}{signature} cannot take those two arguments"
        ) from None


def _callable_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__

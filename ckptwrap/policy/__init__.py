"""Which modules to checkpoint: policy terms, the policy-string grammar and block detection.

A policy selects qualified module names from a model; the marking layer (``wrap_model``)
decides what to do with them. See :func:`parse_policy` for the string form.
"""

from ._base import Complement, Intersection, Policy, Union, split_terms
from ._blocks import find_blocks, library_nests
from ._library_units import code_units
from ._grammar import as_policy, parse_policy
from ._modifiers import DEFAULT_SELECTIVE_OPS, Budget, Offload, Overlap, Selective, overlaps, split_modifiers
from ._ops import draws_random, resolve_ops
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

__all__ = [
    "All",
    "Budget",
    "DEFAULT_SELECTIVE_OPS",
    "Offload",
    "Overlap",
    "Selective",
    "split_modifiers",
    "split_terms",
    "Blocks",
    "Complement",
    "Every",
    "First",
    "Fraction",
    "Instance",
    "Intersection",
    "Last",
    "Name",
    "Nothing",
    "Policy",
    "Predicate",
    "Type",
    "Union",
    "as_policy",
    "code_units",
    "find_blocks",
    "library_nests",
    "overlaps",
    "parse_policy",
    "draws_random",
    "resolve_ops",
]

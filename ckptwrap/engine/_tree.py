"""Flattening of nested arguments and outputs into tensor leaves and back.

Uses torch's pytree registry (tuples, lists, dicts, namedtuples and any type a library
registered, such as Hugging Face ``ModelOutput``) and adds dataclass instances, which the
registry leaves opaque, so tensors inside them take part in autograd too.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, List, Sequence, Tuple

import torch

from .. import _torch_private

__all__ = ["flatten", "is_plain", "merge_tensors", "split_tensors", "tensor_leaves", "unflatten"]

_Spec = Any  # None for a leaf, else (rebuild, [child specs])


def _children(obj: Any) -> Tuple[List[Any], Callable[[List[Any]], Any]] | None:
    """Split a container into its children and a function that rebuilds it; None for a leaf."""
    node_def = _torch_private.pytree_nodes.get(_torch_private.pytree_node_type(obj))
    if node_def is not None:
        children, context = node_def.flatten_fn(obj)
        unflatten_fn = node_def.unflatten_fn
        return list(children), lambda values: unflatten_fn(values, context)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [field.name for field in dataclasses.fields(obj)]

        def rebuild(values: List[Any]) -> Any:
            # A shallow copy keeps fields declared with init=False and works for frozen classes.
            clone = copy.copy(obj)
            for name, value in zip(names, values):
                object.__setattr__(clone, name, value)
            return clone

        return [getattr(obj, name) for name in names], rebuild
    return None


def flatten(obj: Any) -> Tuple[List[Any], _Spec]:
    """Return the leaves of ``obj`` in a fixed order and a spec to rebuild it."""
    leaves: List[Any] = []
    spec = _flatten_into(obj, leaves)
    return leaves, spec


def is_plain(value: Any) -> bool:
    """Whether ``value`` is a leaf that is never looked into: a tensor, None or a scalar."""
    return value is None or isinstance(value, (torch.Tensor, int, float, bool, str))


def _flatten_into(obj: Any, leaves: List[Any]) -> _Spec:
    split = None if is_plain(obj) else _children(obj)
    if split is None:
        leaves.append(obj)
        return None
    children, rebuild = split
    return rebuild, [_flatten_into(child, leaves) for child in children]


def unflatten(leaves: Sequence[Any], spec: _Spec) -> Any:
    """Rebuild the structure described by ``spec`` from ``leaves`` (the inverse of ``flatten``)."""
    return _unflatten_from(iter(leaves), spec)


def _unflatten_from(iterator: Any, spec: _Spec) -> Any:
    if spec is None:
        return next(iterator)
    rebuild, child_specs = spec
    return rebuild([_unflatten_from(iterator, child) for child in child_specs])


def tensor_leaves(obj: Any) -> List[torch.Tensor]:
    """All tensors inside ``obj``, however deeply nested."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    leaves, _ = flatten(obj)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


_TENSOR = object()  # marks where a tensor goes among the other leaves of a structure


def split_tensors(leaves: List[Any]) -> Tuple[List[torch.Tensor], List[Any]]:
    """The tensors among ``leaves``, and the leaves with a marker in place of each."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    rest = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return tensors, rest


def merge_tensors(tensors: Sequence[torch.Tensor], rest: List[Any]) -> List[Any]:
    """The leaves again, with ``tensors`` in place of the markers (the inverse of
    :func:`split_tensors`)."""
    supply = iter(tensors)
    return [next(supply) if leaf is _TENSOR else leaf for leaf in rest]

"""The shape variables of a model's inputs: which tensor dimensions carry the batch and
which a length (a sequence length, an image side), read from one forward's inputs, and
the sizes another forward's inputs give them. Costs are fitted over these variables; the
inputs themselves are never changed or made up.

The rule, from one forward's inputs:

* The **batch** is the first dimension most tensors of two or more dimensions share
  (``input_ids``, ``attention_mask`` and ``labels`` of ``(B, S)``), when it is 2 or more;
  every tensor whose first dimension has that size carries it there. Packed sequences
  (``(1, T)`` with ``position_ids`` restarting) have no batch.
* **Lengths** are the other dimensions that vary in training as people feed models:
  every further dimension of an integer or boolean tensor of two or more dimensions
  (token ids, masks, labels), the second dimension of a floating-point tensor of three
  dimensions (``(B, T, F)``: time steps, not features) and the dimensions after the
  second of one of four or five (``(B, C, H, W)``: the image, not its channels).
  Dimensions of one size are one length; a floating-point tensor's other dimensions of
  that size follow it too (a float mask of ``(B, 1, S, S)``). Sizes below 2 are never a
  length. A variable that never changes in training costs nothing: the fit leaves it be.
* Beside tensors of two or more dimensions, a one-dimensional integer tensor that
  carries no variable (the offsets of packed sequences, ``cu_seq_lens``) is **free**: its
  size may change and is no variable. Without any (a flat token sequence), its
  dimension is a length.
* Everything else is fixed: another forward must give it the same size, the same
  structure of arguments and the same dtypes, or it does not fit this layout as read.

What the rule misses, the steps tell: inputs of the same structure, dtypes and ranks that
give a fixed dimension another size (the patches of images at another resolution, a
second input's length, a flat stream of packed tokens), or that give one variable's
dimensions two sizes (an image's height and width), fit the layout :meth:`widened` by
them, where those dimensions are variables of their own. A variable found so has the
size it took before as its value at the shapes measured then (``InputLayout.extended``),
so nothing measured is lost, and any number of sizes share one layout.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten

from .._errors import CheckpointConfigError

__all__ = ["InputLayout", "as_example", "read_layout"]

_FREE = "free"
"""A dimension whose size may change without being a shape variable."""


@dataclasses.dataclass(frozen=True)
class _Variable:
    """One shape variable and where the inputs carry it."""

    name: str
    """``batch``, ``length``, ``length 2``...: for messages and ``max_shapes``."""
    size: int
    """Its size in the inputs the layout was read from."""
    where: Tuple[Tuple[int, int], ...]
    """(leaf index, dimension) of every tensor dimension that carries it."""
    origin: Optional[int] = None
    """For a variable split off another (its dimensions took that one's sizes until a
    forward gave them others), that variable's index: the size it had before."""


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """The structure of one forward's inputs and the shape variables their tensors carry.

    Plain data, so it pickles and deep-copies with a wrapped model.
    """

    spec: str
    """The argument structure (a pytree spec), with keyword arguments sorted."""
    leaves: Tuple[Tuple[Any, ...], ...]
    """Per leaf: ``(dtype, device type, dims)`` for a tensor, where each dimension is its
    fixed size, the index of its variable as ``-1 - index``, or ``"free"``; ``(type
    name,)`` otherwise."""
    variables: Tuple[_Variable, ...]
    """The shape variables, the batch first if there is one."""
    roots: Tuple[Any, ...] = ()
    """Per leaf, the argument it belongs to: its position (an int) or keyword (a str)."""

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(variable.name for variable in self.variables)

    @property
    def sizes(self) -> Tuple[int, ...]:
        """The variables' sizes in the inputs the layout was read from."""
        return tuple(variable.size for variable in self.variables)

    @property
    def batched(self) -> Tuple[bool, ...]:
        """Per variable, whether an input tensor carries it beside the batch (a token
        length, an image's side), so that what is made of it is made per row; a variable
        without (the patches of a batch's images, flattened into one axis) is not."""
        batch = next((k for k, v in enumerate(self.variables) if v.name == "batch"), None)
        if batch is None:
            return (False,) * len(self.variables)
        beside = set()
        for described in self.leaves:
            dims = described[2] if len(described) == 3 else ()
            indices = {-1 - dim for dim in dims if dim != _FREE and dim < 0}
            if batch in indices:
                beside |= indices
        return tuple(k in beside for k in range(len(self.variables)))

    def sizes_of(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[int, ...]]:
        """The variables' sizes in another forward's inputs, or None if those inputs do
        not fit this layout (another structure, dtype or fixed size, or one variable
        given two sizes)."""
        leaves = self._leaves_alike(args, kwargs)
        if leaves is None:
            return None
        sizes: List[Optional[int]] = [None] * len(self.variables)
        for leaf, described in zip(leaves, self.leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            for size, dim in zip(leaf.shape, described[2]):
                if dim == _FREE:
                    continue
                if dim >= 0:
                    if size != dim:
                        return None
                    continue
                index = -1 - dim
                if sizes[index] is None:
                    sizes[index] = int(size)
                elif sizes[index] != size:
                    return None
        return tuple(int(size) for size in sizes)  # type: ignore[arg-type]

    def _leaves_alike(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[List[Any]]:
        """The inputs' leaves where they have this layout's structure, and each tensor its
        dtype, device and rank (each other leaf its type); else None."""
        spec, leaves = _flat(args, kwargs)
        if spec != self.spec or len(leaves) != len(self.leaves):
            return None
        for leaf, described in zip(leaves, self.leaves):
            if not isinstance(leaf, torch.Tensor):
                if described != (type(leaf).__name__,):
                    return None
            elif (
                len(described) != 3 or described[:2] != (str(leaf.dtype), leaf.device.type)
                or leaf.dim() != len(described[2])
            ):
                return None
        return leaves

    def widened(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional["InputLayout"]:
        """The layout these inputs fit once the dimensions they give other sizes are
        variables: a fixed dimension given another size becomes one (those that had one
        size and now have another are one variable), and a variable whose dimensions
        take two sizes splits (the most of them keep it). None where the inputs fit this
        layout as it is, or differ from it in structure, dtype or rank."""
        leaves = self._leaves_alike(args, kwargs)
        if leaves is None:
            return None
        taken: Dict[int, Dict[int, List[Tuple[int, int]]]] = {}  # per variable, its dimensions by size
        changed: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}  # fixed ones by (was, now)
        for i, (leaf, described) in enumerate(zip(leaves, self.leaves)):
            if not isinstance(leaf, torch.Tensor):
                continue
            for axis, (size, dim) in enumerate(zip(leaf.shape, described[2])):
                if dim == _FREE:
                    continue
                if dim >= 0:
                    if size != dim:
                        changed.setdefault((dim, int(size)), []).append((i, axis))
                    continue
                taken.setdefault(-1 - dim, {}).setdefault(int(size), []).append((i, axis))
        split = {index: groups for index, groups in taken.items() if len(groups) > 1}
        if not changed and not split:
            return None
        variables = list(self.variables)
        names = set(self.names)
        for index, groups in sorted(split.items()):
            kept = max(groups.values(), key=lambda places: (len(places), self.variables[index].where[0] in places))
            variables[index] = dataclasses.replace(variables[index], where=tuple(kept))
            for places in groups.values():
                if places is not kept:
                    name = self._name(places[0], names)
                    variables.append(_Variable(name, self.variables[index].size, tuple(places), origin=index))
        for (was, _), places in changed.items():
            variables.append(_Variable(self._name(places[0], names), was, tuple(places)))
        index = {place: k for k, variable in enumerate(variables) for place in variable.where}
        described = []
        for i, leaf in enumerate(self.leaves):
            if len(leaf) != 3:
                described.append(leaf)
                continue
            dims = tuple(-1 - index[(i, axis)] if (i, axis) in index else dim for axis, dim in enumerate(leaf[2]))
            described.append((leaf[0], leaf[1], dims))
        return InputLayout(self.spec, tuple(described), tuple(variables), self.roots)

    def extended(self, sizes: Sequence[int]) -> Tuple[int, ...]:
        """``sizes`` given at an earlier form of this layout (before it was
        :meth:`widened`: fewer variables), in this one: each variable found since at the
        size it had then."""
        found = [int(size) for size in sizes]
        for variable in self.variables[len(found):]:
            found.append(found[variable.origin] if variable.origin is not None else variable.size)
        return tuple(found)

    def _name(self, place: Tuple[int, int], taken: set) -> str:
        """A new variable's name, from the argument and dimension of ``place``
        (``pixel_values.shape[0]``), unique among ``taken`` (which it joins)."""
        root = self.roots[place[0]] if place[0] < len(self.roots) else place[0]
        name = f"{root}.shape[{place[1]}]" if isinstance(root, str) else f"args[{root}].shape[{place[1]}]"
        unique, number = name, 2
        while unique in taken:
            unique, number = f"{name} ({number})", number + 1
        taken.add(unique)
        return unique

    def declared(self, shapes: Mapping[Any, Sequence[int]]) -> Tuple[int, ...]:
        """The variables' sizes with those that ``shapes`` gives larger: ``shapes`` maps an
        argument (a keyword, or a position as an int) to the shape of its tensor.

        Raises:
            CheckpointConfigError: If an argument is not among the inputs or not one
                tensor, or its shape has another number of dimensions.
        """
        sizes = list(self.sizes)
        known = sorted({str(root) for root, leaf in zip(self.roots, self.leaves) if len(leaf) == 3})
        for key, shape in shapes.items():
            leaves = [i for i, root in enumerate(self.roots) if root == key]
            if len(leaves) != 1 or len(self.leaves[leaves[0]]) != 3:
                raise CheckpointConfigError(
                    f"max_shapes names {key!r}, which is not one tensor argument of the "
                    f"forward; its tensor arguments are {', '.join(known) or 'none'}."
                )
            dims = self.leaves[leaves[0]][2]
            if len(tuple(shape)) != len(dims):
                raise CheckpointConfigError(
                    f"max_shapes gives {key!r} the shape {tuple(shape)}, of {len(tuple(shape))} "
                    f"dimensions; its tensor has {len(dims)}."
                )
            for size, dim in zip(shape, dims):
                if dim != _FREE and dim < 0:
                    sizes[-1 - dim] = max(sizes[-1 - dim], int(size))
        return tuple(sizes)

    def single(self, sizes: Sequence[int]) -> bool:
        """Whether ``sizes`` give the batch one row: kernels then run other operators (a
        product without its batch dimension), so operators are not named as at others."""
        return any(size == 1 for size, v in zip(sizes, self.variables) if v.name == "batch")

    def describe(self, sizes: Optional[Sequence[int]] = None) -> str:
        """``batch 8, length 256``: the variables at ``sizes`` (their own by default)."""
        sizes = self.sizes if sizes is None else sizes
        return ", ".join(f"{name} {size}" for name, size in zip(self.names, sizes)) or "fixed shapes"


def read_layout(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> InputLayout:
    """The layout of one forward's inputs (see the module's rule)."""
    spec, leaves = _flat(args, kwargs)
    tensors = [(i, leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    batch_size = _batch_size(tensors)
    flat_only = not any(t.dim() >= 2 for _, t in tensors)
    owner: Dict[Tuple[int, int], int] = {}
    variables: List[_Variable] = []
    if batch_size >= 2:
        where = tuple((i, 0) for i, t in tensors if t.dim() >= 1 and t.shape[0] == batch_size)
        variables.append(_Variable("batch", batch_size, where))
        owner.update((place, 0) for place in where)
    groups: Dict[int, List[Tuple[int, int]]] = {}
    for i, tensor in tensors:
        for axis in _length_axes(tensor, flat_only):
            size = int(tensor.shape[axis])
            if (i, axis) in owner or size < 2:
                continue
            groups.setdefault(size, []).append((i, axis))
    # Other dimensions of a floating-point tensor that have a length's size follow it.
    for i, tensor in tensors:
        if tensor.is_floating_point():
            for axis in range(1, tensor.dim()):
                size = int(tensor.shape[axis])
                if size in groups and (i, axis) not in groups[size] and (i, axis) not in owner:
                    groups[size].append((i, axis))
    for number, size in enumerate(sorted(groups, key=lambda s: min(groups[s]))):
        name = "length" if number == 0 else f"length {number + 1}"
        variables.append(_Variable(name, size, tuple(sorted(groups[size]))))
    index = {place: k for k, variable in enumerate(variables) for place in variable.where}
    described: List[Tuple[Any, ...]] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            free = not flat_only and leaf.dim() == 1 and not (leaf.is_floating_point() or leaf.is_complex())
            dims = tuple(
                -1 - index[(i, axis)] if (i, axis) in index else (_FREE if free else int(size))
                for axis, size in enumerate(leaf.shape)
            )
            described.append((str(leaf.dtype), leaf.device.type, dims))
        else:
            described.append((type(leaf).__name__,))
    roots: List[Any] = []
    for position, value in enumerate(args):
        roots += [position] * len(tree_flatten(value)[0])
    for name, value in sorted(kwargs.items()):
        roots += [name] * len(tree_flatten(value)[0])
    return InputLayout(spec, tuple(described), tuple(variables), tuple(roots))


def _batch_size(tensors: List[Tuple[int, torch.Tensor]]) -> int:
    """The first dimension most tensors of two or more dimensions share (the first such
    tensor's on a tie); 0 without any."""
    firsts = [int(t.shape[0]) for _, t in tensors if t.dim() >= 2]
    if not firsts:
        return 0
    counts = collections.Counter(firsts)
    most = max(counts.values())
    return next(size for size in firsts if counts[size] == most)


def _length_axes(tensor: torch.Tensor, flat_only: bool) -> range:
    if not tensor.is_floating_point() and not tensor.is_complex():
        if tensor.dim() >= 2:
            return range(1, tensor.dim())
        return range(tensor.dim()) if flat_only else range(0)
    if tensor.dim() == 3:
        return range(1, 2)
    if tensor.dim() in (4, 5):
        return range(2, tensor.dim())
    return range(0)


def _ordered(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    return tuple(args), dict(sorted(kwargs.items()))


def _flat(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[str, List[Any]]:
    leaves, spec = tree_flatten(_ordered(args, kwargs))
    return str(spec), leaves


def as_example(example_inputs: Any, example_kwargs: Optional[Mapping[str, Any]]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Positional and keyword example inputs in a uniform shape.

    Raises:
        CheckpointConfigError: If ``example_kwargs`` is not a mapping of keyword names.
    """
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise CheckpointConfigError(
            f"example_kwargs must be a mapping of keyword arguments, got {type(example_kwargs).__name__}."
        )
    odd = [key for key in (example_kwargs or {}) if not isinstance(key, str)]
    if odd:
        raise CheckpointConfigError(
            f"example_kwargs must map keyword names (strings) to values, got the key {odd[0]!r} "
            f"({type(odd[0]).__name__}); pass positional inputs as example_inputs=(...)."
        )
    if example_inputs is None:
        args: Tuple[Any, ...] = ()
    elif isinstance(example_inputs, tuple):
        args = example_inputs
    elif isinstance(example_inputs, list):
        args = tuple(example_inputs)
    else:
        args = (example_inputs,)
    return args, dict(example_kwargs or {})

"""The shape variables of a model's inputs: which tensor dimensions carry the batch and
which a length (a sequence length, an image side), read from one forward's inputs; the
sizes another forward's inputs give them; and inputs of the same structure at other
sizes, which the planner profiles at.

The rule, from one forward's inputs:

* Every tensor whose first dimension has the batch size ``B`` (that of the first tensor
  with a dimension) carries the **batch** there, when ``B`` is 2 or more.
* **Lengths** are the other dimensions that vary in training as people feed models:
  every further dimension of an integer or boolean tensor (token ids, masks, labels),
  the second dimension of a floating-point tensor of three dimensions (``(B, T, F)``:
  time steps, not features) and the dimensions after the second of one of four or five
  (``(B, C, H, W)``: the image, not its channels). Dimensions of one size are one
  length (``input_ids``, ``attention_mask`` and ``labels`` share theirs); a floating-point
  tensor's other dimensions of that size follow it too (a float mask of ``(B, 1, S, S)``).
  Sizes below 2 are never a length.
* Everything else is fixed: another forward must give it the same size, the same
  structure of arguments and the same dtypes, or it does not fit this layout.

Samples shrink each variable: the batch to 2 and 3 rows (repeating rows where the batch
has only 2), a length to a few sizes between an eighth and three quarters of its own,
in steps of its granule (the largest power of two up to 16 that divides an image side, 1
for tokens), so that profiling stays well below the memory of the forward it plans for.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._errors import CheckpointConfigError

__all__ = ["InputLayout", "as_example", "read_layout"]

_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)
"""Where a length's sample sizes lie, as shares of its size."""
_SAMPLE_SIZES = 4
"""Sample sizes per length: three determine a quadratic, the fourth checks it."""
_SAMPLE_BATCHES = (2, 3)
"""Sample batch sizes: a batch of one takes other code paths in many kernels."""
_LARGEST_GRANULE = 16
_PAIRS = ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2), (2, 2))
"""The sample sizes' indices of two lengths profiled together."""


@dataclasses.dataclass(frozen=True)
class _Variable:
    """One shape variable and where the example inputs carry it."""

    name: str
    """``batch``, ``length``, ``length 2``...: for messages and ``max_shapes``."""
    size: int
    """Its size in the inputs the layout was read from."""
    granule: int
    """Sample sizes are multiples of this."""
    where: Tuple[Tuple[int, int], ...]
    """(leaf index, dimension) of every tensor dimension that carries it."""

    def sample_sizes(self) -> Tuple[int, ...]:
        """The sizes it is profiled at, smallest first; fewer than 3 means it cannot be
        varied (it is then profiled at its own size only)."""
        if self.name == "batch":
            return _SAMPLE_BATCHES
        found: List[int] = []
        for fraction in _FRACTIONS:
            size = int(self.size * fraction) // self.granule * self.granule
            if size >= 2 and size < self.size and size not in found:
                found.append(size)
        return tuple(found[:_SAMPLE_SIZES])


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """The structure of one forward's inputs and the shape variables their tensors carry.

    Plain data, so it pickles and deep-copies with a wrapped model.
    """

    spec: str
    """The argument structure (a pytree spec), with keyword arguments sorted."""
    leaves: Tuple[Tuple[Any, ...], ...]
    """Per leaf: ``(dtype, device type, dims)`` for a tensor, where each dimension is its
    fixed size or the index of its variable as ``-1 - index``; ``(type name,)`` otherwise."""
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

    def sizes_of(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[int, ...]]:
        """The variables' sizes in another forward's inputs, or None if those inputs do
        not fit this layout (another structure, dtype or fixed size, or one variable
        given two sizes)."""
        spec, leaves = _flat(args, kwargs)
        if spec != self.spec or len(leaves) != len(self.leaves):
            return None
        sizes: List[Optional[int]] = [None] * len(self.variables)
        for leaf, described in zip(leaves, self.leaves):
            if not isinstance(leaf, torch.Tensor):
                if described != (type(leaf).__name__,):
                    return None
                continue
            if len(described) != 3 or described[:2] != (str(leaf.dtype), leaf.device.type):
                return None
            dims = described[2]
            if leaf.dim() != len(dims):
                return None
            for size, dim in zip(leaf.shape, dims):
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

    def resized(
        self, args: Tuple[Any, ...], kwargs: Dict[str, Any], sizes: Sequence[int]
    ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """``args`` and ``kwargs`` (which fit this layout) with every variable at
        ``sizes``: the leading part of each dimension where smaller, repeated where
        larger. Non-tensor arguments are passed as they are."""
        flat, tree = tree_flatten(_ordered(args, kwargs))
        out: List[Any] = []
        for leaf, described in zip(flat, self.leaves):
            if not isinstance(leaf, torch.Tensor) or len(described) != 3:
                out.append(leaf)
                continue
            changed = False
            for axis, dim in enumerate(described[2]):
                if dim < 0 and leaf.shape[axis] != sizes[-1 - dim]:
                    leaf = _to_size(leaf, axis, sizes[-1 - dim])
                    changed = True
            # A copy of its own: models view their inputs, which a cut cannot always take.
            out.append(leaf.contiguous().clone() if changed else leaf)
        new_args, new_kwargs = tree_unflatten(out, tree)
        return tuple(new_args), dict(new_kwargs)

    def samples(self) -> Optional[List[Tuple[int, ...]]]:
        """The variables' sizes to profile at, for inputs of this layout's own sizes (see
        :meth:`samples_at`)."""
        return self.samples_at(self.sizes)

    def samples_at(self, sizes: Sequence[int]) -> Optional[List[Tuple[int, ...]]]:
        """The variables' sizes to profile at, for inputs of ``sizes``: every combination
        of the batch's and each length's sample sizes (seven points of a grid of three by
        three when there are two lengths); None when no variable can be varied."""
        variables = [dataclasses.replace(v, size=int(size)) for v, size in zip(self.variables, sizes)]
        axes = [variable.sample_sizes() for variable in variables]
        if not variables or any(len(axis) < (2 if v.name == "batch" else 3) for v, axis in zip(variables, axes)):
            return None
        batch = [axes[0]] if variables[0].name == "batch" else []
        lengths = axes[len(batch):]
        if len(lengths) > 2 or (not lengths and variables[0].size < 4):
            # Without a length to shrink, 3 rows of a batch under 4 are no small sample.
            return None
        if len(lengths) == 2:
            # Seven points of the three-by-three grid: the six a quadratic in two
            # variables needs (a corner triangle) and one more, to check it.
            first, second = lengths
            points = [(first[i], second[j]) for i, j in _PAIRS]
        else:
            points = [tuple(p) for p in itertools.product(*lengths)]
        return [tuple(b) + tuple(p) for b in itertools.product(*batch) for p in points]

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
                if dim < 0:
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
    batch_size = next((int(t.shape[0]) for _, t in tensors if t.dim() >= 1), 0)
    owner: Dict[Tuple[int, int], int] = {}
    variables: List[_Variable] = []
    if batch_size >= 2:
        where = tuple((i, 0) for i, t in tensors if t.dim() >= 1 and t.shape[0] == batch_size)
        variables.append(_Variable("batch", batch_size, 1, where))
        owner.update((place, 0) for place in where)
    groups: Dict[int, List[Tuple[int, int]]] = {}
    granules: Dict[int, int] = {}
    for i, tensor in tensors:
        for axis in _length_axes(tensor):
            size = int(tensor.shape[axis])
            if (i, axis) in owner or size < 2:
                continue
            groups.setdefault(size, []).append((i, axis))
            image = tensor.is_floating_point() and tensor.dim() >= 4
            granules[size] = max(granules.get(size, 1), _granule(size) if image else 1)
    # Other dimensions of a floating-point tensor that have a length's size follow it.
    for i, tensor in tensors:
        if tensor.is_floating_point():
            for axis in range(1, tensor.dim()):
                size = int(tensor.shape[axis])
                if size in groups and (i, axis) not in groups[size] and (i, axis) not in owner:
                    groups[size].append((i, axis))
    for number, size in enumerate(sorted(groups, key=lambda s: min(groups[s]))):
        name = "length" if number == 0 else f"length {number + 1}"
        variables.append(_Variable(name, size, granules[size], tuple(sorted(groups[size]))))
    index = {place: k for k, variable in enumerate(variables) for place in variable.where}
    described: List[Tuple[Any, ...]] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            dims = tuple(
                -1 - index[(i, axis)] if (i, axis) in index else int(size)
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


def _length_axes(tensor: torch.Tensor) -> range:
    if not tensor.is_floating_point() and not tensor.is_complex():
        return range(1, tensor.dim()) if tensor.dim() >= 2 else range(tensor.dim())
    if tensor.dim() == 3:
        return range(1, 2)
    if tensor.dim() in (4, 5):
        return range(2, tensor.dim())
    return range(0)


def _granule(size: int) -> int:
    granule = 1
    while granule < _LARGEST_GRANULE and size % (granule * 2) == 0:
        granule *= 2
    return granule


def _ordered(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    return tuple(args), dict(sorted(kwargs.items()))


def _flat(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[str, List[Any]]:
    leaves, spec = tree_flatten(_ordered(args, kwargs))
    return str(spec), leaves


def _to_size(tensor: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """``tensor`` with dimension ``axis`` cut to ``size`` or grown to it by repeating."""
    have = tensor.shape[axis]
    if size <= have:
        return tensor.narrow(axis, 0, size)
    index = torch.arange(size, device=tensor.device) % have
    return tensor.index_select(axis, index)


def as_example(example_inputs: Any, example_kwargs: Optional[Mapping[str, Any]]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Positional and keyword example inputs in a uniform shape."""
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise CheckpointConfigError(
            f"example_kwargs must be a mapping of keyword arguments, got {type(example_kwargs).__name__}."
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

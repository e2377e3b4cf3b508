"""Costs over input shapes. Every term of the profiles of real steps, measured at the
shapes the caller's inputs took, is fitted as a polynomial in the inputs' shape
variables, so that the profile at another shape is a few dot products rather than a new
measurement; the inputs themselves are never changed or made up. In this module, in
order:

1. **The shape variables** of a model's inputs (:class:`InputLayout`, ``read_layout``):
   which tensor dimensions carry the batch and which a length (a sequence length, an
   image side), read from one forward's inputs, and the sizes another forward's inputs
   give them. The rule, from one forward's inputs:

   * The **batch** is the first dimension most tensors of two or more dimensions share
     (``input_ids``, ``attention_mask`` and ``labels`` of ``(B, S)``), when it is 2 or
     more; every tensor whose first dimension has that size carries it there. Packed
     sequences (``(1, T)`` with ``position_ids`` restarting) have no batch.
   * **Lengths** are the other dimensions that vary in training as people feed models:
     every further dimension of an integer or boolean tensor of two or more dimensions
     (token ids, masks, labels), the second dimension of a floating-point tensor of three
     dimensions (``(B, T, F)``: time steps, not features) and the dimensions after the
     second of one of four or five (``(B, C, H, W)``: the image, not its channels).
     Dimensions of one size are one length; a floating-point tensor's other dimensions of
     that size follow it too (a float mask of ``(B, 1, S, S)``). Sizes below 2 are never
     a length. A variable that never changes in training costs nothing: the fit leaves
     it be.
   * Beside tensors of two or more dimensions, a one-dimensional integer tensor that
     carries no variable (the offsets of packed sequences, ``cu_seq_lens``) is **free**:
     its size may change and is no variable. Without any (a flat token sequence), its
     dimension is a length.
   * Everything else is fixed: another forward must give it the same size, the same
     structure of arguments and the same dtypes, or it does not fit this layout as read.

   What the rule misses, the steps tell: inputs of the same structure, dtypes and ranks
   that give a fixed dimension another size (the patches of images at another resolution,
   a second input's length, a flat stream of packed tokens), or that give one variable's
   dimensions two sizes (an image's height and width), fit the layout
   :meth:`InputLayout.widened` by them, where those dimensions are variables of their
   own. A variable found so has the size it took before as its value at the shapes
   measured then (``InputLayout.extended``), so nothing measured is lost, any number of
   sizes share one layout, and no new layout is opened.

2. **Polynomials** over the shape variables (:class:`Poly`): the monomials a fit may draw
   on, those a set of measured shapes can tell apart, and least-squares fits of many
   columns at once, kept as plain floats so that evaluating one allocates no tensor
   (plans are solved at the start of a training step, inside its memory).

3. **The fit of every cost term** (:class:`CostFit`). Bytes that storages hold are sums
   of tensor sizes, so each is a polynomial in the batch ``b`` and the lengths: the fit
   draws on the monomials of degree at most 1 in ``b`` and at most 2 in the lengths
   together, those a tensor's size can be first (``1, b, b*s, b*s^2``, then ``s, s^2``,
   for a length the inputs carry beside the batch; ``monomials``), taking those the
   measured shapes can tell apart (a batch that never changed is no variable; two lengths
   fit a line, three a parabola). Each term is then raised by its largest miss on the
   measured shapes, so that the fit lies on or above every one of them (a term that
   depends on content as well, such as attention with or without a padding mask, is
   followed at its highest). A peak is not such a sum but the largest of its moments, and
   which moment is largest changes with the shape (the feed-forward's hidden states at
   short lengths, attention scores at long ones), so each moment is fitted, and a peak is
   the largest fitted moment. What the allocator held beyond the meter's moments
   (workspaces, on accelerators) is fitted as one more term. Seconds are modelled per
   candidate as ``overhead + rate * work``, ``work`` being its counted FLOPs plus its
   created bytes (both polynomials), fitted to the measured steps. Where a fit has more
   samples than monomials, :meth:`CostFit.leeway` says how far each monomial it leaves
   out, fitted beside them, would move its peaks at another shape.

4. **What the planner knows of one layout** (:class:`LayoutCosts`, the most recently used
   of them in :class:`Layouts`): the profiles of the steps measured at its shapes, their
   fit, whether that fit may stand for shapes not measured, and the margin the closed
   loop added. A fit is trusted once it has predicted a measured step it was not fitted
   on, within ``_TRUST_UNDER`` (too low) and ``_TRUST_OVER`` (too high) of that step's
   peak; the fits after it keep to its monomials (its *form*) while they predict the
   steps measured next, and fit all the monomials the shapes tell apart again after one
   they miss. A trusted fit stands only where the measured shapes determine it (a batch
   measured at one size says nothing of another) and where no monomial it leaves out
   would move its peaks by more than those shares (``CostFit.leeway``), and up to a tenth
   past the largest size of each variable measured. Elsewhere a bound from a measured
   shape stands (``_bounded_at``): costs grow with the shape, so a larger measured shape
   bounds them, and a smaller one scaled up by its growth. A checked step above its
   prediction adds that share of the un-checkpointed peak as a margin; a large miss at a
   shape not measured has that shape measured again.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch.utils._pytree import tree_flatten

from .._errors import CheckpointConfigError
from ..policy import Budget
from ..measure import END, ModelProfile, ModuleCost, OpCost, StepPeaks

__all__ = [
    "InputLayout",
    "LayoutCosts",
    "Layouts",
    "PlanSettings",
    "as_example",
    "read_layout",
]


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
    for root, value in [*enumerate(args), *sorted(kwargs.items())]:
        roots += [root] * len(tree_flatten(value)[0])
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


def _flat(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[str, List[Any]]:
    leaves, spec = tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
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


Sizes = Tuple[int, ...]

_RANK_TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True)
class Poly:
    """Polynomials over the shape variables, one per column: per monomial, its coefficient
    in every column. Plain floats, so that evaluating one allocates no tensor (a plan is
    solved at the start of a training step, inside its memory)."""

    powers: Tuple[Tuple[int, ...], ...]
    coefficients: List[List[float]]  # per monomial, per column

    def at(self, sizes: Sizes) -> List[float]:
        values = [0.0] * (len(self.coefficients[0]) if self.coefficients else 0)
        for exponents, row in zip(self.powers, self.coefficients):
            term = float(math.prod(size**p for size, p in zip(sizes, exponents)))
            values = [value + term * c for value, c in zip(values, row)]
        return values


def powers_of(names: Sequence[str], batched: Sequence[bool] = ()) -> Tuple[Tuple[int, ...], ...]:
    """Exponents of every monomial the fit may use (degree <= 1 in the batch, <= 2 in the
    lengths), in the order a fit takes them up.

    Bytes are sums of tensor sizes, and a tensor made of a variable the inputs carry
    beside the batch (``batched``: a token length, an image's side) is made per row: its
    size is the batch times the lengths, never the lengths alone. So the monomials a
    tensor's size can be come first (the constant, the batch, then the batch times such
    lengths and the lengths the inputs carry without the batch, lowest degree first),
    and the others after (a mask shared by every row, ``s^2``), lowest degree first: a
    few measured shapes fit a vision tower's ``b`` beside a text tower's ``b*s``, where
    ``1, b, s`` would miss the product."""
    batch = bool(names) and names[0] == "batch"
    lengths = len(names) - batch
    carried = tuple(batched[batch:]) if batched else (False,) * lengths
    length_powers = [p for p in itertools.product(range(3), repeat=lengths) if sum(p) <= 2]
    found = [
        ((b,) if batch else ()) + p for b in ((0, 1) if batch else (0,)) for p in length_powers
    ]

    def made_per_row(exponents: Tuple[int, ...]) -> bool:
        if not batch:
            return True
        used = [with_batch for with_batch, power in zip(carried, exponents[1:]) if power]
        return not used or (all(used) if exponents[0] else not any(used))

    return tuple(sorted(
        found, key=lambda p: (not made_per_row(p), sum(p[batch:]), sum(p), tuple(-e for e in p))
    ))


def basis(names: Sequence[str], points: Sequence[Sizes], batched: Sequence[bool] = ()) -> Tuple[Tuple[int, ...], ...]:
    """The monomials the measured ``points`` can tell apart: each, in the order
    :func:`powers_of` gives them, kept if it raises the rank of the design, until there
    are as many as points."""
    chosen: List[Tuple[int, ...]] = []
    rank = 0
    for powers in powers_of(names, batched):
        if len(chosen) == len(points):
            break
        if rank_of([*chosen, powers], points) > rank:
            chosen.append(powers)
            rank += 1
    return tuple(chosen)


def rank_of(powers: Sequence[Tuple[int, ...]], points: Sequence[Sizes]) -> int:
    """How many of the monomials ``powers`` the ``points`` tell apart."""
    design = monomials(powers, points)
    scaled = design / design.abs().amax(dim=0).clamp_min(1.0)
    return int(torch.linalg.matrix_rank(scaled, rtol=_RANK_TOLERANCE))


def monomials(powers: Sequence[Tuple[int, ...]], points: Sequence[Sizes]) -> torch.Tensor:
    rows = [[float(math.prod(size**p for size, p in zip(point, exponents))) for exponents in powers] for point in points]
    return torch.tensor(rows, dtype=torch.float64)


_CHUNK = 256
"""Columns fitted at once: the tensors of one fit stay a few tens of KiB."""


def least_squares(powers: Sequence[Tuple[int, ...]], points: Sequence[Sizes], columns: Sequence[Sequence[float]]) -> Poly:
    """Least-squares polynomials through ``columns``, as they come (not raised)."""
    design = monomials(powers, points)
    scale = design.abs().amax(dim=0).clamp_min(1.0)
    values = torch.tensor([list(column) for column in columns], dtype=torch.float64).T
    solution = torch.linalg.lstsq(design / scale, values).solution / scale.unsqueeze(1)
    return Poly(tuple(powers), solution.tolist())


def fit_columns(powers: Tuple[Tuple[int, ...], ...], points: Sequence[Sizes], columns: Sequence[Sequence[float]]) -> Tuple[Poly, List[float]]:
    """Least-squares polynomials through ``columns`` (each a column's value at every
    point), each raised by its largest miss below a point so that it lies on or above all
    of them; and each column's largest residual before raising."""
    design = monomials(powers, points)
    scale = design.abs().amax(dim=0).clamp_min(1.0)  # columns of like size: a stable solve
    constant = next((k for k, p in enumerate(powers) if not any(p)), None)
    coefficients: List[List[float]] = [[] for _ in powers]
    misses: List[float] = []
    for start in range(0, len(columns), _CHUNK):
        values = torch.tensor(list(columns[start:start + _CHUNK]), dtype=torch.float64).T
        solution = torch.linalg.lstsq(design / scale, values).solution / scale.unsqueeze(1)
        residual = values - design @ solution
        if constant is not None:
            solution[constant] += residual.amax(dim=0).clamp_min(0.0)
        for row, found in zip(coefficients, solution.tolist()):
            row.extend(found)
        misses.extend(residual.abs().amax(dim=0).tolist())
    return Poly(powers, coefficients), misses


Form = Tuple[Tuple[int, ...], ...]
"""A fit's monomials, by their exponents."""

_BYTES_PER_FLOP = 8
"""How many FLOPs one byte created weighs in ``work``: memory traffic against arithmetic."""
_SIZE_FIELDS = ModuleCost.terms("size")
_OVER_SLACK = 64
_OVER_SHARE = 0.001
"""How far a fit of what the allocator held beyond the moments may miss its samples
(bytes, and share of its largest) and still be followed to other shapes."""
_COUNT_FIELDS = ModuleCost.terms("count")
_SHAPE_FIELDS = ModuleCost.terms("shape")
_SPAN_TOLERANCE = 1e-6
_OTHERS = ("total_activation_bytes", "base_bytes", "step")
"""The terms of a profile not a candidate's: kept by key for the step's tables."""


class ShapesDiffer(Exception):
    """The profiles cannot be fitted together: the model did something else at another
    shape (other candidates called, or called otherwise)."""


@dataclasses.dataclass
class _Timing:
    """``seconds = overhead + rate * work`` of one candidate's recomputation."""

    overhead: float
    rate: float

    def seconds(self, work: float) -> float:
        return max(0.0, self.overhead + self.rate * max(0.0, work))


class CostFit:
    """Profiles of one model measured at several sizes of its inputs' shape variables,
    fitted over them; :meth:`profile_at` gives the profile at any sizes.

    Args:
        names: The shape variables (``batch`` first if there is one), as the sizes give them.
        samples: ``(sizes, profile)`` pairs, each profile with its step; one is enough
            (it then stands for its own sizes alone). The last one's operators are the
            template where candidates' operators line up across them.
        batched: Per variable, whether the inputs carry it beside the batch
            (``InputLayout.batched``): what decides which monomials a fit takes up first.
        form: The monomials to fit (a fit's :attr:`powers`: a form that predicted a step
            it was not fitted on is kept while it does); by default, as many as the
            samples tell apart (``_poly.basis``).

    Raises:
        ShapesDiffer: If the profiles do not line up: other candidates called, or called
            otherwise.
    """

    def __init__(
        self, names: Sequence[str], samples: Sequence[Tuple[Sizes, ModelProfile]], *, batched: Sequence[bool] = (),
        form: Optional["Form"] = None,
    ) -> None:
        if not samples:
            raise ShapesDiffer("no profile to fit")
        self.names = tuple(names)
        points = [tuple(int(size) for size in sizes) for sizes, _ in samples]
        profiles = [profile for _, profile in samples]
        self.points = points
        self.powers: Form = form if form is not None else basis(self.names, points, batched)
        first = _shape_of(profiles[0])
        if any(_shape_of(profile) != first for profile in profiles[1:]):
            raise ShapesDiffer("the model called other candidates, or called them otherwise, at another shape")
        lined_up = _ops_lined_up(profiles)
        self.template = dataclasses.replace(profiles[-1], modules=tuple(
            cost if cost.name in lined_up else dataclasses.replace(cost, ops=()) for cost in profiles[-1].modules
        ))
        flat = [_flatten(profile, lined_up) for profile in profiles]
        self.keys = sorted(set.intersection(*(set(row[0]) for row in flat)))
        values = [[float(row[0][key]) for row in flat] for key in self.keys]
        self._ints, residual = fit_columns(self.powers, points, values)
        # What the allocator held beyond a phase's counted moments is a difference of two
        # peaks: smooth where it is a workspace that grows with the shape, a step where
        # the allocator's peak falls elsewhere at some shapes. Where no polynomial follows
        # it, its largest seen (by its position among the fitted values).
        self._steady_at = [
            (position, int(max(column)))
            for position, (key, column, miss) in enumerate(zip(self.keys, values, residual))
            if key.endswith("/over") and miss > max(_OVER_SLACK, _OVER_SHARE * abs(max(column)))
        ]
        # Every run of moments that lines up across the profiles, fitted as columns of one
        # polynomial (one pass evaluates them all), with its columns' slice per key.
        self._slices: Dict[str, Tuple[int, int]] = {}
        columns: List[List[float]] = []
        for key in sorted(flat[-1][1]):
            traces = [row[1].get(key, ()) for row in flat]
            if len({len(trace) for trace in traces}) != 1 or not traces[0]:
                continue  # fitted through its peak alone
            self._slices[key] = (len(columns), len(columns) + len(traces[0]))
            columns.extend([float(trace[k]) for trace in traces] for k in range(len(traces[0])))
        self._moments = fit_columns(self.powers, points, columns)[0] if columns else None
        self._timings = self._time(samples)
        self._left_out(batched, values)
        # Where each term sits among the fitted values, worked out once: a profile is
        # evaluated at most new shapes a loop meets, and has hundreds of terms.
        at = {key: position for position, key in enumerate(self.keys)}
        self._counted = [position for position, key in enumerate(self.keys) if _counts(key)]
        self._terms = [_Terms.of(cost, at) for cost in self.template.modules]
        self._others = [(key, position) for key, position in at.items() if key.partition("/")[0] in _OTHERS]

    # ------------------------------------------------------------------ evaluation

    def leeway(self, sizes: Sizes) -> Optional[Tuple[float, float]]:
        """How far the monomials this fit leaves out could move its prediction at
        ``sizes``: the most that any one of them, fitted beside the fit's own, raises and
        lowers a phase's peak there, as shares of the highest. None where the measured
        shapes do not determine the costs at ``sizes`` at all: a monomial they cannot
        tell from the fit's own (a batch measured at one size, a length varied at one
        batch only, two lengths that changed together) takes another value there than
        the fit's give it."""
        sizes = tuple(int(size) for size in sizes)
        if self._tied:
            design = monomials(self._tied, self.points)
            scale = design.abs().amax(dim=0).clamp_min(1.0)
            query = monomials(self._tied, [sizes]) / scale
            combination = torch.linalg.lstsq((design / scale).T, query.T, driver="gelsd").solution
            miss = ((design / scale).T @ combination - query.T).norm()
            if miss > _SPAN_TOLERANCE * max(1.0, float(query.norm())):
                return None
        if self._peaks is None:
            return 0.0, 0.0
        own = self._peaks.at(sizes)
        highest = max(1.0, *own)
        raised = lowered = 0.0
        for other in self._others_fitted:
            for theirs, ours in zip(other.at(sizes), own):
                raised, lowered = max(raised, theirs - ours), max(lowered, ours - theirs)
        return raised / highest, lowered / highest

    def profile_at(self, sizes: Sizes, scale: float = 1.0) -> ModelProfile:
        """The fitted profile at ``sizes``; with ``scale``, every byte and FLOP of it that
        many times as large (counts of calls as they are)."""
        sizes = tuple(int(size) for size in sizes)
        values = [round(v) for v in self._ints.at(sizes)]
        for position, value in self._steady_at:
            values[position] = value
        if scale != 1.0:
            unscaled, values = values, [round(value * scale) for value in values]
            for position in self._counted:
                values[position] = unscaled[position]
        peaks: Dict[str, float] = {}
        if self._moments is not None:
            moments = [value * scale for value in self._moments.at(sizes)]
            peaks = {key: max(moments[start:stop]) for key, (start, stop) in self._slices.items()}
        ints = {key: values[position] for key, position in self._others}
        modules = tuple(
            self._module(cost, terms, values, peaks, ints["base_bytes"])
            for cost, terms in zip(self.template.modules, self._terms)
        )
        return ModelProfile(
            modules=modules,
            total_activation_bytes=max(0, ints["total_activation_bytes"]),
            base_bytes=max(0, ints["base_bytes"]),
            step=self._step(ints, peaks),
        )

    # ------------------------------------------------------------------ building

    def _left_out(self, batched: Sequence[bool], values: Sequence[Sequence[float]]) -> None:
        """What :meth:`leeway` reads: the phases' peaks (and the activations in all)
        fitted as this fit's monomials give them, and fitted again with each monomial it
        leaves out beside them, one at a time, where the samples tell that one apart;
        and the fit's monomials with those they cannot tell apart from them."""
        checked = [
            column for key, column in zip(self.keys, values)
            if key == "total_activation_bytes" or (key.startswith("step/") and not key.endswith("/over"))
        ]
        own = rank_of(self.powers, self.points)
        tied: List[Tuple[int, ...]] = []
        self._others_fitted: List[Poly] = []
        self._peaks = least_squares(self.powers, self.points, checked) if checked else None
        for powers in powers_of(self.names, batched):
            if powers in self.powers:
                continue
            if rank_of([*self.powers, powers], self.points) == own:
                tied.append(powers)
            elif self._peaks is not None:
                self._others_fitted.append(least_squares([*self.powers, powers], self.points, checked))
        self._tied = (*self.powers, *tied) if tied else ()

    def _time(self, samples: Sequence[Tuple[Sizes, ModelProfile]]) -> Dict[str, _Timing]:
        """Per candidate, ``overhead + rate * work`` fitted to its measured times (a rate
        alone from one)."""
        timings: Dict[str, _Timing] = {}
        for cost in self.template.modules:
            seen = [
                (_work(profile[cost.name].flops, profile[cost.name].created_bytes), profile[cost.name].forward_time)
                for _, profile in samples
                if cost.name in profile and profile[cost.name].forward_time > 0
            ]
            if not seen:
                continue
            if len({work for work, _ in seen}) < 2:
                work, seconds = max(seen)
                timings[cost.name] = _Timing(0.0, seconds / work) if work > 0 else _Timing(seconds, 0.0)
                continue
            design = torch.tensor([[1.0, work] for work, _ in seen], dtype=torch.float64)
            times = torch.tensor([[seconds] for _, seconds in seen], dtype=torch.float64)
            scale = design.abs().amax(dim=0).clamp_min(1e-30)
            overhead, rate = (torch.linalg.lstsq(design / scale, times).solution[:, 0] / scale).tolist()
            if rate < 0:
                overhead, rate = min(seconds for _, seconds in seen), 0.0
            elif overhead < 0:
                overhead, rate = 0.0, max(seconds / work for work, seconds in seen if work > 0)
            timings[cost.name] = _Timing(overhead, rate)
        return timings

    def _module(
        self, cost: ModuleCost, terms: "_Terms", values: List[int], peaks: Mapping[str, float], base: int
    ) -> ModuleCost:
        fields: Dict[str, Any] = {field: max(0, values[position]) for field, position in terms.ints}
        fields.update((field, values[position]) for field, position in terms.counts)
        forward = peaks.get(terms.forward)
        if forward is not None:
            fields["forward_peak_bytes"] = max(0, round(forward))
        if terms.base_before is not None:
            # A part of the base, as measured; a fit must not make it more.
            fields["base_before_bytes"] = min(max(0, values[terms.base_before]), max(0, base))
        fields["self_saved_input_bytes"] = min(fields["self_saved_input_bytes"], fields["input_bytes"])
        fields["call_kept_bytes"] = min(fields["call_kept_bytes"], fields["kept_bytes"])
        fields["handed_over_bytes"] = min(fields["handed_over_bytes"], fields["kept_bytes"])
        work = _work(fields["flops"], fields["created_bytes"])
        timing = self._timings.get(cost.name)
        seconds = cost.forward_time if timing is None else timing.seconds(work)
        # One construction per operator (a profile has hundreds: evaluated at every new shape).
        share = timing.overhead / len(cost.ops) if timing is not None and cost.ops else 0.0
        ops = []
        for op, (at_bytes, at_flops) in zip(cost.ops, terms.ops):
            nbytes = max(0, op.bytes if at_bytes is None else values[at_bytes])
            flops = max(0, op.flops if at_flops is None else values[at_flops])
            spent = op.time if timing is None else share + timing.rate * (flops + _BYTES_PER_FLOP * nbytes)
            ops.append(OpCost(op.op, op.occurrence, nbytes, op.saved, flops, spent, op.mutated, op.random))
        recompute = None
        if cost.recompute_time is not None and cost.forward_time > 0:
            recompute = seconds * cost.recompute_time / cost.forward_time
        return dataclasses.replace(
            cost, **fields, forward_time=seconds, recompute_time=recompute, ops=tuple(ops), forward_moments=(),
        )

    def _step(self, ints: Mapping[str, int], peaks: Mapping[str, float]) -> Optional[StepPeaks]:
        template = self.template.step
        if template is None:
            return None

        def peak(key: str) -> int:
            """A phase's peak: its highest fitted moment and what the allocator held beyond
            the moments; where its moments did not line up, its peak fitted as it is."""
            runs = [peaks.get(f"step/{key}/{len(run)}") for run in template.moments.get(key, ())]
            if not runs or any(run is None for run in runs):
                return max(0, ints[f"step/{key}"])
            return max(0, round(max(runs)) + max(0, ints[f"step/{key}/over"]))  # type: ignore[type-var]

        tables = {
            table: {name: peak(f"{table}:{name}") for name in getattr(template, table)}
            for table in ("forward", "recompute", "backward")
        }
        end = peak(END)
        total = max([end, *(v for table in tables.values() for v in table.values())])
        return StepPeaks(
            tables["forward"], end, tables["recompute"], tables["backward"], total,
            at_allocator=template.at_allocator,
        )


@dataclasses.dataclass(frozen=True)
class _Terms:
    """Where one candidate's terms sit among a fit's values: ``(field, position)`` of its
    byte and count fields, its base share's position, and per operator the positions of
    its bytes and FLOPs (None: not fitted, the template's)."""

    ints: Tuple[Tuple[str, int], ...]
    counts: Tuple[Tuple[str, int], ...]
    base_before: Optional[int]
    forward: str
    ops: Tuple[Tuple[Optional[int], Optional[int]], ...]

    @classmethod
    def of(cls, cost: ModuleCost, at: Mapping[str, int]) -> "_Terms":
        name = cost.name
        return cls(
            ints=tuple((field, at[f"{name}/{field}"]) for field in _SIZE_FIELDS),
            counts=tuple((field, at[f"{name}/{field}"]) for field in _COUNT_FIELDS),
            base_before=None if cost.base_before_bytes is None else at[f"{name}/base_before_bytes"],
            forward=f"{name}/forward",
            ops=tuple((at.get(f"{name}/op{k}/bytes"), at.get(f"{name}/op{k}/flops")) for k in range(len(cost.ops))),
        )


# ---------------------------------------------------------------------- flattening


def _counts(key: str) -> bool:
    """Whether the term ``key`` counts calls or positions (never scaled with bytes)."""
    return key.rpartition("/")[2] in _COUNT_FIELDS


def _work(flops: Any, created_bytes: Any) -> float:
    return float(flops) + _BYTES_PER_FLOP * float(created_bytes)


def _shape_of(profile: ModelProfile) -> Tuple[Any, ...]:
    """What must be the same in every profile fitted together: the candidates, how they
    were called, and the step's phases."""
    modules = tuple(
        (cost.name, *(getattr(cost, field) for field in _SHAPE_FIELDS), cost.base_before_bytes is None)
        for cost in profile.modules
    )
    step = profile.step
    phases = None if step is None else (
        tuple(sorted(step.forward)), tuple(sorted(step.recompute)), tuple(sorted(step.backward)),
        step.at_allocator,
    )
    return modules, phases


def _ops_lined_up(profiles: Sequence[ModelProfile]) -> Set[str]:
    """The candidates whose operators are the same at every shape (a batch of one, or a
    loop over the length, runs others): only theirs are fitted and offer levels."""
    def listed(cost: ModuleCost) -> Tuple[Any, ...]:
        return tuple((op.op, op.occurrence, op.saved, op.mutated, op.random) for op in cost.ops)

    names = set()
    for cost in profiles[0].modules:
        first = listed(cost)
        if first and all(listed(profile[cost.name]) == first for profile in profiles[1:]):
            names.add(cost.name)
    return names


def _flatten(profile: ModelProfile, with_ops: Set[str]) -> Tuple[Dict[str, int], Dict[str, Tuple[int, ...]]]:
    """Every integer term of a profile (operators' of the candidates ``with_ops``), and
    every run of moments, by key."""
    ints: Dict[str, int] = {
        "total_activation_bytes": profile.total_activation_bytes,
        "base_bytes": profile.base_bytes,
    }
    moments: Dict[str, Tuple[int, ...]] = {}
    for cost in profile.modules:
        for field in (*_SIZE_FIELDS, *_COUNT_FIELDS):
            ints[f"{cost.name}/{field}"] = int(getattr(cost, field))
        if cost.base_before_bytes is not None:
            ints[f"{cost.name}/base_before_bytes"] = int(cost.base_before_bytes)
        for k, op in enumerate(cost.ops if cost.name in with_ops else ()):
            ints[f"{cost.name}/op{k}/bytes"] = int(op.bytes)
            ints[f"{cost.name}/op{k}/flops"] = int(op.flops)
        if cost.forward_moments:
            moments[f"{cost.name}/forward"] = tuple(cost.forward_moments)
    step = profile.step
    if step is not None:
        peaks = {END: step.end}
        for table in ("forward", "recompute", "backward"):
            peaks.update((f"{table}:{name}", value) for name, value in getattr(step, table).items())
        for key, value in peaks.items():
            ints[f"step/{key}"] = int(value)
            runs = step.moments.get(key, ())
            for run in runs:
                moments[f"step/{key}/{len(run)}"] = tuple(run)
            highest = max((max(run) for run in runs if run), default=None)
            ints[f"step/{key}/over"] = 0 if highest is None else int(value) - highest
    return ints, moments


_TRUST_UNDER = 0.02
"""How far below a measured step's peak (a share of it) a fit may predict a phase and
still be trusted."""
_TRUST_OVER = 0.10
"""How far above it."""
_EXTEND = 1.1
"""A fit that predicted one measured step stands for sizes up to this multiple of the
largest measured (any smaller size: costs there are smaller, and a miss is caught by the
checks)."""
_REACH = 2.0
"""The furthest a fit stands past the largest size measured, as a multiple of it: its
reach doubles its share past ``_EXTEND`` for each further step it predicted at sizes
beyond those it was fitted on."""
_KEPT = 12
"""Measured profiles kept per layout: the extremes of each variable and the most recent."""
_REMEASURE = 0.03
"""A checked step this far above its fitted prediction (a share of the un-checkpointed
peak) has its shape measured again."""
_MARGIN_SLACK = 0.005
"""Added to a miss when it becomes the margin."""
_GIVE_UP = 3
"""Failed measurements of one layout after which it is no longer measured."""
_LAYOUTS = 8
"""Layouts of inputs kept per planner, the most recently used."""
_EVALUATED = 64
"""Evaluations of a fit kept per layout, the most recent."""

@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What a measured plan is made of, besides the model and its inputs."""

    candidates: Tuple[Tuple[str, str], ...]
    """``(qualified name, class name)`` of each candidate, in model order."""
    run_region: Callable[..., Any]
    """How the marking layer runs a checkpointed region (``RegionRunner``): a step
    measured on given inputs runs its regions as a plan's run."""
    budget: Optional[Budget] = None
    """The budget term; None predicts the plan that checkpoints every candidate."""
    save_policy: Optional[Callable[..., Any]] = None
    """The selective tier's policy, if candidates are checkpointed selectively."""
    segments: bool = False
    """Whether consecutive candidates may share one region."""
    levels: bool = False
    """Whether a candidate may be checkpointed at a selective level."""
    recompute: bool = True
    """Whether the candidates are recomputed (the plain tier), for the entries' labels."""
    preserve_rng_state: bool = True
    """The engine option: on the CPU each region keeps the generator's state."""
    loss_fn: Optional[Callable[[Any], Any]] = None
    """How a training step turns the output into the loss (see ``plan``)."""
    rates: Any = None
    """What a step run on fake tensors is priced at (``plan``'s ``device_rates``)."""
    fake: bool = False
    """Whether steps on given inputs run on fake tensors even for a real model."""
    optimizer: Any = None
    """The optimizer whose state and step count in a device's memory (an ``OptimizerSpec``)."""
    accumulation: int = 1
    """Micro-steps per optimizer step: past one, a plan from example inputs is for a
    micro-step that starts with the gradients held (``plan``'s ``accumulation``)."""

    @property
    def names(self) -> List[str]:
        return [name for name, _ in self.candidates]

    @property
    def outermost(self) -> List[str]:
        """The candidates no other candidate contains: those a measured step checkpoints."""
        names = self.names
        return [
            name for name in names
            if name and not any(name.startswith(other + ".") for other in names if other)
        ]


_SCALE_STEP = 2 ** (1 / 16)
"""The grid a scaled bound's factor is rounded up to (steps of 4.4%)."""
_SCALE_REUSE = _SCALE_STEP ** 2 * (1 + 1e-9)
"""How much larger than its own a scaled bound already worked out may be and still be
taken (two steps of the grid, 9%): a new shape then costs no evaluation and no solve."""
_SCALED_PEAK = 0.999
"""A scaled bound's peak against its measured shape's times the scale (counts of calls do
not scale): what it is at least, for telling whether it may peak below a fit."""


class LayoutCosts:
    """What is known of one input layout's costs (see the module)."""

    def __init__(self, layout: InputLayout) -> None:
        self.layout = layout
        self.profiles: "collections.OrderedDict[Sizes, ModelProfile]" = collections.OrderedDict()
        self.fit: Optional[CostFit] = None
        self.trusted = False
        self.margin = 0.0
        """A share of the un-checkpointed peak kept free beyond the predictions."""
        self.failures = 0
        self.remeasure: Set[Sizes] = set()
        # The form of a fit that predicted a step it was not fitted on: later fits keep
        # to it (more samples, the same monomials) until it fails to predict one.
        self._form: Optional[Form] = None
        # The steps measured past the sizes it was fitted on that the form predicted, one
        # after another: how far past them it stands (``fits``).
        self._confirmed = 0
        # Evaluations of the current fit, by sizes (a loop meets a shape many times).
        self._fitted: Dict[Sizes, ModelProfile] = {}
        self._covered: Dict[Sizes, bool] = {}
        self._known: Dict[Sizes, Optional[Tuple[str, ModelProfile]]] = {}
        self._single: Dict[Sizes, CostFit] = {}  # one measured profile, to scale
        self._scaled: Dict[Tuple[Sizes, float], ModelProfile] = {}

    @property
    def given_up(self) -> bool:
        return self.failures >= _GIVE_UP

    def source_at(self, sizes: Sizes) -> Optional[str]:
        """Where the costs at ``sizes`` come from if they are known without measuring
        (``measured``, ``fitted``, or a bound from a measured shape, ``bounded`` or
        ``scaled``; then :meth:`profile_at` gives them), else None."""
        if sizes in self.remeasure:
            return None
        if sizes in self.profiles:
            return "measured"
        known = self._known_at(sizes)
        return None if known is None else known[0]

    def fits(self, sizes: Sizes) -> bool:
        """Whether a trusted fit stands for ``sizes`` (measuring there teaches little)."""
        fit = self.fit
        if fit is None or not self.trusted:
            return False
        covered = self._covered.get(sizes)
        if covered is None:
            # How far past the largest measured sizes the trusted fit stands (see the module).
            reach = min(_REACH, 1 + (_EXTEND - 1) * 2 ** max(0, self._confirmed - 1))
            covered = all(size <= largest * reach for size, largest in zip(sizes, _largest(fit.points)))
            if covered:
                leeway = fit.leeway(sizes)
                covered = leeway is not None and leeway[0] <= _TRUST_UNDER and leeway[1] <= _TRUST_OVER
            _remember(self._covered, sizes, covered)
        return covered

    def profile_at(self, sizes: Sizes) -> ModelProfile:
        """The profile at ``sizes``: measured there, or else as :meth:`source_at` says,
        or else fitted."""
        known = self.profiles.get(sizes)
        if known is not None:
            return known
        found = self._known_at(sizes) if sizes not in self.remeasure else None
        return found[1] if found is not None else self._fitted_at(sizes)

    def _known_at(self, sizes: Sizes) -> Optional[Tuple[str, ModelProfile]]:
        """The costs at unmeasured ``sizes``: the trusted fit's, or a bound from a measured
        shape (:meth:`_bounded_at`), whichever peaks lower."""
        if sizes in self._known:
            return self._known[sizes]
        found = []
        if self.fits(sizes):
            found.append(("fitted", self._fitted_at(sizes)))
        # The bound's peak is its measured shape's, scaled: its profile is worked out only
        # where it may peak lower than the fit's (a loop meets a new shape at most steps).
        bound = self._bounded_at(sizes, above=_peak(found[0][1]) if found else None)
        if bound is not None:
            found.append(bound)
        return _remember(self._known, sizes, min(found, key=lambda pair: _peak(pair[1])) if found else None)

    def _bounded_at(self, sizes: Sizes, above: Optional[int] = None) -> Optional[Tuple[str, ModelProfile]]:
        """Costs at ``sizes`` no lower than the real ones, from a measured shape: every
        term a sum of tensor sizes, of degree at most 1 in the batch and 2 in the lengths,
        none negative, so a shape at least as large in every variable bounds them as
        measured (``bounded``), and a smaller one once each term is scaled by the batch's
        growth and the square of the largest length's growth (``scaled``). The measured
        shape whose bound peaks lowest, said ``bounded`` wherever a measured shape at
        least as large stands (a smaller one scaled may peak lower: no larger shape
        needs measuring); None where there is none, or where that bound's peak would not
        be below ``above``."""
        names = self.layout.names
        scaled = [(_growth(names, point, sizes), point) for point in self.profiles if point not in self.remeasure]
        if not scaled:
            return None
        scale, point = min(scaled, key=lambda pair: pair[0] * _peak(self.profiles[pair[1]]))
        if above is not None and scale * _peak(self.profiles[point]) * _SCALED_PEAK >= above:
            return None
        if scale == 1.0:
            return "bounded", self.profiles[point]
        # Scaled up to the next step of a grid: still a bound, and the shapes between two
        # steps share one profile (and so one plan, solved once). A profile already
        # worked out a step or two higher is a bound too, and its plan is solved already.
        scale = _SCALE_STEP ** math.ceil(math.log(scale, _SCALE_STEP) - 1e-9)
        scale = min((s for p, s in self._scaled if p == point and scale <= s <= scale * _SCALE_REUSE), default=scale)
        found = self._scaled.get((point, scale))
        if found is None:
            single = self._single.get(point)
            if single is None:
                single = self._single[point] = CostFit(names, [(point, self.profiles[point])])
            found = _remember(self._scaled, (point, scale), single.profile_at(point, scale=scale))
        return ("bounded" if any(growth == 1.0 for growth, _ in scaled) else "scaled"), found

    def _fitted_at(self, sizes: Sizes) -> ModelProfile:
        assert self.fit is not None
        found = self._fitted.get(sizes)
        return found if found is not None else _remember(self._fitted, sizes, self.fit.profile_at(sizes))

    def widen(self, layout: InputLayout) -> None:
        """The layout, :meth:`InputLayout.widened` by inputs that gave some of its
        dimensions other sizes: what was measured stands, its shapes given their sizes
        in the new variables (those they had), and the fit is made over them again."""
        added = len(layout.variables) - len(self.layout.variables)
        self.layout = layout
        self.profiles = collections.OrderedDict(
            (layout.extended(sizes), profile) for sizes, profile in self.profiles.items()
        )
        self.remeasure = {layout.extended(sizes) for sizes in self.remeasure}
        if self._form is not None:
            self._form = tuple(powers + (0,) * added for powers in self._form)
        if self.profiles:
            trusted = self.trusted
            self._refit()
            # The measured shapes determine nothing where the new variables take other
            # sizes (``CostFit.leeway``): where the fit was trusted, it still is.
            self.trusted = trusted and self.trusted

    def learn(self, sizes: Sizes, profile: ModelProfile) -> str:
        """Take a step measured at ``sizes``: check the fit on it if it was not fitted on
        it, then fit again. Returns what happened, for the notes."""
        sizes = self.layout.extended(sizes)  # a step planned before the layout widened
        said = "measured"
        fit = self.fit
        if fit is not None and sizes not in self.profiles:
            under, over = misses(fit.profile_at(sizes), profile)
            was = self.trusted
            self.trusted = under <= _TRUST_UNDER and over <= _TRUST_OVER
            self._form = (self._richer(sizes, profile) or fit.powers) if self.trusted else None
            if not self.trusted:
                self._confirmed = 0
            elif not was or any(size > largest for size, largest in zip(sizes, _largest(fit.points))):
                self._confirmed += 1  # trusted now, or predicted further out than it was fitted
            said = (
                f"the fit predicted it within {max(under, over):.1%}"
                if self.trusted
                else f"the fit missed it by {max(under, over):.1%}{'; no longer trusted' if was else ''}"
            )
        known = self.profiles.pop(sizes, None)
        if known is not None and _peak(known) > _peak(profile):
            profile = known  # the same shape measured twice: its higher costs stand
        self.profiles[sizes] = profile
        self.remeasure.discard(sizes)
        self._bound()
        self._refit()
        return said

    def _richer(self, sizes: Sizes, profile: ModelProfile) -> Optional[Form]:
        """More monomials than the trusted fit's, where the measured shapes tell them
        apart and a fit of them all predicted the step at ``sizes`` as well, from the
        shapes measured before it: the monomials a form leaves out are those a loop
        that grows would otherwise measure for (``CostFit.leeway``)."""
        fit = self.fit
        assert fit is not None
        names, batched = self.layout.names, self.layout.batched
        if len(basis(names, list(self.profiles), batched)) <= len(fit.powers):
            return None  # the shapes tell no more apart
        try:
            fuller = CostFit(names, list(self.profiles.items()), batched=batched)
        except ShapesDiffer:
            return None
        under, over = misses(fuller.profile_at(sizes), profile)
        return fuller.powers if under <= _TRUST_UNDER and over <= _TRUST_OVER else None

    def missed(self, sizes: Sizes, share: float, source: str) -> None:
        """A checked step at ``sizes`` peaked ``share`` of the un-checkpointed peak above
        its prediction from ``source`` costs."""
        sizes = self.layout.extended(sizes)
        self.margin = max(self.margin, min(0.5, share + _MARGIN_SLACK))
        if source != "measured" and share > _REMEASURE:
            self.remeasure.add(sizes)
            # The form did not hold where it reached: it stands a tenth past what it was
            # fitted on again, until it predicts further steps.
            self._confirmed = 0
            self._known.clear()
            self._covered.clear()

    def _bound(self) -> None:
        """At most ``_KEPT`` profiles: the extremes of each variable stay, then the newest."""
        if len(self.profiles) <= _KEPT:
            return
        points = list(self.profiles)
        keep = set()
        for index in range(len(points[0])):
            keep.add(min(points, key=lambda p: p[index]))
            keep.add(max(points, key=lambda p: p[index]))
        for point in reversed(points):
            if len(keep) >= _KEPT:
                break
            keep.add(point)
        for point in points:
            if point not in keep:
                del self.profiles[point]

    def _refit(self) -> None:
        for table in (self._fitted, self._covered, self._known, self._single, self._scaled):
            table.clear()
        samples = list(self.profiles.items())
        names, batched = self.layout.names, self.layout.batched
        try:
            self.fit = CostFit(names, samples, batched=batched, form=self._form)
            return
        except ShapesDiffer:
            pass
        # The model did something else at some shapes: fit those like the newest.
        alike = []
        for sizes, profile in samples:
            try:
                CostFit(names, [(sizes, profile), samples[-1]], batched=batched)
                alike.append((sizes, profile))
            except ShapesDiffer:
                continue
        self.fit = CostFit(names, alike or [samples[-1]], batched=batched)
        self.trusted = False
        self._form = None
        self._confirmed = 0


class Layouts:
    """The layouts of a model's inputs met so far, with their costs: the most recently used
    ``_LAYOUTS``; ``forget`` is told of each one dropped, and of each one widened (the
    sizes its plans were solved at are no longer its)."""

    def __init__(self, forget: Callable[[LayoutCosts], None]) -> None:
        self._known: "collections.OrderedDict[Tuple[Any, ...], LayoutCosts]" = collections.OrderedDict()
        self._forget = forget

    def __len__(self) -> int:
        return len(self._known)

    def values(self) -> Any:
        return self._known.values()

    def of(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[LayoutCosts, Sizes]:
        """The costs of the layout these inputs fit, and their sizes: a known layout, as it
        is or widened by these inputs (``InputLayout.widened``: they differ from it in
        sizes only), else a new one."""
        found = self.find(args, kwargs) or self._widen(args, kwargs)
        if found is not None:
            return found
        layout = read_layout(args, kwargs)
        costs = LayoutCosts(layout)
        self._known[(layout.spec, layout.leaves)] = costs
        while len(self._known) > _LAYOUTS:
            self._forget(self._known.popitem(last=False)[1])
        return costs, layout.sizes

    def find(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[LayoutCosts, Sizes]]:
        """The known layout these inputs fit, and their sizes in it. A keyword argument
        holding a 0-dim tensor that the known inputs lacked (the Trainer's
        ``num_items_in_batch``, a loss scale) is looked past: it moves no activation."""
        for given in self._tries(kwargs):
            for key, costs in reversed(self._known.items()):
                sizes = costs.layout.sizes_of(args, given)
                if sizes is not None:
                    self._known.move_to_end(key)
                    return costs, sizes
        return None

    def _widen(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[LayoutCosts, Sizes]]:
        """The most recently used layout that these inputs differ from in sizes only,
        widened by them (its dimensions they give other sizes made variables), and
        their sizes in it; None if there is none."""
        for given in self._tries(kwargs):
            for key, costs in reversed(list(self._known.items())):
                wider = costs.layout.widened(args, given)
                if wider is None:
                    continue
                del self._known[key]
                costs.widen(wider)
                self._forget(costs)
                other = self._known.pop((wider.spec, wider.leaves), None)
                if other is not None:
                    self._forget(other)
                self._known[(wider.spec, wider.leaves)] = costs
                sizes = wider.sizes_of(args, given)
                assert sizes is not None
                return costs, sizes
        return None

    @staticmethod
    def _tries(kwargs: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The keyword arguments as given, then without those holding a 0-dim tensor."""
        scalars = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
        return [kwargs, {k: v for k, v in kwargs.items() if k not in scalars}] if scalars else [kwargs]


def misses(predicted: ModelProfile, measured: ModelProfile) -> Tuple[float, float]:
    """How far ``predicted`` lies below and above ``measured`` at its worst, as shares of
    the measured step's peak: every phase of the step, and the activations in all."""
    ours, theirs = predicted.step, measured.step
    pairs = [(predicted.total_activation_bytes, measured.total_activation_bytes)]
    if ours is not None and theirs is not None:
        pairs += [(ours.end, theirs.end), (ours.total, theirs.total)]
        for table in ("forward", "recompute", "backward"):
            mine, real = getattr(ours, table), getattr(theirs, table)
            pairs += [(mine.get(name, 0), value) for name, value in real.items()]
    scale = max(_peak(measured), 1)
    under = max(0, max(real - mine for mine, real in pairs)) / scale
    over = max(0, max(mine - real for mine, real in pairs)) / scale
    return under, over


def _remember(table: Dict[Any, Any], key: Any, value: Any) -> Any:
    """``value``, kept in ``table`` under ``key`` among the ``_EVALUATED`` most recent."""
    table[key] = value
    while len(table) > _EVALUATED:
        del table[next(iter(table))]
    return value


def _largest(points: Sequence[Sizes]) -> Sizes:
    """The largest size of each shape variable among ``points``."""
    return tuple(max(sizes) for sizes in zip(*points))


def _growth(names: Tuple[str, ...], point: Sizes, sizes: Sizes) -> float:
    """How many times a term measured at ``point`` may grow at ``sizes`` (see
    ``LayoutCosts._bounded_at``): 1 where ``point`` is at least as large everywhere."""
    batch = length = 1.0
    for name, measured, size in zip(names, point, sizes):
        grown = max(1.0, size / max(measured, 1))
        if name == "batch":
            batch = grown
        else:
            length = max(length, grown)
    return batch * length**2


def _peak(profile: ModelProfile) -> int:
    return profile.step.total if profile.step is not None else profile.total_activation_bytes

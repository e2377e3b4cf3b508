"""Polynomials over the inputs' shape variables: the monomials a fit may draw on, those a
set of measured shapes can tell apart, and least-squares fits of many columns at once,
kept as plain floats so that evaluating one allocates no tensor (plans are solved at the
start of a training step, inside its memory).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import List, Sequence, Tuple

import torch

__all__ = ["Poly", "basis", "fit_columns", "least_squares", "monomials", "powers_of", "rank_of"]

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

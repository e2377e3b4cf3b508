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

__all__ = ["Poly", "basis", "fit_columns", "monomials", "powers_of"]

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


def powers_of(names: Sequence[str]) -> Tuple[Tuple[int, ...], ...]:
    """Exponents of every monomial the fit may use, lowest degree first: degree <= 1 in
    the batch, <= 2 in the lengths."""
    batch = bool(names) and names[0] == "batch"
    lengths = len(names) - batch
    length_powers = [p for p in itertools.product(range(3), repeat=lengths) if sum(p) <= 2]
    found = [
        ((b,) if batch else ()) + p for b in ((0, 1) if batch else (0,)) for p in length_powers
    ]
    return tuple(sorted(found, key=lambda p: (sum(p), tuple(-e for e in p))))


def basis(names: Sequence[str], points: Sequence[Sizes]) -> Tuple[Tuple[int, ...], ...]:
    """The monomials the measured ``points`` can tell apart: each, lowest degree first,
    kept if it raises the rank of the design."""
    chosen: List[Tuple[int, ...]] = []
    rank = 0
    for powers in powers_of(names):
        if len(chosen) == len(points):
            break
        design = monomials([*chosen, powers], points)
        scaled = design / design.abs().amax(dim=0).clamp_min(1.0)
        found = int(torch.linalg.matrix_rank(scaled, rtol=_RANK_TOLERANCE))
        if found > rank:
            chosen.append(powers)
            rank = found
    return tuple(chosen)


def monomials(powers: Sequence[Tuple[int, ...]], points: Sequence[Sizes]) -> torch.Tensor:
    rows = [[float(math.prod(size**p for size, p in zip(point, exponents))) for exponents in powers] for point in points]
    return torch.tensor(rows, dtype=torch.float64)


_CHUNK = 256
"""Columns fitted at once: the tensors of one fit stay a few tens of KiB."""


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

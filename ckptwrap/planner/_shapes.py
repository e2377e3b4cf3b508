"""Budget plans per input shape: the bucket rule, and the per-model cache of plans.

A plan measured at one input shape says nothing about a larger one, so a model wrapped
with a ``budget:`` policy plans again, before the forward goes on, when a training input
comes that no plan made so far serves, and keeps its plans per *bucket*.

The rule:

* An input's **shapes** are its structure (positional and keyword arguments, nested
  containers) and, for each tensor in it, its dtype, device type and shape; other values
  (numbers, flags) count by their type, not their value.
* Its **bucket** is the same with every dimension rounded up to the next power of two:
  sequence lengths 65 to 128 at one batch size share a bucket.
* A plan serves the inputs of its bucket that are nowhere larger than the one it was
  profiled on: every dimension of every tensor at most the profiled one. This assumes, as
  holds for the layers people checkpoint (linear, attention, convolution, normalisation),
  that activation memory does not grow when an input dimension shrinks; then the peak
  predicted at the profiled shapes, which fits the budget, bounds the peak at any shapes
  the plan serves.
* An input that no plan of its bucket serves (larger than each in some dimension) is
  profiled in turn, and its plan replaces the bucket's plans that it serves: the bucket
  keeps the plans of the largest inputs seen, a few (:data:`_PER_BUCKET`) when inputs
  trade batch size for length.

So every training step runs under a plan whose predicted peak, at shapes at least as
large as the step's, fits an absolute budget, without scaling or extrapolating a
measurement. A bucket is profiled once when its first input is its largest (lengths padded
to powers of two, fixed-length packing), otherwise once per new largest input. A percent
budget is read against the un-checkpointed activation memory at the shapes its plan was
profiled at. A model keeps the plans of its :data:`CAPACITY` most recently used buckets.
Profiling itself holds, at its highest, the activations outside the candidates plus one
candidate's.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten

from ._plan import Plan

__all__ = ["CAPACITY", "ShapePlans", "Shapes", "bucket_of", "describe", "input_shapes"]

CAPACITY = 16
"""Buckets whose plans a model keeps; the least recently used goes first."""
_PER_BUCKET = 4
"""Plans a bucket keeps when none of its inputs is the largest in every dimension."""

Shapes = Tuple[str, Tuple[Tuple[Any, ...], ...]]
"""The structure, and per leaf (dtype, device type, shape) for a tensor, else (type name,)."""


def input_shapes(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Shapes:
    """The shapes of one forward's inputs, as the bucket rule reads them."""
    leaves, spec = tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
    described = tuple(
        (str(leaf.dtype), leaf.device.type, tuple(leaf.shape))
        if isinstance(leaf, torch.Tensor)
        else (type(leaf).__name__,)
        for leaf in leaves
    )
    return str(spec), described


def bucket_of(shapes: Shapes) -> Shapes:
    """``shapes`` with every tensor dimension rounded up to the next power of two."""
    spec, leaves = shapes
    return spec, tuple(
        (leaf[0], leaf[1], tuple(_power_of_two(size) for size in leaf[2])) if len(leaf) == 3 else leaf
        for leaf in leaves
    )


def describe(shapes: Shapes) -> str:
    """The tensor shapes, for messages: ``(4, 128), (4, 128)``."""
    tensors = [leaf[2] for leaf in shapes[1] if len(leaf) == 3]
    return ", ".join(str(tuple(shape)) for shape in tensors) or "no tensors"


def _power_of_two(size: int) -> int:
    return size if size <= 1 else 1 << (size - 1).bit_length()


def _serves(profiled: Shapes, shapes: Shapes) -> bool:
    """Whether a plan profiled at ``profiled`` serves ``shapes`` (of the same bucket)."""
    return all(
        len(a) != 3 or all(x <= y for x, y in zip(b[2], a[2]))
        for a, b in zip(profiled[1], shapes[1])
    )


class ShapePlans:
    """The plans one model made, by bucket, most recently used last.

    Plain data (shapes and :class:`Plan`), so it deep-copies and pickles with the model.
    """

    def __init__(self) -> None:
        self._buckets: "collections.OrderedDict[Shapes, List[Tuple[Shapes, Plan]]]" = (
            collections.OrderedDict()
        )

    def find(self, shapes: Shapes, prefer: Optional[Plan] = None) -> Optional[Plan]:
        """A plan that serves ``shapes``: ``prefer`` if it does, else the one profiled at
        the fewest elements; None when the bucket has none."""
        bucket = bucket_of(shapes)
        entries = self._buckets.get(bucket)
        if not entries:
            return None
        self._buckets.move_to_end(bucket)
        serving = [(profiled, plan) for profiled, plan in entries if _serves(profiled, shapes)]
        if not serving:
            return None
        if any(plan is prefer for _, plan in serving):
            return prefer
        return min(serving, key=lambda entry: _elements(entry[0]))[1]

    def knows(self, shapes: Shapes) -> bool:
        """Whether the bucket of ``shapes`` has a plan (for any size)."""
        return bool(self._buckets.get(bucket_of(shapes)))

    def add(self, shapes: Shapes, plan: Plan) -> None:
        """Keep ``plan``, profiled at ``shapes``, in place of the plans it serves for."""
        bucket = bucket_of(shapes)
        kept = [entry for entry in self._buckets.pop(bucket, []) if not _serves(shapes, entry[0])]
        self._buckets[bucket] = [*kept[-(_PER_BUCKET - 1):], (shapes, plan)]
        while len(self._buckets) > CAPACITY:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)


def _elements(shapes: Shapes) -> int:
    total = 0
    for leaf in shapes[1]:
        if len(leaf) == 3:
            count = 1
            for size in leaf[2]:
                count *= size
            total += count
    return total

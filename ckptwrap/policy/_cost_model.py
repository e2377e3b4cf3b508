"""The peak model of the budget planner: what one candidate costs (:class:`CostItem`) and
the activation peak a choice of checkpointed candidates is predicted to reach.

The solver (``_search`` and ``_solver``) optimises over this model; it knows nothing of modules.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from typing import Iterable, List, Optional, Sequence, Set, Tuple, Union

from .._errors import CheckpointConfigError

__all__ = ["CostItem", "CostOption", "Group", "format_bytes", "predicted_peak"]

_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """A byte count in human units: ``512 B``, ``1.5 KiB``, ``12.5 MiB``, ``2.0 GiB``."""
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in _BYTE_UNITS[:-1]:
        # Compare the rounded value, so 1048575 bytes reads "1.0 MiB", not "1024.0 KiB".
        if abs(round(value, 1)) < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {_BYTE_UNITS[-1]}"


@dataclasses.dataclass(frozen=True)
class CostOption:
    """A further way to checkpoint one candidate alone, besides recomputing all of it:
    a selective level that saves the outputs of some operators and recomputes the rest.

    Example:
        >>> CostOption("save mm x2", inputs=3 << 20, rebuilt=4 << 20, time=0.0005)
        CostOption(label='save mm x2', inputs=3145728, rebuilt=4194304, time=0.0005)
    """

    label: str
    """What the option saves, for the plan table (``save mm x2, addmm``)."""
    inputs: int
    """Bytes the checkpoint keeps from forward to backward: the candidate's inputs (as in
    ``CostItem.inputs``) and the saved operator outputs."""
    rebuilt: int
    """Bytes its recomputation creates and holds until its backward."""
    time: float
    """Seconds its recomputation takes: the operators it does not save."""


@dataclasses.dataclass(frozen=True)
class CostItem:
    """What one candidate costs, as the solver sees it.

    Example:
        >>> CostItem("layers.0", kept=8 << 20, inputs=1 << 20, time=0.002)
        CostItem(name='layers.0', kept=8388608, inputs=1048576, time=0.002, rebuilt=8388608, before=None, joins=None, options=(), grads=0, recompute_grads=0)
    """

    name: str
    """Qualified name of the candidate, for messages."""
    kept: int
    """Bytes its forward keeps for backward when it is not checkpointed."""
    inputs: int
    """Bytes a checkpoint of it keeps from its forward to its backward instead: its inputs,
    and whatever a selective policy saves."""
    time: float
    """Seconds its recomputation takes."""
    rebuilt: Optional[int] = None
    """Bytes its recomputation creates and holds until its backward; ``None`` means
    ``kept`` (a full recomputation rebuilds all of it)."""
    before: Optional[int] = None
    """Bytes of the activations outside every candidate (the solver's ``base``) that the
    forward saved before this candidate ran, and so are still alive when backward reaches
    it; ``None`` means all of ``base``, the safe assumption."""
    joins: Optional[int] = None
    """Set when this candidate's only input is the previous candidate's output, so that
    both can run as one checkpointed segment: the bytes of ``base`` (and of ``before``)
    that this input takes because this candidate saves it. A segment through both frees
    them. ``None``: it cannot join the previous candidate."""
    options: Tuple[CostOption, ...] = ()
    """Further ways to checkpoint it alone (selective levels); recomputing all of it
    (``inputs``, ``rebuilt``, ``time`` above) is always one."""
    grads: int = 0
    """Bytes its backward holds besides activations, at its highest: the gradients of its
    outputs and inputs, backward temporaries, and the parameter gradients accumulated by
    then (its own and those of everything backward reached before it)."""
    recompute_grads: int = 0
    """Bytes of gradients alive while its recomputation runs: its outputs' gradients and
    the parameter gradients accumulated before its backward began."""

    def __post_init__(self) -> None:
        if self.rebuilt is None:
            object.__setattr__(self, "rebuilt", self.kept)
        for field in ("kept", "inputs", "rebuilt", "before", "joins"):
            value = getattr(self, field)
            if field in ("before", "joins") and value is None:
                continue
            if not _is_int(value) or value < 0:
                raise CheckpointConfigError(
                    f"cost item {self.name!r}: {field} must be a non-negative integer number "
                    f"of bytes; got {value!r}"
                )
            object.__setattr__(self, field, int(value))
        if (
            not isinstance(self.time, numbers.Real)
            or isinstance(self.time, bool)
            or not math.isfinite(self.time)
            or self.time < 0
        ):
            raise CheckpointConfigError(
                f"cost item {self.name!r}: time must be a finite, non-negative number of "
                f"seconds; got {self.time!r}"
            )
        object.__setattr__(self, "time", float(self.time))


Group = Tuple[int, ...]


def predicted_peak(
    items: Sequence[CostItem], selected: Iterable[Union[int, Sequence[int]]], *, base: int
) -> int:
    """Predicted activation peak, in bytes, when the candidates ``selected`` are checkpointed.

    ``items`` are in forward order, so backward reaches them last to first. The peak is
    the larger of two moments:

    - the end of the forward: ``base`` + ``kept`` of every other candidate + ``inputs`` of
      every selected one;
    - each selected candidate's recomputation, when backward has freed everything saved
      after it: its ``before`` + what the candidates ahead of it hold (``kept``, or
      ``inputs`` if selected) + its own ``inputs`` + ``rebuilt``.

    A segment (consecutive candidates checkpointed as one region, each after the first
    with ``joins`` set) holds only its first member's ``inputs``, frees its members'
    ``joins`` from ``base``, and is recomputed at once: ``rebuilt`` of its last member on
    top of ``kept`` and ``joins`` of the others.

    Args:
        items: The candidates, in forward order.
        selected: Indices into ``items`` of the checkpointed candidates; a tuple of
            consecutive indices stands for a segment.
        base: Bytes of activations outside every candidate.

    Raises:
        CheckpointConfigError: On a bad item, index, segment or ``base``.

    Example:
        >>> items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0) for i in range(3)]
        >>> predicted_peak(items, [0, 1], base=5)  # end of forward: 5 + 10 + 10 + 100
        125
    """
    base = _check(items, base)
    return _peak(items, _groups(items, selected), base)


# --------------------------------------------------------------------------- helpers


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_bytes(value: object, what: str) -> int:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise CheckpointConfigError(
            f"{what} must be a non-negative integer number of bytes; got {value!r}"
        )
    return int(value)  # type: ignore[arg-type]


def _check(items: Sequence[CostItem], base: object) -> int:
    """Check the items and ``base``; return ``base`` as an int."""
    base = _check_bytes(base, "base")
    joined = 0
    for index, item in enumerate(items):
        if not isinstance(item, CostItem):
            raise CheckpointConfigError(
                f"candidate {index} is a {type(item).__name__}; expected a CostItem"
            )
        if item.before is not None and item.before > base:
            raise CheckpointConfigError(
                f"cost item {item.name!r}: before ({item.before} bytes) cannot exceed base "
                f"({base} bytes), of which it is a part"
            )
        if item.joins is not None:
            if index == 0:
                raise CheckpointConfigError(
                    f"cost item {item.name!r}: joins is set on the first candidate, which "
                    f"has no previous candidate to join"
                )
            joined += item.joins
            if joined > _before(item, base):
                raise CheckpointConfigError(
                    f"cost item {item.name!r}: the joins of the candidates up to it "
                    f"({joined} bytes) exceed its before ({_before(item, base)} bytes), "
                    f"of which they are a part"
                )
    return base


def _groups(items: Sequence[CostItem], selected: Iterable[Union[int, Sequence[int]]]) -> List[Group]:
    """``selected`` as checked groups of consecutive indices."""
    groups: List[Group] = []
    taken: Set[int] = set()
    for entry in selected:
        group = (entry,) if _is_int(entry) else tuple(entry)  # type: ignore[arg-type]
        for index in group:
            if not _is_int(index) or not 0 <= index < len(items):
                raise CheckpointConfigError(
                    f"selected index {index!r} is not a candidate index in [0, {len(items)})"
                )
            if index in taken:
                raise CheckpointConfigError(f"candidate index {index} is selected twice")
            taken.add(int(index))
        if not group:
            raise CheckpointConfigError("a selected segment is empty")
        for previous, index in zip(group, group[1:]):
            if index != previous + 1 or items[index].joins is None:
                raise CheckpointConfigError(
                    f"segment {group}: {items[index].name!r} cannot follow "
                    f"{items[previous].name!r} in one segment; a segment runs over "
                    f"consecutive candidates, each after the first with joins set"
                )
        groups.append(tuple(int(index) for index in group))
    return groups


def _before(item: CostItem, base: int) -> int:
    return base if item.before is None else item.before


def _carried(item: CostItem) -> int:
    return 0 if item.joins is None else item.joins


def _peak(items: Sequence[CostItem], groups: Iterable[Group], base: int) -> int:
    terms = _Terms(items, sorted(groups), base)
    return max(terms.end, terms.before_max[-1])


def _rebuilt(items: Sequence[CostItem], group: Group) -> int:
    """What recomputing a group holds at its highest: the members before the last keep
    their saved tensors and pass on their outputs while the last one runs."""
    *first, last = group
    return sum(items[i].kept + _carried(items[i + 1]) for i in first) + items[last].rebuilt


class _Terms:
    """The peak's terms for ``groups`` (sorted), to price dropping one group in O(log n):
    dropping it adds the same amount to the end of the forward and to every later
    recomputation, and removes its own."""

    def __init__(self, items: Sequence[CostItem], groups: List[Group], base: int) -> None:
        self.items = items
        self.starts = [group[0] for group in groups]
        self.index = {group: k for k, group in enumerate(groups)}
        joined = list(itertools.accumulate(_carried(item) for item in items))
        starts = {group[0]: group for group in groups}
        inside = {i for group in groups for i in group[1:]}
        held, terms = 0, []
        for i, item in enumerate(items):
            if i in inside:
                continue
            group = starts.get(i)
            if group is None:
                held += _carried(item) + item.kept
                continue
            terms.append(
                _before(item, base) - joined[i] + held + _carried(item) + item.inputs
                + _rebuilt(items, group)
            )
            held += _carried(item) + item.inputs
        self.end = base - (joined[-1] if joined else 0) + held
        self.before_max = list(itertools.accumulate(terms, max, initial=-1))
        self.after_max = list(itertools.accumulate(reversed(terms), max, initial=-1))[::-1]

    def peak_without(self, group: Group) -> int:
        items, k = self.items, self.index[group]
        growth = sum(_carried(items[i]) + items[i].kept for i in group) - (
            _carried(items[group[0]]) + items[group[0]].inputs
        )
        later = self.after_max[k + 1]
        return max(self.end + growth, self.before_max[k], later + growth if later >= 0 else -1)


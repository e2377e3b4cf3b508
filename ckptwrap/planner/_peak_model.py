"""The peak model of the budget planner, and the items it is priced on.

The solver (``_solver``) knows nothing of modules: it optimises over this model, with the
same moments, on one item per candidate. In this module, in order:

1. **The items**: what one candidate costs (:class:`CostItem`) and each way of
   checkpointing it other than recomputing it whole (:class:`CostOption`).
2. **The peak**: the activation peak a choice of checkpointed candidates is predicted to
   reach (:func:`predicted_peak`, whose docstring is the model's specification), and the
   moments that make it up: what is alive at each point of the training step that can
   set its peak, for one plan. The step's own terms (``forward``, ``recompute_grads``,
   ``grads`` and the tail) come from one measured step with every candidate checkpointed:
   each is what a phase of it reached beyond the activation part of the very moment that
   predicts that phase (:func:`step_terms`), so measurement and prediction share their
   algebra here.
3. **Selective levels** of one candidate (:class:`Level`): ways to checkpoint it that save
   the outputs of some of its operators and recompute the rest, derived from its measured
   operators; each is a :class:`CostOption` the solver can choose instead of recomputing
   the whole candidate, with the operator instances a selective policy must save to carry
   it out.
4. **From a profile to the items**: what checkpointing each measured candidate frees,
   holds and costs, in the order the forward calls them, with its selective levels and
   the terms of the profile's measured step. Times are the profile's prices
   (``measure.RecomputePrices``): the same counts give the same plan in every process.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import statistics
from collections import Counter
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from .._errors import CheckpointConfigError
from ..measure import ModelProfile, RecomputePrices

__all__ = [
    "CostItem",
    "CostOption",
    "Group",
    "Level",
    "alone_moment",
    "check_bytes",
    "check_items",
    "format_bytes",
    "item_before",
    "item_carried",
    "item_held",
    "moment_peak",
    "plain_forward",
    "plain_moment",
    "plan_moments",
    "predicted_peak",
    "segment_moment",
    "step_items",
]


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
        CostItem(name='layers.0', kept=8388608, inputs=1048576, time=0.002, rebuilt=8388608, before=None, joins=None, options=(), grads=0, recompute_grads=0, saved=0, forward=0, call_kept=8388608, call_inputs=1048576)
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
    saved: int = 0
    """The part of ``inputs`` that is operator outputs a selective policy saves (the
    selective tier); once recomputed they are part of what its backward holds as
    ``kept``, so its backward holds ``inputs - saved + kept``."""
    forward: int = 0
    """Bytes its forward holds at its highest when checkpointed (it runs without
    autograd, keeping only its inputs), beyond ``carried`` and what is held before it.
    Plain, its forward is taken to reach ``rebuilt``, the working set of a forward with
    autograd on. 0: not measured, and the forward is taken never to set the peak."""
    call_kept: Optional[int] = None
    """For a candidate its model calls several times in a row (a shared layer, a recurrent
    cell stepped over time): what one call keeps, which the backward of that call holds
    once recomputed, while ``kept``, ``inputs`` and ``rebuilt`` are of all calls, all
    calls and one call. ``None`` means ``kept`` (one call)."""
    call_inputs: Optional[int] = None
    """Likewise, what a checkpoint of one call keeps (``inputs`` of one call); what the
    earlier calls' checkpoints hold while the last one runs is ``inputs - call_inputs``
    (``forward`` is beyond it). ``None`` means ``inputs``."""

    def __post_init__(self) -> None:
        if self.rebuilt is None:
            object.__setattr__(self, "rebuilt", self.kept)
        if self.call_kept is None:
            object.__setattr__(self, "call_kept", self.kept)
        if self.call_inputs is None:
            object.__setattr__(self, "call_inputs", self.inputs)
        # Items are made for every plan solved, mostly from items already checked: what is
        # plainly right is taken as it is, and only the rest checked (and said) in full.
        for field in _BYTE_FIELDS:
            value = getattr(self, field)
            if (type(value) is int and value >= 0) or (value is None and field in _OPTIONAL):
                continue
            object.__setattr__(self, field, check_bytes(value, f"cost item {self.name!r}: {field}"))
        time = self.time
        if not (type(time) is float and 0.0 <= time < math.inf):
            object.__setattr__(self, "time", _check_time(time, f"cost item {self.name!r}: time"))
        options = self.options
        if not (type(options) is tuple and all(map(_plain_option, options))):
            object.__setattr__(self, "options", self._checked_options())

    def _checked_options(self) -> Tuple[CostOption, ...]:
        options = self.options
        if isinstance(options, (str, bytes, CostOption)) or not isinstance(options, Sequence):
            raise CheckpointConfigError(
                f"cost item {self.name!r}: options must be a sequence of CostOption; got "
                f"{options!r}; pass a tuple, e.g. options=(CostOption(...),)"
            )
        checked = []
        for k, option in enumerate(options):
            where = f"cost item {self.name!r}: options[{k}]"
            if not isinstance(option, CostOption):
                raise CheckpointConfigError(
                    f"{where} is a {type(option).__name__} ({option!r}); expected a CostOption"
                )
            checked.append(
                CostOption(
                    option.label,
                    inputs=check_bytes(option.inputs, f"{where} ({option.label!r}) inputs"),
                    rebuilt=check_bytes(option.rebuilt, f"{where} ({option.label!r}) rebuilt"),
                    time=_check_time(option.time, f"{where} ({option.label!r}) time"),
                )
            )
        return tuple(checked)


Group = Tuple[int, ...]

_BYTE_FIELDS = (
    "kept", "inputs", "rebuilt", "before", "joins", "grads", "recompute_grads", "saved",
    "forward", "call_kept", "call_inputs",
)
_OPTIONAL = ("before", "joins")


def _plain_option(option: object) -> bool:
    """Whether ``option`` is a CostOption whose terms are already what checking makes them."""
    return (
        type(option) is CostOption
        and type(option.inputs) is int and option.inputs >= 0  # type: ignore[attr-defined]
        and type(option.rebuilt) is int and option.rebuilt >= 0  # type: ignore[attr-defined]
        and type(option.time) is float and 0.0 <= option.time < math.inf  # type: ignore[attr-defined]
    )


def predicted_peak(
    items: Sequence[CostItem],
    selected: Iterable[Union[int, Sequence[int]]],
    *,
    base: int,
    tail: int = 0,
    options: Optional[Mapping[int, int]] = None,
) -> int:
    """Predicted peak of a training step's activations and gradients, in bytes, when the
    candidates ``selected`` are checkpointed.

    ``items`` are in forward order, so backward reaches them last to first. Write
    ``carried_i`` for ``joins`` of candidate i (0 if None), ``ahead_i`` for its ``before``
    (``base`` if None) less the ``joins`` of candidates 0 to i, and ``floor`` for
    ``base`` less all ``joins``. A candidate holds from its forward to its backward
    ``carried + kept`` when plain, and ``carried + inputs_o`` when checkpointed alone with
    option o, where o is the full recomputation (``inputs``, ``rebuilt``, ``time`` of the
    item) or one of its ``options``; a segment holds its first member's ``carried +
    inputs`` and nothing for the others. With ``x`` the bytes held by the candidates
    before candidate (or segment) i, the peak is the largest of these moments:

    - the end of the forward: ``floor + x_final + tail``;
    - each plain candidate's forward and backward: ``ahead_i + x + carried_i +
      max(kept_i + grads_i, kept_i - call_kept_i + F_i)``, where ``F_i`` is
      ``max(rebuilt_i, forward_i)`` if ``forward`` is set, else 0 (with ``grads`` and
      ``forward`` 0 never above the end of the forward); ``kept - call_kept`` is what the
      earlier calls of a candidate called several times keep;
    - each candidate checkpointed alone with option o: ``ahead_i + x + carried_i +
      max(inputs_o + rebuilt_o + recompute_grads_i, inputs_i - saved_i + call_kept_i +
      grads_i, forward_i + inputs_o - call_inputs_i)``: its (last call's) recomputation;
      its backward, which holds all that call keeps (by then the operator outputs an
      option saved are part of the rebuilt graph); and its forward without autograd,
      which keeps what the option saves as it goes, and what the earlier calls'
      checkpoints hold (0 if ``forward`` is not set);
    - each segment f..l: ``ahead_f + x + carried_f + inputs_f + max(R + recompute_grads_l,
      B, F)``, where R, its recomputation, is ``kept_m + carried_(m+1)`` summed over the
      members m before l, plus ``rebuilt_l``; B is the largest, over its members k, of
      ``kept_m + carried_(m+1)`` summed over the members m before k, plus ``kept_k +
      grads_k``: the backward of k with what the members before it rebuilt; and F the
      largest ``forward_k + carried_k`` of the members whose ``forward`` is set. A segment
      always recomputes in full.

    Args:
        items: The candidates, in forward order.
        selected: Indices into ``items`` of the checkpointed candidates; a tuple of
            consecutive indices stands for a segment.
        base: Bytes of activations outside every candidate.
        tail: Bytes the end of the forward and the backward of the code after the last
            candidate hold beyond ``base`` and the candidates' activations, such as the
            loss and the gradient of the output.
        options: Maps an index selected alone to the option it is checkpointed with: 0
            for the full recomputation (the default), k >= 1 for ``items[i].options[k - 1]``.

    Raises:
        CheckpointConfigError: On a bad item, index, segment, option, ``base`` or ``tail``.

    Example:
        >>> items = [CostItem(f"l{i}", kept=100, inputs=10, time=1.0) for i in range(3)]
        >>> predicted_peak(items, [0, 1], base=5)  # end of forward: 5 + 10 + 10 + 100
        125
        >>> cheap = CostOption("save mm", inputs=60, rebuilt=40, time=0.5)
        >>> items[2] = CostItem("l2", kept=100, inputs=10, time=1.0, options=(cheap,))
        >>> predicted_peak(items, [0, 1, 2], base=5, tail=50, options={2: 1})
        135
    """
    base = check_items(items, base)
    tail = check_bytes(tail, "tail")
    groups = _groups(items, selected)
    return moment_peak(items, groups, base, tail, _check_options(items, groups, options))


# --------------------------------------------------------------------------- helpers


def _is_int(value: object) -> bool:
    # Checked for every term of every item each plan is solved on: plain ints first.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def check_bytes(value: object, what: str) -> int:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise CheckpointConfigError(
            f"{what} must be a non-negative integer number of bytes; got {value!r}"
        )
    return int(value)  # type: ignore[arg-type]


def _check_time(value: object, what: str) -> float:
    real = type(value) is float or (isinstance(value, numbers.Real) and not isinstance(value, bool))
    if not real or not math.isfinite(value) or value < 0:  # type: ignore[arg-type,operator]
        raise CheckpointConfigError(
            f"{what} must be a finite, non-negative number of seconds; got {value!r}"
        )
    return float(value)


def check_items(items: Sequence[CostItem], base: object) -> int:
    """Check the items and ``base``; return ``base`` as an int."""
    base = check_bytes(base, "base")
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
            if joined > item_before(item, base):
                raise CheckpointConfigError(
                    f"cost item {item.name!r}: the joins of the candidates up to it "
                    f"({joined} bytes) exceed its before ({item_before(item, base)} bytes), "
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


def _check_options(
    items: Sequence[CostItem], groups: Sequence[Group], options: Optional[Mapping[int, int]]
) -> Dict[int, int]:
    """``options`` checked against the selection, without the full recomputations (0)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise CheckpointConfigError(
            f"options must map a selected candidate index to an option number; got "
            f"{options!r}; pass a dict such as {{3: 1}}"
        )
    alone = {group[0] for group in groups if len(group) == 1}
    members = {i for group in groups if len(group) > 1 for i in group}
    checked = {}
    for index, number in options.items():
        if index in members:
            raise CheckpointConfigError(
                f"options name candidate {index!r}, which is in a segment; a segment always "
                f"recomputes in full, so give options only for candidates selected alone"
            )
        if not _is_int(index) or int(index) not in alone:
            raise CheckpointConfigError(
                f"options name candidate {index!r}, which is not selected; give options "
                f"only for the candidates selected alone ({sorted(alone)})"
            )
        count = len(items[index].options)
        if not _is_int(number) or not 0 <= number <= count:
            raise CheckpointConfigError(
                f"options give candidate {index} ({items[index].name!r}) option {number!r}; "
                f"it has {count} option(s), so allowed are 0 (recompute all of it) to {count}"
            )
        if number:
            checked[int(index)] = int(number)
    return checked


# ------------------------------------------------------------------ the moments


def item_before(item: CostItem, base: int) -> int:
    return base if item.before is None else item.before


def item_carried(item: CostItem) -> int:
    return 0 if item.joins is None else item.joins


def _choice(item: CostItem, option: int) -> Tuple[int, int]:
    """``inputs`` and ``rebuilt`` of option ``option`` (0: the full recomputation)."""
    if option == 0:
        return item.inputs, item.rebuilt  # type: ignore[return-value]
    chosen = item.options[option - 1]
    return chosen.inputs, chosen.rebuilt


def item_held(item: CostItem, option: Optional[int]) -> int:
    """Bytes a candidate holds until its backward: plain (None), or checkpointed."""
    return item_carried(item) + (item.kept if option is None else _choice(item, option)[0])


def plain_moment(item: CostItem) -> int:
    """A plain candidate's forward and backward, above ``ahead`` and what the candidates
    before hold."""
    return item_carried(item) + max(
        item.kept + item.grads, item.kept - item.call_kept + plain_forward(item)
    )


def plain_forward(item: CostItem) -> int:
    """What a plain candidate's forward holds at its highest, if its forward was measured."""
    return max(item.rebuilt, item.forward) if item.forward else 0  # type: ignore[type-var]


def _alone_parts(item: CostItem, option: int) -> Tuple[int, int, int]:
    """The activation part of a candidate checkpointed alone, above ``carried``: at its
    recomputation (what its checkpoint keeps and what it rebuilds), at its backward (its
    checkpoint's inputs and one call's rebuilt graph) and at its forward (beyond
    ``forward``, what the option saves as it goes, less one call's inputs, which
    ``forward`` holds)."""
    inputs, rebuilt = _choice(item, option)
    return (
        inputs + rebuilt,  # type: ignore[operator]
        item.inputs - item.saved + item.call_kept,
        inputs - item.call_inputs,
    )


def alone_moment(item: CostItem, option: int) -> int:
    """A candidate checkpointed alone: its forward, its recomputation, then its backward."""
    recompute, backward, forward = _alone_parts(item, option)
    return item_carried(item) + max(
        recompute + item.recompute_grads,
        backward + item.grads,
        item.forward + forward if item.forward else 0,
    )


def segment_moment(items: Sequence[CostItem], group: Group) -> int:
    """A segment (or a candidate alone, recomputed in full): recomputation, then the
    backward of each member with what the members before it rebuilt."""
    first, last = items[group[0]], items[group[-1]]
    rebuilt, backward = 0, 0
    for i in group[:-1]:
        backward = max(backward, rebuilt + items[i].kept + items[i].grads)
        rebuilt += items[i].kept + item_carried(items[i + 1])
    backward = max(backward, rebuilt + last.kept + last.grads)
    rebuilt += last.rebuilt  # type: ignore[operator]
    # Each member's forward, under the first's input, holds its own input and working set.
    forward = max(items[i].forward + item_carried(items[i]) if items[i].forward else 0 for i in group)
    return item_carried(first) + first.inputs + max(rebuilt + last.recompute_grads, backward, forward)


def moment_peak(
    items: Sequence[CostItem],
    groups: Iterable[Group],
    base: int,
    tail: int = 0,
    options: Optional[Mapping[int, int]] = None,
) -> int:
    moments, _, end = plan_moments(items, sorted(groups), base, tail, options or {})
    return max([end] + moments)


def plan_moments(
    items: Sequence[CostItem], groups: List[Group], base: int, tail: int, options: Mapping[int, int]
) -> Tuple[List[int], Dict[Group, Tuple[int, int]], int]:
    """A plan's moments (``groups`` sorted, ``options`` by first index) in forward order
    but for the end of the forward; per region, the index of its moment and what the
    candidates before it hold; and the end of the forward."""
    joined = list(itertools.accumulate(item_carried(item) for item in items))
    starts = {group[0]: group for group in groups}
    inside = {i for group in groups for i in group[1:]}
    where: Dict[Group, Tuple[int, int]] = {}
    held, moments = 0, []
    for i, item in enumerate(items):
        if i in inside:
            continue
        ahead = item_before(item, base) - joined[i]
        group = starts.get(i)
        if group is None:
            moments.append(ahead + held + plain_moment(item))
            held += item_held(item, None)
            continue
        option = options.get(i, 0)
        where[group] = (len(moments), held)
        region = alone_moment(item, option) if len(group) == 1 else segment_moment(items, group)
        moments.append(ahead + held + region)
        held += item_held(item, option)
    return moments, where, base - (joined[-1] if joined else 0) + held + tail


def step_terms(
    items: Sequence[CostItem],
    base: int,
    forward: Mapping[int, int],
    recompute: Mapping[int, int],
    backward: Mapping[int, int],
    end: int,
) -> Tuple[List[Dict[str, int]], int]:
    """The step's terms of each item, from one step measured with every item
    checkpointed alone in full: per item index, the peaks of its forward, recomputation
    and backward phases (missing if not measured), and that of the end of the forward.

    Returns the terms per item, by field (``forward``, ``recompute_grads``, ``grads``;
    those its phases give), and the tail. Each term is its phase's peak less the rest of the moment that
    predicts the phase (:func:`alone_moment` at option 0, and the end of the forward)
    with what the items before it held in that step; never negative.
    """
    changes: List[Dict[str, int]] = []
    held = joined = 0
    for index, item in enumerate(items):
        carried = item_carried(item)
        joined += carried
        found: Dict[str, int] = {}
        if item.before is not None:
            ahead = item.before - joined + held + carried
            recompute_part, backward_part, forward_part = _alone_parts(item, 0)
            if index in forward:
                found["forward"] = max(0, forward[index] - ahead - forward_part)
            if index in recompute and index in backward:
                found["recompute_grads"] = max(0, recompute[index] - ahead - recompute_part)
                found["grads"] = max(0, backward[index] - ahead - backward_part)
        changes.append(found)
        held += carried + item.inputs
    return changes, max(0, end - (base - joined + held))


MAX_LEVELS = 6
"""At most this many levels per candidate: enough to span its byte range, few enough to
keep the solver's work small."""

Instance = Tuple[str, int]


@dataclasses.dataclass(frozen=True)
class Level:
    """One selective level of a candidate."""

    option: CostOption
    """What it costs, as the solver sees it."""
    instances: Tuple[Instance, ...]
    """``(operator packet, occurrence)`` of each operator call whose output it saves, in
    forward order."""


def selective_levels(
    cost: Any,
    item: CostItem,
    *,
    op_times: Optional[Sequence[float]] = None,
    overhead: Optional[float] = None,
) -> Tuple[Level, ...]:
    """The selective levels of one measured candidate, fewest saved bytes first.

    Only operator calls that create new storage (``bytes > 0``) which autograd saves for
    backward are worth saving. Saving an output autograd does not keep (a matmul feeding
    only an addition, say) makes the checkpoint hold it from forward to backward, and yet
    the recomputation must still rebuild everything backward needs: memory spent, nothing
    held less and little time gained. Outputs a later operator writes into in place
    cannot be saved at all, nor those of an operator that drew random numbers (the
    recomputation must draw them again, in order). The calls are taken in order of time saved per byte (ties by
    position), and each prefix of that order is a level: it keeps ``item.inputs`` plus
    the saved bytes, rebuilds what recomputation still must (as ``cost_item`` reckons it,
    with the saved bytes taken off), and costs the recompute time less the saved calls',
    plus twice ``selective_overhead`` (the forward and the recomputation each run under
    the selective dispatch mode).

    Per-operator times are measured one operator at a time, which adds overhead to each;
    when they add up to more than the candidate's recompute time they are scaled down to
    it, so that their shares, not the overhead, decide what a level saves.

    Only levels strictly between recomputing all and keeping all are returned: each holds
    less than the candidate keeps unchecked, takes less time than a full recomputation,
    and takes less time than every level that holds fewer bytes (the others are
    dominated). Of more than :data:`MAX_LEVELS`, that many are kept, spread evenly over
    the bytes they hold.

    Args:
        cost: The candidate's ``ModuleCost`` (its ``ops``, ``kept_bytes`` and
            ``forward_peak_bytes`` are read).
        item: The candidate's solver item (``cost_item(cost)``).
        op_times: Seconds per operator to use instead of those in ``cost.ops``.
        overhead: Seconds to use instead of ``cost.selective_overhead``.

    Returns:
        The levels; empty when the candidate has no operators worth saving.
    """
    ops = list(getattr(cost, "ops", ()) or ())
    times = [op.time for op in ops] if op_times is None else list(op_times)
    chosen = [
        (position, op) for position, op in enumerate(ops)
        if op.bytes > 0 and op.saved and not op.mutated and not op.random
    ]
    if not chosen:
        return ()
    # torch's selective checkpointing runs a dispatch mode over every operator of the
    # checkpointed forward and of its recomputation: a level pays that twice, on top of
    # the operators it recomputes.
    if overhead is None:
        overhead = float(getattr(cost, "selective_overhead", 0.0) or 0.0)
    overhead *= 2
    total = math.fsum(times)
    scale = item.time / total if total > item.time and total > 0 else 1.0
    chosen.sort(key=lambda pair: (-times[pair[0]] / pair[1].bytes, pair[0]))
    levels: List[Level] = []
    saved_bytes, saved_time, taken = 0, 0.0, []
    for position, op in chosen:
        saved_bytes += op.bytes
        saved_time += times[position] * scale
        taken.append((position, op))
        inputs = item.inputs + saved_bytes
        time = max(item.time - saved_time, 0.0) + overhead
        if inputs >= item.kept or time >= item.time:
            continue
        if levels and time >= levels[-1].option.time:
            continue  # holds more than the level before it, and saves no time on it
        rebuilt = max(
            int(cost.kept_bytes) - saved_bytes, int(cost.forward_peak_bytes) - saved_bytes, 0
        )
        instances = tuple(op.instance for _, op in sorted(taken, key=lambda pair: pair[0]))
        levels.append(Level(CostOption(_label(instances), inputs, rebuilt, time), instances))
    return tuple(_spread(levels, MAX_LEVELS))


def pooled_levels(
    pairs: Sequence[Tuple[Any, CostItem]],
    *,
    op_times: Sequence[Sequence[float]],
    overheads: Sequence[float],
) -> List[Tuple[Level, ...]]:
    """:func:`selective_levels` of each ``(cost, item)``, weighing ``op_times`` (per
    candidate, per operator) and ``overheads`` (per candidate, one pass of the selective
    mode) as the planner prices them (``RecomputePrices``); candidates alike in all but
    time share one set of levels, from the medians of their prices (alike candidates are
    priced alike but for the operators a call runs beyond those recorded), so the solver
    can weigh them as one (see ``pooled_times``).
    """
    groups: Dict[Any, List[int]] = {}
    for index, (cost, item) in enumerate(pairs):
        groups.setdefault(_alike(cost, item), []).append(index)
    result: List[Tuple[Level, ...]] = [()] * len(pairs)
    for members in groups.values():
        first = pairs[members[0]][0]
        count = len(getattr(first, "ops", ()) or ())
        times = [statistics.median(op_times[i][k] for i in members) for k in range(count)]
        typical = statistics.median(pairs[i][1].time for i in members)
        item = dataclasses.replace(pairs[members[0]][1], time=typical)
        overhead = statistics.median(overheads[i] for i in members)
        levels = selective_levels(first, item, op_times=times, overhead=overhead)
        for i in members:
            result[i] = levels
    return result


def _alike(cost: Any, item: CostItem) -> Tuple[Any, ...]:
    """What must match for two candidates to share their levels: all but times."""
    ops = tuple(
        (op.op, op.occurrence, op.bytes, op.flops, op.saved, op.mutated, op.random)
        for op in (getattr(cost, "ops", ()) or ())
    )
    return (
        item.kept, item.inputs, item.rebuilt,
        int(cost.kept_bytes), int(cost.forward_peak_bytes), ops,
    )


def _label(instances: Sequence[Instance]) -> str:
    """``save mm x3, addmm x2``: what a level saves, operators in order of first call."""
    counts: Dict[str, int] = Counter(name for name, _ in instances)
    order = list(dict.fromkeys(name for name, _ in instances))
    return "save " + ", ".join(
        name if counts[name] == 1 else f"{name} x{counts[name]}" for name in order
    )


def _spread(levels: List[Level], most: int) -> List[Level]:
    """At most ``most`` of ``levels`` (ordered by bytes held), the least and the most
    holding among them, the others nearest to evenly spaced byte counts between."""
    if len(levels) <= most:
        return levels
    low, high = levels[0].option.inputs, levels[-1].option.inputs
    picked: List[int] = []
    for step in range(most):
        target = low + (high - low) * step / (most - 1)
        free = [i for i in range(len(levels)) if i not in picked]
        picked.append(min(free, key=lambda i: (abs(levels[i].option.inputs - target), i)))
    return [levels[i] for i in sorted(picked)]


def cost_item(cost: Any, *, time: float, segments: bool = False, region_bytes: int = 0) -> CostItem:
    """The solver's view of one measured module.

    A checkpoint keeps the module's inputs; the part of them the module saves itself is
    already counted in the profile's base bytes (it stays alive either way), so only the
    rest is extra, with ``region_bytes`` per checkpointed call (what the engine keeps for
    a region besides its inputs: on the CPU, the generator state it replays). Likewise
    its saved outputs that the code after it saves too are in the base, not freed by the
    checkpoint, yet rebuilt by its recomputation, which at its highest also holds the
    forward's temporaries. With ``segments``, a module that takes the previous
    candidate's output as its only input may run in one region with it. Measured with a
    save policy (the selective tier), the checkpoint also keeps the outputs the policy
    saves, and its recomputation rebuilds, and costs, only the rest.

    A module called several times keeps (and its checkpoint holds) the sum over its
    calls, while one recomputation rebuilds one call's share, and one backward holds it.

    ``time``: the seconds its recomputation is priced at (see ``RecomputePrices``).
    """
    calls = max(1, int(cost.calls))
    extra_inputs = max(0, int(cost.input_bytes) - int(cost.self_saved_input_bytes))
    handed_over = int(cost.handed_over_bytes)
    call_kept = max(0, int(cost.call_kept_bytes or cost.kept_bytes) - handed_over // calls)
    return CostItem(
        cost.name,
        int(cost.kept_bytes) - handed_over,
        extra_inputs + int(cost.policy_saved_bytes) + calls * region_bytes,
        float(time),
        rebuilt=max(
            call_kept - int(cost.policy_saved_kept_bytes) // calls,
            int(cost.forward_peak_bytes) - int(cost.policy_saved_bytes) // calls,
            0,
        ),
        before=cost.base_before_bytes,
        joins=int(cost.self_saved_input_bytes) if segments and cost.joins_previous else None,
        saved=int(cost.policy_saved_kept_bytes),
        call_kept=min(call_kept, int(cost.kept_bytes) - handed_over),
        call_inputs=(extra_inputs + int(cost.policy_saved_bytes)) // calls + region_bytes,
    )


def step_items(
    profile: ModelProfile,
    names: Sequence[str],
    *,
    segments: bool = False,
    levels: bool = False,
    region_bytes: int = 0,
) -> Tuple[List[Tuple[str, CostItem]], Dict[str, Tuple[Level, ...]], int]:
    """What a plan is solved on: the solver's items for ``names`` in the order the
    profiled forward called them, with the step's terms; the selective levels behind each
    one's ``options``; and the solver's ``tail``.

    Candidates never called outside another candidate's call come last, in the given order.
    With ``segments``, a candidate may join the one before it only if that one is among
    ``names`` and just before it in this order. With ``levels``, each item carries its
    selective levels as ``options`` (none for a candidate called several times). Every
    time is the profile's price (``RecomputePrices``), not a measured one. ``forward``,
    ``grads`` and ``recompute_grads`` come from the profile's measured step (see
    :func:`step_terms`); without one the tail is 0, and the model then predicts the
    activation peak only.
    """
    costs = [profile[name] for name in names]
    prices = RecomputePrices(profile)
    order = sorted(range(len(costs)), key=lambda i: (costs[i].position < 0, costs[i].position, i))
    pairs = []
    for rank, i in enumerate(order):
        follows = rank > 0 and costs[order[rank - 1]].position == costs[i].position - 1
        item = cost_item(
            costs[i], segments=segments and follows, region_bytes=region_bytes, time=prices.time(costs[i].name)
        )
        pairs.append((costs[i], item))
    found = pooled_levels(
        pairs,
        op_times=[prices.op_times(cost.name) for cost, _ in pairs],
        overheads=[prices.selective(cost.name) for cost, _ in pairs],
    ) if levels else [()] * len(pairs)
    found = [ours if cost.calls <= 1 else () for (cost, _), ours in zip(pairs, found)]
    ordered = [
        (names[i], dataclasses.replace(item, options=tuple(level.option for level in ours)))
        for i, (_, item), ours in zip(order, pairs, found)
    ]
    levels_of = {name: ours for (name, _), ours in zip(ordered, found)}
    step = profile.step
    if step is None:
        return ordered, levels_of, 0
    index = {name: i for i, (name, _) in enumerate(ordered)}

    def by_index(table: Any) -> Any:
        return {index[name]: value for name, value in table.items() if name in index}

    changes, tail = step_terms(
        [item for _, item in ordered], profile.base_bytes,
        by_index(step.forward), by_index(step.recompute), by_index(step.backward), step.end,
    )
    ordered = [(name, dataclasses.replace(item, **change)) for (name, item), change in zip(ordered, changes)]
    return ordered, levels_of, tail

"""Terms that say how much or how, not which: ``budget:``, ``recompute``, ``selective``,
``offload`` and ``overlap``.

They combine with the selecting terms through ``;`` / ``&`` only. Inside a selection they
pick every candidate (so ``select`` still works on a policy that contains them); the
planner takes them out and acts on them: ``budget:`` chooses among the candidates from
measured costs, ``recompute``, ``selective`` and ``offload`` say what happens inside the
chosen modules; ``overlap`` says when their recomputation runs.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import re
from typing import Optional, Tuple

from .._errors import CheckpointConfigError
from ._base import Intersection, Names, Policy, Picker
from ._numbers import MAX_BYTES, abbreviate, parse_decimal
from ._ops import resolve_ops
from ._terms import Blocks

__all__ = [
    "Budget",
    "DEFAULT_SELECTIVE_OPS",
    "Offload",
    "Overlap",
    "overlaps",
    "Recompute",
    "Selective",
    "split_modifiers",
]

_UNITS = {
    "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
_UNIT_NAMES = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
_TOTAL = re.compile(r"total\s*=(.*)", re.IGNORECASE | re.DOTALL)
_AMOUNT = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*(%|[A-Za-z]+)")

DEFAULT_SELECTIVE_OPS: Tuple[str, ...] = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "scaled_dot_product_attention",
)
"""What ``selective`` alone saves in a transformer block: the matrix products and the
attention kernel, the costly operators, while cheap elementwise work is recomputed."""


class _Modifier(Picker):
    """A term that leaves the candidates as they are when a policy selects."""

    def _pick(self, candidates: Tuple[str, ...]) -> Names:
        return frozenset(candidates)


@dataclasses.dataclass(frozen=True)
class Budget(_Modifier):
    """``budget:X``: checkpoint the candidates so that the training step's peak fits X at
    the least recompute time; X is ``NN%`` of the un-checkpointed step's peak (at the
    largest shape planned so far) or an amount of bytes such as ``512MiB``, ``2GiB`` or
    ``1.5e9B``. In a device's terms: ``total=SIZE`` is a whole device of SIZE, the
    parameters, buffers, optimizer state and the optimizer's step included, and ``device``
    is the memory the step's device has for the model now, less a margin."""

    amount: str
    """The budget as written, e.g. ``"40%"``, ``"512MiB"``, ``"total=80GiB"`` or ``"device"``."""
    _read: Tuple[Optional[float], Optional[int]] = dataclasses.field(
        init=False, repr=False, compare=False, default=(None, None)
    )

    def __post_init__(self) -> None:
        """Reads the amount once, so that a malformed one is refused when the policy is built
        (and a planner, which asks at every training forward, reads it from :meth:`parsed`).

        Raises:
            CheckpointConfigError: If the amount is malformed, or out of range: a
                percentage must lie in (0, 100], an amount in bytes (rounded down to a
                whole byte) from 1 B to :data:`MAX_BYTES`.
        """
        scope = self.scope
        if scope == "device":
            return
        text = str(self.amount).strip()
        if scope == "total":
            text = _TOTAL.fullmatch(text).group(1).strip()  # type: ignore[union-attr]
        fraction, amount = _amount(text, "total=" if scope == "total" else "")
        if fraction is not None and scope == "total":
            raise CheckpointConfigError(
                f"budget:{abbreviate(str(self.amount).strip())} is malformed: total= takes "
                f"the device's memory in bytes, such as budget:total=80GiB (a share of the "
                f"step's peak is budget:NN%)"
            )
        object.__setattr__(self, "_read", (fraction, amount))

    def describe(self) -> str:
        return f"budget:{self.amount}"

    @property
    def scope(self) -> str:
        """What the budget caps: ``"step"`` (one training step's peak), ``"total"`` (a
        whole device of a given size) or ``"device"`` (the step's device as it is)."""
        text = str(self.amount).strip().lower()
        if text == "device":
            return "device"
        return "total" if _TOTAL.fullmatch(text) else "step"

    def parsed(self) -> Tuple[Optional[float], Optional[int]]:
        """(fraction of the un-checkpointed step's peak, None) or (None, bytes): bytes of
        the step, or of the whole device for ``total=SIZE``; (None, None) for ``device``
        (read from the device when planned)."""
        return self._read


def _amount(text: str, prefix: str) -> Tuple[Optional[float], Optional[int]]:
    """``NN%`` as (fraction, None), or an amount of bytes as (None, bytes); ``prefix``
    is what was written before it (for messages)."""
    match = _AMOUNT.fullmatch(text)
    unit = match.group(3).upper() if match else ""
    if not match or (unit != "%" and unit not in _UNITS):
        raise CheckpointConfigError(
            f"budget:{prefix}{abbreviate(text)} is malformed: write a percentage of the "
            f"un-checkpointed training step's peak such as budget:40%, an amount such as "
            f"budget:512MiB, budget:2GiB or budget:1.5e9B (units: {_UNIT_NAMES}), "
            f"a whole device's memory such as budget:total=80GiB, or budget:device"
        )
    # Exact arithmetic: a float of hundreds of digits would overflow to infinity.
    value = parse_decimal(match.group(1))
    exponent = _exponent(match.group(2))
    if value and exponent > _LARGEST_EXPONENT:
        raise CheckpointConfigError(_too_large(prefix + text, unit))
    value *= fractions.Fraction(10) ** max(exponent, -_LARGEST_EXPONENT)
    if unit == "%":
        if 0 < value <= 100 and float(value) / 100 > 0:  # not so small that it is 0 as a float
            return float(value) / 100, None
        raise CheckpointConfigError(_too_large(prefix + text, unit))
    amount = math.floor(value * _UNITS[unit])
    if 1 <= amount <= MAX_BYTES:
        return None, amount
    raise CheckpointConfigError(_too_large(prefix + text, unit))


_LARGEST_EXPONENT = 400
"""Beyond this power of ten, no budget is in range (and the exact value is not worked out)."""


def _exponent(text: Optional[str]) -> int:
    """The power of ten written after ``e``, held within what matters (past
    ``_LARGEST_EXPONENT`` either way the budget is out of range)."""
    if not text:
        return 0
    digits = text.lstrip("+-")
    value = int(digits) if len(digits) <= 12 else 10**13  # int() of thousands of digits is refused
    return -value if text.startswith("-") else value


def _too_large(text: str, unit: str) -> str:
    """The message for an amount out of range (too large, or at or below zero)."""
    if unit == "%":
        return f"budget:{abbreviate(text)} is out of range: a percentage must be in (0, 100], such as budget:40%"
    return (
        f"budget:{abbreviate(text)} is out of range: an amount must be from 1 B to "
        f"{MAX_BYTES} B (8 EiB), such as budget:512MiB"
    )


@dataclasses.dataclass(frozen=True)
class Selective(_Modifier):
    """``selective[:OP,...]``: inside each chosen module, save the outputs of the named
    operators and recompute the rest (op-level selective checkpointing)."""

    ops: Tuple[str, ...] = DEFAULT_SELECTIVE_OPS
    """Operator names such as ``mm`` or ``scaled_dot_product_attention``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if not self.ops:
            raise CheckpointConfigError("selective: needs at least one operator name, e.g. selective:mm")
        resolve_ops(self.ops)  # unknown operator names are reported now

    def describe(self) -> str:
        if self.ops == DEFAULT_SELECTIVE_OPS:
            return "selective"
        return "selective:" + ",".join(self.ops)


@dataclasses.dataclass(frozen=True)
class Recompute(_Modifier):
    """``recompute``: recompute each chosen module whole. A ``budget:`` plan otherwise may
    also checkpoint a module at a selective level (saving the outputs of some of its
    operators, recomputing the rest) where that costs less time; with this term it
    chooses among whole modules only (``budget:50%;recompute``), as a baseline to compare
    against, or where saving operator outputs is not wanted. Without a budget it changes
    nothing: modules are recomputed whole anyway."""

    def describe(self) -> str:
        return "recompute"


@dataclasses.dataclass(frozen=True)
class Offload(_Modifier):
    """``offload``: keep the chosen modules' saved tensors in CPU memory (pinned when the
    model is on CUDA) instead of recomputing them."""

    def describe(self) -> str:
        return "offload"


@dataclasses.dataclass(frozen=True)
class Overlap(_Modifier):
    """``overlap``: recompute each chosen module ahead of the backward, in a worker thread
    (on a side stream of the device) while backward runs through the module after it, so
    that the recomputation's launches overlap the backward's instead of stalling it. Holds
    one module's recomputed activations more at the peak. Joins ``recompute`` (the
    default) or ``selective``."""

    def describe(self) -> str:
        return "overlap"


def overlaps(policy: Policy) -> bool:
    """Whether ``policy`` holds the ``overlap`` term (joined with ``;``)."""
    if isinstance(policy, Overlap):
        return True
    return isinstance(policy, Intersection) and any(isinstance(p, Overlap) for p in policy.pickers)


def split_modifiers(policy: Policy) -> Tuple[Policy, Optional[Budget], Optional[Policy]]:
    """Take the modifier terms out of ``policy``.

    Returns:
        (the selecting rest, the budget term or None, the tier term (Recompute,
        Selective or Offload) or None). The rest is ``blocks`` when nothing else selects.
        ``overlap`` is left out of all three (see :func:`overlaps`).

    Raises:
        CheckpointConfigError: A modifier appears inside ``|`` or ``~``, appears twice,
            or two of ``recompute``, ``selective`` and ``offload`` are combined.
    """
    if isinstance(policy, _Modifier):
        parts_sets, parts_pickers = (), (policy,)
    elif isinstance(policy, Intersection):
        parts_sets, parts_pickers = policy.sets, policy.pickers
    else:
        _reject_nested_modifiers(policy)
        return policy, None, None
    for part in parts_sets + parts_pickers:
        if not isinstance(part, _Modifier):
            _reject_nested_modifiers(part)
    modifiers = [p for p in parts_pickers if isinstance(p, _Modifier)]
    pickers = tuple(p for p in parts_pickers if not isinstance(p, _Modifier))
    budgets = [m for m in modifiers if isinstance(m, Budget)]
    tiers = [m for m in modifiers if not isinstance(m, (Budget, Overlap))]
    ahead = [m for m in modifiers if isinstance(m, Overlap)]
    if len(budgets) > 1 or len(tiers) > 1 or len(ahead) > 1:
        twice = budgets if len(budgets) > 1 else tiers if len(tiers) > 1 else ahead
        raise CheckpointConfigError(
            f"a policy takes at most one budget term and one of recompute/selective/offload; got "
            f"{', '.join(m.describe() for m in twice)}"
        )
    if not parts_sets and not pickers:
        rest: Policy = Blocks()
    elif not pickers and len(parts_sets) == 1:
        rest = parts_sets[0]
    else:
        rest = Intersection(sets=parts_sets, pickers=pickers)
    return rest, (budgets[0] if budgets else None), (tiers[0] if tiers else None)


def _reject_nested_modifiers(policy: Policy) -> None:
    inner = getattr(policy, "parts", None) or (
        (policy.inner,) if hasattr(policy, "inner") else ()
    )
    for part in inner:
        if isinstance(part, _Modifier) or (
            isinstance(part, Intersection) and any(isinstance(p, _Modifier) for p in part.pickers)
        ):
            raise CheckpointConfigError(
                f"{part.describe()} cannot stand inside '|' or '~' in {policy.describe()}; "
                f"join budget, recompute, selective, offload and overlap to the rest with ';' (or &)"
            )
        _reject_nested_modifiers(part)

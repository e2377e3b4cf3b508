"""The numbers in policy terms (``every:N``, ``first:K``, ``last:K``, ``fraction:P``,
``budget:X``): how they are read from text and which values are allowed.

Text is read exactly and range-checked before it becomes an int or a float, so a number
of any length gets an error that names the term, the value (abbreviated) and the range,
never an ``OverflowError`` or Python's limit on int digits.
"""

from __future__ import annotations

import decimal
import fractions
import math
import numbers
import sys
from typing import Any

from .._errors import CheckpointConfigError

__all__ = [
    "MAX_BYTES",
    "MAX_COUNT",
    "abbreviate",
    "check_count",
    "check_fraction",
    "parse_count",
    "parse_decimal",
    "show",
]

MAX_COUNT = sys.maxsize
"""The largest ``N`` of ``every:N`` and ``K`` of ``first:K``/``last:K`` (an index)."""
MAX_BYTES = (1 << 63) - 1
"""The largest budget in bytes: what a signed 64-bit byte count holds (8 EiB)."""

_SHOWN = 40  # characters of a value shown in full; longer ones are abbreviated


def abbreviate(text: str) -> str:
    """``text`` as written if short, else its ends and its length, for error messages.

    Example:
        >>> abbreviate("9" * 500 + "%")
        '9999999999999999...9999999% (501 characters)'
    """
    if len(text) <= _SHOWN:
        return text
    return f"{text[:16]}...{text[-8:]} ({len(text)} characters)"


def show(value: Any) -> str:
    """``repr(value)``, abbreviated; safe for ints too long for Python to print."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"an integer of about {digits} digits"
    return abbreviate(repr(value))


def check_count(term: str, letter: str, value: Any) -> int:
    """``value`` if it is a whole number from 1 to :data:`MAX_COUNT`.

    Raises:
        CheckpointConfigError: Naming ``term``, ``value`` and the range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_COUNT:
        raise CheckpointConfigError(
            f"{term}:{letter} takes a whole number with 1 <= {letter} <= {MAX_COUNT}, such as "
            f"{term}:2; got {show(value)}"
        )
    return int(value)


def parse_count(term: str, letter: str, text: str) -> int:
    """The count written as ``text`` (digits only), range-checked before conversion."""
    digits = text.lstrip("0")
    malformed = not (text.isdigit() and text.isascii())
    # The length is checked first: int() of thousands of digits is refused.
    if malformed or len(digits) > len(str(MAX_COUNT)) or not 1 <= int(digits or "0") <= MAX_COUNT:
        raise CheckpointConfigError(
            f"{term}:{abbreviate(text)} is {'malformed' if malformed else 'out of range'}: {letter} must be "
            f"a whole number with 1 <= {letter} <= {MAX_COUNT}, such as {term}:2"
        )
    return int(digits)


def check_fraction(value: Any, shown: str = "") -> float:
    """``value`` as a float if it is a number with 0 < P <= 1.

    Args:
        value: The fraction, a real number (an exact ``fractions.Fraction`` is compared
            exactly, then converted).
        shown: How the value was written, for the message; ``repr(value)`` if empty.

    Raises:
        CheckpointConfigError: Naming ``fraction:P``, the value and the range.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok and isinstance(value, numbers.Rational):
        ok = 0 < value <= 1  # exact, for ints and fractions of any size
    elif ok:
        ok = math.isfinite(value) and 0 < value <= 1
    converted = float(value) if ok else 0.0
    if not ok or converted == 0.0:
        tiny = " (it rounds to 0.0 as a float)" if ok else ""
        raise CheckpointConfigError(
            f"fraction:P takes a number with 0 < P <= 1, such as fraction:0.5; got "
            f"{shown or show(value)}{tiny}"
        )
    return converted


def parse_decimal(text: str) -> fractions.Fraction:
    """The exact value of a decimal number written with digits and at most one point.

    Raises:
        ValueError: If ``text`` is not such a number.
    """
    if not text or not text.isascii() or text.count(".") > 1 or not text.replace(".", "").isdigit():
        raise ValueError(f"not a decimal number: {abbreviate(text)}")
    try:
        # Decimal reads any number of digits exactly; the ratio avoids int(str) limits.
        return fractions.Fraction(*decimal.Decimal(text).as_integer_ratio())
    except decimal.InvalidOperation:
        raise ValueError(f"not a decimal number: {abbreviate(text)}") from None

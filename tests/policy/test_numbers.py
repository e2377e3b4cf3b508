"""Numbers in policy terms: any text, however long, is either read exactly or refused with
an error that names the term, the value (abbreviated) and the allowed range."""

from __future__ import annotations

import math
import pickle
import sys
from fractions import Fraction as Exact

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.policy import (
    Budget,
    Every,
    First,
    Fraction,
    Last,
    parse_policy,
    split_modifiers,
)
from ckptwrap.planner._solver import resolve_budget
from ckptwrap.policy._numbers import MAX_BYTES, abbreviate

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "GB": 10**9}

# Long runs of one digit, and long random digit strings, with leading zeros at times.
digits = st.one_of(
    st.builds(lambda d, n: d * n, st.sampled_from("0123456789"), st.integers(1, 6000)),
    st.text("0123456789", min_size=1, max_size=6000),
    st.builds(lambda z, d: "0" * z + d, st.integers(0, 5000), st.text("0123456789", min_size=1, max_size=30)),
)
decimals = st.one_of(
    digits,
    st.builds(lambda a, b: f"{a}.{b}", digits, st.text("0123456789", max_size=3000)),
    st.builds(lambda b: f".{b}", digits),
)


def _big(text: str) -> int:
    # In chunks: Python refuses int() of strings of more than 4300 digits.
    value = 0
    for start in range(0, len(text), 1000):
        chunk = text[start : start + 1000]
        value = value * 10 ** len(chunk) + int(chunk)
    return value


def _exact(text: str) -> Exact:
    whole, _, part = text.partition(".")
    return Exact(_big(whole + part or "0"), 10 ** len(part))


def _refusal(spec: str, term: str, allowed: str) -> None:
    with pytest.raises(CheckpointConfigError) as caught:
        parse_policy(spec)
    message = str(caught.value)
    assert term in message and allowed in message, message
    assert len(message) < 800, message  # the value is abbreviated, not echoed whole
    assert abbreviate(spec.partition(":")[2]) in message, message


@settings(max_examples=60, deadline=None)
@given(term=st.sampled_from(["every", "first", "last"]), text=digits)
def test_counts_of_any_length(term, text):
    expected = _big(text)
    if 1 <= expected <= sys.maxsize:
        policy = parse_policy(f"{term}:{text}")
        assert policy == {"every": Every, "first": First, "last": Last}[term](expected)
    else:
        _refusal(f"{term}:{text}", f"{term}:", f"<= {sys.maxsize}")


@settings(max_examples=60, deadline=None)
@given(text=decimals)
def test_fractions_of_any_length(text):
    exact = _exact(text)
    if 0 < exact <= 1 and float(exact) > 0:
        assert parse_policy(f"fraction:{text}") == Fraction(float(exact))
    else:
        _refusal(f"fraction:{text}", "fraction:", "0 < P <= 1")


@settings(max_examples=60, deadline=None)
@given(text=decimals)
def test_percent_budgets_of_any_length(text):
    exact = _exact(text)
    spec = f"budget:{text}%"
    if 0 < exact <= 100 and float(exact) / 100 > 0:
        _, budget, _ = split_modifiers(parse_policy(spec))
        assert budget.parsed() == (float(exact) / 100, None)
    else:
        _refusal(spec, "budget:", "(0, 100]")


@settings(max_examples=60, deadline=None)
@given(text=decimals, unit=st.sampled_from(sorted(_UNITS)))
def test_byte_budgets_of_any_length(text, unit):
    amount = math.floor(_exact(text) * _UNITS[unit])
    spec = f"budget:{text}{unit}"
    if 1 <= amount <= MAX_BYTES:
        _, budget, _ = split_modifiers(parse_policy(spec))
        assert budget.parsed() == (None, amount)
    else:
        _refusal(spec, "budget:", f"from 1 B to {MAX_BYTES} B")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("budget:" + "9" * 400 + "%", r"budget:9{16}\.\.\.9{7}% \(401 characters\) is out of range: a percentage must be in \(0, 100\]"),
        ("budget:" + "9" * 400 + "MiB", r"budget:9{16}\.\.\..*is out of range: an amount must be from 1 B to"),
        ("budget:1e400MiB", r"budget:1e400MiB is out of range: an amount must be from 1 B to"),
        ("budget:1e" + "9" * 30 + "GiB", r"is out of range: an amount must be from 1 B to"),
        ("budget:1e400%", r"budget:1e400% is out of range: a percentage must be in \(0, 100\]"),
        ("budget:1e-400MiB", r"budget:1e-400MiB is out of range: an amount must be from 1 B to"),
        ("budget:1e-" + "9" * 30 + "%", r"is out of range: a percentage must be in \(0, 100\]"),
        ("budget:3eMiB", r"budget:3eMiB is malformed: write a percentage of the un-checkpointed training step's peak"),
        ("every:" + "9" * 5000, r"every:9{16}\.\.\.9{8} \(5000 characters\) is out of range: N must be a whole number with 1 <= N <= "),
        ("last:" + "1" + "0" * 19, r"last:10{19} is out of range: K must be"),
        ("fraction:" + "9" * 5000, r"fraction:P takes a number with 0 < P <= 1.*got 9{16}\.\.\."),
        ("fraction:0." + "0" * 400 + "1", r"fraction:P takes.*rounds to 0\.0"),
    ],
)
def test_huge_numbers_name_the_term_the_value_and_the_range(spec, match):
    with pytest.raises(CheckpointConfigError, match=match):
        parse_policy(spec)


@pytest.mark.parametrize("term", [Every, First, Last])
def test_count_pickers_refuse_ints_too_large_to_print(term):
    with pytest.raises(CheckpointConfigError, match=r"1 <= . <= \d+.*got an integer of about 5001 digits"):
        term(10**5000)


def test_fraction_refuses_ints_too_large_for_a_float():
    with pytest.raises(CheckpointConfigError, match=r"0 < P <= 1.*got an integer of about 401 digits"):
        Fraction(10**400)


@pytest.mark.parametrize(
    ("amount", "parsed"),
    [("1.5e9B", (None, 1_500_000_000)), ("2e3MiB", (None, 2000 * 2**20)), ("1.5E+3KiB", (None, 1_536_000)),
     ("2.5e-1%", (0.0025, None)), ("4e1%", (0.4, None))],
)
def test_budgets_take_powers_of_ten(amount, parsed):
    assert Budget(amount).parsed() == parsed


def test_a_budget_in_percent_resolves_as_before_and_pickles():
    budget = Budget("35%")
    resolved = resolve_budget(budget, 128064)
    assert resolved == int(35 / 100 * 128064) and resolved.percent == pytest.approx(35)
    again = pickle.loads(pickle.dumps(resolved))
    assert (again, again.fraction, again.reference) == (resolved, resolved.fraction, 128064)
    assert type(resolve_budget(Budget("2MiB"), 128064)) is int

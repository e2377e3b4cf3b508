"""Tests of the policy-string grammar and of ``as_policy``: what each form becomes, and
the errors for each kind of bad input, raised before any model is seen."""

from __future__ import annotations

import re

import pytest
from _policy_models import GPT, GPTBlock
from torch import nn

from ckptwrap._errors import CheckpointConfigError, CheckpointError
from ckptwrap.policy import DEFAULT_SELECTIVE_OPS, Offload, Selective, split_modifiers
from ckptwrap.policy import (
    All,
    Blocks,
    Every,
    First,
    Fraction,
    Instance,
    Last,
    Name,
    Nothing,
    Predicate,
    Type,
    as_policy,
    parse_policy,
)

VALID_TERMS = re.escape(
    "valid terms: none, blocks, all, type:NAME[,NAME...], name:GLOB, "
    "every:N, first:K, last:K, fraction:P, budget:X"
)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", Nothing()),
        ("blocks", Blocks()),
        ("all", All()),
        ("type:GPTBlock", Type("GPTBlock")),
        ("type:A,B", Type(("A", "B"))),
        ("name:encoder.layers.*", Name("encoder.layers.*")),
        ("every:2", Every(2)),
        ("first:3", First(3)),
        ("last:6", Last(6)),
        ("fraction:0.5", Fraction(0.5)),
        ("fraction:1", Fraction(1.0)),
        ("fraction:.25", Fraction(0.25)),
        ("every:007", Every(7)),
    ],
)
def test_each_term_parses_to_its_policy(spec, expected):
    assert parse_policy(spec) == expected


def test_whitespace_around_terms_and_values_is_ignored():
    assert parse_policy("  type : GPTBlock ;\tlast: 6 \n") == Type("GPTBlock") & Last(6)
    assert parse_policy(" blocks ") == Blocks()


def test_a_glob_keeps_its_colons():
    assert parse_policy("name:a:b") == Name("a:b")


# -------------------------------------------------------------------------- bad strings


def test_empty_string():
    for spec in ("", "   "):
        with pytest.raises(
            CheckpointConfigError,
            match="the policy string is empty.*" + VALID_TERMS,
        ):
            parse_policy(spec)


def test_empty_term():
    with pytest.raises(CheckpointConfigError, match=r"in policy 'blocks;;last:2': empty term"):
        parse_policy("blocks;;last:2")
    with pytest.raises(CheckpointConfigError, match="empty term"):
        parse_policy("blocks;")


def test_unknown_term_lists_the_valid_ones():
    with pytest.raises(CheckpointConfigError, match=r"unknown term 'segments:4'; " + VALID_TERMS):
        parse_policy("segments:4")


def test_unknown_term_suggests_a_close_one():
    with pytest.raises(
        CheckpointConfigError,
        match=r"unknown term 'evrey:2' \(did you mean 'every'\?\)",
    ):
        parse_policy("evrey:2")
    with pytest.raises(
        CheckpointConfigError,
        match=r"unknown term 'Blocks' \(did you mean 'blocks'\?\)",
    ):
        parse_policy("Blocks")


@pytest.mark.parametrize(
    "spec", ["type:", "name:", "every:", "first: ", "last", "fraction", "budget:"]
)
def test_missing_value(spec):
    keyword = spec.split(":")[0].strip()
    with pytest.raises(CheckpointConfigError, match=rf"{keyword} needs a value, as in {keyword}:"):
        parse_policy(spec)


@pytest.mark.parametrize("spec", ["none:1", "blocks:3", "all:x"])
def test_value_given_to_a_term_without_one(spec):
    with pytest.raises(CheckpointConfigError, match=r"takes no value; got"):
        parse_policy(spec)


@pytest.mark.parametrize(
    "spec", ["every:two", "every:-1", "every:2.0", "first:1e3", "last:+3", "last:٣"]
)
def test_malformed_whole_number(spec):
    with pytest.raises(
        CheckpointConfigError,
        match=rf"{re.escape(spec)} is malformed: . must be a whole number with 1 <= . <= ",
    ):
        parse_policy(spec)


@pytest.mark.parametrize("spec", ["every:0", "first:0", "last:00"])
def test_zero_count(spec):
    with pytest.raises(
        CheckpointConfigError,
        match=r":0+ is out of range: . must be a whole number with 1 <= . <= \d+, such as ",
    ):
        parse_policy(spec)


@pytest.mark.parametrize(
    "spec",
    ["fraction:abc", "fraction:nan", "fraction:inf", "fraction:1e-1", "fraction:-1", "fraction:5%"],
)
def test_malformed_fraction(spec):
    with pytest.raises(
        CheckpointConfigError,
        match=r"is malformed: P must be a decimal number with 0 < P <= 1",
    ):
        parse_policy(spec)


@pytest.mark.parametrize("spec", ["fraction:0", "fraction:0.0", "fraction:1.5", "fraction:2"])
def test_fraction_out_of_range(spec):
    with pytest.raises(
        CheckpointConfigError,
        match=r"fraction:P takes a number with 0 < P <= 1.*got",
    ):
        parse_policy(spec)


def test_bad_class_names_in_type():
    with pytest.raises(CheckpointConfigError, match=r"'' is not one"):
        parse_policy("type:A,,B")
    with pytest.raises(CheckpointConfigError, match=r"'GPTBlock last:6' is not one.*joined by ';'"):
        parse_policy("type:GPTBlock last:6")


@pytest.mark.parametrize(
    "spec, fraction, amount",
    [("budget:40%", 0.4, None), ("budget:512MiB", None, 512 << 20), ("budget:2GiB", None, 2 << 30),
     ("budget: 1.5 GB", None, 1_500_000_000), ("budget:100%", 1.0, None)],
)
def test_budget_amounts(spec, fraction, amount):
    rest, budget, tier = split_modifiers(parse_policy("blocks;" + spec))
    assert rest == parse_policy("blocks") and tier is None
    assert budget.parsed() == (fraction, amount)
    assert parse_policy(str(parse_policy(spec))) == parse_policy(spec)


@pytest.mark.parametrize(
    "spec, message",
    [("budget:40", "malformed"), ("budget:0%", "out of range"), ("budget:120%", "out of range"),
     ("budget:12 parsecs", "malformed"), ("budget:0MiB", "out of range"),
     ("budget:0.5B", "out of range")],
)
def test_bad_budgets_name_the_term(spec, message):
    with pytest.raises(CheckpointConfigError, match=rf"{re.escape(spec)}.*{message}"):
        parse_policy(spec)


def test_tiers_parse_and_split():
    rest, budget, tier = split_modifiers(parse_policy("type:Block;last:4;selective:mm,bmm"))
    assert rest == parse_policy("type:Block;last:4") and budget is None
    assert tier == Selective(("mm", "bmm"))
    assert split_modifiers(parse_policy("offload"))[2] == Offload()
    assert split_modifiers(parse_policy("selective"))[2].ops == DEFAULT_SELECTIVE_OPS
    with pytest.raises(CheckpointConfigError, match="not an aten operator"):
        parse_policy("selective:mm,frobnicate")
    with pytest.raises(CheckpointConfigError, match="at most one"):
        split_modifiers(parse_policy("selective;offload"))
    with pytest.raises(CheckpointConfigError, match=r"cannot stand inside '\|' or '~'"):
        split_modifiers(parse_policy("blocks") | parse_policy("every:2;budget:40%"))


def test_errors_name_the_whole_policy():
    with pytest.raises(
        CheckpointConfigError,
        match=r"in policy 'type:GPTBlock;every:x': every:x is malformed",
    ):
        parse_policy("type:GPTBlock;every:x")


def test_select_errors_name_the_policy_and_the_model():
    with pytest.raises(
        CheckpointConfigError,
        match=r"policy 'type:Nope;last:2' cannot be applied to GPT: type:Nope",
    ):
        parse_policy("last:2;type:Nope").select(GPT())


def test_parse_rejects_non_strings():
    with pytest.raises(CheckpointConfigError, match="a policy string must be a str; got int"):
        parse_policy(3)


# ---------------------------------------------------------------------------- as_policy


def is_attention(module, name):
    return name.endswith(".attn")


def test_as_policy_forms():
    policy = Type("GPTBlock") & Last(2)
    assert as_policy(policy) is policy
    assert as_policy("type:GPTBlock;last:2") == policy
    assert as_policy(GPTBlock) == Instance(GPTBlock)
    assert as_policy((nn.Linear, nn.LayerNorm)) == Instance((nn.Linear, nn.LayerNorm))
    assert as_policy(is_attention) == Predicate(is_attention)
    assert as_policy(is_attention).select(GPT(n_layers=2)) == ["h.0.attn", "h.1.attn"]


@pytest.mark.parametrize(
    "obj, match",
    [
        (None, r"cannot use NoneType None as a policy; allowed: a policy string"),
        (3, r"cannot use int 3 as a policy; allowed: .*a predicate fn\(module, qualified_name\)"),
        ([nn.Linear], r"cannot use list .* pass a tuple of classes, not a list"),
        (nn.Linear(2, 2), r"cannot use Linear .* pass the class Linear"),
        (int, r"cannot use the class int as a policy: it is not an nn.Module subclass"),
        ((), r"a tuple must hold one or more nn.Module subclasses"),
        ((nn.Linear, "LayerNorm"), r"a tuple must hold one or more nn.Module subclasses"),
        (lambda module: True, r"cannot take those two arguments"),
        ("nope", r"unknown term 'nope'"),
    ],
)
def test_as_policy_rejects_other_forms(obj, match):
    with pytest.raises(CheckpointConfigError, match=match):
        as_policy(obj)


def test_config_errors_are_value_errors():
    with pytest.raises(ValueError):
        parse_policy("every:0")

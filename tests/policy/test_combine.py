"""Tests of combining policies with ``&``, ``|`` and ``~``, and of what every policy
object promises: equal to its string form, pure, hashable, picklable, readable."""

from __future__ import annotations

import copy
import pickle

import pytest
from _policy_models import GPT, Bert, GPTBlock, ResNet, gpt_blocks, mlp, module_names
from torch import nn

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.policy import (
    Blocks,
    Complement,
    Every,
    First,
    Fraction,
    Instance,
    Intersection,
    Last,
    Name,
    Nothing,
    Policy,
    Predicate,
    Type,
    Union,
    as_policy,
    parse_policy,
)


def is_attention(module, name):
    return name.endswith(".attn")


def resnet_blocks():
    return [f"layer{stage}.{i}" for stage in (1, 2, 3) for i in (0, 1)]


# ------------------------------------------------------------------------ intersection


def test_and_equals_the_string_form():
    assert Type("GPTBlock") & Last(6) == parse_policy("type:GPTBlock;last:6")
    assert Type("GPTBlock") & Last(6) == parse_policy("last:6;type:GPTBlock")
    assert (Type("GPTBlock") & Last(6)).select(GPT()) == gpt_blocks()[6:]


def test_pickers_each_pick_from_the_same_candidates():
    assert parse_policy("every:2;last:3").select(GPT()) == ["h.10"]
    assert parse_policy("last:3;every:2").select(GPT()) == ["h.10"]
    assert parse_policy("first:1;last:1").select(GPT()) == []


def test_set_terms_intersect_into_the_candidates():
    policy = parse_policy("name:h.1*;type:GPTBlock;first:2")
    assert policy.select(GPT()) == ["h.1", "h.10"]


def test_and_is_associative_and_flat():
    a, b, c = Type("GPTBlock"), Every(2), Last(4)
    assert (a & b) & c == a & (b & c) == parse_policy("type:GPTBlock;every:2;last:4")
    assert (b & c) & a == Intersection(sets=(a,), pickers=(b, c))


def test_picker_only_intersection_is_a_picker():
    pickers = Every(2) & Last(3)
    assert (Type("GPTBlock") & pickers).select(GPT()) == ["h.10"]
    assert pickers.select(GPT()) == ["h.10"]


def test_and_with_other_forms():
    assert Type("GPTBlock") & "last:2" == parse_policy("type:GPTBlock;last:2")
    assert "last:2" & Type("GPTBlock") == parse_policy("last:2;type:GPTBlock")
    assert (GPTBlock & Last(2)).select(GPT()) == ["h.10", "h.11"]
    assert (Last(1) & is_attention).select(GPT()) == ["h.11.attn"]


def test_and_with_something_else_names_it():
    with pytest.raises(
        CheckpointConfigError,
        match="cannot use int 5 as a policy; allowed: a policy string",
    ):
        Last(2) & 5


# ------------------------------------------------------------------------------- union


def test_union_of_set_terms():
    model = GPT(n_layers=2)
    union = Type("Embedding") | Type("LayerNorm")
    assert union.select(model) == parse_policy("type:Embedding,LayerNorm").select(model)


def test_union_of_pickers_is_a_picker():
    policy = Type("GPTBlock") & (First(2) | Last(2))
    assert policy.select(GPT()) == ["h.0", "h.1", "h.10", "h.11"]
    assert (Name("encoder.layer.*") & Type("BertLayer") & (First(1) | Last(1))).select(Bert()) == [
        "encoder.layer.0",
        "encoder.layer.5",
    ]


def test_union_of_a_set_term_and_a_picker_is_a_set_term():
    policy = Type("Embedding") | Last(1)
    assert policy.select(GPT()) == ["wte", "h.11"]
    assert (policy & Name("h.*")).select(GPT()) == ["h.11"]


def test_union_flattens():
    a, b, c = Type("A"), Type("B"), Type("C")
    assert (a | b) | c == a | (b | c) == Union((a, b, c))
    assert nn.Linear | Type("LayerNorm") == Union((Instance(nn.Linear), Type("LayerNorm")))


# -------------------------------------------------------------------------- complement


def test_complement_of_a_set_term_is_every_other_module():
    model = GPT(n_layers=2)
    selected = (~Type("Linear")).select(model)
    assert selected == [n for n, m in model.named_modules() if n and type(m) is not nn.Linear]


def test_complement_of_a_picker_is_the_rest_of_its_candidates():
    assert (~Last(2)).select(GPT()) == gpt_blocks()[:-2]
    assert (Type("BasicBlock") & ~First(1)).select(ResNet()) == resnet_blocks()[1:]


def test_complement_of_an_intersection_is_its_candidates_minus_its_selection():
    assert (~(Type("GPTBlock") & Last(2))).select(GPT()) == gpt_blocks()[:-2]
    assert (~(Every(2) & Last(4))).select(GPT()) == gpt_blocks()[:8] + ["h.9", "h.11"]


def test_complement_of_an_intersection_of_set_terms_is_every_other_module():
    model = GPT(n_layers=2)
    selected = (~(Type("GPTBlock") & Name("h.0"))).select(model)
    assert selected == [n for n in module_names(model) if n != "h.0"]


def test_complement_of_none_is_everything():
    model = mlp()
    assert (~Nothing()).select(model) == module_names(model)


def test_double_complement_is_the_policy():
    for policy in (Type("A"), Last(2), Type("A") & Last(2), Type("A") | Type("B")):
        assert ~~policy == policy
    assert isinstance(~Last(2), Complement)


# ---------------------------------------------------------------------- policy objects


GRAMMAR_POLICIES = [
    "none",
    "blocks",
    "all",
    "type:GPTBlock",
    "type:Embedding,LayerNorm",
    "name:h.1*",
    "every:3",
    "first:2",
    "last:6",
    "fraction:0.25",
    "type:GPTBlock;last:6",
    "every:2;last:3",
    "name:h.*;type:GPTBlock;fraction:0.5;every:2",
]


@pytest.mark.parametrize("spec", GRAMMAR_POLICIES)
def test_describe_renders_the_string_form(spec):
    policy = parse_policy(spec)
    assert str(policy) == policy.describe() == spec
    assert parse_policy(str(policy)) == policy


def test_describe_normalises_whitespace_and_order():
    assert str(parse_policy(" last:6 ;  type: GPTBlock ")) == "type:GPTBlock;last:6"
    assert str(parse_policy("fraction:.5")) == "fraction:0.5"


def test_describe_writes_python_only_forms_as_expressions():
    assert str(as_policy(nn.Linear)) == "isinstance(Linear)"
    assert str(as_policy(is_attention)) == "predicate(is_attention)"
    assert str(Type("A") | Type("B") & Last(2)) == "type:A | (type:B;last:2)"
    assert str((Type("A") | Type("B")) & Last(2)) == "(type:A | type:B);last:2"
    assert str(~(Type("A") & Last(2))) == "~(type:A;last:2)"
    assert str(~Type("A")) == "~type:A"


@pytest.mark.parametrize("spec", GRAMMAR_POLICIES)
def test_policies_pickle_hash_and_compare(spec):
    policy = parse_policy(spec)
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert hash(parse_policy(spec)) == hash(policy)
    assert len({policy, parse_policy(spec)}) == 1


def test_python_only_forms_pickle_and_repr():
    policy = as_policy((nn.Linear, GPTBlock)) | Predicate(is_attention)
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert repr(Instance(nn.Linear)) == "Instance(classes=(torch.nn.modules.linear.Linear,))"
    assert repr(Predicate(is_attention)) == "Predicate(fn=is_attention)"


def test_repr_is_readable():
    assert repr(parse_policy("type:GPTBlock;last:6")) == (
        "Intersection(sets=(Type(names=('GPTBlock',)),), pickers=(Last(k=6),))"
    )
    assert repr(Fraction(0.5)) == "Fraction(p=0.5)"


def test_combinators_reject_wrong_parts():
    with pytest.raises(CheckpointConfigError, match="takes only pickers"):
        Intersection(pickers=(Type("A"),))
    with pytest.raises(CheckpointConfigError, match="takes only set terms"):
        Intersection(sets=(Last(2),))
    with pytest.raises(CheckpointConfigError, match="needs at least one part"):
        Intersection()
    with pytest.raises(CheckpointConfigError, match="Union.parts takes Policy objects; got str"):
        Union(("blocks",))


# ------------------------------------------------------------------------------ purity


PURITY_CASES = [
    (GPT, "every:2"),
    (GPT, "type:GPTBlock;fraction:0.5"),
    (Bert, "blocks;last:2"),
    (ResNet, "every:2"),
    (mlp, "all;first:2"),
]


@pytest.mark.parametrize("build, spec", PURITY_CASES)
def test_selection_is_a_pure_function_of_the_model(build, spec):
    policy = parse_policy(spec)
    model = build()
    first = policy.select(model)
    assert policy.select(model) == first
    assert policy.select(copy.deepcopy(model)) == first
    assert policy.select(build()) == first
    assert copy.deepcopy(policy).select(model) == first


def test_one_policy_object_serves_several_models():
    policy = Every(2) & Last(3)
    assert policy.select(GPT(n_layers=4)) == ["h.2"]
    assert policy.select(GPT(n_layers=12)) == ["h.10"]
    assert policy.select(GPT(n_layers=4)) == ["h.2"]


def test_select_rejects_a_non_module():
    with pytest.raises(CheckpointConfigError, match="selects from an nn.Module; got list"):
        Blocks().select([nn.Linear(2, 2)])


def test_policy_is_the_common_base():
    for policy in (Blocks(), Last(2), Type("A") & Last(2), Type("A") | Last(2), ~Type("A")):
        assert isinstance(policy, Policy)

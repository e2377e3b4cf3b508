"""Tests of each policy term on its own: what it selects, and the errors it raises."""

from __future__ import annotations

import dataclasses

import pytest
from _policy_models import GPT, Bert, GPTBlock, NoRepeat, ResNet, gpt_blocks, mlp, module_names
from torch import nn

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.policy import (
    All,
    Every,
    First,
    Fraction,
    Instance,
    Last,
    Name,
    Nothing,
    Predicate,
    Type,
    parse_policy,
)


class SubBlock(GPTBlock):
    """Same structure as GPTBlock, another class name."""


# ----------------------------------------------------------------------------- pickers


@pytest.mark.parametrize("n", [1, 2, 3, 5, 12, 13])
def test_every_picks_indices_divisible_by_n(n):
    blocks = gpt_blocks()
    expected = [name for i, name in enumerate(blocks) if i % n == 0]
    assert parse_policy(f"every:{n}").select(GPT()) == expected
    assert Every(n).select(GPT()) == expected


@pytest.mark.parametrize("k", [1, 5, 12, 100])
def test_first_and_last_pick_k_or_everything(k):
    blocks = gpt_blocks()
    assert parse_policy(f"first:{k}").select(GPT()) == blocks[:k]
    assert parse_policy(f"last:{k}").select(GPT()) == blocks[-k:]


@pytest.mark.parametrize("n", range(1, 14))
@pytest.mark.parametrize("p", [0.05, 0.1, 0.25, 1 / 3, 0.5, 0.6, 0.75, 0.9, 1.0])
def test_fraction_picks_round_p_n_distinct_evenly_spaced(n, p):
    model = GPT(n_layers=n)
    # A one-layer ModuleList repeats nothing, so name the candidates instead of using blocks.
    picked = (Type("GPTBlock") & Fraction(p)).select(model)
    k = round(p * n)
    assert len(picked) == k
    indices = [int(name.split(".")[1]) for name in picked]
    assert indices == [(2 * j + 1) * n // (2 * k) for j in range(k)]
    gaps = {b - a for a, b in zip(indices, indices[1:])}
    assert not gaps or max(gaps) - min(gaps) <= 1


def test_fraction_examples():
    assert parse_policy("fraction:0.5").select(GPT()) == ["h.1", "h.3", "h.5", "h.7", "h.9", "h.11"]
    assert parse_policy("fraction:1").select(GPT()) == gpt_blocks()
    assert parse_policy("fraction:0.01").select(GPT()) == []


def test_a_single_layer_is_not_a_repetition():
    # The only repetition left is inside the block, so blocks are its MLP's Linears.
    assert parse_policy("last:1").select(GPT(n_layers=1)) == ["h.0.mlp.2"]


def test_pickers_without_a_set_term_need_blocks():
    with pytest.raises(
        CheckpointConfigError,
        match=r"last:2 picks among the repeated blocks.*NoRepeat has no repeated blocks",
    ):
        Last(2).select(NoRepeat())


# --------------------------------------------------------------------------- set terms


def test_none_selects_nothing():
    assert Nothing().select(GPT()) == []
    assert parse_policy("none").select(NoRepeat()) == []


def test_none_with_other_terms_selects_nothing_but_still_checks_them():
    assert parse_policy("none;blocks").select(GPT()) == []
    assert parse_policy("none;every:2").select(NoRepeat()) == []
    with pytest.raises(CheckpointConfigError, match="type:Nope matches no module"):
        parse_policy("none;type:Nope").select(GPT())


def test_all_selects_direct_children_holding_parameters_or_submodules():
    model = GPT()
    model.act = nn.GELU()  # neither parameters nor submodules
    assert All().select(model) == ["wte", "h", "ln_f"]
    expected = ["conv1", "bn1", "layer1", "layer2", "layer3", "fc"]
    assert parse_policy("all").select(ResNet()) == expected
    assert parse_policy("all").select(mlp()) == ["0", "2", "4"]


def test_all_matching_nothing_raises():
    with pytest.raises(
        CheckpointConfigError,
        match="all matches nothing: no direct child of Sequential",
    ):
        parse_policy("all").select(nn.Sequential(nn.ReLU(), nn.GELU()))


def test_type_matches_the_exact_class_name():
    model = GPT(n_layers=3)
    model.h.append(SubBlock())
    assert parse_policy("type:GPTBlock").select(model) == ["h.0", "h.1", "h.2"]
    assert parse_policy("type:SubBlock").select(model) == ["h.3"]


def test_type_with_several_names():
    selected = parse_policy("type:Embedding,LayerNorm").select(GPT(n_layers=1))
    assert selected == ["wte", "h.0.ln_1", "h.0.ln_2", "ln_f"]
    assert Type(("Embedding", "LayerNorm")) == parse_policy("type: Embedding , LayerNorm")


def test_type_not_in_model_lists_the_classes_present():
    expected = (
        "the classes in GPT are Attention, Embedding, GELU, GPTBlock, LayerNorm, Linear, "
        "ModuleList, Sequential$"
    )
    with pytest.raises(CheckpointConfigError, match=expected):
        parse_policy("type:GPT2Block").select(GPT())


def test_type_suggests_a_close_class_name():
    with pytest.raises(CheckpointConfigError, match="did you mean 'GPTBlock'"):
        parse_policy("type:GptBlock").select(GPT())


def test_type_naming_only_the_root_says_so():
    with pytest.raises(
        CheckpointConfigError,
        match="GPT is the model itself, which is never selected",
    ):
        parse_policy("type:GPT").select(GPT())


def test_type_reports_every_missing_name():
    with pytest.raises(CheckpointConfigError, match="no module of class Foo, Bar;"):
        parse_policy("type:Foo,Linear,Bar").select(GPT())


def test_name_matches_qualified_names_with_fnmatch():
    assert parse_policy("name:h.1?").select(GPT()) == ["h.10", "h.11"]
    selected = parse_policy("name:encoder.layer.[0-1]").select(Bert())
    assert selected == ["encoder.layer.0", "encoder.layer.1"]
    # '*' crosses dots, so a prefix glob also reaches everything inside.
    inside = [n for n in module_names(GPT(n_layers=1)) if n.startswith("h.0")]
    assert parse_policy("name:h.0*").select(GPT(n_layers=1)) == inside


def test_name_is_case_sensitive():
    with pytest.raises(CheckpointConfigError, match="name:H.0 matches no qualified name"):
        parse_policy("name:H.0").select(GPT())


def test_name_matching_nothing_shows_names_that_exist():
    with pytest.raises(
        CheckpointConfigError,
        match=r"look like wte, h, ln_f, h\.0, .*\(\d+ in all\)",
    ):
        parse_policy("name:transformer.h.*").select(GPT())


def test_instance_includes_subclasses():
    model = GPT(n_layers=2)
    model.h.append(SubBlock())
    assert Instance(GPTBlock).select(model) == ["h.0", "h.1", "h.2"]
    assert Instance((nn.Embedding, nn.LayerNorm)).select(GPT(n_layers=0)) == ["wte", "ln_f"]


def test_instance_matching_nothing_raises():
    with pytest.raises(
        CheckpointConfigError,
        match=r"isinstance\(Conv2d\) matches no module; the classes in GPT are",
    ):
        Instance(nn.Conv2d).select(GPT())


def test_predicate_sees_every_module_but_the_root():
    seen = []

    def record(module, name):
        seen.append((name, type(module)))
        return name.endswith("attn")

    assert Predicate(record).select(GPT(n_layers=2)) == ["h.0.attn", "h.1.attn"]
    model = GPT(n_layers=2)
    assert [name for name, _ in seen] == module_names(model)


def test_predicate_false_everywhere_raises():
    def never(module, name):
        return False

    with pytest.raises(
        CheckpointConfigError,
        match=r"predicate\(.*never\) is false for every module of GPT",
    ):
        Predicate(never).select(GPT())


# ---------------------------------------------------------------------- constructors


@pytest.mark.parametrize("term", [Every, First, Last])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_count_pickers_reject_anything_but_a_positive_int(term, bad):
    with pytest.raises(CheckpointConfigError, match=r"takes a whole number with 1 <= . <= \d+.*got"):
        term(bad)


@pytest.mark.parametrize("bad", [0, -0.5, 1.0001, float("nan"), float("inf"), True, "0.5"])
def test_fraction_rejects_values_outside_zero_one(bad):
    with pytest.raises(CheckpointConfigError, match=r"fraction:P takes a number with 0 < P <= 1"):
        Fraction(bad)


def test_type_rejects_non_names():
    with pytest.raises(CheckpointConfigError, match="pass the class itself"):
        Type(nn.Linear)
    with pytest.raises(CheckpointConfigError, match="'GPTBlock last:6' is not one"):
        Type("GPTBlock last:6")
    with pytest.raises(CheckpointConfigError, match="one or more class names"):
        Type(())


def test_name_rejects_an_empty_glob():
    with pytest.raises(CheckpointConfigError, match="name: takes a glob"):
        Name("")


def test_instance_rejects_non_module_classes():
    with pytest.raises(CheckpointConfigError, match="Instance takes an nn.Module subclass"):
        Instance(int)
    with pytest.raises(CheckpointConfigError, match="Instance takes an nn.Module subclass"):
        Instance(())


def test_predicate_checks_its_signature_early():
    with pytest.raises(CheckpointConfigError, match=r"called as fn\(module, qualified_name\)"):
        Predicate(lambda module: True)
    with pytest.raises(CheckpointConfigError, match="takes a function"):
        Predicate(nn.Linear)


def test_terms_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Every(2).n = 3

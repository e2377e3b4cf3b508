"""Tests of repeated-block detection (``find_blocks`` and the ``blocks`` term)."""

from __future__ import annotations

import pytest
from _policy_models import GPT, Bert, NoRepeat, ResNet, gpt_blocks, mlp, module_names
from torch import nn

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.policy import Blocks, find_blocks, parse_policy


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)


class Stage(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(n_layers))


class Wrapper(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body


def test_gpt_blocks_are_the_layers_not_the_mlp_linears():
    assert find_blocks(GPT()) == gpt_blocks()


def test_bert_blocks_are_the_encoder_layers():
    assert find_blocks(Bert(n_layers=6)) == [f"encoder.layer.{i}" for i in range(6)]


def test_resnet_blocks_span_all_stages():
    expected = [f"layer{stage}.{i}" for stage in (1, 2, 3) for i in (0, 1)]
    assert find_blocks(ResNet()) == expected


def test_sequential_root_counts_as_a_container():
    assert find_blocks(mlp()) == ["0", "2", "4"]


def test_no_repetition_finds_nothing():
    assert find_blocks(NoRepeat()) == []
    assert find_blocks(nn.Linear(2, 2)) == []


def test_blocks_term_selects_what_find_blocks_finds():
    for model in (GPT(), Bert(), ResNet(), mlp()):
        assert Blocks().select(model) == find_blocks(model)
        assert parse_policy("blocks").select(model) == find_blocks(model)


def test_blocks_term_without_repetition_raises_with_advice():
    with pytest.raises(CheckpointConfigError, match=r"NoRepeat has no repeated blocks.*type:NAME"):
        parse_policy("blocks").select(NoRepeat())


def test_more_members_win_over_larger_modules():
    model = nn.Sequential(Big(), Big(), nn.ReLU(), nn.ReLU(), nn.ReLU())
    assert find_blocks(model) == ["2", "3", "4"]


def test_ties_go_to_more_parameters_per_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), Big(), Big())
    assert find_blocks(model) == ["2", "3"]


def test_remaining_ties_go_to_the_first_class_to_appear():
    model = nn.Sequential(nn.GELU(), nn.ReLU(), nn.GELU(), nn.ReLU())
    assert find_blocks(model) == ["0", "2"]


def test_outermost_repetition_wins_over_larger_inner_ones():
    model = nn.ModuleList([Stage(6), Stage(6)])
    assert find_blocks(model) == ["0", "1"]


def test_inner_repetition_counts_when_its_parent_does_not_repeat():
    model = nn.Module()
    model.stem = nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU())
    model.body = Wrapper(Stage(4))
    assert find_blocks(model) == [f"body.body.layers.{i}" for i in range(4)]


def test_groups_of_one_class_in_several_containers_are_joined():
    model = nn.Module()
    model.a = nn.ModuleList([Big(), Big()])
    model.b = nn.ModuleList([Big(), Big(), Big()])
    assert find_blocks(model) == ["a.0", "a.1", "b.0", "b.1", "b.2"]


def test_module_dict_is_not_a_block_container():
    model = nn.ModuleDict({"x": nn.Linear(2, 2), "y": nn.Linear(2, 2)})
    assert find_blocks(model) == []


def test_a_shared_module_is_named_once():
    shared = nn.Linear(2, 2)
    model = nn.ModuleList([shared, shared, nn.Linear(2, 2)])
    blocks = find_blocks(model)
    assert blocks == ["0", "2"]
    assert set(blocks) <= set(module_names(model))


def test_lazy_modules_do_not_break_the_parameter_count():
    model = nn.Sequential(nn.LazyLinear(2), nn.LazyLinear(2))
    assert find_blocks(model) == ["0", "1"]


def test_find_blocks_rejects_a_non_module():
    with pytest.raises(CheckpointConfigError, match="needs an nn.Module; got dict"):
        find_blocks({"h": nn.Linear(2, 2)})

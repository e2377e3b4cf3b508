"""Tests of repeated-block detection (``find_blocks`` and the ``blocks`` term)."""

from __future__ import annotations

import subprocess
import sys
import types

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


def test_modules_with_submodules_win_over_more_numerous_leaves():
    model = nn.Sequential(Big(), Big(), nn.ReLU(), nn.ReLU(), nn.ReLU())
    assert find_blocks(model) == ["0", "1"]


def test_without_blocks_more_members_win():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU(), nn.ReLU(), nn.ReLU())
    assert find_blocks(model) == ["2", "3", "4"]


def test_ties_go_to_more_parameters_per_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Bilinear(2, 2, 2), nn.Bilinear(2, 2, 2))
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


# --------------------------------------------------------------------------- every family


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 4))


class DecoderLayer(EncoderLayer):
    def __init__(self) -> None:
        super().__init__()
        self.cross_attn = nn.Linear(4, 4)


class EncoderDecoder(nn.Module):
    """Fewer encoder than decoder layers, and repeated leaves beside the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer() for _ in range(2))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(DecoderLayer() for _ in range(3))
        self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        self.classifier = nn.Sequential(
            nn.Dropout(0.1), nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.1), nn.Linear(4, 2)
        )


def test_every_repeated_block_family_is_selected():
    expected = [f"encoder.layers.{i}" for i in range(2)] + [f"decoder.layers.{i}" for i in range(3)]
    assert find_blocks(EncoderDecoder()) == expected
    assert parse_policy("blocks").select(EncoderDecoder()) == expected


def test_families_sharing_one_container_are_all_selected():
    model = nn.Sequential(EncoderLayer(), EncoderLayer(), DecoderLayer(), DecoderLayer(), DecoderLayer())
    assert find_blocks(model) == ["0", "1", "2", "3", "4"]


def test_pickers_pick_across_every_family():
    layers = [f"encoder.layers.{i}" for i in range(2)] + [f"decoder.layers.{i}" for i in range(3)]
    assert parse_policy("every:2").select(EncoderDecoder()) == layers[::2]
    assert parse_policy("first:3").select(EncoderDecoder()) == layers[:3]


def test_an_empty_container_in_a_family_is_not_a_block():
    model = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2)), nn.Sequential()])
    assert find_blocks(model) == ["0", "1"]


# --------------------------------------------------------------------------- declared layers


class GradientCheckpointingLayer(nn.Module):
    """Stands for transformers' base class of the layers it checkpoints itself."""


class Layer(GradientCheckpointingLayer):
    def __init__(self, inner: int = 0) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.inner = nn.ModuleList(Layer() for _ in range(inner))
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2))


@pytest.fixture
def transformers_layers(monkeypatch):
    """Makes ``GradientCheckpointingLayer`` above look like the one transformers defines."""
    module = types.ModuleType("transformers.modeling_layers")
    module.GradientCheckpointingLayer = GradientCheckpointingLayer
    monkeypatch.setitem(sys.modules, "transformers.modeling_layers", module)


def _declared_model() -> nn.Module:
    model = nn.Module()
    model.vision = Layer()  # a layer transformers checkpoints, though not repeated
    model.stages = nn.ModuleList([Layer(inner=2), Layer(inner=2)])  # layers in layers
    model.text = Wrapper(Layer())
    model.heads = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
    return model


def test_declared_layers_are_blocks_innermost_where_they_nest(transformers_layers):
    # Experts inside a kept layer are part of it; those of an outer stage, outside its
    # inner layers, are blocks of their own, as that stage is not checkpointed whole.
    stages = [
        name
        for s in (0, 1)
        for name in (f"stages.{s}.inner.0", f"stages.{s}.inner.1", f"stages.{s}.experts.0", f"stages.{s}.experts.1")
    ]
    assert find_blocks(_declared_model()) == ["vision", *stages, "text.body", "heads.0", "heads.1"]


def test_a_repeated_block_holding_declared_layers_gives_way_to_them(transformers_layers):
    model = nn.ModuleList([Wrapper(Layer()), Wrapper(Layer())])
    assert find_blocks(model) == ["0.body", "1.body"]


def test_declared_layers_count_only_when_transformers_defines_them(monkeypatch):
    # Without transformers loaded, a class of that name is just another nn.Module.
    monkeypatch.delitem(sys.modules, "transformers.modeling_layers", raising=False)
    experts = ["experts.0", "experts.1"]
    expected = [
        *(f"vision.{e}" for e in experts), "stages.0", "stages.1",
        *(f"text.body.{e}" for e in experts), "heads.0", "heads.1",
    ]
    assert find_blocks(_declared_model()) == expected


def test_find_blocks_does_not_import_transformers():
    script = (
        "import sys\n"
        "from torch import nn\n"
        "from ckptwrap.policy import find_blocks\n"
        "model = nn.ModuleList(nn.Sequential(nn.Linear(2, 2)) for _ in range(2))\n"
        "assert find_blocks(model) == ['0', '1']\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'transformers'], 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)

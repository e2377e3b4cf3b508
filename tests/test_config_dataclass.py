"""CheckpointingArguments: the flag's options as a dataclass, for HfArgumentParser and YAML configs.

Whatever reads it, it must end in the same ``wrap_model`` call as the flag, and refuse bad
values with a CheckpointConfigError that names them.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List

import pytest
import torch
import yaml
from torch import nn

import ckptwrap
from ckptwrap import config
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.config import CheckpointingArguments


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _flags(argv: List[str]) -> argparse.Namespace:
    return config.add_argparse_args(argparse.ArgumentParser()).parse_args(argv)


def _wrap_calls(monkeypatch: pytest.MonkeyPatch, apply: Any) -> List[Dict[str, Any]]:
    """The wrap_model calls ``apply(model)`` makes, with the model left out."""
    calls: List[Dict[str, Any]] = []
    real = ckptwrap.wrap_model

    def recording(model: nn.Module, policy: Any, **kwargs: Any) -> nn.Module:
        calls.append(dict(kwargs, policy=policy))
        return real(model, policy, **kwargs)

    monkeypatch.setattr(config, "wrap_model", recording)
    apply(Net())
    return calls


def _marked(model: nn.Module) -> List[str]:
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


# --------------------------------------------------------------------------- one home with the flag


def test_the_fields_are_the_flags_attributes_with_the_same_defaults():
    assert {field.name: field.default for field in dataclasses.fields(CheckpointingArguments)} == vars(_flags([]))
    for field in dataclasses.fields(CheckpointingArguments):
        assert field.metadata["help"], field.name
    assert "CheckpointingArguments" in config.__all__
    assert "CheckpointingArguments" in config.__doc__


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--activation-checkpointing", "every:2"],
        ["--activation-checkpointing", "last:1", "--ac-use-reentrant", "--no-ac-preserve-rng-state"],
        ["--activation-checkpointing", "all", "--ac-nested", "--no-ac-early-stop"],
        ["--activation-checkpointing", "blocks", "--ac-determinism-check", "none"],
    ],
)
def test_it_makes_the_same_wrap_model_call_as_the_flag(monkeypatch, argv):
    args = _flags(argv)
    arguments = CheckpointingArguments(**vars(args))
    by_flag = _wrap_calls(monkeypatch, lambda model: config.apply_from_args(model, args))
    by_dataclass = _wrap_calls(monkeypatch, arguments.apply)
    assert by_dataclass == by_flag and len(by_flag) == 1
    assert arguments.to_config() == config.from_args(args)


def test_apply_wraps_in_place_and_takes_example_inputs(monkeypatch):
    model = Net()
    assert CheckpointingArguments(activation_checkpointing="every:2").apply(model) is model
    assert _marked(model) == ["layers.0", "layers.2"]
    x = torch.randn(2, 4)
    calls = _wrap_calls(
        monkeypatch,
        lambda m: CheckpointingArguments(activation_checkpointing="first:1").apply(m, example_inputs=(x,)),
    )
    assert calls[0]["example_inputs"] == (x,) and calls[0]["example_kwargs"] is None


def test_apply_passes_the_optimizer_for_a_budget_in_a_devices_terms():
    """The flag's ``budget:total=SIZE`` counts the optimizer the script hands to apply."""
    model = Net()
    x = torch.randn(2, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    applied = CheckpointingArguments(activation_checkpointing="budget:total=1GiB").apply(
        model, example_inputs=(x,), optimizer=optimizer
    )
    memory = applied.ckptwrap_plan.device_memory
    assert memory.optimizer == "AdamW"
    assert memory.optimizer_state == 2 * sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_policy_left_out_comes_from_the_environment_when_applied(monkeypatch):
    monkeypatch.delenv(config.ENV_VAR, raising=False)
    arguments = CheckpointingArguments()  # made before the variable is set: read at apply time
    monkeypatch.setenv(config.ENV_VAR, "first:2")
    assert _marked(arguments.apply(Net())) == ["layers.0", "layers.1"]
    # given, the field wins over the environment
    assert _marked(CheckpointingArguments(activation_checkpointing="last:1").apply(Net())) == ["layers.3"]


def test_it_is_frozen_keyword_only_with_a_readable_repr():
    arguments = CheckpointingArguments(activation_checkpointing="blocks")
    with pytest.raises(dataclasses.FrozenInstanceError):
        arguments.ac_nested = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        CheckpointingArguments("blocks")  # type: ignore[misc]
    assert "activation_checkpointing='blocks'" in repr(arguments)


# --------------------------------------------------------------------------- HfArgumentParser


def _parser(transformers: Any) -> Any:
    return transformers.HfArgumentParser((transformers.TrainingArguments, CheckpointingArguments))


def test_hf_argument_parser_parses_the_command_line(transformers, tmp_path):
    training, arguments = _parser(transformers).parse_args_into_dataclasses(
        [
            "--output_dir", str(tmp_path), "--max_steps", "3",
            "--activation-checkpointing", "every:2",
            "--ac_use_reentrant",
            "--no_ac_preserve_rng_state",
            "--ac_early_stop", "false",
            "--ac_determinism_check", "none",
        ],
        look_for_args_file=False,
    )
    assert training.max_steps == 3
    assert arguments == CheckpointingArguments(
        activation_checkpointing="every:2", ac_use_reentrant=True, ac_preserve_rng_state=False,
        ac_early_stop=False, ac_determinism_check="none",
    )
    # the same configuration as ckptwrap's own flags
    flags = _flags([
        "--activation-checkpointing", "every:2", "--ac-use-reentrant", "--no-ac-preserve-rng-state",
        "--no-ac-early-stop", "--ac-determinism-check", "none",
    ])
    assert arguments.to_config() == config.from_args(flags)


def test_hf_argument_parser_defaults_and_help(transformers, tmp_path):
    parser = _parser(transformers)
    _, arguments = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)], look_for_args_file=False)
    assert arguments == CheckpointingArguments()
    text = parser.format_help()
    assert "activation checkpointing (ckptwrap)" in text and "--ac_use_reentrant" in text
    assert "budget:NN%" in text and "budget:NN%%" not in text


def test_hf_argument_parser_refuses_a_bad_policy_naming_it(transformers, tmp_path):
    with pytest.raises(CheckpointConfigError, match=r"activation_checkpointing='blcks'.*did you mean 'blocks'"):
        _parser(transformers).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--activation_checkpointing", "blcks"], look_for_args_file=False
        )


def test_parse_dict_and_parse_yaml_file(transformers, tmp_path):
    section = {"activation_checkpointing": "type:Sequential;last:2", "ac_nested": True, "ac_early_stop": None}
    training, arguments = _parser(transformers).parse_dict(dict(section, output_dir=str(tmp_path)))
    assert arguments == CheckpointingArguments(**section)
    path = tmp_path / "train.yaml"
    path.write_text(
        f"output_dir: {tmp_path}\n"
        "max_steps: 3\n"
        "activation_checkpointing: every:2\n"
        "ac_use_reentrant: true\n"
    )
    training, arguments = _parser(transformers).parse_yaml_file(path)
    assert training.max_steps == 3
    assert arguments == CheckpointingArguments(activation_checkpointing="every:2", ac_use_reentrant=True)
    assert _marked(arguments.apply(Net())) == ["layers.0", "layers.2"]


# --------------------------------------------------------------------------- a YAML section


def test_a_yaml_section_maps_onto_it():
    document = yaml.safe_load(
        "model: {n_layer: 4}\n"
        "ckptwrap:\n"
        "  activation_checkpointing: 'budget:50%'\n"
        "  ac_use_reentrant: false\n"
        "  ac_determinism_check: none\n"
    )
    arguments = CheckpointingArguments(**document["ckptwrap"])
    assert arguments.ac_determinism_check == "none"  # YAML's `none` is a string, not null
    assert arguments.to_config().policy == "budget:50%"


@pytest.mark.parametrize(
    "section, match",
    [
        ({"activation_checkpointing": "evry:2"}, r"activation_checkpointing='evry:2'.*valid terms: none, blocks"),
        ({"ac_use_reentrant": "yes"}, r"ac_use_reentrant='yes'.*must be True or False, got 'yes'"),
        ({"ac_preserve_rng_state": 1}, r"ac_preserve_rng_state=1.*must be True or False"),
        ({"ac_early_stop": "no"}, r"ac_early_stop='no'.*must be True, False or None"),
        ({"ac_determinism_check": "sometimes"}, r"ac_determinism_check='sometimes'.*one of 'default', 'none'"),
        ({"ac_nested": "true"}, r"ac_nested='true'.*nested must be True or False"),
        ({"activation_checkpointing": 3}, r"activation_checkpointing=3.*must be a policy string"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(section, match):
    with pytest.raises(CheckpointConfigError, match=match):
        CheckpointingArguments(**section)
    with pytest.raises(CheckpointConfigError, match=match):
        CheckpointingArguments(**yaml.safe_load(yaml.safe_dump(section)))

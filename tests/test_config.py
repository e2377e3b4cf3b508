"""The entry points for training scripts: argparse flags, the environment variable, config dicts."""

from __future__ import annotations

import argparse
import copy
import logging
import subprocess
import sys
from typing import List

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import ckptwrap
from ckptwrap import config, wrap_model
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.engine import CheckpointOptions


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)).tanh()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _marked(model: nn.Module) -> List[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def _parse(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    assert config.add_argparse_args(parser) is parser
    return parser.parse_args(argv)


@pytest.fixture(autouse=True)
def _no_policy_in_the_environment(monkeypatch):
    monkeypatch.delenv(config.ENV_VAR, raising=False)


# --------------------------------------------------------------------------- argparse


def test_defaults_checkpoint_nothing():
    args = _parse([])
    assert args.activation_checkpointing is None  # not given: from_args looks further
    cfg = config.from_args(args)
    assert cfg.policy == "none" and cfg.nested is False
    assert cfg.options == CheckpointOptions()
    model = config.apply_from_args(_net(), args)
    assert _marked(model) == []


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("blocks", ["layers.0", "layers.1", "layers.2", "layers.3"]),
        ("every:2", ["layers.0", "layers.2"]),
        ("type:Layer;last:1", ["layers.3"]),
        ("name:head", ["head"]),
    ],
)
def test_the_policy_flag_is_applied(policy, expected):
    args = _parse(["--activation-checkpointing", policy])
    model = _net()
    assert config.apply_from_args(model, args) is model
    assert _marked(model) == expected
    assert model.ckptwrap_plan.names == expected


def test_the_policy_comes_from_the_environment_variable(monkeypatch):
    monkeypatch.setenv("CKPTWRAP_POLICY", "every:2")
    assert config.ENV_VAR == "CKPTWRAP_POLICY"
    model = config.apply_from_args(_net(), _parse([]))
    assert _marked(model) == ["layers.0", "layers.2"]

    # the flag wins over the environment
    model = config.apply_from_args(_net(), _parse(["--activation-checkpointing", "last:1"]))
    assert _marked(model) == ["layers.3"]


def test_engine_option_flags_reach_the_wrapped_modules():
    args = _parse(
        [
            "--activation-checkpointing", "blocks",
            "--ac-use-reentrant",
            "--no-ac-preserve-rng-state",
            "--no-ac-early-stop",
            "--ac-determinism-check", "none",
        ]
    )
    expected = CheckpointOptions(
        use_reentrant=True, preserve_rng_state=False, early_stop=False, determinism_check="none"
    )
    assert config.from_args(args).options == expected
    model = config.apply_from_args(_net(), args)
    assert model.ckptwrap_plan.options == expected
    # The same options as wrap_model given them directly, which also marks the same modules.
    direct = wrap_model(_net(), "blocks", **expected.as_kwargs())
    assert direct.ckptwrap_plan == model.ckptwrap_plan
    # and they are in force: only the re-entrant engine refuses torch.autograd.grad
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ckptwrap.CheckpointError, match="use_reentrant=True"):
        torch.autograd.grad(model(x).sum(), x)


def test_positive_option_flags():
    args = _parse(["--no-ac-use-reentrant", "--ac-preserve-rng-state", "--ac-early-stop"])
    assert config.from_args(args).options == CheckpointOptions(
        use_reentrant=False, preserve_rng_state=True, early_stop=True
    )


def test_the_nested_flag():
    argv = ["--activation-checkpointing", "type:Layer,Linear"]
    flat = config.apply_from_args(_net(), _parse(argv))
    assert _marked(flat) == ["layers.0", "layers.1", "layers.2", "layers.3", "head"]
    nested = config.apply_from_args(_net(), _parse(argv + ["--ac-nested"]))
    assert config.from_args(_parse(argv + ["--ac-nested"])).nested is True
    assert "layers.0.lin" in _marked(nested)


def test_a_wrapped_model_from_flags_trains_like_the_plain_one():
    plain = _net()
    wrapped = config.apply_from_args(copy.deepcopy(plain), _parse(["--activation-checkpointing", "blocks"]))
    results = []
    for model in (plain, wrapped):
        torch.manual_seed(1)
        model(torch.ones(3, 4)).sum().backward()
        results.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in results[0].items():
        assert torch.equal(results[1][name], grad), name


def test_bad_flag_values_are_rejected(capsys):
    parser = argparse.ArgumentParser()
    config.add_argparse_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ac-determinism-check", "strict"])
    assert "invalid choice: 'strict'" in capsys.readouterr().err


def test_a_bad_policy_flag_is_an_error_naming_it():
    with pytest.raises(CheckpointConfigError, match="unknown term 'blokcs'"):
        config.from_args(_parse(["--activation-checkpointing", "blokcs"]))
    model = _net()
    with pytest.raises(CheckpointConfigError, match="type:Nope matches no module"):
        config.apply_from_args(model, _parse(["--activation-checkpointing", "type:Nope"]))
    assert _marked(model) == []


def test_from_args_without_the_flags_says_what_to_do():
    with pytest.raises(CheckpointConfigError, match="add_argparse_args"):
        config.from_args(argparse.Namespace())


# --------------------------------------------------------------------------- dicts


def test_from_config_with_a_dict():
    cfg = config.from_config({"policy": "every:2", "use_reentrant": True, "early_stop": False, "nested": True})
    assert cfg.policy == "every:2" and cfg.nested is True
    assert cfg.options == CheckpointOptions(use_reentrant=True, early_stop=False)
    model = _net()
    assert cfg.apply(model) is model
    assert _marked(model) == ["layers.0", "layers.2"]
    assert model.ckptwrap_plan.options == cfg.options


@pytest.mark.parametrize("section", [None, {}])
def test_an_empty_config_means_the_defaults(section):
    cfg = config.from_config(section)
    assert cfg == config.ActivationCheckpointingConfig()
    assert cfg.policy == "none"


def test_from_config_takes_the_policy_from_the_environment(monkeypatch):
    monkeypatch.setenv(config.ENV_VAR, "last:2")
    assert config.from_config({}).policy == "last:2"
    assert config.from_config({"policy": "blocks"}).policy == "blocks"


def test_unknown_keys_are_errors_naming_them_and_the_allowed_keys():
    with pytest.raises(CheckpointConfigError, match=r"'polcy', 'reentrant'.*allowed: policy, nested, use_reentrant"):
        config.from_config({"polcy": "blocks", "reentrant": True})
    with pytest.raises(CheckpointConfigError, match="allowed:.*determinism_check, debug"):
        config.from_config({"context_fn": None})


@pytest.mark.parametrize(
    "section, match",
    [
        ({"use_reentrant": "yes"}, "use_reentrant must be True or False, got 'yes'"),
        ({"preserve_rng_state": 1}, "preserve_rng_state must be True or False, got 1"),
        ({"early_stop": "no"}, "early_stop must be True, False or None, got 'no'"),
        ({"determinism_check": "strict"}, "determinism_check must be one of .*got 'strict'"),
        ({"nested": "true"}, "'nested' must be true or false, got 'true'"),
        ({"policy": 2}, "policy must be a policy string, got 2"),
        ({"policy": ["blocks"]}, r"policy must be a policy string, got \['blocks'\]"),
        ({"policy": "every:two"}, "every:two is malformed"),
    ],
)
def test_bad_types_and_values_are_errors(section, match):
    with pytest.raises(CheckpointConfigError, match=match):
        config.from_config(section)


def test_a_section_that_is_not_a_mapping_is_an_error():
    with pytest.raises(CheckpointConfigError, match="expected a mapping.*got list"):
        config.from_config(["policy", "blocks"])


def test_the_config_is_a_frozen_value():
    cfg = config.from_config({"policy": "blocks"})
    assert cfg == config.from_config({"policy": "blocks"})
    with pytest.raises(AttributeError):
        cfg.policy = "all"
    assert "blocks" in repr(cfg)


# --------------------------------------------------------------------------- help text


def test_the_help_of_a_parser_with_every_flag_formats():
    parser = argparse.ArgumentParser(prog="train.py")
    config.add_argparse_args(parser)
    text = parser.format_help()
    for flag in ("--activation-checkpointing", "--ac-use-reentrant", "--ac-nested", "--ac-determinism-check"):
        assert flag in text
    # argparse expands %-placeholders in help texts: the percent sign must survive as one.
    assert "budget:NN%" in text and "budget:NN%%" not in text
    assert config.ENV_VAR in text


def test_the_documented_import_form_works_in_a_fresh_interpreter():
    # `import ckptwrap` alone must make ckptwrap.config reachable, as the README shows.
    done = subprocess.run(
        [sys.executable, "-c", "import ckptwrap; print(ckptwrap.config.add_argparse_args.__name__)"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "add_argparse_args"
    assert "config" not in ckptwrap.__all__  # a submodule, not a name of the public API


# --------------------------------------------------------------------------- malformed input


def test_a_key_that_is_not_a_string_is_an_error_naming_it():
    with pytest.raises(CheckpointConfigError, match=r"unknown .*key\(s\) 1, None;.*allowed: policy, nested"):
        config.from_config({1: "x", "policy": "blocks", None: 2})


def test_a_namespace_without_the_option_flags_names_the_missing_ones():
    args = argparse.Namespace(activation_checkpointing="blocks", ac_use_reentrant=False)
    with pytest.raises(
        CheckpointConfigError,
        match=r"ac_preserve_rng_state, ac_early_stop, ac_determinism_check, ac_nested.*"
        r"add_argparse_args\(parser\) before parsing",
    ):
        config.apply_from_args(_net(), args)


def test_a_namespace_with_a_wrong_nested_value_is_an_error():
    args = _parse([])
    args.ac_nested = "yes"
    with pytest.raises(CheckpointConfigError, match="nested must be True or False, got 'yes'"):
        config.from_args(args)


_ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_ANY_KEY = (
    st.sampled_from(("policy", "nested", "use_reentrant", "preserve_rng_state", "early_stop",
                     "determinism_check", "debug"))
    | st.text(max_size=8) | st.integers() | st.none() | st.floats(allow_nan=False)
    | st.tuples(st.integers())
)
_POLICY_TEXT = st.text(alphabet="blockseveryatfirsuagdn:;%,.*0123456789 -", max_size=16)


@given(st.dictionaries(_ANY_KEY, _ANY_VALUE | _POLICY_TEXT, max_size=5))
def test_from_config_raises_only_the_library_errors(section):
    try:
        made = config.from_config(section)
    except CheckpointConfigError:
        return
    assert isinstance(made, config.ActivationCheckpointingConfig)


# --------------------------------------------------------------------------- where the policy comes from


@pytest.fixture
def policy_log(caplog):
    config._LOGGED.clear()  # the once-per-source memory is process-wide
    caplog.set_level(logging.INFO, logger="ckptwrap")
    yield caplog
    config._LOGGED.clear()


def _policy_records(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("ckptwrap") and "policy" in r.getMessage()]


def test_the_config_key_wins_over_the_environment_and_says_so(monkeypatch, policy_log):
    monkeypatch.setenv(config.ENV_VAR, "last:1")
    assert config.from_config({"policy": "every:2"}).policy == "every:2"
    assert config.from_config({"policy": "every:2"}).policy == "every:2"
    assert _policy_records(policy_log) == [
        "activation checkpointing policy 'every:2' from the config key 'policy' "
        "(it wins over the environment variable CKPTWRAP_POLICY='last:1')"
    ]
    assert all(r.levelno == logging.INFO for r in policy_log.records)


def test_the_environment_fills_in_a_missing_config_key_and_says_so(monkeypatch, policy_log):
    monkeypatch.setenv(config.ENV_VAR, "last:2")
    assert config.from_config({"nested": False}).policy == "last:2"
    config.from_config({})
    assert _policy_records(policy_log) == [
        "activation checkpointing policy 'last:2' from the environment variable CKPTWRAP_POLICY "
        "(the config has no 'policy' key)"
    ]


def test_the_flag_wins_over_the_environment_read_when_the_flags_are_read(monkeypatch, policy_log):
    args = _parse([])  # the variable is read by from_args, not when the parser is built
    monkeypatch.setenv(config.ENV_VAR, "every:2")
    assert config.from_args(args).policy == "every:2"
    assert config.from_args(_parse(["--activation-checkpointing", "blocks"])).policy == "blocks"
    assert _policy_records(policy_log) == [
        "activation checkpointing policy 'every:2' from the environment variable CKPTWRAP_POLICY "
        "(no --activation-checkpointing flag)",
        "activation checkpointing policy 'blocks' from the --activation-checkpointing flag "
        "(it wins over the environment variable CKPTWRAP_POLICY='every:2')",
    ]


def test_with_no_source_the_policy_is_none_and_says_so(monkeypatch, policy_log):
    monkeypatch.setenv(config.ENV_VAR, "  ")  # set but blank counts as unset
    assert config.from_config({}).policy == "none"
    assert _policy_records(policy_log) == [
        "activation checkpointing policy 'none' by default (the config has no 'policy' key, "
        "CKPTWRAP_POLICY unset)"
    ]


def test_a_bad_policy_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv(config.ENV_VAR, "blokcs")
    with pytest.raises(CheckpointConfigError, match=r"unknown term 'blokcs'.*environment variable CKPTWRAP_POLICY='blokcs'"):
        config.from_config({})
    with pytest.raises(CheckpointConfigError, match="environment variable CKPTWRAP_POLICY"):
        config.from_args(_parse([]))

"""docs/recipes/trainer.md, run as printed: Hugging Face Trainer with a wrapped model.

Each block must be checkpointed exactly once per step (one forward, one recomputation),
also when TrainingArguments switch on transformers' own gradient checkpointing, and the
run must train as the same recipe un-checkpointed does, bit for bit.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any, Dict, List

import pytest
import torch

import ckptwrap

from ._recipe import (
    assert_same_weights, never_wrapped, one_thread, recipes, run, runs_of, warnings_naming, weights,
)

transformers = pytest.importorskip("transformers")

PAGE = "trainer.md"
STEPS, LAYERS = 3, 2
BLOCK_PART = "GPT2Attention"  # called once per run of a GPT2Block


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipes write to trainer-out/


def _losses(trainer: Any) -> List[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Dict[str, Any]:
    """The first recipe, never wrapped: the reference run."""
    with one_thread(), runs_of(BLOCK_PART) as counts, never_wrapped(), pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("plain"))
        namespace = run(PAGE, "trainer")
    assert counts == {"forward": STEPS * LAYERS}  # nothing recomputed: a true reference
    return {"losses": _losses(namespace["trainer"]), "weights": weights(namespace["model"])}


def test_the_recipe_checkpoints_each_block_and_trains_as_the_plain_run(plain):
    with runs_of(BLOCK_PART) as counts:
        namespace = run(PAGE, "trainer")
    model, trainer = namespace["model"], namespace["trainer"]
    assert trainer.state.global_step == STEPS
    assert counts == {"forward": STEPS * LAYERS, "recomputed": STEPS * LAYERS}
    assert _losses(trainer) == plain["losses"] and len(plain["losses"]) == STEPS
    assert_same_weights(weights(model), plain["weights"])
    fresh = transformers.GPT2LMHeadModel(namespace["config"])
    assert list(model.state_dict()) == list(fresh.state_dict())


def test_with_gradient_checkpointing_each_block_is_checkpointed_once_and_said_once(plain):
    with runs_of(BLOCK_PART) as counts, warnings_naming("gradient_checkpointing") as warned:
        namespace = run(PAGE, "trainer-gradient-checkpointing")
    assert namespace["trainer"].state.global_step == STEPS
    assert counts == {"forward": STEPS * LAYERS, "recomputed": STEPS * LAYERS}
    assert len(warned) == 1, warned
    assert not namespace["model"].is_gradient_checkpointing
    assert _losses(namespace["trainer"]) == plain["losses"]


@pytest.mark.parametrize("policy", ["blocks", "budget:80%"])
def test_with_reentrant_gradient_checkpointing_training_runs(policy):
    # Not a recipe (the page says to leave gradient_checkpointing off), but what a shared
    # config does to it: transformers' re-entrant checkpointing on, switched on after wrapping.
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=LAYERS, n_embd=64, n_head=2, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0
    )
    model = ckptwrap.wrap_model(transformers.GPT2LMHeadModel(config), policy)
    tokens = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir="trainer-out", max_steps=STEPS, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in tokens]
    )
    with runs_of(BLOCK_PART) as counts, warnings_naming("gradient_checkpointing") as warned:
        trainer.train()
    assert trainer.state.global_step == STEPS
    if policy == "blocks":
        assert counts == {"forward": STEPS * LAYERS, "recomputed": STEPS * LAYERS}
    assert len(warned) == 1, warned
    assert not model.is_gradient_checkpointing


def test_the_budget_recipe_plans_at_wrap_model_and_trains_as_the_plain_run(plain, monkeypatch, capsys):
    train = transformers.Trainer.train
    during_training: Dict[str, Any] = {}

    def counted_train(self: Any, *args: Any, **kwargs: Any) -> Any:
        with runs_of(BLOCK_PART) as counts:
            result = train(self, *args, **kwargs)
        during_training.update(counts)
        return result

    monkeypatch.setattr(transformers.Trainer, "train", counted_train)
    namespace = run(PAGE, "trainer-budget")
    assert "budget:80%" in capsys.readouterr().out  # the printed plan
    # No measuring forward in training (example_kwargs had every key Trainer passes), and
    # something recomputed: the plan was made at wrap_model and is applied.
    assert during_training["forward"] == STEPS * LAYERS
    assert 0 < during_training["recomputed"] <= STEPS * LAYERS
    assert_same_weights(weights(namespace["model"]), plain["weights"])


@pytest.mark.parametrize("source", ["flags", "yaml"])
def test_the_arguments_recipe_runs_from_flags_and_from_yaml(source, monkeypatch, tmp_path, plain):
    if source == "flags":
        argv = shlex.split(recipes(PAGE)["trainer-arguments-command"].replace("\\\n", " "))
        assert argv[:2] == ["python", "train.py"]
        argv = argv[1:]
    else:
        (tmp_path / "train.yaml").write_text(recipes(PAGE)["trainer-arguments-yaml"])
        argv = ["train.py", "train.yaml"]
    monkeypatch.setattr(sys, "argv", argv)
    with runs_of(BLOCK_PART) as counts:
        namespace = run(PAGE, "trainer-arguments")
    assert namespace["checkpointing_args"].activation_checkpointing == "every:2"
    assert namespace["model"].ckptwrap_plan.names == ["transformer.h.0"]
    assert counts == {"forward": STEPS * LAYERS, "recomputed": STEPS}
    assert_same_weights(weights(namespace["model"]), plain["weights"])

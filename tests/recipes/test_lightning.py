"""docs/recipes/lightning.md, run as printed: wrap_model in a LightningModule's configure_model.

The blocks must be recomputed once per step, training must match the same recipe
un-checkpointed bit for bit, and the saved .ckpt must load into a wrapped and an
unwrapped module alike.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from ._recipe import assert_same_weights, never_wrapped, one_thread, run, runs_of, weights

pytest.importorskip("transformers")
pytest.importorskip("lightning")
# lightning 2.6 asks torch's pytree in a way torch 2.13 deprecates: its noise, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")

PAGE = "lightning.md"
STEPS, LAYERS = 3, 2


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe saves lit.ckpt


def _checkpoint() -> Dict[str, torch.Tensor]:
    return torch.load("lit.ckpt", weights_only=False)["state_dict"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Dict[str, Any]:
    """The recipe, never wrapped: the reference run."""
    with one_thread(), runs_of("GPT2Attention") as counts, never_wrapped(), pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("plain"))
        namespace = run(PAGE, "lightning")
        checkpoint = _checkpoint()
    assert counts == {"forward": STEPS * LAYERS}
    return {
        "loss": namespace["trainer"].callback_metrics["train_loss"],
        "weights": weights(namespace["module"]),
        "checkpoint": checkpoint,
    }


def test_configure_model_wraps_and_training_matches_the_plain_run(plain):
    with runs_of("GPT2Attention") as counts:
        namespace = run(PAGE, "lightning")
    module, trainer = namespace["module"], namespace["trainer"]
    assert trainer.global_step == STEPS
    assert module.model.ckptwrap_plan.names == ["transformer.h.0", "transformer.h.1"]
    assert counts == {"forward": STEPS * LAYERS, "recomputed": STEPS * LAYERS}
    assert torch.equal(trainer.callback_metrics["train_loss"], plain["loss"])
    assert_same_weights(weights(module), plain["weights"])
    assert_same_weights(_checkpoint(), plain["checkpoint"])


@pytest.mark.parametrize("policy", ["blocks", "none"])
def test_the_checkpoint_loads_into_a_wrapped_and_an_unwrapped_module(plain, policy):
    namespace = run(PAGE, "lightning")
    loaded = namespace["LitGPT"].load_from_checkpoint("lit.ckpt", config=namespace["config"], policy=policy)
    expected = ["transformer.h.0", "transformer.h.1"] if policy == "blocks" else []
    assert loaded.model.ckptwrap_plan.names == expected
    assert_same_weights(weights(loaded), plain["weights"])

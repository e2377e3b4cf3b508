"""docs/recipes/accelerate.md, run as printed: wrap before and after accelerator.prepare.

Each order must recompute every block once per step and train exactly as the same
recipe un-checkpointed; what accelerate saves must keep the model's own keys.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from ._recipe import assert_same_weights, never_wrapped, one_thread, run, runs_of, weights

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

PAGE = "accelerate.md"
STEPS, LAYERS = 3, 2


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe saves accelerate-out/


def _saved(directory: str) -> Dict[str, Any]:
    return safetensors_torch.load_file(f"{directory}/model.safetensors")


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Dict[str, Any]:
    """The first recipe, never wrapped: the reference run."""
    with one_thread(), runs_of("GPT2Attention") as counts, never_wrapped(), pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("plain"))
        namespace = run(PAGE, "accelerate")
        namespace["accelerator"].save_state("state")
        saved = {"pretrained": _saved("accelerate-out"), "state": _saved("state")}
    assert counts == {"forward": STEPS * LAYERS}
    return {"losses": namespace["losses"], "weights": weights(namespace["model"]), "saved": saved}


@pytest.mark.parametrize("recipe", ["accelerate", "accelerate-after-prepare"])
def test_each_order_recomputes_every_block_and_trains_as_the_plain_run(plain, recipe):
    with runs_of("GPT2Attention") as counts:
        namespace = run(PAGE, recipe)
    model = namespace["accelerator"].unwrap_model(namespace["model"])
    assert model.ckptwrap_plan.names == ["transformer.h.0", "transformer.h.1"]
    assert counts == {"forward": STEPS * LAYERS, "recomputed": STEPS * LAYERS}
    assert namespace["losses"] == plain["losses"] and len(plain["losses"]) == STEPS
    assert_same_weights(weights(model), plain["weights"])


def test_save_pretrained_and_save_state_write_the_plain_keys_and_values(plain):
    namespace = run(PAGE, "accelerate")
    namespace["accelerator"].save_state("state")
    assert_same_weights(_saved("accelerate-out"), plain["saved"]["pretrained"])
    assert_same_weights(_saved("state"), plain["saved"]["state"])

"""docs/recipes/diffusers.md, run as printed: LoRA on a diffusers UNet, wrapped.

The blocks diffusers itself would checkpoint must be the plan and be recomputed once per
step (never twice, with diffusers' own checkpointing switched on as well), the LoRA
matrices must train to exactly the un-checkpointed run's weights (frozen weights
untouched), and the LoRA state dict must keep its names.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

import ckptwrap

from ._recipe import assert_same_weights, never_wrapped, one_thread, run, runs_of, warnings_naming, weights

pytest.importorskip("diffusers")
pytest.importorskip("peft")

PAGE = "diffusers.md"
STEPS, TRANSFORMER_BLOCKS = 3, 4  # one FeedForward in each transformer block


@pytest.fixture(scope="module")
def plain() -> Dict[str, Any]:
    """The recipe, never wrapped: the reference run."""
    with one_thread(), runs_of("FeedForward") as counts, never_wrapped():
        namespace = run(PAGE, "unet-lora")
    assert counts == {"forward": STEPS * TRANSFORMER_BLOCKS}
    return {"namespace": namespace, "weights": weights(namespace["unet"])}


def _check_trained_as_plain(namespace: Dict[str, Any], plain: Dict[str, Any]) -> None:
    assert namespace["losses"] == plain["namespace"]["losses"]
    assert_same_weights(weights(namespace["unet"]), plain["weights"])
    assert_same_weights(namespace["lora_weights"], plain["namespace"]["lora_weights"])


def test_the_recipe_checkpoints_what_diffusers_would_and_trains_as_the_plain_run(plain):
    with runs_of("FeedForward") as counts:
        namespace = run(PAGE, "unet-lora")
    names = namespace["unet"].ckptwrap_plan.names
    assert len(names) == 11 and sum(".transformer_blocks." in name for name in names) == TRANSFORMER_BLOCKS
    assert any(name.startswith("down_blocks.") for name in names)
    assert counts == {"forward": STEPS * TRANSFORMER_BLOCKS, "recomputed": STEPS * TRANSFORMER_BLOCKS}
    _check_trained_as_plain(namespace, plain)
    lora = namespace["lora_weights"]
    assert lora and all("lora_" in name for name in lora)


def test_diffusers_own_checkpointing_left_on_is_switched_off_once_named(plain, monkeypatch):
    real = ckptwrap.wrap_model

    def with_diffusers_checkpointing_on(model: Any, *args: Any, **kwargs: Any) -> Any:
        model.enable_gradient_checkpointing()  # a training script's --gradient_checkpointing
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ckptwrap, "wrap_model", with_diffusers_checkpointing_on)
    with runs_of("FeedForward") as counts, warnings_naming("own gradient checkpointing") as said:
        namespace = run(PAGE, "unet-lora")
    assert len(said) == 1 and "diffusers'" in said[0] and "enable_gradient_checkpointing()" in said[0], said
    assert counts == {"forward": STEPS * TRANSFORMER_BLOCKS, "recomputed": STEPS * TRANSFORMER_BLOCKS}
    _check_trained_as_plain(namespace, plain)

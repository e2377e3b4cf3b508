"""docs/recipes/timm.md, run as printed where timm is installed: a timm ViT, wrapped.

The blocks timm itself would checkpoint must be the plan and be recomputed once per step
(never twice, with timm's own checkpointing switched on as well), and the model must
train to exactly the un-checkpointed run's weights.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

import ckptwrap

from ._recipe import assert_same_weights, never_wrapped, one_thread, run, runs_of, warnings_naming, weights

pytest.importorskip("timm")

PAGE = "timm.md"
STEPS, BLOCKS = 3, 3  # one Mlp in each block


@pytest.fixture(scope="module")
def plain() -> Dict[str, Any]:
    """The recipe, never wrapped: the reference run."""
    with one_thread(), runs_of("Mlp") as counts, never_wrapped():
        namespace = run(PAGE, "vit")
    assert counts == {"forward": STEPS * BLOCKS}
    return {"namespace": namespace, "weights": weights(namespace["model"])}


def test_the_recipe_checkpoints_timms_blocks_and_trains_as_the_plain_run(plain):
    with runs_of("Mlp") as counts:
        namespace = run(PAGE, "vit")
    assert namespace["model"].ckptwrap_plan.names == [f"blocks.{i}" for i in range(BLOCKS)]
    assert counts == {"forward": STEPS * BLOCKS, "recomputed": STEPS * BLOCKS}
    assert namespace["losses"] == plain["namespace"]["losses"]
    assert_same_weights(weights(namespace["model"]), plain["weights"])


def test_timms_own_checkpointing_left_on_is_switched_off_once_named(plain, monkeypatch):
    real = ckptwrap.wrap_model

    def with_timm_checkpointing_on(model: Any, *args: Any, **kwargs: Any) -> Any:
        model.set_grad_checkpointing(True)  # timm's train.py --grad-checkpointing
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ckptwrap, "wrap_model", with_timm_checkpointing_on)
    with runs_of("Mlp") as counts, warnings_naming("own gradient checkpointing") as said:
        namespace = run(PAGE, "vit")
    assert len(said) == 1 and "timm's" in said[0] and "set_grad_checkpointing" in said[0], said
    assert counts == {"forward": STEPS * BLOCKS, "recomputed": STEPS * BLOCKS}
    assert namespace["losses"] == plain["namespace"]["losses"]
    assert_same_weights(weights(namespace["model"]), plain["weights"])

"""docs/recipes/trl.md, run as printed: TRL's SFTTrainer with packing on a wrapped model.

The layers must be recomputed once per step (never twice, also with SFTConfig's default
``gradient_checkpointing=True``, which ckptwrap switches off and names), and training must
match the same run un-checkpointed, bit for bit.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from ._recipe import PAGES, assert_same_weights, never_wrapped, one_thread, recipes, run, runs_of, warnings_naming, weights

pytest.importorskip("trl")
pytest.importorskip("datasets")

PAGE = "trl.md"
STEPS, LAYERS = 4, 2  # one LlamaMLP in each layer


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the trainer's output_dir


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Dict[str, Any]:
    """The recipe, never wrapped: the reference run."""
    with one_thread(), runs_of("LlamaMLP") as counts, never_wrapped(), pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("plain"))
        namespace = run(PAGE, "sft-packing")
    assert counts == {"forward": STEPS * LAYERS}
    return {"namespace": namespace, "weights": weights(namespace["model"])}


def _check(namespace: Dict[str, Any], counts: Any, plain: Dict[str, Any]) -> None:
    assert namespace["model"].ckptwrap_plan.names == [f"model.layers.{i}" for i in range(LAYERS)]
    assert counts == {"forward": STEPS * LAYERS, "recomputed": STEPS * LAYERS}
    assert len(namespace["losses"]) == STEPS and namespace["losses"] == plain["namespace"]["losses"]
    assert_same_weights(weights(namespace["model"]), plain["weights"])


def test_the_recipe_trains_packed_rows_as_the_plain_run(plain):
    with runs_of("LlamaMLP") as counts:
        namespace = run(PAGE, "sft-packing")
    _check(namespace, counts, plain)


def test_sftconfigs_default_checkpointing_is_switched_off_once_named(plain):
    source = recipes(PAGE)["sft-packing"]
    assert "gradient_checkpointing=False" in source
    default = source.replace(", gradient_checkpointing=False)", ")")  # SFTConfig's default: on
    namespace: Dict[str, Any] = {"__name__": "__main__"}
    with runs_of("LlamaMLP") as counts, warnings_naming("own gradient checkpointing") as said:
        exec(compile(default, f"{PAGES / PAGE} [sft-packing, SFTConfig's default]", "exec"), namespace)
    assert len(said) == 1 and "SFTConfig(gradient_checkpointing=False)" in said[0], said
    _check(namespace, counts, plain)

"""docs/recipes/peft.md, run as printed: a PEFT LoRA model, wrapped.

The blocks must be recomputed, the LoRA matrices must get exactly the gradients of the
un-checkpointed run (so train to the same adapter, bit for bit), the frozen weights must
stay as they were, and the saved adapter must keep PEFT's names.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

import ckptwrap

from ._recipe import assert_same_weights, never_wrapped, one_thread, run, runs_of, weights

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

PAGE = "peft.md"
STEPS, LAYERS = 3, 2


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe saves lora-adapter/


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Dict[str, Any]:
    """The recipe, never wrapped: the reference run."""
    with one_thread(), runs_of("GPT2Attention") as counts, never_wrapped(), pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("plain"))
        namespace = run(PAGE, "peft")
        adapter = safetensors_torch.load_file("lora-adapter/adapter_model.safetensors")
    assert counts == {"forward": STEPS * LAYERS}
    return {"namespace": namespace, "weights": weights(namespace["model"]), "adapter": adapter}


def _lora(name: str) -> bool:
    return ".lora_" in name


def test_the_recipe_recomputes_the_blocks_and_trains_the_adapter_as_the_plain_run(plain):
    with runs_of("GPT2Attention") as counts:
        namespace = run(PAGE, "peft")
    model = namespace["model"]
    assert model.ckptwrap_plan.names == [f"base_model.model.transformer.h.{i}" for i in range(LAYERS)]
    assert counts == {"forward": STEPS * LAYERS, "recomputed": STEPS * LAYERS}
    assert namespace["losses"] == plain["namespace"]["losses"]
    trained = weights(model)
    assert_same_weights(trained, plain["weights"])
    # the gradients reached the LoRA matrices (B starts at zero) and nothing else moved
    lora_b = [name for name in trained if ".lora_B." in name]
    assert len(lora_b) == LAYERS and all(trained[name].abs().sum() > 0 for name in lora_b)
    torch.manual_seed(0)
    initial = transformers.GPT2LMHeadModel(namespace["config"]).state_dict()
    frozen = {name.replace("base_model.model.", "").replace(".base_layer", ""): tensor
              for name, tensor in trained.items() if not _lora(name)}
    assert_same_weights(frozen, dict(initial))


def test_the_saved_adapter_keeps_peft_names_and_equals_the_plain_one(plain):
    run(PAGE, "peft")
    adapter = safetensors_torch.load_file("lora-adapter/adapter_model.safetensors")
    assert_same_weights(adapter, plain["adapter"])
    unwrapped = peft.get_peft_model(transformers.GPT2LMHeadModel(plain["namespace"]["config"]), plain["namespace"]["lora"])
    assert sorted(adapter) == sorted(peft.get_peft_model_state_dict(unwrapped))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_gradients_flow_through_either_engine_without_input_require_grads(plain, use_reentrant):
    # Embeddings frozen, so no block input requires grad: torch's re-entrant checkpoint
    # would drop the LoRA gradients here; ckptwrap's must not.
    config, lora, tokens = (plain["namespace"][key] for key in ("config", "lora", "tokens"))

    def lora_grads(wrap: bool) -> Dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora).train()
        if wrap:
            ckptwrap.wrap_model(model, "blocks", use_reentrant=use_reentrant)
        torch.manual_seed(1)
        model(input_ids=tokens[:4], labels=tokens[:4]).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    expected, got = lora_grads(wrap=False), lora_grads(wrap=True)
    assert list(got) == list(expected) and all(_lora(name) for name in got)
    missing = [name for name, grad in got.items() if grad is None]
    assert not missing, f"LoRA gradients lost: {missing}"
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_merge_and_unload_returns_a_model_that_is_still_checkpointed_and_says_how(plain):
    namespace = run(PAGE, "peft")
    merged = namespace["model"].merge_and_unload()
    assert isinstance(merged, transformers.GPT2LMHeadModel)
    assert merged.ckptwrap_plan.names == [f"transformer.h.{i}" for i in range(LAYERS)]
    tokens = namespace["tokens"][:4]
    merged.requires_grad_(True)  # PEFT left the base weights frozen: train them all now
    with runs_of("GPT2Attention") as counts:
        merged(input_ids=tokens, labels=tokens).loss.backward()
    assert counts == {"forward": LAYERS, "recomputed": LAYERS}
    ckptwrap.unwrap_model(merged)
    assert "ckptwrap_plan" not in merged.__dict__
    with runs_of("GPT2Attention") as counts:
        merged(input_ids=tokens, labels=tokens).loss.backward()
    assert counts == {"forward": LAYERS}

"""The profiler on Hugging Face decoder models with their default KV cache (built tiny from
config objects, no download).

Measuring a layer runs its forward besides the model's own call of it; with the cache
passed in, that would write the layer's keys and values a second time. A layer is measured
as a checkpointed call of it runs, without the cache, so the figures are those of a model
run with ``use_cache=False``, where no cache exists at all.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from torch import nn

from ckptwrap.wrap import profile_modules

VOCAB = 100


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _gpt2(tf: Any) -> nn.Module:
    config = tf.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )
    return tf.GPT2LMHeadModel(config)


def _llama(tf: Any) -> nn.Module:
    config = tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return tf.LlamaForCausalLM(config)


def _t5(tf: Any) -> nn.Module:
    config = tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return tf.T5ForConditionalGeneration(config)


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "t5": _t5}


def _batch() -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # padding, so a cache written twice no longer fits the mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _figures(profile: Any, name: str) -> tuple:
    cost = profile[name]
    return (cost.calls, cost.kept_bytes, cost.input_bytes, cost.output_bytes, cost.flops)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_layers_with_the_default_cache_are_measured_as_without_it(transformers, name):
    torch.manual_seed(0)
    model = BUILDERS[name](transformers).train()
    assert model.config.use_cache
    kinds = ("Block", "DecoderLayer")
    layers = [n for n, m in model.named_modules() if type(m).__name__.endswith(kinds)]
    assert layers
    with_cache = profile_modules(model, layers, (), _batch(), repeats=0)
    without = profile_modules(model, layers, (), {**_batch(), "use_cache": False}, repeats=0)
    for layer in layers:
        assert with_cache[layer].calls == 1
        assert _figures(with_cache, layer) == _figures(without, layer), layer


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_cache_passed_in_is_measured_on_copies_and_left_as_it_was(transformers, name):
    torch.manual_seed(0)
    model = BUILDERS[name](transformers).train()
    kinds = ("Block", "DecoderLayer")
    layers = [n for n, m in model.named_modules() if type(m).__name__.endswith(kinds)]
    cache = transformers.DynamicCache()
    given = {**_batch(), "past_key_values": cache, "use_cache": True}
    # Before, both passes wrote into the one cache, and the second no longer fit the mask.
    with_cache = profile_modules(model, layers, (), given, repeats=1)
    assert cache.get_seq_length() == 0, "profiling wrote into the caller's cache"
    without = profile_modules(model, layers, (), {**_batch(), "use_cache": False}, repeats=0)
    for layer in layers:
        assert _figures(with_cache, layer) == _figures(without, layer), layer
    # The plain model's own forward on that cache still runs, as if nothing had been measured.
    model(**given).loss.backward()
    assert cache.get_seq_length() == _batch()["input_ids"].shape[1]

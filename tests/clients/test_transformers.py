"""A real client: Hugging Face transformers models, built tiny from config objects (no download).

``wrap_model(model, "blocks")`` must select exactly each model's layer list, and training
must give the loss and gradients of the un-checkpointed model, with dropout on.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import checkpointed, plan, unwrap_model, wrap_model

VOCAB = 100
SEQ = 12


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _gpt2(tf: Any) -> nn.Module:
    config = tf.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )
    return tf.GPT2LMHeadModel(config)


def _llama(tf: Any) -> nn.Module:
    config = tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        attention_dropout=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return tf.LlamaForCausalLM(config)


def _bert(tf: Any) -> nn.Module:
    config = tf.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, pad_token_id=0,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    return tf.BertForMaskedLM(config)


# name -> (builder, the model's own list of layers)
MODELS: Dict[str, Tuple[Callable[[Any], nn.Module], Callable[[nn.Module], nn.ModuleList]]] = {
    "gpt2": (_gpt2, lambda model: model.transformer.h),
    "llama": (_llama, lambda model: model.model.layers),
    "bert": (_bert, lambda model: model.bert.encoder.layer),
}
ALL_MODELS = pytest.mark.parametrize("name", list(MODELS))
WITH_KV_CACHE = pytest.mark.parametrize("name", ["gpt2", "llama"])
VARIANTS = pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])


def _build(transformers: Any, name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name][0](transformers)
    return model.train()


def _layer_names(model: nn.Module, name: str) -> List[str]:
    """Qualified names of the model's layers, found through the model's own attributes."""
    qualified = {id(module): n for n, module in model.named_modules()}
    return [qualified[id(layer)] for layer in MODELS[name][1](model)]


def _batch() -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # some padding, so the attention mask matters
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _step(model: nn.Module, seed: int = 1, *, kv_cache: bool = False, padded: bool = True) -> Tuple[torch.Tensor, Any]:
    """One forward and backward from ``seed``. Decoder models run with ``use_cache=False``
    (as under transformers' own gradient checkpointing) unless ``kv_cache`` is True, in
    which case the config's default (True) applies."""
    model.zero_grad(set_to_none=True)
    batch = _batch()
    if not padded:
        del batch["attention_mask"]
    if not kv_cache and "use_cache" in model.config:
        batch["use_cache"] = False
    torch.manual_seed(seed)
    output = model(**batch)
    output.loss.backward()
    return output.loss.detach(), output


def _grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _assert_same(actual: Dict[str, Any], expected: Dict[str, Any], what: str) -> None:
    assert list(actual) == list(expected), f"{what}: keys differ"
    differ = [
        name
        for name, e in expected.items()
        if not ((e is None and actual[name] is None) or (e is not None and actual[name] is not None and torch.equal(actual[name], e)))
    ]
    assert not differ, f"{what}: {len(differ)} of {len(expected)} differ, e.g. {differ[:4]}"


def _marked(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


# --------------------------------------------------------------------------- selection


@ALL_MODELS
def test_blocks_selects_exactly_the_layers(transformers, name):
    model = _build(transformers, name)
    expected = _layer_names(model, name)
    assert len(expected) == model.config.num_hidden_layers
    keys = list(model.state_dict())
    parameters = [n for n, _ in model.named_parameters()]
    types = [(n, type(m)) for n, m in model.named_modules()]

    assert plan(model, "blocks").names == expected
    wrap_model(model, "blocks")
    assert _marked(model) == expected
    assert model.ckptwrap_plan.names == expected
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == parameters
    assert [(n, type(m)) for n, m in model.named_modules()] == types

    unwrap_model(model)
    assert _marked(model) == []


@ALL_MODELS
def test_pickers_pick_among_the_layers(transformers, name):
    model = _build(transformers, name)
    layers = _layer_names(model, name)
    assert plan(model, "every:2").names == layers[::2]
    assert plan(model, "last:1").names == layers[-1:]
    layer_class = type(MODELS[name][1](model)[0]).__name__
    assert plan(model, f"type:{layer_class};first:2").names == layers[:2]


# --------------------------------------------------------------------------- numerics


@VARIANTS
@ALL_MODELS
def test_loss_and_gradients_equal_the_unwrapped_model(transformers, name, use_reentrant):
    plain = _build(transformers, name)
    wrapped = wrap_model(copy.deepcopy(plain), "blocks", use_reentrant=use_reentrant)
    for seed in (1, 2):
        loss_plain, _ = _step(plain, seed)
        loss_wrapped, _ = _step(wrapped, seed)
        assert torch.equal(loss_wrapped, loss_plain)
        _assert_same(_grads(wrapped), _grads(plain), f"{name} gradients")


@ALL_MODELS
def test_the_layers_are_recomputed(transformers, name):
    model = wrap_model(_build(transformers, name), "blocks")
    first_layer = _layer_names(model, name)[0]
    # the first module with weights and no children inside the first layer
    first_leaf = next(
        m for n, m in model.named_modules()
        if n.startswith(first_layer + ".") and next(m.children(), None) is None and next(m.parameters(), None) is not None
    )
    seen: List[bool] = []
    handle = first_leaf.register_forward_hook(lambda *_: seen.append(ckptwrap.is_recomputing()))
    try:
        _step(model)
    finally:
        handle.remove()
    assert seen == [False, True]


@ALL_MODELS
def test_gradients_equal_transformers_own_gradient_checkpointing(transformers, name):
    """Against torch.utils.checkpoint as the library itself applies it."""
    reference = _build(transformers, name)
    wrapped = wrap_model(copy.deepcopy(reference), "blocks")
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_reference, _ = _step(reference)
    loss_wrapped, _ = _step(wrapped)
    assert torch.equal(loss_wrapped, loss_reference)
    _assert_same(_grads(wrapped), _grads(reference), f"{name} gradients")


@VARIANTS
@WITH_KV_CACHE
def test_training_with_the_default_kv_cache(transformers, name, use_reentrant):
    """Decoder models build a KV cache in training too (``config.use_cache`` is True by
    default) and hand it to every layer, which appends its keys and values. A
    recomputation must not append them again, nor read what the forward appended: with a
    padding mask the attention shapes no longer fit, and the re-entrant variant would
    take the forward's keys (computed without a graph) and lose their gradients.
    transformers' own gradient checkpointing passes no cache to checkpointed layers."""
    plain = _build(transformers, name)
    assert plain.config.use_cache
    wrapped = wrap_model(copy.deepcopy(plain), "blocks", use_reentrant=use_reentrant)
    loss_plain, _ = _step(plain, kv_cache=True)
    loss_wrapped, _ = _step(wrapped, kv_cache=True)
    assert torch.equal(loss_wrapped, loss_plain)
    _assert_same(_grads(wrapped), _grads(plain), f"{name} gradients with the KV cache on")


@VARIANTS
@WITH_KV_CACHE
def test_the_recomputation_does_not_append_to_the_kv_cache(transformers, name, use_reentrant):
    plain = _build(transformers, name)
    wrapped = wrap_model(copy.deepcopy(plain), "blocks", use_reentrant=use_reentrant)
    # Without a padding mask the shapes still fit, so nothing fails loudly.
    _, out_plain = _step(plain, kv_cache=True, padded=False)
    _, out_wrapped = _step(wrapped, kv_cache=True, padded=False)
    assert out_plain.past_key_values.get_seq_length() == SEQ
    # Like transformers' own gradient checkpointing, checkpointed layers do not write the
    # cache in training; what must never happen is a second write by the recomputation.
    assert out_wrapped.past_key_values.get_seq_length() == 0, (
        "a checkpointed layer wrote into the KV cache (the recomputation would write again)"
    )


# --------------------------------------------------------------------------- save / load


@ALL_MODELS
def test_save_pretrained_and_from_pretrained_round_trip(transformers, name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    wrapped = wrap_model(_build(transformers, name), "blocks")
    _step(wrapped)  # the saved model has been used for training
    wrapped.save_pretrained(tmp_path)

    reloaded = type(wrapped).from_pretrained(tmp_path)
    assert _marked(reloaded) == []
    _assert_same(dict(reloaded.state_dict()), dict(wrapped.state_dict()), f"{name} reloaded state dict")

    wrap_model(reloaded.train(), "blocks")
    assert _marked(reloaded) == _marked(wrapped)
    loss_wrapped, _ = _step(wrapped, seed=5)
    loss_reloaded, _ = _step(reloaded, seed=5)
    assert torch.equal(loss_reloaded, loss_wrapped)
    _assert_same(_grads(reloaded), _grads(wrapped), f"{name} gradients after reloading")


# --------------------------------------------------------------------------- hand-written


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (t.reshape(batch, seq, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        attn = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(mask, float("-inf"))
        mixed = (self.drop(attn.softmax(-1)) @ v).transpose(1, 2).reshape(batch, seq, width)
        x = x + self.drop(self.proj(mixed))
        return x + self.drop(self.mlp(self.norm2(x)))


class _CheckpointedBlock(_Block):
    forward = checkpointed(_Block.forward)


class _HandWritten(nn.Module):
    def __init__(self, block: type, layers: int = 3, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(block(width, 2) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def test_a_hand_written_transformer_with_checkpointed_blocks_equals_the_plain_one():
    torch.manual_seed(0)
    plain = _HandWritten(_Block)
    decorated = _HandWritten(_CheckpointedBlock)
    decorated.load_state_dict(plain.state_dict())
    ids = _batch()["input_ids"]

    results = []
    for model in (plain, decorated):
        seen: List[bool] = []
        handle = model.blocks[0].qkv.register_forward_hook(lambda *_: seen.append(ckptwrap.is_recomputing()))
        torch.manual_seed(1)
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        handle.remove()
        results.append((loss.detach(), _grads(model), seen))

    (loss_plain, grads_plain, seen_plain), (loss_decorated, grads_decorated, seen_decorated) = results
    assert seen_plain == [False] and seen_decorated == [False, True]
    assert torch.equal(loss_decorated, loss_plain)
    _assert_same(grads_decorated, grads_plain, "hand-written transformer gradients")
    # wrap_model sees the decorated blocks as already checkpointed
    assert plan(decorated, "blocks").names == []
    assert all("already checkpointed by @checkpointed" in reason for _, reason in plan(decorated, "blocks").dropped)

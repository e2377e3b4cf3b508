"""``blocks`` against transformers' own gradient checkpointing, over many architectures.

Each Hugging Face model is built tiny from a config object (no download). On every one,
``wrap_model(model, "blocks")`` must checkpoint every layer that
``model.gradient_checkpointing_enable()`` checkpoints (the inner ones where they nest),
reach a training-step peak no higher than it, and give the gradients of the
un-checkpointed model.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch import nn

from ckptwrap import plan, wrap_model
from ckptwrap.measure import measure_peak

transformers = pytest.importorskip("transformers")
GradientCheckpointingLayer = pytest.importorskip("transformers.modeling_layers").GradientCheckpointingLayer

VOCAB = 64
SEQ = 32
BATCH = 4
IMAGE = 32
POSITIONS = 2 * SEQ
WIDTH = 32
DROPOUT = 0.1

# The CPU peak counts tensor storages as operators create and free them, so it is nearly
# deterministic; the slack absorbs what is not: storages whose release waits on Python's
# garbage collector, and a few small bookkeeping tensors either engine may keep.
PEAK_SLACK = 1.02


def _tokens() -> Dict[str, int]:
    # Special tokens inside the tiny vocabulary: the defaults point past its end.
    return {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _seq2seq(config_class: type, model_class: type, **extra: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = config_class(
            vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * WIDTH,
            decoder_ffn_dim=2 * WIDTH, max_position_embeddings=POSITIONS, dropout=DROPOUT,
            attention_dropout=DROPOUT, decoder_start_token_id=1, **_tokens(), **extra,
        )
        return model_class(config)

    return build


def _decoder(config_class: type, model_class: type) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = config_class(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=POSITIONS, attention_dropout=DROPOUT, **_tokens(),
        )
        return model_class(config)

    return build


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=2, n_positions=POSITIONS,
        resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT, **_tokens(),
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=POSITIONS, pad_token_id=0,
        hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT,
    )
    return transformers.BertForMaskedLM(config)


def _t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=2 * WIDTH, num_layers=2, num_heads=2,
        dropout_rate=DROPOUT, decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
    )
    return transformers.T5ForConditionalGeneration(config)


def _whisper() -> nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * WIDTH,
        decoder_ffn_dim=2 * WIDTH, num_mel_bins=8, max_source_positions=SEQ,
        max_target_positions=POSITIONS, dropout=DROPOUT, attention_dropout=DROPOUT,
        decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[], **_tokens(),
    )
    return transformers.WhisperForConditionalGeneration(config)


def _vit() -> nn.Module:
    config = transformers.ViTConfig(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE, patch_size=4, num_labels=3, hidden_dropout_prob=DROPOUT,
        attention_probs_dropout_prob=DROPOUT,
    )
    return transformers.ViTForImageClassification(config)


def _swin() -> nn.Module:
    # Swin's stages (SwinStage) hold its layers (SwinLayer); both are checkpointing layers.
    config = transformers.SwinConfig(
        image_size=IMAGE, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
        window_size=2, num_labels=3, hidden_dropout_prob=DROPOUT,
        attention_probs_dropout_prob=DROPOUT, drop_path_rate=DROPOUT,
    )
    return transformers.SwinForImageClassification(config)


def _clip() -> nn.Module:
    tower = dict(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=2, attention_dropout=DROPOUT,
    )
    config = transformers.CLIPConfig(
        text_config=dict(tower, vocab_size=VOCAB, max_position_embeddings=SEQ, **_tokens()),
        vision_config=dict(tower, image_size=IMAGE, patch_size=4),
        projection_dim=16,
    )
    return transformers.CLIPModel(config)


def _text(labels: bool = True) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # some padding, so the attention mask matters
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels:
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    return batch


def _image() -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator)
    return {"pixel_values": pixels, "labels": torch.arange(BATCH) % 3}


def _speech() -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # Whisper's two convolutions halve the frames once: 2 * max_source_positions in.
    features = torch.randn(BATCH, 8, 2 * SEQ, generator=generator)
    labels = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    return {"input_features": features, "labels": labels}


def _text_and_image() -> Dict[str, Any]:
    return {**_text(labels=False), "pixel_values": _image()["pixel_values"], "return_loss": True}


# name -> (builder, inputs of one training step)
CORPUS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[], Dict[str, Any]]]] = {
    "gpt2": (_gpt2, _text),
    "llama": (_decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM), _text),
    "qwen2": (_decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM), _text),
    "mistral": (_decoder(transformers.MistralConfig, transformers.MistralForCausalLM), _text),
    "bert": (_bert, _text),
    "t5": (_t5, _text),
    "bart": (_seq2seq(transformers.BartConfig, transformers.BartForConditionalGeneration), _text),
    "marian": (_seq2seq(transformers.MarianConfig, transformers.MarianMTModel), _text),
    "pegasus": (_seq2seq(transformers.PegasusConfig, transformers.PegasusForConditionalGeneration), _text),
    "whisper": (_whisper, _speech),
    "vit": (_vit, _image),
    "swin": (_swin, _image),
    "clip": (_clip, _text_and_image),
}
ALL_MODELS = pytest.mark.parametrize("name", list(CORPUS))


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CORPUS[name][0]().train()


def _natively_checkpointed(model: nn.Module) -> List[str]:
    """What ``gradient_checkpointing_enable()`` made transformers checkpoint: the layers
    whose flag it turned on, in model order. Where they nest (Swin's stages hold its
    layers), the inner ones are checkpointed again inside the outer recomputation."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing
    ]


def _inside(name: str, others: List[str]) -> bool:
    return any(name.startswith(other + ".") for other in others)


def _step(model: nn.Module, name: str) -> Tuple[int, Dict[str, torch.Tensor]]:
    """One forward and backward with dropout seeded; returns its CPU peak and the gradients."""
    model.zero_grad(set_to_none=True)
    batch = CORPUS[name][1]()
    if getattr(model.config, "use_cache", False):
        # As under transformers' own gradient checkpointing, which turns the cache off.
        batch["use_cache"] = False
    torch.manual_seed(1)
    with measure_peak("cpu") as peak:
        model(**batch).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return peak.peak_bytes, grads


@ALL_MODELS
def test_blocks_select_what_transformers_checkpoints(name):
    model = _build(name)
    native = copy.deepcopy(model)
    native.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _natively_checkpointed(native)
    assert checkpointed, f"{name}: transformers checkpoints nothing; the corpus entry is wrong"
    selected = plan(model, "blocks").names

    # The innermost layers transformers checkpoints are the regions whose activations it
    # never holds at once: blocks must select every one of them...
    innermost = [n for n in checkpointed if not any(o.startswith(n + ".") for o in checkpointed)]
    missing = [n for n in innermost if n not in selected]
    assert not missing, f"{name}: blocks left out {missing}; selected {selected}"
    # ...and nothing inside them, which would be a second, nested checkpoint.
    nested = [n for n in selected if _inside(n, innermost)]
    assert not nested, f"{name}: blocks selected {nested} inside layers transformers checkpoints"


@ALL_MODELS
def test_peak_no_worse_than_transformers_and_gradients_equal_plain(name):
    plain = _build(name)
    native = copy.deepcopy(plain)
    native.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapped = wrap_model(copy.deepcopy(plain), "blocks")

    peak_plain, grads_plain = _step(plain, name)
    peak_native, _ = _step(native, name)
    peak_wrapped, grads_wrapped = _step(wrapped, name)

    assert peak_wrapped <= PEAK_SLACK * peak_native, (
        f"{name}: peak {peak_wrapped} B with blocks, {peak_native} B with transformers' own "
        f"gradient checkpointing ({peak_plain} B without checkpointing)"
    )
    assert list(grads_wrapped) == list(grads_plain), f"{name}: gradients reach other parameters"
    differ = [n for n, g in grads_plain.items() if not torch.equal(grads_wrapped[n], g)]
    assert not differ, f"{name}: {len(differ)} of {len(grads_plain)} gradients differ, e.g. {differ[:3]}"

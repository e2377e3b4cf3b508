"""A catalogue of tiny Hugging Face architectures, built from configs with random weights
(nothing is downloaded), for benchmarks that train each one for a few dozen steps on the
CPU: causal and masked language models, encoder-decoders, speech, vision, hierarchical
vision, multimodal, state-space and hybrid models, each with a seeded batch maker.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["Architecture", "ARCHITECTURES", "available"]

VOCAB = 96
PAD, BOS, EOS, MASK = 0, 1, 2, 3
"""Special tokens; ordinary tokens are drawn from ``MASK + 1 .. VOCAB - 1``."""
TEXT = (8, 128)
AUDIO = (1600, 6400)
"""Raw samples: the feature encoders below stride by 20, so about 80 to 320 frames."""
SIDE = 32
CLASSES = 10
MELS, MEL_FRAMES = 16, 64
"""Whisper's encoder takes exactly ``2 * max_source_positions`` frames."""
CTC_VOCAB = 32

# Only dropouts inside the network; the heads' (classifier, summary, pooler) stay as built.
_DROPOUTS = (
    "dropout", "dropout_rate", "attention_dropout", "activation_dropout", "hidden_dropout",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop",
    "attn_pdrop", "resid_dropout", "embed_dropout", "residual_dropout", "embedding_dropout",
    "mlp_dropout", "feat_proj_dropout", "final_dropout",
)
# LayerDrop skips whole layers at random, so every step would run a different graph.
_LAYERDROPS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One tiny model, how to build it and how to make its training inputs."""

    name: str
    family: str
    """causal, encoder, encoder-decoder, speech, vision, hierarchical vision, multimodal,
    state-space or hybrid (recurrent or convolutional layers beside attention)."""
    build: Callable[[], nn.Module]
    """A fresh tiny model in train mode, the same weights every call (seed inside with
    torch.manual_seed(0))."""
    batch: Callable[[int, int, int, bool], Dict[str, Any]]
    """batch(rows, length, seed, padded) -> the forward's keyword inputs for one training
    step, labels included so that the output has a scalar `.loss` (use a private
    torch.Generator seeded from (rows, length, seed), never the global RNG)."""
    lengths: Tuple[int, int]
    """The shortest and longest `length` the model takes (tokens; audio samples or frames;
    equal when the input size is fixed, e.g. images)."""
    generates: bool = False
    """Whether model.generate(input_ids=..., attention_mask=..., max_new_tokens=4) works
    (causal LMs and encoder-decoders that take input_ids)."""
    candidates: str = ""
    """The set term a budget chooses among where ``blocks`` (the default) finds nothing:
    ALBERT's one shared layer, which transformers' own gradient checkpointing does not
    take either."""


def _tune(config: Any) -> None:
    """Dropout 0.1 wherever the config (or a sub-config) has one; LayerDrop off."""
    from transformers import PreTrainedConfig

    for name in _DROPOUTS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(config, name, 0.1)
    for name in _LAYERDROPS:
        if hasattr(config, name):
            setattr(config, name, 0.0)
    for value in list(vars(config).values()):
        if isinstance(value, PreTrainedConfig):
            _tune(value)


def _hf(model: str, **config: Any) -> Callable[[], nn.Module]:
    """A builder of the transformers class ``model`` from its own config class."""

    def build() -> nn.Module:
        import transformers

        cls = getattr(transformers, model)
        cfg = cls.config_class(**config)
        _tune(cfg)
        torch.manual_seed(0)
        return cls(cfg).train()

    build.model, build.config = model, config  # type: ignore[attr-defined]
    return build


_WIDTHS = frozenset((
    "hidden_size", "intermediate_size", "n_embd", "d_model", "d_ff", "d_kv", "ffn_dim", "dim",
    "hidden_dim", "embedding_size", "encoder_ffn_dim", "decoder_ffn_dim", "head_dim",
    "rotary_dim", "word_embed_proj_dim", "attention_hidden_size", "projection_dim",
    "embed_dim", "hidden_sizes", "conv_dim", "mrope_section",
))
"""Config fields that are widths (of features, heads or channels), never counts or lengths."""


def _widened(config: Any, factor: int) -> Any:
    if isinstance(config, dict):
        return {
            key: (_scaled(value, factor) if key in _WIDTHS else _widened(value, factor))
            for key, value in config.items()
        }
    return config


def _scaled(value: Any, factor: int) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value * factor
    if isinstance(value, (list, tuple)):
        return type(value)(_scaled(v, factor) for v in value)
    return value


def widened(arch: "Architecture", factor: int) -> Optional["Architecture"]:
    """``arch`` with every width of its config (hidden sizes, feed-forward, head and
    channel widths) ``factor`` times as large, layers, heads and lengths as they are;
    None if it is not built from a transformers config."""
    config = getattr(arch.build, "config", None)
    if factor == 1:
        return arch
    if config is None:
        return None
    return dataclasses.replace(arch, build=_hf(arch.build.model, **_widened(config, factor)))  # type: ignore[attr-defined]


def _generator(rows: int, length: int, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((rows * 1_000_003 + length) * 1_000_003 + seed)


def _valid(g: torch.Generator, rows: int, length: int, padded: bool) -> torch.Tensor:
    """A (rows, length) 0/1 mask of real positions: right padding as a collator makes it,
    each row between half and all of ``length`` long, one row always full."""
    if not padded:
        return torch.ones(rows, length, dtype=torch.long)
    true = torch.randint((length + 1) // 2, length + 1, (rows,), generator=g)
    true[torch.randint(rows, (1,), generator=g)] = length
    return (torch.arange(length) < true[:, None]).long()


def _tokens(
    g: torch.Generator, rows: int, length: int, padded: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ordinary tokens with ``PAD`` after each row's end, and the attention mask."""
    mask = _valid(g, rows, length, padded)
    ids = torch.randint(MASK + 1, VOCAB, (rows, length), generator=g)
    return ids.masked_fill(mask == 0, PAD), mask


def causal_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    """Token ids that are their own labels (the model shifts them), padding ignored."""
    ids, mask = _tokens(_generator(rows, length, seed), rows, length, padded)
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def masked_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    """About 15% of the real tokens replaced by ``MASK`` and predicted; the first always is,
    so a short batch never has an empty loss."""
    g = _generator(rows, length, seed)
    ids, mask = _tokens(g, rows, length, padded)
    chosen = (torch.rand(rows, length, generator=g) < 0.15) & (mask == 1)
    chosen[:, 0] = True
    return dict(
        input_ids=ids.masked_fill(chosen, MASK), attention_mask=mask,
        labels=ids.masked_fill(~chosen, -100),
    )


def seq2seq_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    """A source and a target of ``length`` tokens each, padded independently."""
    g = _generator(rows, length, seed)
    ids, mask = _tokens(g, rows, length, padded)
    target, target_mask = _tokens(g, rows, length, padded)
    labels = target.masked_fill(target_mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def whisper_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    """A fixed log-mel window and a transcript of ``length`` tokens."""
    g = _generator(rows, length, seed)
    features = torch.randn(rows, MELS, MEL_FRAMES, generator=g)
    target, target_mask = _tokens(g, rows, length, padded)
    return dict(input_features=features, labels=target.masked_fill(target_mask == 0, -100))


def ctc_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    """Raw audio of ``length`` samples (zeros after each row's end) and a character
    transcript about one label per 400 samples, short enough for CTC to align."""
    g = _generator(rows, length, seed)
    mask = _valid(g, rows, length, padded)
    audio = torch.randn(rows, length, generator=g) * mask
    chars = max(2, length // 400)
    label_mask = _valid(g, rows, chars, padded)
    labels = torch.randint(1, CTC_VOCAB, (rows, chars), generator=g)  # 0 is CTC's blank
    labels = labels.masked_fill(label_mask == 0, -100)
    return dict(input_values=audio, attention_mask=mask, labels=labels)


def image_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    """Images of side ``SIDE`` with class labels; ``length`` and ``padded`` play no part."""
    g = _generator(rows, SIDE, seed)
    return dict(
        pixel_values=torch.randn(rows, 3, SIDE, SIDE, generator=g),
        labels=torch.randint(0, CLASSES, (rows,), generator=g),
    )


def contrastive_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    """Captions and images for an image-text contrastive loss. Each caption ends with
    ``EOS``, where CLIP pools its text."""
    g = _generator(rows, length, seed)
    ids, mask = _tokens(g, rows, length, padded)
    ids[torch.arange(rows), mask.sum(1) - 1] = EOS
    images = torch.randn(rows, 3, SIDE, SIDE, generator=g)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=images, return_loss=True)


VISION_SIDES = (4, 16)
"""Image sides in patches for dynamic resolution (patches of 4 pixels: 16 to 64 pixels)."""
_IMAGE_TOKEN, _VIDEO_TOKEN, _VISION_START, _VISION_END = VOCAB - 4, VOCAB - 3, VOCAB - 2, VOCAB - 1
_PATCH, _TEMPORAL, _MERGE = 4, 2, 2


def dynamic_resolution_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    """One image per row at a resolution of its own, as Qwen2-VL's processor feeds them:
    each image ``length`` patches high (even) and up to as wide, its patches flattened
    into one axis of ``pixel_values`` (so their number changes with every batch), its
    grid in ``image_grid_thw``, and one token per 2 x 2 merged patches in the row before
    a caption of 12 tokens (4 to 12 where ``padded``). Captions are the labels."""
    g = _generator(rows, length, seed)
    high = max(2, length - length % 2)
    rows_ids, grids, patches = [], [], []
    for _ in range(rows):
        wide = 2 * int(torch.randint(1, high // 2 + 1, (1,), generator=g))
        caption = int(torch.randint(4, 13, (1,), generator=g)) if padded else 12
        image = high * wide // (_MERGE * _MERGE)
        text = torch.randint(MASK + 1, _IMAGE_TOKEN, (caption,), generator=g)
        rows_ids.append(torch.cat([
            torch.tensor([_VISION_START]), torch.full((image,), _IMAGE_TOKEN), torch.tensor([_VISION_END]), text,
        ]))
        grids.append([1, high, wide])
        patches.append(torch.randn(high * wide, 3 * _TEMPORAL * _PATCH * _PATCH, generator=g))
    longest = max(len(row) for row in rows_ids)
    ids = torch.full((rows, longest), PAD, dtype=torch.long)
    mask = torch.zeros(rows, longest, dtype=torch.long)
    for index, row in enumerate(rows_ids):
        ids[index, :len(row)], mask[index, :len(row)] = row, 1
    labels = ids.masked_fill((mask == 0) | (ids >= _IMAGE_TOKEN), -100)
    return dict(
        input_ids=ids, attention_mask=mask, labels=labels, pixel_values=torch.cat(patches),
        image_grid_thw=torch.tensor(grids), mm_token_type_ids=(ids == _IMAGE_TOKEN).int(),
    )


_SPECIAL = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
_SEQ2SEQ = dict(_SPECIAL, decoder_start_token_id=BOS)
# The Llama family's shared config names; head_dim is explicit as Gemma's defaults to 256.
_DECODER = dict(
    _SPECIAL, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=TEXT[1],
)
_BERT = dict(
    _SPECIAL, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    max_position_embeddings=TEXT[1] + 2,  # RoBERTa-style positions start after the pad id
)
_BART_LAYERS = dict(
    _SEQ2SEQ, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
)
_BART = dict(_BART_LAYERS, max_position_embeddings=TEXT[1])
_GPT2 = dict(_SPECIAL, n_embd=32, n_layer=2, n_head=2, n_positions=TEXT[1])
# Two strided convolutions (5 x 4) take 16 kHz audio to 800 frames a second.
_AUDIO_ENCODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    conv_dim=(32, 32), conv_kernel=(10, 4), conv_stride=(5, 4), num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4, vocab_size=CTC_VOCAB, pad_token_id=PAD,
    ctc_zero_infinity=True, mask_time_prob=0.0,  # SpecAugment draws from numpy's global RNG
)
_VIT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    image_size=SIDE, patch_size=8, num_labels=CLASSES,
)
_SWIN = dict(
    image_size=SIDE, patch_size=2, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4,
    num_labels=CLASSES,
)
_CONVNEXT = dict(
    num_stages=2, hidden_sizes=[32, 64], depths=[2, 2], image_size=SIDE, num_labels=CLASSES
)
_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
_TEXT_TOWER = dict(_TOWER, **_SPECIAL, max_position_embeddings=TEXT[1])
_VISION_TOWER = dict(_TOWER, image_size=SIDE, patch_size=8)
_MAMBA = dict(
    _SPECIAL, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
)
# Hybrids default to use_cache=True, so their model builds its cache in training too (a
# hybrid one: keys and values for the attention layers, conv and recurrent states for the
# others) and hands it to every layer. Four layers, recurrent ones first, and head widths
# that give the scans their 64 channels; Mamba kernels off (their pure-PyTorch paths).
_HYBRID = dict(
    _SPECIAL, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=TEXT[1],
)
_ALTERNATING = ["mamba", "attention", "mamba", "attention"]
_MAMBA2_HEADS = dict(
    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=32,
)


def _arch(
    name: str, family: str, model: str, batch: Callable[[int, int, int, bool], Dict[str, Any]],
    lengths: Tuple[int, int], generates: bool = False, **config: Any,
) -> Architecture:
    return Architecture(name, family, _hf(model, **config), batch, lengths, generates)


def _causal(name: str, model: str, family: str = "causal", **config: Any) -> Architecture:
    return _arch(name, family, model, causal_batch, TEXT, True, **config)


def _llama_like(name: str, model: str, **config: Any) -> Architecture:
    return _causal(name, model, **dict(_DECODER, **config))


def _encoder(name: str, model: str, **config: Any) -> Architecture:
    return _arch(name, "encoder", model, masked_batch, TEXT, **config)


def _seq2seq(name: str, model: str, **config: Any) -> Architecture:
    return _arch(name, "encoder-decoder", model, seq2seq_batch, TEXT, True, **config)


def _image(name: str, family: str, model: str, **config: Any) -> Architecture:
    return _arch(name, family, model, image_batch, (SIDE, SIDE), **config)


_CATALOGUE: List[Architecture] = [
    # Causal language models.
    _causal("gpt2", "GPT2LMHeadModel", **_GPT2),
    _causal(
        "gpt_neo", "GPTNeoForCausalLM", hidden_size=32, num_layers=2, num_heads=2, window_size=16,
        attention_types=[[["global", "local"], 1]], max_position_embeddings=TEXT[1], **_SPECIAL,
    ),
    _causal(
        "gpt_neox", "GPTNeoXForCausalLM", hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=TEXT[1], **_SPECIAL,
    ),
    _causal("gptj", "GPTJForCausalLM", rotary_dim=8, **_GPT2),
    _causal(
        "opt", "OPTForCausalLM", hidden_size=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=2, word_embed_proj_dim=32, max_position_embeddings=TEXT[1], **_SPECIAL,
    ),
    _causal("bloom", "BloomForCausalLM", hidden_size=32, n_layer=2, n_head=2, **_SPECIAL),
    _llama_like("llama", "LlamaForCausalLM"),
    # Sliding windows shorter than the longest length, so their masks take part.
    _llama_like("mistral", "MistralForCausalLM", sliding_window=64),
    _llama_like("mixtral", "MixtralForCausalLM", num_local_experts=2, num_experts_per_tok=2),
    _llama_like("qwen2", "Qwen2ForCausalLM"),
    _llama_like("qwen3", "Qwen3ForCausalLM"),
    _llama_like("phi3", "Phi3ForCausalLM"),
    _llama_like("gemma", "GemmaForCausalLM"),
    _llama_like("gemma2", "Gemma2ForCausalLM", sliding_window=64, query_pre_attn_scalar=8),
    _llama_like("olmo", "OlmoForCausalLM"),
    _llama_like("starcoder2", "Starcoder2ForCausalLM"),
    _llama_like("stablelm", "StableLmForCausalLM"),
    _llama_like("phi", "PhiForCausalLM"),
    _causal(
        "falcon", "FalconForCausalLM", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=TEXT[1], **_SPECIAL,
    ),
    # CodeGen splits its fused projection into 4 model-parallel shards of whole heads.
    _causal("codegen", "CodeGenForCausalLM", rotary_dim=8, **dict(_GPT2, n_head=4)),
    _causal("gpt_bigcode", "GPTBigCodeForCausalLM", **_GPT2),
    _causal(
        "biogpt", "BioGptForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=TEXT[1], **_SPECIAL,
    ),
    _causal(
        "xglm", "XGLMForCausalLM", d_model=32, ffn_dim=64, num_layers=2, attention_heads=2,
        max_position_embeddings=TEXT[1], **_SPECIAL,
    ),
    # Masked language models.
    _encoder("bert", "BertForMaskedLM", **_BERT),
    _encoder("roberta", "RobertaForMaskedLM", **_BERT),
    _encoder("xlm_roberta", "XLMRobertaForMaskedLM", **_BERT),
    _encoder("electra", "ElectraForMaskedLM", embedding_size=32, **_BERT),
    dataclasses.replace(
        _encoder("albert", "AlbertForMaskedLM", embedding_size=16, **_BERT), candidates="type:AlbertLayer",
    ),
    _encoder("deberta_v2", "DebertaV2ForMaskedLM", **_BERT),
    _encoder("mpnet", "MPNetForMaskedLM", **_BERT),
    _encoder(
        "distilbert", "DistilBertForMaskedLM", dim=32, hidden_dim=64, n_layers=2, n_heads=2,
        max_position_embeddings=TEXT[1], vocab_size=VOCAB, pad_token_id=PAD,
    ),
    _encoder(
        "modernbert", "ModernBertForMaskedLM", cls_token_id=BOS, sep_token_id=EOS,
        local_attention=32, **dict(_BERT, max_position_embeddings=TEXT[1]),
    ),
    # Encoder-decoders.
    _seq2seq(
        "t5", "T5ForConditionalGeneration", d_model=32, d_ff=64, d_kv=16, num_layers=2,
        num_decoder_layers=2, num_heads=2, **_SEQ2SEQ,
    ),
    _seq2seq("bart", "BartForConditionalGeneration", **_BART),
    _seq2seq("mbart", "MBartForConditionalGeneration", **_BART),
    _seq2seq("pegasus", "PegasusForConditionalGeneration", **_BART),
    _seq2seq("marian", "MarianMTModel", **_BART),
    _seq2seq("m2m100", "M2M100ForConditionalGeneration", **_BART),
    _seq2seq("blenderbot_small", "BlenderbotSmallForConditionalGeneration", **_BART),
    _seq2seq(
        "led", "LEDForConditionalGeneration", attention_window=[16, 16],
        max_encoder_position_embeddings=TEXT[1], max_decoder_position_embeddings=TEXT[1],
        **_BART_LAYERS,
    ),
    # Speech.
    _arch(
        "whisper", "speech", "WhisperForConditionalGeneration", whisper_batch, TEXT,
        num_mel_bins=MELS, max_source_positions=MEL_FRAMES // 2, max_target_positions=TEXT[1],
        suppress_tokens=None, begin_suppress_tokens=None,
        **_BART_LAYERS,
    ),
    _arch("wav2vec2", "speech", "Wav2Vec2ForCTC", ctc_batch, AUDIO, **_AUDIO_ENCODER),
    _arch("hubert", "speech", "HubertForCTC", ctc_batch, AUDIO, **_AUDIO_ENCODER),
    _arch("wavlm", "speech", "WavLMForCTC", ctc_batch, AUDIO, **_AUDIO_ENCODER),
    # Vision: a flat sequence of patches.
    _image("vit", "vision", "ViTForImageClassification", **_VIT),
    _image("deit", "vision", "DeiTForImageClassification", **_VIT),
    _image("dinov2", "vision", "Dinov2ForImageClassification", **_VIT),
    _image("beit", "vision", "BeitForImageClassification", **_VIT),
    # Hierarchical vision: stages that halve the resolution.
    _image("swin", "hierarchical vision", "SwinForImageClassification", **_SWIN),
    _image("swinv2", "hierarchical vision", "Swinv2ForImageClassification", **_SWIN),
    _image("convnext", "hierarchical vision", "ConvNextForImageClassification", **_CONVNEXT),
    _image("convnextv2", "hierarchical vision", "ConvNextV2ForImageClassification", **_CONVNEXT),
    _image(
        "resnet", "hierarchical vision", "ResNetForImageClassification", embedding_size=32,
        hidden_sizes=[32, 64], depths=[2, 2], layer_type="basic", num_labels=CLASSES,
    ),
    # Multimodal.
    _arch(
        "clip", "multimodal", "CLIPModel", contrastive_batch, TEXT, projection_dim=32,
        text_config=_TEXT_TOWER, vision_config=_VISION_TOWER,
    ),
    _arch(
        "siglip", "multimodal", "SiglipModel", contrastive_batch, TEXT,
        text_config=_TEXT_TOWER, vision_config=_VISION_TOWER,
    ),
    # State-space models (their pure-PyTorch paths on the CPU).
    _causal("mamba", "MambaForCausalLM", "state-space", **_MAMBA),
    # 8 heads of 8 make the expanded width 64; the torch path pads to whole chunks.
    _causal(
        "mamba2", "Mamba2ForCausalLM", "state-space", num_heads=8, head_dim=8, n_groups=1,
        chunk_size=32, **_MAMBA,
    ),
    _causal(
        "rwkv", "RwkvForCausalLM", "state-space", hidden_size=32, attention_hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, context_length=TEXT[1], **_SPECIAL,
    ),
    # Its model builds no cache in training.
    _causal("falcon_mamba", "FalconMambaForCausalLM", "state-space", **_MAMBA),
    # Hybrids, whose cache in training a checkpointed layer must neither write twice nor go
    # without (their Mamba layers take other code without one).
    _causal(
        "jamba", "JambaForCausalLM", "hybrid", attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False,
        **_HYBRID,
    ),
    # Zamba's shared attention block runs at every third layer, tied across them.
    _causal(
        "zamba", "ZambaForCausalLM", "hybrid", attention_hidden_size=64, attention_head_dim=16,
        n_mamba_heads=2, attn_layer_period=3, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False,
        **dict(_HYBRID, num_hidden_layers=6, num_key_value_heads=4),
    ),
    _causal(
        "zamba2", "Zamba2ForCausalLM", "hybrid", layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4,
        chunk_size=32, num_mem_blocks=1, adapter_rank=8, use_mem_rope=True, use_mamba_kernels=False,
        **dict(_HYBRID, num_key_value_heads=4),
    ),
    _causal("bamba", "BambaForCausalLM", "hybrid", attn_layer_indices=[1, 3], **_MAMBA2_HEADS, **_HYBRID),
    _causal(
        "granitemoehybrid", "GraniteMoeHybridForCausalLM", "hybrid", layer_types=_ALTERNATING,
        num_local_experts=2, num_experts_per_tok=2, shared_intermediate_size=64, **_MAMBA2_HEADS, **_HYBRID,
    ),
    _causal(
        "falcon_h1", "FalconH1ForCausalLM", "hybrid", mamba_d_ssm=64, **_MAMBA2_HEADS,
        **dict(_HYBRID, num_hidden_layers=2),
    ),
    _causal(
        "nemotron_h", "NemotronHForCausalLM", "hybrid", layers_block_type=["mamba", "attention", "mamba", "mlp"],
        head_dim=8, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, conv_kernel=4,
        expand=2, chunk_size=32, use_mamba_kernels=False, **_HYBRID,
    ),
    # Gated delta-net and other linear-attention layers, with their conv and recurrent states.
    _causal(
        "qwen3_next", "Qwen3NextForCausalLM", "hybrid", head_dim=8,
        layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=2, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        **_HYBRID,
    ),
    _causal(
        "olmo_hybrid", "OlmoHybridForCausalLM", "hybrid",
        layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        **_HYBRID,
    ),
    _causal(
        "kimi_linear", "KimiLinearForCausalLM", "hybrid", layer_types=["linear_attention", "full_attention"],
        moe_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, num_experts_per_tok=2, num_local_experts=2,
        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
        **dict(_HYBRID, num_hidden_layers=2, num_key_value_heads=4),
    ),
    _causal(
        "minimax", "MiniMaxForCausalLM", "hybrid", head_dim=8, layer_types=["linear_attention", "full_attention"],
        num_local_experts=2, num_experts_per_tok=2, block_size=16, **dict(_HYBRID, num_hidden_layers=2),
    ),
    # Short convolutions beside attention, their windows in the cache.
    _causal(
        "lfm2", "Lfm2ForCausalLM", "hybrid", layer_types=["conv", "full_attention"] * 2, conv_L_cache=3,
        block_auto_adjust_ff_dim=False, **_HYBRID,
    ),
    # Vision-language at dynamic resolution: every batch's images give pixel_values another
    # number of patches. Multimodal rotary sections (temporal, height, width) of a head of 8.
    _arch(
        "qwen2_vl", "multimodal", "Qwen2VLForConditionalGeneration", dynamic_resolution_batch, VISION_SIDES,
        text_config=dict(
            _DECODER, max_position_embeddings=512,
            rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0),
        ),
        vision_config=dict(
            depth=2, embed_dim=32, hidden_size=32, num_heads=2, patch_size=_PATCH,
            temporal_patch_size=_TEMPORAL, spatial_merge_size=_MERGE,
        ),
        image_token_id=_IMAGE_TOKEN, video_token_id=_VIDEO_TOKEN, vision_start_token_id=_VISION_START,
        vision_end_token_id=_VISION_END,
    ),
]

ARCHITECTURES: Dict[str, Architecture] = {arch.name: arch for arch in _CATALOGUE}


@functools.lru_cache(maxsize=None)
def _builds(name: str) -> Optional[str]:
    """None if ``name`` builds here, else why not."""
    try:
        ARCHITECTURES[name].build()
    except Exception as error:  # ImportError, and configs an installed version rejects
        return f"{type(error).__name__}: {error}"
    return None


def available() -> List[str]:
    """Names whose ``build()`` works in this environment, in catalogue order (each name
    is tried once per process)."""
    return [name for name in ARCHITECTURES if _builds(name) is None]

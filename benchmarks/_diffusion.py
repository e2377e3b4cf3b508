"""Diffusers models built tiny from their configs.

For the budget loops, three models with a denoising step's loss (the prediction's mean
squared error against the noise) around each, so that the output has a ``loss`` as the
loops expect (:data:`DIFFUSION`). For the tests that hold ``blocks`` to what diffusers'
own gradient checkpointing checkpoints, every model class diffusers exports at a tiny
config with one forward's inputs (:data:`TINY`), and why the others are not built here
(:data:`NOT_BUILT`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from _architectures import Architecture

__all__ = ["DIFFUSION", "NOT_BUILT", "TINY", "Tiny", "available", "model_classes"]

_SIDE = 16


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor
    sample: torch.Tensor


class Denoising(nn.Module):
    """A diffusers model and the denoising loss of one training step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, target: torch.Tensor, **inputs: Any) -> _Output:
        sample = self.model(**inputs).sample
        return _Output(nn.functional.mse_loss(sample, target), sample)


def _built(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return Denoising(factory()).train()

    return build


def _unet() -> nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=_SIDE, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8,
    )


def _vae() -> nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=2 * _SIDE,
    )


def _dit() -> nn.Module:
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=2, sample_size=_SIDE, patch_size=2, num_embeds_ada_norm=10, dropout=0.1,
    )


def _generator(rows: int, length: int, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * seed + 1009 * rows + length)


def _unet_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    g = _generator(rows, length, seed)
    return {
        "sample": torch.randn(rows, 4, _SIDE, _SIDE, generator=g),
        "timestep": torch.randint(0, 1000, (rows,), generator=g),
        "encoder_hidden_states": torch.randn(rows, length, 32, generator=g),
        "target": torch.randn(rows, 4, _SIDE, _SIDE, generator=g),
    }


def _vae_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    g = _generator(rows, length, seed)
    images = torch.randn(rows, 3, 2 * _SIDE, 2 * _SIDE, generator=g)
    return {"sample": images, "target": images.clone()}


def _dit_batch(rows: int, length: int, seed: int, padded: bool) -> Dict[str, Any]:
    g = _generator(rows, length, seed)
    return {
        "hidden_states": torch.randn(rows, 4, _SIDE, _SIDE, generator=g),
        "timestep": torch.randint(0, 1000, (rows,), generator=g),
        "class_labels": torch.randint(0, 10, (rows,), generator=g),
        "target": torch.randn(rows, 4, _SIDE, _SIDE, generator=g),
    }


DIFFUSION: Dict[str, Architecture] = {
    "unet2d-condition": Architecture("unet2d-condition", "diffusion", _built(_unet), _unet_batch, (8, 32)),
    "autoencoder-kl": Architecture("autoencoder-kl", "diffusion", _built(_vae), _vae_batch, (2 * _SIDE, 2 * _SIDE)),
    "dit": Architecture("dit", "diffusion", _built(_dit), _dit_batch, (_SIDE, _SIDE)),
}


@functools.lru_cache(maxsize=1)
def available() -> List[str]:
    """The diffusers models that build here (none without diffusers)."""
    found = []
    for name, arch in DIFFUSION.items():
        try:
            arch.build()
        except ImportError:
            continue
        found.append(name)
    return found


# ------------------------------------------------------------- every model class, tiny


@dataclasses.dataclass(frozen=True)
class _Draw:
    """An input tensor drawn (or filled) when a batch is made."""

    shape: Tuple[int, ...]
    kind: str = "normal"
    """``normal``, ``uniform``, ``ints`` (from ``low`` to ``high``, excluded), ``full``
    (``value``) or ``coin`` (booleans)."""
    low: int = 0
    high: int = 0
    value: Any = None
    dtype: torch.dtype = torch.float32

    def make(self, g: torch.Generator) -> torch.Tensor:
        if self.kind == "normal":
            return torch.randn(self.shape, generator=g)
        if self.kind == "uniform":
            return torch.rand(self.shape, generator=g)
        if self.kind == "coin":
            return torch.rand(self.shape, generator=g) < 0.5
        if self.kind == "ints":
            return torch.randint(self.low, self.high, self.shape, generator=g).to(self.dtype)
        return torch.full(self.shape, self.value, dtype=self.dtype)


def _ints(low: int, high: int, *shape: int, dtype: torch.dtype = torch.int64, real: bool = False) -> _Draw:
    """Integers from ``low`` to ``high`` (excluded), as floats with ``real``."""
    return _Draw(shape, "ints", low, high, dtype=torch.float32 if real else dtype)


def _full(value: Any, *shape: int, dtype: torch.dtype = torch.float32) -> _Draw:
    return _Draw(shape, "full", value=value, dtype=dtype)


def _uniform(*shape: int) -> _Draw:
    return _Draw(shape, "uniform")


def _coin(*shape: int) -> _Draw:
    return _Draw(shape, "coin")


@dataclasses.dataclass(frozen=True)
class _Literal:
    """An input passed as it is, though it holds tuples of ints (``img_shapes``)."""

    value: Any


def _literal(value: Any) -> _Literal:
    return _Literal(value)


def _made(value: Any, g: torch.Generator) -> Any:
    if isinstance(value, tuple) and all(isinstance(each, int) for each in value):
        return torch.randn(value, generator=g)
    if isinstance(value, _Draw):
        return value.make(g)
    if isinstance(value, _Literal):
        return value.value
    if isinstance(value, list):
        return [_made(each, g) for each in value]
    if isinstance(value, dict):
        return {key: _made(each, g) for key, each in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Tiny:
    """One diffusers model class at a tiny config, and one training forward's inputs."""

    cls: str
    """The class's name, as ``diffusers`` exports it."""
    config: Dict[str, Any]
    inputs: Dict[str, Any]
    """The forward's keyword inputs: a shape stands for a tensor of normal samples, a
    ``_Draw`` for one drawn otherwise; anything else (lists and dicts of these too, and a
    ``_Literal``'s value) is passed as it is."""

    def build(self) -> nn.Module:
        """A fresh model in train mode, the same weights every call."""
        import diffusers

        torch.manual_seed(0)
        return getattr(diffusers, self.cls)(**self.config).train()

    def batch(self, seed: int = 0) -> Dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        return {key: _made(value, g) for key, value in self.inputs.items()}

    @staticmethod
    def loss(output: Any) -> torch.Tensor:
        """Each floating-point output that requires grad, squared and averaged, summed."""
        parts = output.to_tuple() if hasattr(output, "to_tuple") else output
        leaves = [each for each in tree_leaves(parts) if isinstance(each, torch.Tensor) and each.requires_grad]
        return sum(each.float().square().mean() for each in leaves)  # type: ignore[return-value]


def model_classes() -> List[str]:
    """Every model class diffusers exports (a ``ModelMixin``), by name; none without diffusers."""
    try:
        import diffusers
    except ImportError:
        return []
    found = []
    for name in dir(diffusers):
        try:
            cls = getattr(diffusers, name)
        except (ImportError, AttributeError):  # an optional backend that is not installed
            continue
        if isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin) and cls is not diffusers.ModelMixin:
            found.append(name)
    return sorted(found)


_TABLE: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {
    "AceStepTransformer1DModel": (
        dict(
            audio_acoustic_hidden_dim=8, head_dim=8, hidden_size=32, in_channels=24, intermediate_size=64,
            num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_size=2,
            rms_norm_eps=1e-06, rope_theta=10000.0, sliding_window=16,
        ),
        dict(
            context_latents=(2, 8, 16), encoder_hidden_states=(2, 10, 32), hidden_states=(2, 8, 8),
            timestep=(2,), timestep_r=(2,),
        ),
    ),
    "AllegroTransformer3DModel": (
        dict(
            attention_head_dim=8, caption_channels=8, cross_attention_dim=16, in_channels=4,
            num_attention_heads=2, num_layers=1, out_channels=4, sample_frames=8, sample_height=8,
            sample_width=8,
        ),
        dict(encoder_hidden_states=(2, 16, 8), hidden_states=(2, 4, 2, 8, 8), timestep=_ints(44, 240, 2)),
    ),
    "AnyFlowTransformer3DModel": (
        dict(
            attention_head_dim=12, cross_attn_norm=True, deltatime_type='r', ffn_dim=32, freq_dim=256,
            gate_value=0.25, in_channels=4, num_attention_heads=2, num_layers=2, out_channels=4,
            patch_size=(1, 2, 2), rope_max_seq_len=32, text_dim=16,
        ),
        dict(
            encoder_hidden_states=(1, 12, 16), hidden_states=(1, 2, 4, 16, 16),
            r_timestep=_full(250.0, 1, 2), timestep=_full(500.0, 1, 2),
        ),
    ),
    "AsymmetricAutoencoderKL": (
        dict(
            act_fn='silu', down_block_out_channels=[2, 4],
            down_block_types=['DownEncoderBlock2D', 'DownEncoderBlock2D'], in_channels=3, latent_channels=4,
            layers_per_down_block=1, layers_per_up_block=1, norm_num_groups=2, out_channels=3,
            sample_size=32, scaling_factor=0.18215, up_block_out_channels=[2, 4],
            up_block_types=['UpDecoderBlock2D', 'UpDecoderBlock2D'],
        ),
        dict(mask=_full(1.0, 4, 1, 32, 32), sample=(4, 3, 32, 32)),
    ),
    "AudioLDM2UNet2DConditionModel": (
        dict(
            block_out_channels=(8, 16), cross_attention_dim=(8, 16),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), in_channels=4, layers_per_block=1,
            norm_num_groups=8, out_channels=4, sample_size=16,
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        ),
        dict(
            sample=(1, 4, 16, 16), timestep=_ints(0, 1000, 1), encoder_hidden_states=(1, 6, 16),
            encoder_hidden_states_1=(1, 6, 8),
        ),
    ),
    "AuraFlowTransformer2DModel": (
        dict(
            attention_head_dim=8, caption_projection_dim=32, in_channels=4, joint_attention_dim=32,
            num_attention_heads=4, num_mmdit_layers=1, num_single_dit_layers=1, out_channels=4, patch_size=2,
            pos_embed_max_size=256, sample_size=32,
        ),
        dict(encoder_hidden_states=(2, 256, 32), hidden_states=(2, 4, 32, 32), timestep=_ints(44, 240, 2)),
    ),
    "AutoencoderDC": (
        dict(
            attention_head_dim=2, decoder_act_fns='silu', decoder_block_out_channels=(8, 8),
            decoder_block_types=('ResBlock', 'EfficientViTBlock'), decoder_layers_per_block=[1, 1],
            decoder_norm_types='rms_norm', decoder_qkv_multiscales=((), (5,)), downsample_block_type='conv',
            encoder_block_out_channels=(8, 8), encoder_block_types=('ResBlock', 'EfficientViTBlock'),
            encoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), (5,)), in_channels=3,
            latent_channels=4, scaling_factor=0.41407, upsample_block_type='interpolate',
        ),
        dict(sample=(4, 3, 32, 32)),
    ),
    "AutoencoderKL": (
        dict(
            block_out_channels=[2, 4], down_block_types=['DownEncoderBlock2D', 'DownEncoderBlock2D'],
            in_channels=3, latent_channels=4, norm_num_groups=2, out_channels=3,
            up_block_types=['UpDecoderBlock2D', 'UpDecoderBlock2D'],
        ),
        dict(sample=(4, 3, 32, 32)),
    ),
    "AutoencoderKLCogVideoX": (
        dict(
            block_out_channels=(8, 8, 8, 8),
            down_block_types=('CogVideoXDownBlock3D', 'CogVideoXDownBlock3D', 'CogVideoXDownBlock3D', 'CogVideoXDownBlock3D'),
            in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=2, out_channels=3,
            temporal_compression_ratio=4,
            up_block_types=('CogVideoXUpBlock3D', 'CogVideoXUpBlock3D', 'CogVideoXUpBlock3D', 'CogVideoXUpBlock3D'),
        ),
        dict(sample=(4, 3, 8, 16, 16)),
    ),
    "AutoencoderKLCosmos": (
        dict(
            attention_resolutions=(8,), decode_block_out_channels=(8, 8, 8, 8),
            encoder_block_out_channels=(8, 8, 8, 8), in_channels=3, latent_channels=4, num_layers=2,
            out_channels=3, patch_size=4, patch_type='haar', resolution=64, scaling_factor=1.0,
            spatial_compression_ratio=4, temporal_compression_ratio=4,
        ),
        dict(sample=(1, 3, 5, 16, 16)),
    ),
    "AutoencoderKLFlux2": (
        dict(
            block_out_channels=(4,), down_block_types=("DownEncoderBlock2D",), in_channels=3,
            latent_channels=1, layers_per_block=1, norm_num_groups=1, out_channels=3, sample_size=32,
            up_block_types=("UpDecoderBlock2D",), use_post_quant_conv=False, use_quant_conv=False,
        ),
        dict(sample=(1, 3, 16, 16)),
    ),
    "AutoencoderKLHunyuanImage": (
        dict(
            block_out_channels=(32, 32, 32, 32), in_channels=3, latent_channels=4, layers_per_block=1,
            out_channels=3, sample_size=32, scaling_factor=0.476986, spatial_compression_ratio=8,
        ),
        dict(sample=(1, 3, 32, 32)),
    ),
    "AutoencoderKLHunyuanVideo": (
        dict(
            act_fn='silu', block_out_channels=(8, 8, 8, 8),
            down_block_types=('HunyuanVideoDownBlock3D', 'HunyuanVideoDownBlock3D', 'HunyuanVideoDownBlock3D', 'HunyuanVideoDownBlock3D'),
            in_channels=3, latent_channels=4, layers_per_block=1, mid_block_add_attention=True,
            norm_num_groups=4, out_channels=3, scaling_factor=0.476986, spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            up_block_types=('HunyuanVideoUpBlock3D', 'HunyuanVideoUpBlock3D', 'HunyuanVideoUpBlock3D', 'HunyuanVideoUpBlock3D'),
        ),
        dict(sample=(2, 3, 9, 16, 16)),
    ),
    "AutoencoderKLHunyuanVideo15": (
        dict(
            block_out_channels=(16, 16), downsample_match_channel=False, in_channels=3, latent_channels=4,
            layers_per_block=1, out_channels=3, spatial_compression_ratio=4, temporal_compression_ratio=2,
            upsample_match_channel=False,
        ),
        dict(sample=(1, 3, 3, 16, 16)),
    ),
    "AutoencoderKLKVAE": (
        dict(
            ch_mult=(1, 2), channels=32, double_z=True, in_channels=3, num_dec_blocks=1, num_enc_blocks=1,
            sample_size=32, z_channels=4,
        ),
        dict(sample=(2, 3, 32, 32)),
    ),
    "AutoencoderKLKVAEVideo": (
        dict(
            ch=32, ch_mult=(1, 2), in_channels=3, num_res_blocks=1, out_ch=3, temporal_compress_times=2,
            z_channels=4,
        ),
        dict(sample=(2, 3, 3, 16, 16)),
    ),
    "AutoencoderKLLTX2Audio": (
        dict(
            attn_resolutions=None, base_channels=16, causality_axis='height', ch_mult=(1, 2, 4),
            double_z=True, in_channels=2, is_causal=True, latent_channels=4, mel_bins=16, mel_hop_length=160,
            mid_block_add_attention=False, norm_type='pixel', num_res_blocks=2, output_channels=2,
            resolution=16, sample_rate=16000,
        ),
        dict(sample=(2, 2, 8, 16)),
    ),
    "AutoencoderKLLTX2Video": (
        dict(
            block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(16, 32, 64), decoder_causal=False,
            decoder_inject_noise=(False, False, False, False), decoder_layers_per_block=(1, 1, 1, 1),
            decoder_spatial_padding_mode='zeros', decoder_spatio_temporal_scaling=(True, True, True),
            downsample_type=('spatial', 'temporal', 'spatiotemporal', 'spatiotemporal'), encoder_causal=True,
            encoder_spatial_padding_mode='zeros', in_channels=3, latent_channels=8,
            layers_per_block=(1, 1, 1, 1, 1), out_channels=3, patch_size=1, patch_size_t=1,
            spatio_temporal_scaling=(True, True, True, True), timestep_conditioning=False,
            upsample_factor=(2, 2, 2), upsample_residual=(True, True, True),
        ),
        dict(sample=(2, 3, 9, 16, 16)),
    ),
    "AutoencoderKLLTXVideo": (
        dict(
            block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8), decoder_causal=False,
            decoder_inject_noise=(False, False, False, False, False),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            decoder_spatio_temporal_scaling=(True, True, False, False), encoder_causal=True, in_channels=3,
            latent_channels=8, layers_per_block=(1, 1, 1, 1, 1), out_channels=3, patch_size=1,
            patch_size_t=1, spatio_temporal_scaling=(True, True, False, False), timestep_conditioning=False,
            upsample_factor=(1, 1, 1, 1), upsample_residual=(False, False, False, False),
        ),
        dict(sample=(2, 3, 9, 16, 16)),
    ),
    "AutoencoderKLMagvit": (
        dict(
            block_out_channels=[8, 8, 8, 8],
            down_block_types=['SpatialDownBlock3D', 'SpatialTemporalDownBlock3D', 'SpatialTemporalDownBlock3D', 'SpatialTemporalDownBlock3D'],
            in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8, out_channels=3,
            spatial_group_norm=True,
            up_block_types=['SpatialUpBlock3D', 'SpatialTemporalUpBlock3D', 'SpatialTemporalUpBlock3D', 'SpatialTemporalUpBlock3D'],
        ),
        dict(sample=(2, 3, 9, 16, 16)),
    ),
    "AutoencoderKLMiniMaxH3": (
        dict(
            block_out_channels=(8, 16), clip_length=17, decoder_attention_head_dim=8, decoder_ffn_mult=2,
            decoder_num_attention_heads=2, decoder_num_layers=2, decoder_num_register_tokens=2,
            in_channels=3, latent_channels=4, latents_mean=(0.0, 0.0, 0.0, 0.0),
            latents_std=(1.0, 1.0, 1.0, 1.0), layers_per_block=1, norm_num_groups=8, out_channels=3,
            spatial_downsample_factors=(2, 2), temporal_downsample_factors=(2, 2), token_drop=3,
        ),
        dict(sample=(2, 3, 22, 8, 8)),
    ),
    "AutoencoderKLMiniMaxH3Audio": (
        dict(
            decoder_dim=16, decoder_kernel_sizes=(4, 4), decoder_rates=(2, 2), encoder_dim=4,
            encoder_rates=(2, 2), latent_channels=8, latent_dim=32,
            latents_mean=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            latents_std=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], num_attention_heads=2,
            resblock_dilation_sizes=((1, 3), (1, 3)), resblock_kernel_sizes=(3, 7), sampling_rate=32000,
        ),
        dict(sample=(2, 1, 32)),
    ),
    "AutoencoderKLMochi": (
        dict(
            act_fn='silu', decoder_block_out_channels=(32, 32, 32, 32),
            encoder_block_out_channels=(32, 32, 32, 32), in_channels=15, latent_channels=4,
            layers_per_block=(1, 1, 1, 1, 1), out_channels=3, scaling_factor=1,
        ),
        dict(sample=(2, 3, 7, 16, 16)),
    ),
    "AutoencoderKLQwenImage": (
        dict(
            base_dim=8, dim_mult=[1, 2, 4], latents_mean=[0.0] * 4, latents_std=[1.0] * 4, num_res_blocks=1,
            temperal_downsample=[False, True], z_dim=4,
        ),
        dict(sample=(1, 3, 1, 16, 16)),
    ),
    "AutoencoderKLTemporalDecoder": (
        dict(
            block_out_channels=[32, 64], down_block_types=['DownEncoderBlock2D', 'DownEncoderBlock2D'],
            in_channels=3, latent_channels=4, layers_per_block=2, out_channels=3,
        ),
        dict(num_frames=3, sample=(3, 3, 16, 16)),
    ),
    "AutoencoderKLWan": (
        dict(
            base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            z_dim=16,
        ),
        dict(sample=(2, 3, 9, 16, 16)),
    ),
    "AutoencoderOobleck": (
        dict(
            audio_channels=2, channel_multiples=[1, 2], decoder_channels=12, decoder_input_channels=6,
            downsampling_ratios=[2, 4], encoder_hidden_size=12,
        ),
        dict(sample=(4, 2, 24), sample_posterior=False),
    ),
    "AutoencoderSAME": (
        dict(
            audio_channels=2, dim_heads=8, encoder_c_mults=[1, 2], encoder_channels=16,
            encoder_strides=[2, 2], encoder_transformer_depths=[1, 1], ff_mult=2, latent_dim=8, patch_size=4,
            sampling_rate=44100, use_differential_attention=False,
        ),
        dict(sample=(2, 2, 128)),
    ),
    "AutoencoderTiny": (
        dict(
            decoder_block_out_channels=[32, 32], encoder_block_out_channels=[32, 32], in_channels=3,
            num_decoder_blocks=[1, 1], num_encoder_blocks=[1, 1], out_channels=3,
        ),
        dict(sample=(4, 3, 32, 32)),
    ),
    "AutoencoderVidTok": (
        dict(
            ch=8, ch_mult=[1, 2, 2, 2, 2], codebook_size=262144, double_z=False, in_channels=3,
            is_causal=False, num_res_blocks=1, out_channels=3, regularizer='fsq', z_channels=6,
        ),
        dict(sample=(1, 3, 8, 16, 16)),
    ),
    "BriaFiboTransformer2DModel": (
        dict(
            attention_head_dim=8, axes_dims_rope=[0, 4, 4], in_channels=48, joint_attention_dim=64,
            num_attention_heads=2, num_layers=1, num_single_layers=1, patch_size=1,
            pooled_projection_dim=None, text_encoder_dim=32,
        ),
        dict(
            encoder_hidden_states=(1, 32, 64), hidden_states=(1, 256, 48), img_ids=(256, 3),
            text_encoder_layers=[(1, 32, 32), (1, 32, 32)], timestep=_full(1.0, 1), txt_ids=(32, 3),
        ),
    ),
    "BriaTransformer2DModel": (
        dict(
            attention_head_dim=8, axes_dims_rope=[0, 4, 4], in_channels=4, joint_attention_dim=32,
            num_attention_heads=2, num_layers=1, num_single_layers=1, patch_size=1,
            pooled_projection_dim=None,
        ),
        dict(
            encoder_hidden_states=(1, 48, 32), hidden_states=(1, 16, 4), img_ids=(16, 3),
            timestep=_full(1.0, 1), txt_ids=(48, 3),
        ),
    ),
    "ChromaTransformer2DModel": (
        dict(
            approximator_hidden_dim=16, approximator_layers=1, approximator_num_channels=8,
            attention_head_dim=16, axes_dims_rope=[4, 4, 8], in_channels=4, joint_attention_dim=32,
            num_attention_heads=2, num_layers=1, num_single_layers=1, patch_size=1,
        ),
        dict(
            encoder_hidden_states=(1, 48, 32), hidden_states=(1, 16, 4), img_ids=(16, 3),
            timestep=_full(1.0, 1), txt_ids=(48, 3),
        ),
    ),
    "ChronoEditTransformer3DModel": (
        dict(
            added_kv_proj_dim=None, attention_head_dim=8, cross_attn_norm=True, eps=1e-06, ffn_dim=32,
            freq_dim=16, image_dim=None, in_channels=16, num_attention_heads=2, num_layers=2,
            out_channels=16, patch_size=(1, 2, 2), pos_embed_seq_len=None, qk_norm='rms_norm_across_heads',
            rope_max_seq_len=64, rope_temporal_skip_len=8, text_dim=32,
        ),
        dict(
            encoder_hidden_states=(1, 12, 32), encoder_hidden_states_image=None,
            hidden_states=(1, 16, 2, 8, 8), timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "CogVideoXTransformer3DModel": (
        dict(
            attention_head_dim=8, in_channels=4, max_text_seq_length=8, num_attention_heads=2, num_layers=2,
            out_channels=4, patch_size=2, patch_size_t=None, sample_frames=8, sample_height=8,
            sample_width=8, temporal_compression_ratio=4, text_embed_dim=8, time_embed_dim=2,
        ),
        dict(encoder_hidden_states=(2, 8, 8), hidden_states=(2, 1, 4, 8, 8), timestep=_ints(44, 240, 2)),
    ),
    "CogView3PlusTransformer2DModel": (
        dict(
            attention_head_dim=4, condition_dim=2, in_channels=4, num_attention_heads=2, num_layers=2,
            out_channels=4, patch_size=2, pos_embed_max_size=8, sample_size=8, text_embed_dim=8,
            time_embed_dim=8,
        ),
        dict(
            crop_coords=_full(0, 2, 2, dtype=torch.int64), encoder_hidden_states=(2, 8, 8),
            hidden_states=(2, 4, 8, 8), original_size=_full(64, 2, 2, dtype=torch.int64),
            target_size=_full(64, 2, 2, dtype=torch.int64), timestep=_ints(44, 240, 2),
        ),
    ),
    "CogView4Transformer2DModel": (
        dict(
            attention_head_dim=4, condition_dim=4, in_channels=4, num_attention_heads=4, num_layers=2,
            out_channels=4, patch_size=2, text_embed_dim=8, time_embed_dim=8,
        ),
        dict(
            crop_coords=_full(0, 2, 2, dtype=torch.int64), encoder_hidden_states=(2, 8, 8),
            hidden_states=(2, 4, 8, 8), original_size=_full(64, 2, 2, dtype=torch.int64),
            target_size=_full(64, 2, 2, dtype=torch.int64), timestep=_ints(44, 240, 2),
        ),
    ),
    "ConsisIDTransformer3DModel": (
        dict(
            LFE_depth=5, LFE_dim_head=8, LFE_ff_mult=1, LFE_id_dim=2, LFE_num_heads=2, LFE_num_id_token=1,
            LFE_num_querie=1, LFE_num_scale=1, LFE_output_dim=10, LFE_vit_dim=2, attention_head_dim=8,
            cross_attn_dim_head=1, cross_attn_interval=1, cross_attn_num_heads=1, in_channels=4,
            is_kps=False, is_train_face=True, max_text_seq_length=8, num_attention_heads=2, num_layers=1,
            out_channels=4, patch_size=2, sample_frames=8, sample_height=8, sample_width=8,
            temporal_compression_ratio=4, text_embed_dim=8, time_embed_dim=2,
        ),
        dict(
            encoder_hidden_states=(2, 8, 8), hidden_states=(2, 1, 4, 8, 8), id_cond=_full(1.0, 2, 2),
            id_vit_hidden=[_full(1.0, 2, 2, 2)], timestep=_ints(44, 240, 2),
        ),
    ),
    "ConsistencyDecoderVAE": (
        dict(
            decoder_add_attention=False, decoder_block_out_channels=[2, 4],
            decoder_down_block_types=['ResnetDownsampleBlock2D', 'ResnetDownsampleBlock2D'],
            decoder_downsample_padding=1, decoder_in_channels=7, decoder_layers_per_block=1,
            decoder_norm_eps=1e-05, decoder_norm_num_groups=2, decoder_num_train_timesteps=1024,
            decoder_out_channels=6, decoder_resnet_time_scale_shift='scale_shift',
            decoder_time_embedding_type='learned',
            decoder_up_block_types=['ResnetUpsampleBlock2D', 'ResnetUpsampleBlock2D'],
            encoder_block_out_channels=[2, 4],
            encoder_down_block_types=['DownEncoderBlock2D', 'DownEncoderBlock2D'], encoder_in_channels=3,
            encoder_norm_num_groups=2, encoder_out_channels=4, latent_channels=4, scaling_factor=1,
        ),
        dict(sample=(1, 3, 16, 16)),
    ),
    "ControlNetModel": (
        dict(
            block_out_channels=(8, 8), conditioning_embedding_out_channels=(8, 8), cross_attention_dim=8,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), in_channels=4, layers_per_block=2,
            norm_num_groups=1,
        ),
        dict(
            sample=(1, 4, 16, 16), timestep=_ints(0, 1000, 1), encoder_hidden_states=(1, 4, 8),
            controlnet_cond=(1, 3, 32, 32),
        ),
    ),
    "Cosmos3AVAEAudioTokenizer": (
        dict(
            dec_c_mults=(1, 2), dec_dim=4, dec_out_channels=2, dec_strides=(2, 2), enc_c_mults=(1,),
            enc_dim=4, enc_hop_length=2, enc_latent_dim=8, enc_n_fft=8, enc_num_blocks=1, enc_strides=(2,),
            hop_size=4, input_channels=1, normalize_volume=True, sampling_rate=16, stereo=True,
            vocoder_input_dim=4,
        ),
        dict(sample=(2, 2, 16)),
    ),
    "Cosmos3OmniTransformer": (
        dict(
            head_dim=6, hidden_act='relu2', hidden_size=12, intermediate_size=24, latent_channel=2,
            latent_patch_size=1, num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1,
            patch_latent_dim=2, qk_norm_for_text=False, rms_norm_eps=1e-05, rope_axes_dim=[1, 1, 1],
            rope_theta=100000000.0, vocab_size=32,
        ),
        dict(
            input_ids=_ints(1, 3, 2), position_ids=_full(0, 3, 3, dtype=torch.int64), sequence_length=3,
            text_indexes=_ints(0, 2, 2), und_len=2, vision_mse_loss_indexes=_full(2, 1, dtype=torch.int64),
            vision_noisy_frame_indexes=[_full(0, 1, dtype=torch.int64)],
            vision_sequence_indexes=_full(2, 1, dtype=torch.int64), vision_timesteps=_full(1.0, 1),
            vision_token_shapes=_literal([(1, 1, 1)]), vision_tokens=[(1, 2, 1, 1, 1)],
        ),
    ),
    "DiTTransformer2DModel": (
        dict(
            activation_fn='gelu-approximate', attention_bias=True, attention_head_dim=4, in_channels=4,
            norm_type='ada_norm_zero', num_attention_heads=2, num_embeds_ada_norm=8, num_layers=1,
            out_channels=8, patch_size=2, sample_size=8,
        ),
        dict(class_labels=_ints(0, 4, 4), hidden_states=(4, 4, 8, 8), timestep=_ints(44, 934, 4)),
    ),
    "DreamLiteUNetModel": (
        dict(
            attention_head_dim=8, block_out_channels=(32, 64), cross_attention_dim=16,
            down_block_types=("DreamLiteCrossAttnNoSelfAttnDownBlock2D", "DreamLiteCrossAttnDownBlock2D"),
            in_channels=4, layers_per_block=1, norm_num_groups=8, out_channels=4, sample_size=8,
            transformer_layers_per_block=1,
            up_block_types=("DreamLiteCrossAttnUpBlock2D", "DreamLiteUpBlock2D"),
        ),
        dict(sample=(1, 4, 8, 8), timestep=_ints(0, 1000, 1), encoder_hidden_states=(1, 4, 16)),
    ),
    "EasyAnimateTransformer3DModel": (
        dict(
            attention_head_dim=16, in_channels=4, mmdit_layers=2, num_attention_heads=2, num_layers=2,
            out_channels=4, patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16,
            time_embed_dim=8, time_position_encoding_type='3d_rope', timestep_activation_fn='silu',
        ),
        dict(
            control_latents=None, encoder_hidden_states=(2, 16, 16), encoder_hidden_states_t5=None,
            hidden_states=(2, 4, 2, 16, 16), inpaint_latents=None, timestep=_ints(44, 240, 2),
            timestep_cond=None,
        ),
    ),
    "ErnieImageTransformer2DModel": (
        dict(
            eps=1e-06, ffn_hidden_size=16, hidden_size=16, in_channels=16, num_attention_heads=1,
            num_layers=1, out_channels=16, patch_size=1, qk_layernorm=True, rope_axes_dim=(8, 4, 4),
            rope_theta=256, text_in_dim=16,
        ),
        dict(
            hidden_states=(1, 16, 16, 16), text_bth=(1, 16, 16), text_lens=_full(16, 1, dtype=torch.int64),
            timestep=_full(1.0, 1),
        ),
    ),
    "Flux2Transformer2DModel": (
        dict(
            attention_head_dim=16, axes_dims_rope=[4, 4, 4, 4], in_channels=4, joint_attention_dim=32,
            num_attention_heads=2, num_layers=1, num_single_layers=1, patch_size=1,
            timestep_guidance_channels=256,
        ),
        dict(
            encoder_hidden_states=(1, 48, 32), guidance=_full(1.0, 1), hidden_states=(1, 16, 4),
            img_ids=_ints(0, 4, 1, 16, 4), timestep=_full(1.0, 1), txt_ids=_ints(0, 48, 1, 48, 4),
        ),
    ),
    "FluxControlNetModel": (
        dict(
            attention_head_dim=16, axes_dims_rope=[4, 4, 8], in_channels=16, joint_attention_dim=32,
            num_attention_heads=2, num_layers=1, num_single_layers=1, patch_size=1, pooled_projection_dim=32,
        ),
        dict(
            hidden_states=(1, 16, 16), controlnet_cond=(1, 16, 16), encoder_hidden_states=(1, 8, 32),
            pooled_projections=(1, 32), timestep=_full(1.0, 1), img_ids=(16, 3), txt_ids=(8, 3),
        ),
    ),
    "FluxTransformer2DModel": (
        dict(
            attention_head_dim=16, axes_dims_rope=[4, 4, 8], in_channels=4, joint_attention_dim=32,
            num_attention_heads=2, num_layers=1, num_single_layers=1, patch_size=1, pooled_projection_dim=32,
        ),
        dict(
            encoder_hidden_states=(1, 48, 32), hidden_states=(1, 16, 4), img_ids=(16, 3),
            pooled_projections=(1, 32), timestep=_full(1.0, 1), txt_ids=(48, 3),
        ),
    ),
    "GlmImageTransformer2DModel": (
        dict(
            attention_head_dim=8, condition_dim=8, in_channels=4, num_attention_heads=2, num_layers=1,
            out_channels=4, patch_size=2, prior_vq_quantizer_codebook_size=64, text_embed_dim=32,
            time_embed_dim=16,
        ),
        dict(
            crop_coords=_full(0.0, 1, 2), encoder_hidden_states=(1, 12, 32), hidden_states=(1, 4, 8, 8),
            prior_token_drop=_full(False, 1, dtype=torch.bool),
            prior_token_id=_full(44, 1, dtype=torch.int64), target_size=_full(8.0, 1, 2),
            timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "HeliosTransformer3DModel": (
        dict(
            attention_head_dim=12, cross_attn_norm=True, ffn_dim=32, freq_dim=256, guidance_cross_attn=True,
            has_multi_term_memory_patch=True, in_channels=4, is_amplify_history=False, num_attention_heads=2,
            num_layers=2, out_channels=4, patch_size=(1, 2, 2), qk_norm='rms_norm_across_heads',
            rope_dim=(4, 4, 4), text_dim=16, zero_history_timestep=True,
        ),
        dict(
            encoder_hidden_states=(1, 12, 16), hidden_states=(1, 4, 2, 16, 16),
            indices_hidden_states=_full(1.0, 1, 2), indices_latents_history_long=_full(1.0, 1, 4),
            indices_latents_history_mid=_full(1.0, 1, 1), indices_latents_history_short=_full(1.0, 1, 1),
            latents_history_long=(1, 4, 4, 16, 16), latents_history_mid=(1, 4, 1, 16, 16),
            latents_history_short=(1, 4, 1, 16, 16), timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "HiDreamImageTransformer2DModel": (
        dict(
            attention_head_dim=8, axes_dims_rope=(4, 2, 2), caption_channels=[8, 4],
            force_inference_output=True, in_channels=4, llama_layers=(0, 1), max_resolution=(32, 32),
            num_activated_experts=2, num_attention_heads=4, num_layers=1, num_routed_experts=2,
            num_single_layers=1, out_channels=4, patch_size=2, text_emb_dim=8,
        ),
        dict(
            encoder_hidden_states_llama3=(2, 1, 8, 4), encoder_hidden_states_t5=(1, 8, 8),
            hidden_states=(1, 4, 16, 16), pooled_embeds=(1, 8), timesteps=_ints(44, 240, 1),
        ),
    ),
    "HunyuanDiT2DControlNetModel": (
        dict(
            activation_fn="gelu-approximate", attention_head_dim=8, cross_attention_dim=8,
            cross_attention_dim_t5=8, hidden_size=16, in_channels=4, num_attention_heads=2,
            transformer_num_layers=2, patch_size=2, pooled_projection_dim=4, sample_size=8, text_len=4,
            text_len_t5=4,
        ),
        dict(
            encoder_hidden_states=(1, 4, 8), encoder_hidden_states_t5=(1, 4, 8), hidden_states=(1, 4, 8, 8),
            controlnet_cond=(1, 4, 8, 8), image_meta_size=_ints(0, 1025, 1, 6, real=True),
            image_rotary_emb=[_full(1.0, 16, 8), _full(0.0, 16, 8)], style=_full(0, 1, dtype=torch.int64),
            text_embedding_mask=_full(1.0, 1, 4), text_embedding_mask_t5=_full(1.0, 1, 4),
            timestep=_ints(44, 240, 1, real=True),
        ),
    ),
    "HunyuanDiT2DModel": (
        dict(
            activation_fn='gelu-approximate', attention_head_dim=8, cross_attention_dim=8,
            cross_attention_dim_t5=8, hidden_size=16, in_channels=4, num_attention_heads=2, num_layers=1,
            patch_size=2, pooled_projection_dim=4, sample_size=8, text_len=4, text_len_t5=4,
        ),
        dict(
            encoder_hidden_states=(2, 4, 8), encoder_hidden_states_t5=(2, 4, 8), hidden_states=(2, 4, 8, 8),
            image_meta_size=_ints(0, 1025, 2, 6, real=True),
            image_rotary_emb=[_full(1.0, 1, 8), _full(0.0, 1, 8)], style=_full(0, 2, dtype=torch.int64),
            text_embedding_mask=_full(1.0, 2, 4), text_embedding_mask_t5=_full(1.0, 2, 4),
            timestep=_ints(44, 240, 2, real=True),
        ),
    ),
    "HunyuanImageTransformer2DModel": (
        dict(
            attention_head_dim=8, guidance_embeds=False, in_channels=4, num_attention_heads=4, num_layers=1,
            num_refiner_layers=1, num_single_layers=1, out_channels=4, patch_size=(1, 1),
            rope_axes_dim=(4, 4), text_embed_2_dim=32, text_embed_dim=32,
        ),
        dict(
            hidden_states=(1, 4, 4, 4), timestep=_ints(0, 1000, 1, real=True),
            encoder_hidden_states=(1, 6, 32), encoder_attention_mask=_full(1, 1, 6, dtype=torch.int64),
            encoder_hidden_states_2=(1, 6, 32), encoder_attention_mask_2=_full(1, 1, 6, dtype=torch.int64),
        ),
    ),
    "HunyuanVideo15Transformer3DModel": (
        dict(
            attention_head_dim=8, image_embed_dim=12, in_channels=4, mlp_ratio=2.0, num_attention_heads=2,
            num_layers=2, num_refiner_layers=1, out_channels=4, patch_size=1, patch_size_t=1,
            rope_axes_dim=(2, 2, 4), target_size=16, task_type='t2v', text_embed_2_dim=8, text_embed_dim=16,
        ),
        dict(
            encoder_attention_mask=_full(1.0, 1, 6), encoder_attention_mask_2=_full(1.0, 1, 4),
            encoder_hidden_states=(1, 6, 16), encoder_hidden_states_2=(1, 4, 8),
            hidden_states=(1, 4, 1, 8, 8), image_embeds=_full(0.0, 1, 3, 12), timestep=_full(1.0, 1),
        ),
    ),
    "HunyuanVideoFramepackTransformer3DModel": (
        dict(
            attention_head_dim=10, guidance_embeds=True, has_clean_x_embedder=True, has_image_proj=True,
            image_condition_type=None, image_proj_dim=16, in_channels=4, num_attention_heads=2, num_layers=1,
            num_refiner_layers=1, num_single_layers=1, out_channels=4, patch_size=2, patch_size_t=1,
            pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), text_embed_dim=16,
        ),
        dict(
            encoder_attention_mask=_full(1.0, 1, 12), encoder_hidden_states=(1, 12, 16),
            guidance=_full(44, 1, dtype=torch.int64), hidden_states=(1, 4, 3, 4, 4),
            image_embeds=(1, 12, 16), indices_latents=_full(1.0, 3), indices_latents_clean=_full(1.0, 2),
            indices_latents_history_2x=_full(1.0, 2), indices_latents_history_4x=_full(1.0, 8),
            latents_clean=(1, 4, 2, 4, 4), latents_history_2x=(1, 4, 2, 4, 4),
            latents_history_4x=(1, 4, 8, 4, 4), pooled_projections=(1, 8),
            timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "HunyuanVideoTransformer3DModel": (
        dict(
            attention_head_dim=10, guidance_embeds=True, image_condition_type=None, in_channels=4,
            num_attention_heads=2, num_layers=1, num_refiner_layers=1, num_single_layers=1, out_channels=4,
            patch_size=1, patch_size_t=1, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
            text_embed_dim=16,
        ),
        dict(
            encoder_attention_mask=_full(1.0, 1, 12), encoder_hidden_states=(1, 12, 16),
            guidance=_full(44.0, 1), hidden_states=(1, 4, 1, 16, 16), pooled_projections=(1, 8),
            timestep=_full(44.0, 1),
        ),
    ),
    "Ideogram4Transformer2DModel": (
        dict(
            adaln_dim=16, attention_head_dim=8, in_channels=16, intermediate_size=32, llm_features_dim=24,
            mrope_section=(2, 1, 1), norm_eps=1e-05, num_attention_heads=4, num_layers=2, rope_theta=10000,
        ),
        dict(
            encoder_hidden_states=(1, 8, 24), hidden_states=(1, 8, 16), indicator=_ints(2, 4, 1, 8),
            position_ids=_ints(0, 65538, 1, 8, 3), segment_ids=_full(1, 1, 8, dtype=torch.int64),
            timestep=_full(0.5, 1),
        ),
    ),
    "JoyImageEditPlusTransformer3DModel": (
        dict(
            hidden_size=32, in_channels=16, num_attention_heads=2, num_layers=2, patch_size=[1, 2, 2],
            rope_dim_list=[4, 6, 6], text_dim=16, theta=256,
        ),
        dict(
            encoder_hidden_states=(1, 12, 16), hidden_states=(1, 2, 16, 1, 2, 2),
            shape_list=_literal([[(1, 1, 1), (1, 1, 1)]]), timestep=_full(1.0, 1),
        ),
    ),
    "JoyImageEditTransformer3DModel": (
        dict(
            hidden_size=32, in_channels=16, num_attention_heads=2, num_layers=2, patch_size=[1, 2, 2],
            rope_dim_list=[4, 6, 6], text_dim=16, theta=256,
        ),
        dict(encoder_hidden_states=(1, 12, 16), hidden_states=(1, 16, 1, 4, 4), timestep=_full(1.0, 1)),
    ),
    "Kandinsky3UNet": (
        dict(
            attention_head_dim=4, block_out_channels=(32, 64), cross_attention_dim=4, encoder_hid_dim=32,
            groups=2, in_channels=4, layers_per_block=3, time_embedding_dim=4,
        ),
        dict(
            sample=(1, 4, 8, 8), timestep=_ints(0, 1000, 1), encoder_hidden_states=(1, 4, 32),
            encoder_attention_mask=_full(1, 1, 4, dtype=torch.int64),
        ),
    ),
    "Krea2Transformer2DModel": (
        dict(
            attention_head_dim=8, axes_dims_rope=(4, 2, 2), in_channels=16, intermediate_size=32,
            norm_eps=1e-05, num_attention_heads=4, num_key_value_heads=2, num_layers=2,
            num_layerwise_text_blocks=1, num_refiner_text_blocks=1, num_text_layers=3, rope_theta=1000.0,
            text_hidden_dim=16, text_intermediate_size=16, text_num_attention_heads=2,
            text_num_key_value_heads=1, timestep_embed_dim=8,
        ),
        dict(
            encoder_attention_mask=_coin(1, 4), encoder_hidden_states=(1, 4, 3, 16),
            hidden_states=(1, 4, 16), position_ids=_ints(0, 2, 8, 3, real=True), timestep=_full(0.5, 1),
        ),
    ),
    "LTX2VideoTransformer3DModel": (
        dict(
            attention_head_dim=8, audio_attention_head_dim=4, audio_cross_attention_dim=8,
            audio_in_channels=4, audio_num_attention_heads=2, audio_out_channels=4, caption_channels=16,
            cross_attention_dim=16, in_channels=4, num_attention_heads=2, num_layers=2, out_channels=4,
            patch_size=1, patch_size_t=1, qk_norm='rms_norm_across_heads', rope_double_precision=False,
        ),
        dict(
            audio_encoder_hidden_states=(2, 16, 16), audio_hidden_states=(2, 9, 4), audio_num_frames=9,
            encoder_attention_mask=_full(True, 2, 16, dtype=torch.bool), encoder_hidden_states=(2, 16, 16),
            fps=25.0, height=16, hidden_states=(2, 512, 4), num_frames=2, timestep=(2,), width=16,
        ),
    ),
    "LTXVideoTransformer3DModel": (
        dict(
            attention_head_dim=8, caption_channels=16, cross_attention_dim=16, in_channels=4,
            num_attention_heads=2, num_layers=1, out_channels=4, qk_norm='rms_norm_across_heads',
        ),
        dict(
            encoder_attention_mask=_full(True, 2, 16, dtype=torch.bool), encoder_hidden_states=(2, 16, 16),
            height=16, hidden_states=(2, 512, 4), num_frames=2, timestep=_ints(44, 240, 2), width=16,
        ),
    ),
    "LatteTransformer3DModel": (
        dict(
            activation_fn='gelu-approximate', attention_bias=True, attention_head_dim=4, caption_channels=8,
            cross_attention_dim=8, in_channels=4, norm_elementwise_affine=False, norm_eps=1e-06,
            norm_type='ada_norm_single', num_attention_heads=2, num_embeds_ada_norm=1000, num_layers=1,
            out_channels=8, patch_size=2, sample_size=8,
        ),
        dict(
            enable_temporal_attentions=True, encoder_hidden_states=(2, 8, 8), hidden_states=(2, 4, 1, 8, 8),
            timestep=_ints(44, 240, 2),
        ),
    ),
    "LongCatAudioDiTTransformer": (
        dict(dit_depth=2, dit_dim=64, dit_heads=4, dit_text_dim=32, latent_dim=8, text_conv=False),
        dict(
            attention_mask=_full(True, 1, 16, dtype=torch.bool),
            encoder_attention_mask=_full(True, 1, 10, dtype=torch.bool), encoder_hidden_states=(1, 10, 32),
            hidden_states=(1, 16, 8), timestep=_full(1.0, 1),
        ),
    ),
    "LongCatImageTransformer2DModel": (
        dict(
            attention_head_dim=16, axes_dims_rope=[4, 4, 8], in_channels=4, joint_attention_dim=32,
            num_attention_heads=2, num_layers=1, num_single_layers=1, patch_size=1, pooled_projection_dim=32,
        ),
        dict(
            encoder_hidden_states=(1, 48, 32), guidance=_full(3.5, 1), hidden_states=(1, 16, 4),
            img_ids=(16, 3), timestep=_full(1.0, 1), txt_ids=(48, 3),
        ),
    ),
    "Lumina2Transformer2DModel": (
        dict(
            axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=32, ffn_dim_multiplier=None,
            hidden_size=24, in_channels=4, multiple_of=2, norm_eps=1e-05, num_attention_heads=3,
            num_kv_heads=1, num_layers=2, num_refiner_layers=1, patch_size=2, sample_size=16,
            scaling_factor=1.0,
        ),
        dict(
            encoder_attention_mask=_full(True, 2, 16, dtype=torch.bool), encoder_hidden_states=(2, 16, 32),
            hidden_states=(2, 4, 16, 16), timestep=_uniform(2,),
        ),
    ),
    "LuminaNextDiT2DModel": (
        dict(
            cross_attention_dim=32, ffn_dim_multiplier=None, hidden_size=24, in_channels=4,
            learn_sigma=False, multiple_of=16, norm_eps=1e-05, num_attention_heads=3, num_kv_heads=1,
            num_layers=2, patch_size=2, qk_norm=True, sample_size=16, scaling_factor=1.0,
        ),
        dict(
            cross_attention_kwargs={}, encoder_hidden_states=(2, 16, 32), encoder_mask=(2, 16),
            hidden_states=(2, 4, 16, 16), image_rotary_emb=(384, 384, 4), timestep=_uniform(2,),
        ),
    ),
    "MiniMaxH3Transformer3DModel": (
        dict(
            attention_head_dim=16, audio_in_channels=6, ffn_dim=32, freq_dim=8, hidden_size=24,
            in_channels=4, num_attention_heads=2, num_layers=2, num_refiner_layers=2, patch_size=(1, 2, 2),
            rope_freq_dim=2, text_dim=8, time_embed_dim=16, time_embed_hidden_dim=24,
        ),
        dict(
            audio_hidden_states=(2, 6, 6), audio_indices=_ints(4, 10, 6), encoder_hidden_states=(2, 4, 8),
            hidden_states=(2, 8, 16), position_ids=_ints(0, 18, 18, 3, real=True),
            text_indices=_ints(0, 4, 4), timestep=_uniform(2,), timestep_indices=_ints(0, 2, 18),
            token_tags=_ints(0, 3, 18), video_indices=_ints(10, 18, 8),
        ),
    ),
    "MiniMaxMusic3Transformer1DModel": (
        dict(
            attention_head_dim=8, condition_dim=16, ff_inner_dim=32, fourier_embedding_dim=8, in_channels=8,
            num_attention_heads=2, num_layers=2, rotary_dim=4,
        ),
        dict(encoder_hidden_states=(1, 24, 16), hidden_states=(1, 8, 24), timestep=_full(0.5, 1)),
    ),
    "MochiTransformer3DModel": (
        dict(
            activation_fn='swiglu', attention_head_dim=8, in_channels=4, max_sequence_length=16,
            num_attention_heads=2, num_layers=2, out_channels=None, patch_size=2, pooled_projection_dim=16,
            qk_norm='rms_norm', text_embed_dim=16, time_embed_dim=4,
        ),
        dict(
            encoder_attention_mask=_full(True, 2, 16, dtype=torch.bool), encoder_hidden_states=(2, 16, 16),
            hidden_states=(2, 4, 2, 16, 16), timestep=_ints(44, 240, 2),
        ),
    ),
    "MotifVideoTransformer3DModel": (
        dict(
            attention_head_dim=12, enable_text_cross_attention_dual=False,
            enable_text_cross_attention_single=False, image_embed_dim=4, in_channels=33, mlp_ratio=4.0,
            norm_type='layer_norm', num_attention_heads=2, num_decoder_layers=0, num_layers=1,
            num_single_layers=1, out_channels=16, patch_size=1, patch_size_t=1, qk_norm='rms_norm',
            rope_axes_dim=(4, 4, 4), rope_theta=256.0, text_embed_dim=32,
        ),
        dict(
            encoder_hidden_states=(1, 12, 32), hidden_states=(1, 33, 9, 16, 16),
            timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "NucleusMoEImageTransformer2DModel": (
        dict(
            attention_head_dim=16, axes_dims_rope=(8, 4, 4), capacity_factors=[8.0, 8.0], in_channels=16,
            joint_attention_dim=16, moe_enabled=False, num_attention_heads=4, num_layers=2, out_channels=4,
            patch_size=2,
        ),
        dict(
            encoder_hidden_states=(1, 8, 16), encoder_hidden_states_mask=_full(1, 1, 8, dtype=torch.int64),
            hidden_states=(1, 16, 16), img_shapes=_literal([(1, 4, 4)]), timestep=_full(1.0, 1),
        ),
    ),
    "OmniGenTransformer2DModel": (
        dict(
            hidden_size=16, in_channels=4, intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, num_layers=2, pad_token_id=0,
            rope_scaling={'long_factor': [1, 2], 'short_factor': [1, 2]}, time_step_dim=4, vocab_size=1000,
        ),
        dict(
            attention_mask=_full(1.0, 2, 41, 41), hidden_states=(2, 4, 8, 8), input_ids=_ints(0, 10, 2, 24),
            input_image_sizes={0: [[0, 16]]}, input_img_latents=[(1, 4, 8, 8)],
            position_ids=_ints(0, 41, 2, 41), timestep=_uniform(2,),
        ),
    ),
    "OvisImageTransformer2DModel": (
        dict(
            attention_head_dim=16, axes_dims_rope=(4, 4, 8), in_channels=4, joint_attention_dim=32,
            num_attention_heads=2, num_layers=1, num_single_layers=1, out_channels=4, patch_size=1,
        ),
        dict(
            encoder_hidden_states=(1, 48, 32), hidden_states=(1, 16, 4), img_ids=(16, 3),
            timestep=_full(1.0, 1), txt_ids=(48, 3),
        ),
    ),
    "PRXTransformer2DModel": (
        dict(
            axes_dim=[16, 16], context_in_dim=32, depth=2, hidden_size=64, in_channels=16, mlp_ratio=3.5,
            num_heads=2, patch_size=2, theta=10000,
        ),
        dict(encoder_hidden_states=(1, 16, 32), hidden_states=(1, 16, 8, 8), timestep=_full(1.0, 1)),
    ),
    "PixArtTransformer2DModel": (
        dict(
            activation_fn='gelu-approximate', attention_bias=True, attention_head_dim=2,
            caption_channels=None, cross_attention_dim=8, in_channels=4, norm_elementwise_affine=False,
            norm_eps=1e-06, norm_type='ada_norm_single', num_attention_heads=2, num_embeds_ada_norm=8,
            num_layers=1, out_channels=8, patch_size=2, sample_size=8, use_additional_conditions=False,
        ),
        dict(
            added_cond_kwargs={'aspect_ratio': None, 'resolution': None}, encoder_hidden_states=(4, 8, 8),
            hidden_states=(4, 4, 8, 8), timestep=_ints(44, 934, 4),
        ),
    ),
    "PriorTransformer": (
        dict(
            additional_embeddings=4, attention_head_dim=4, embedding_dim=8, num_attention_heads=2,
            num_embeddings=7, num_layers=2,
        ),
        dict(encoder_hidden_states=(4, 7, 8), hidden_states=(4, 8), proj_embedding=(4, 8), timestep=2),
    ),
    "QwenImageControlNetModel": (
        dict(
            attention_head_dim=16, axes_dims_rope=(8, 4, 4), in_channels=16, joint_attention_dim=16,
            num_attention_heads=3, num_layers=2, out_channels=4, patch_size=2,
        ),
        dict(
            hidden_states=(1, 16, 16), controlnet_cond=(1, 16, 16), encoder_hidden_states=(1, 7, 16),
            encoder_hidden_states_mask=_full(1, 1, 7, dtype=torch.int64), timestep=_full(1.0, 1),
            img_shapes=_literal([(1, 4, 4)]),
        ),
    ),
    "QwenImageTransformer2DModel": (
        dict(
            attention_head_dim=16, axes_dims_rope=(8, 4, 4), guidance_embeds=False, in_channels=16,
            joint_attention_dim=16, num_attention_heads=4, num_layers=2, out_channels=4, patch_size=2,
        ),
        dict(
            encoder_hidden_states=(1, 8, 16), encoder_hidden_states_mask=_full(1, 1, 8, dtype=torch.int64),
            hidden_states=(1, 16, 16), img_shapes=_literal([(1, 4, 4)]), timestep=_full(1.0, 1),
        ),
    ),
    "SD3ControlNetModel": (
        dict(
            attention_head_dim=8, caption_projection_dim=32, extra_conditioning_channels=1, in_channels=8,
            joint_attention_dim=32, num_attention_heads=4, num_layers=1, out_channels=8, patch_size=1,
            pooled_projection_dim=64, sample_size=32,
        ),
        dict(
            hidden_states=(1, 8, 16, 16), controlnet_cond=(1, 9, 16, 16), encoder_hidden_states=(1, 6, 32),
            pooled_projections=(1, 64), timestep=_ints(0, 1000, 1),
        ),
    ),
    "SD3Transformer2DModel": (
        dict(
            attention_head_dim=8, caption_projection_dim=32, dual_attention_layers=(), in_channels=4,
            joint_attention_dim=32, num_attention_heads=4, num_layers=4, out_channels=4, patch_size=1,
            pooled_projection_dim=64, pos_embed_max_size=96, qk_norm=None, sample_size=32,
        ),
        dict(
            encoder_hidden_states=(2, 154, 32), hidden_states=(2, 4, 32, 32), pooled_projections=(2, 64),
            timestep=_ints(44, 240, 2),
        ),
    ),
    "SanaControlNetModel": (
        dict(
            attention_head_dim=4, caption_channels=8, cross_attention_dim=8, cross_attention_head_dim=4,
            in_channels=4, num_attention_heads=2, num_cross_attention_heads=2, num_layers=1, out_channels=4,
            patch_size=1, sample_size=32,
        ),
        dict(
            hidden_states=(1, 4, 8, 8), encoder_hidden_states=(1, 6, 8), timestep=_ints(0, 1000, 1),
            controlnet_cond=(1, 4, 8, 8),
        ),
    ),
    "SanaTransformer2DModel": (
        dict(
            attention_head_dim=4, caption_channels=8, cross_attention_dim=8, cross_attention_head_dim=4,
            in_channels=4, num_attention_heads=2, num_cross_attention_heads=2, num_layers=1, out_channels=4,
            patch_size=1, sample_size=32,
        ),
        dict(encoder_hidden_states=(2, 8, 8), hidden_states=(2, 4, 32, 32), timestep=_ints(44, 240, 2)),
    ),
    "SanaVideoTransformer3DModel": (
        dict(
            attention_bias=False, attention_head_dim=12, caption_channels=16, cross_attention_dim=24,
            cross_attention_head_dim=12, dropout=0.0, in_channels=16, mlp_ratio=2.5,
            norm_elementwise_affine=False, norm_eps=1e-06, num_attention_heads=2,
            num_cross_attention_heads=2, num_layers=2, out_channels=16, patch_size=(1, 2, 2),
            qk_norm='rms_norm_across_heads', rope_max_seq_len=32, sample_size=8,
        ),
        dict(
            encoder_hidden_states=(1, 12, 16), hidden_states=(1, 16, 2, 16, 16),
            timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "SkyReelsV2Transformer3DModel": (
        dict(
            attention_head_dim=12, cross_attn_norm=True, ffn_dim=32, freq_dim=256, in_channels=4,
            num_attention_heads=2, num_layers=2, out_channels=4, patch_size=(1, 2, 2),
            qk_norm='rms_norm_across_heads', rope_max_seq_len=32, text_dim=16,
        ),
        dict(
            encoder_hidden_states=(1, 12, 16), hidden_states=(1, 4, 2, 16, 16),
            timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "SparseControlNetModel": (
        dict(
            block_out_channels=(8, 8), conditioning_channels=3, conditioning_embedding_out_channels=(8, 8),
            cross_attention_dim=8, down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
            in_channels=4, layers_per_block=2, norm_num_groups=1, use_simplified_condition_embedding=False,
        ),
        dict(
            sample=(1, 4, 2, 16, 16), timestep=_ints(0, 1000, 1), encoder_hidden_states=(2, 4, 8),
            controlnet_cond=(1, 3, 2, 32, 32), conditioning_mask=_full(1.0, 1, 1, 2, 32, 32),
        ),
    ),
    "StableAudio3DiTModel": (
        dict(
            cond_token_dim=16, depth=2, embed_dim=32, ff_mult=2, global_cond_dim=12, io_channels=8,
            local_add_cond_dim=5, num_heads=4, num_memory_tokens=3, patch_size=1, timestep_features_dim=16,
            use_differential_attention=False,
        ),
        dict(
            encoder_hidden_states=(2, 4, 16), global_hidden_states=(2, 12), hidden_states=(2, 8, 16),
            timestep=_uniform(2,),
        ),
    ),
    "StableAudioDiTModel": (
        dict(
            attention_head_dim=4, cross_attention_dim=4, cross_attention_input_dim=4,
            global_states_input_dim=8, in_channels=3, num_key_value_attention_heads=2, num_layers=2,
            out_channels=3, sample_size=4, time_proj_dim=8,
        ),
        dict(
            hidden_states=(1, 3, 4), timestep=_ints(0, 1000, 1), encoder_hidden_states=(1, 6, 4),
            global_hidden_states=(1, 1, 8),
        ),
    ),
    "Transformer2DModel": (
        dict(
            num_attention_heads=2, attention_head_dim=4, attention_type="default", cross_attention_dim=8,
            in_channels=8, norm_num_groups=2, num_layers=1, only_cross_attention=False,
            upcast_attention=False, use_linear_projection=False,
        ),
        dict(hidden_states=(1, 8, 4, 4), encoder_hidden_states=(1, 4, 8)),
    ),
    "TransformerTemporalModel": (
        dict(attention_head_dim=4, in_channels=4, norm_num_groups=1, num_attention_heads=8, num_layers=1),
        dict(hidden_states=(2, 4, 32, 32), timestep=_ints(44, 240, 2)),
    ),
    "UNet1DModel": (
        dict(
            act_fn='swish', block_out_channels=(8, 8, 16, 16),
            down_block_types=('DownResnetBlock1D', 'DownResnetBlock1D', 'DownResnetBlock1D', 'DownResnetBlock1D'),
            flip_sin_to_cos=False, freq_shift=1.0, in_channels=14, mid_block_type='MidResTemporalBlock1D',
            out_block_type='OutConv1DBlock', out_channels=14, time_embedding_type='positional',
            up_block_types=('UpResnetBlock1D', 'UpResnetBlock1D', 'UpResnetBlock1D'),
            use_timestep_embedding=True,
        ),
        dict(sample=(4, 14, 16), timestep=_full(10, 4, dtype=torch.int64)),
    ),
    "UNet2DConditionModel": (
        dict(
            attention_head_dim=2, block_out_channels=(4, 8), cross_attention_dim=8,
            down_block_types=('CrossAttnDownBlock2D', 'DownBlock2D'), in_channels=4, layers_per_block=1,
            norm_num_groups=4, out_channels=4, sample_size=16,
            up_block_types=('UpBlock2D', 'CrossAttnUpBlock2D'),
        ),
        dict(
            encoder_hidden_states=(4, 4, 8), sample=(4, 4, 16, 16), timestep=_full(10, 1, dtype=torch.int64),
        ),
    ),
    "UNet2DModel": (
        dict(
            attention_head_dim=3, block_out_channels=(4, 8),
            down_block_types=('DownBlock2D', 'AttnDownBlock2D'), in_channels=3, layers_per_block=2,
            norm_num_groups=2, out_channels=3, sample_size=32, up_block_types=('AttnUpBlock2D', 'UpBlock2D'),
        ),
        dict(sample=(4, 3, 32, 32), timestep=_full(10, 1, dtype=torch.int64)),
    ),
    "UNet3DConditionModel": (
        dict(
            attention_head_dim=2, block_out_channels=(4, 8), cross_attention_dim=8,
            down_block_types=('CrossAttnDownBlock3D', 'DownBlock3D'), in_channels=4, layers_per_block=1,
            norm_num_groups=4, out_channels=4, sample_size=16,
            up_block_types=('UpBlock3D', 'CrossAttnUpBlock3D'),
        ),
        dict(
            encoder_hidden_states=(1, 4, 8), sample=(1, 4, 2, 16, 16),
            timestep=_full(10, 1, dtype=torch.int64),
        ),
    ),
    "UNetControlNetXSModel": (
        dict(
            block_out_channels=(4, 8), cross_attention_dim=8, ctrl_block_out_channels=[2, 4],
            ctrl_conditioning_embedding_out_channels=(2, 2), ctrl_max_norm_num_groups=2,
            ctrl_num_attention_heads=4, down_block_types=('DownBlock2D', 'CrossAttnDownBlock2D'),
            norm_num_groups=4, num_attention_heads=2, sample_size=16, transformer_layers_per_block=1,
            up_block_types=('CrossAttnUpBlock2D', 'UpBlock2D'), upcast_attention=False,
        ),
        dict(
            conditioning_scale=1, controlnet_cond=(4, 3, 32, 32), encoder_hidden_states=(4, 4, 8),
            sample=(4, 4, 16, 16), timestep=_full(10, 1, dtype=torch.int64),
        ),
    ),
    "UNetMotionModel": (
        dict(
            block_out_channels=(16, 32), cross_attention_dim=16,
            down_block_types=('CrossAttnDownBlockMotion', 'DownBlockMotion'), in_channels=4,
            layers_per_block=1, norm_num_groups=16, num_attention_heads=2, out_channels=4, sample_size=16,
            up_block_types=('UpBlockMotion', 'CrossAttnUpBlockMotion'),
        ),
        dict(
            encoder_hidden_states=(16, 4, 16), sample=(4, 4, 4, 16, 16),
            timestep=_full(10, 1, dtype=torch.int64),
        ),
    ),
    "UNetSpatioTemporalConditionModel": (
        dict(
            addition_time_embed_dim=32, block_out_channels=(32, 64), cross_attention_dim=32,
            down_block_types=('CrossAttnDownBlockSpatioTemporal', 'DownBlockSpatioTemporal'), in_channels=4,
            layers_per_block=2, num_attention_heads=8, out_channels=4,
            projection_class_embeddings_input_dim=96, sample_size=32,
            up_block_types=('UpBlockSpatioTemporal', 'CrossAttnUpBlockSpatioTemporal'),
        ),
        dict(
            added_time_ids=(1, 3), encoder_hidden_states=(1, 1, 32), sample=(1, 2, 4, 16, 16),
            timestep=_full(10, 1, dtype=torch.int64),
        ),
    ),
    "VQModel": (
        dict(
            block_out_channels=[8, 16], down_block_types=['DownEncoderBlock2D', 'DownEncoderBlock2D'],
            in_channels=3, latent_channels=3, norm_num_groups=8, out_channels=3,
            up_block_types=['UpDecoderBlock2D', 'UpDecoderBlock2D'],
        ),
        dict(sample=(4, 3, 32, 32)),
    ),
    "WanAnimateTransformer3DModel": (
        dict(
            attention_head_dim=12, cross_attn_norm=True, face_encoder_hidden_dim=16,
            face_encoder_num_heads=2, ffn_dim=32, freq_dim=256, image_dim=16, in_channels=12,
            inject_face_latents_blocks=2, latent_channels=4, motion_dim=4,
            motion_encoder_channel_sizes={'16': 16, '4': 16, '8': 16}, motion_encoder_dim=16,
            motion_encoder_size=16, motion_style_dim=8, num_attention_heads=2, num_layers=2, out_channels=4,
            patch_size=(1, 2, 2), qk_norm='rms_norm_across_heads', rope_max_seq_len=32, text_dim=16,
        ),
        dict(
            encoder_hidden_states=(1, 12, 16), encoder_hidden_states_image=(1, 12, 16),
            face_pixel_values=(1, 3, 77, 16, 16), hidden_states=(1, 12, 21, 16, 16),
            pose_hidden_states=(1, 4, 20, 16, 16), timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "WanTransformer3DModel": (
        dict(
            attention_head_dim=12, cross_attn_norm=True, ffn_dim=32, freq_dim=256, in_channels=4,
            num_attention_heads=2, num_layers=2, out_channels=4, patch_size=(1, 2, 2),
            qk_norm='rms_norm_across_heads', rope_max_seq_len=32, text_dim=16,
        ),
        dict(
            encoder_hidden_states=(1, 12, 16), hidden_states=(1, 4, 2, 16, 16),
            timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "WanVACETransformer3DModel": (
        dict(
            attention_head_dim=12, cross_attn_norm=True, ffn_dim=32, freq_dim=256, in_channels=16,
            num_attention_heads=2, num_layers=4, out_channels=16, patch_size=(1, 2, 2),
            qk_norm='rms_norm_across_heads', rope_max_seq_len=32, text_dim=32, vace_in_channels=48,
            vace_layers=[0, 2],
        ),
        dict(
            control_hidden_states=(1, 48, 2, 16, 16), encoder_hidden_states=(1, 12, 32),
            hidden_states=(1, 16, 2, 16, 16), timestep=_full(44, 1, dtype=torch.int64),
        ),
    ),
    "ZImageTransformer2DModel": (
        dict(
            all_f_patch_size=(1,), all_patch_size=(2,), axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
            cap_feat_dim=16, dim=16, in_channels=16, n_heads=1, n_kv_heads=2, n_layers=1, n_refiner_layers=1,
            qk_norm=True, rope_theta=256.0, t_scale=1000.0,
        ),
        dict(cap_feats=[(16, 16)], t=_full(0.0, 1), x=[(16, 1, 16, 16)]),
    ),
}
"""Tiny configs and inputs, most as diffusers' own model tests make them."""

TINY: Dict[str, Tiny] = {name: Tiny(name, config, inputs) for name, (config, inputs) in _TABLE.items()}

_NO_CONFIG = "no tiny config here yet: diffusers' own tests build it only inside its pipeline, or not at all"
_NO_GC = (
    "no gradient checkpointing of its own (it does not support it): nothing of diffusers' to hold blocks to, "
    "and no tiny config here"
)
_MULTI = "a list of other models, run one after the other"

NOT_BUILT: Dict[str, str] = {
    "AceStepAudioTokenDetokenizer": _NO_CONFIG,
    "AceStepAudioTokenizer": _NO_CONFIG,
    "AceStepConditionEncoder": _NO_CONFIG,
    "AnimaTextConditioner": _NO_CONFIG,
    "AnyFlowFARTransformer3DModel": "its FlexAttention has no backward on the CPU and refuses inputs that require grad",
    "AudioLDM2ProjectionModel": _NO_GC,
    "AutoencoderKLAllegro": "it encodes only tile by tile (enable_tiling()), not in one training forward",
    "AutoencoderKLHunyuanImageRefiner": _NO_CONFIG,
    "AutoencoderKLKVAEAudio": _NO_GC,
    "AutoencoderKLQwenImage21": _NO_GC,
    "AutoencoderRAE": _NO_GC,
    "BriaFibo2Transformer2DModel": _NO_CONFIG,
    "CLIPImageProjection": _NO_GC,
    "ControlNetUnionModel": _NO_CONFIG,
    "ControlNetXSAdapter": "no forward of its own: UNetControlNetXSModel, here, runs it",
    "CosmosControlNetModel": "its forward needs torchvision, which is not installed here",
    "CosmosTransformer3DModel": "its forward needs torchvision, which is not installed here",
    "DreamLiteTransformer2DModel": "the tiny config of its pipeline does not run alone; DreamLiteUNetModel, here, runs it inside",
    "Flux3Transformer2DModel": _NO_CONFIG,
    "FluxMultiControlNetModel": _MULTI,
    "HunyuanDiT2DMultiControlNetModel": _MULTI,
    "I2VGenXLUNet": _NO_GC,
    "Ideogram4PromptEnhancerHead": _NO_GC,
    "Kandinsky5Transformer3DModel": _NO_CONFIG,
    "Kandinsky6SRLatentUpscalerBank": _NO_GC,
    "Kandinsky6SRTransformer3DModel": _NO_CONFIG,
    "Kandinsky6SRVAE": _NO_GC,
    "Kandinsky6Transformer3DModel": _NO_CONFIG,
    "LongCatAudioDiTVae": _NO_GC,
    "LTX2VideoDiffusionDecoderModel": "its FlexAttention has no backward on the CPU and refuses inputs that require grad",
    "MMAudioVAE": _NO_GC,
    "MMAudioVocoder": _NO_GC,
    "MiniMaxMusic3ConditionEncoder": _NO_GC,
    "MiniMaxMusic3RVQDepthDecoder": _NO_GC,
    "MiniMaxMusic3Vocoder": _NO_GC,
    "MotionAdapter": "no forward of its own: the motion modules it holds run inside UNetMotionModel, here",
    "MultiAdapter": _MULTI,
    "MultiControlNetModel": _MULTI,
    "QwenImage21Transformer2DModel": _NO_CONFIG,
    "QwenImageMultiControlNetModel": _MULTI,
    "RFD4ProteinaAutoencoder": _NO_GC,
    "RFD4ProteinaTransformer": _NO_CONFIG,
    "ReduxImageEncoder": _NO_GC,
    "SD3MultiControlNetModel": _MULTI,
    "SanaWMLTX2RefinerTransformer3DModel": _NO_GC,
    "SanaWMTransformer3DModel": _NO_CONFIG,
    "StableAudio3DurationEmbedder": _NO_GC,
    "StableAudioProjectionModel": _NO_GC,
    "StableCascadeUNet": _NO_CONFIG,
    "T2IAdapter": _NO_GC,
    "T5FilmDecoder": _NO_GC,
    "UVit2DModel": _NO_CONFIG,
    "UniDiffuserModel": _NO_GC,
    "UniDiffuserTextDecoder": _NO_GC,
    "WanAnimate2Transformer3DModel": "its forward needs a WanAnimate2KVCache that its pipeline fills in a reference pass first",
    "ZImageControlNetModel": _NO_CONFIG,
}
"""Model classes diffusers exports that are not in :data:`TINY`, and why."""

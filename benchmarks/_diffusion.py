"""Diffusers models built tiny from their configs, for the budget loops: a denoising step's
loss (the prediction's mean squared error against the noise) around each, so that the
output has a ``loss`` as the loops expect."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List

import torch
from torch import nn

from _architectures import Architecture

__all__ = ["DIFFUSION", "available"]

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

"""Model factories to try the ``python -m ckptwrap plan`` command on.

Each factory takes no arguments and returns a freshly initialised model; the command
builds it, profiles it on random inputs of the given shape and prints the plan::

    python -m ckptwrap plan examples/factories.py:gpt_small \\
        --input-shape 8,128 --input-dtype long --vocab 512 --policy budget:50%
    python -m ckptwrap plan examples/factories.py:conv_pyramid \\
        --input-shape 8,3,128,128 --policy budget:50% --pareto pyramid.png

The two differ in where memory goes. The GPT's blocks all cost the same, so a budget
checkpoints some number of interchangeable blocks. The pyramid's early, high-resolution
stages hold most of the activation memory for a fraction of the compute, so a good plan
recomputes those and keeps the cheap-to-store late stages, which ``every:2`` does not.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

# Imported as ``examples.factories`` (not by path), the sibling gpt.py is not on sys.path.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from gpt import GPT, GPTConfig  # noqa: E402

__all__ = ["conv_pyramid", "gpt_small", "ConvPyramid", "ResidualBlock"]


def gpt_small() -> GPT:
    """A small GPT: 8 blocks of width 128, sequences up to 128 tokens, 512 token ids.

    Try it with::

        python -m ckptwrap plan examples/factories.py:gpt_small \\
            --input-shape 8,128 --input-dtype long --vocab 512 --policy budget:50%
    """
    return GPT(GPTConfig(vocab=512, width=128, heads=4, layers=8, seq_len=128))


def conv_pyramid() -> "ConvPyramid":
    """A convolutional pyramid for 3x128x128 images: 4 stages of 16, 32, 64, 128 channels.

    Try it with::

        python -m ckptwrap plan examples/factories.py:conv_pyramid \\
            --input-shape 8,3,128,128 --policy budget:50%
    """
    return ConvPyramid(in_channels=3, widths=(16, 32, 64, 128), blocks_per_stage=2, classes=10)


class ResidualBlock(nn.Module):
    """Conv-BN-ReLU-Conv-BN on a residual, at constant resolution and width."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(x + out)


class _Downsample(nn.Module):
    """A strided convolution that halves the resolution and changes the width."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class ConvPyramid(nn.Module):
    """An image classifier whose resolution halves and width doubles at every stage.

    Activation memory per block scales with resolution x width, compute with resolution x
    width², so the first stage keeps 8 times the bytes of the last for the same FLOPs.

    Args:
        in_channels: Channels of the input images.
        widths: Channels of each stage; stage i runs at 1/2**i of the input resolution.
        blocks_per_stage: :class:`ResidualBlock` s per stage.
        classes: Outputs of the linear head.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        widths: Sequence[int],
        blocks_per_stage: int,
        classes: int,
    ) -> None:
        super().__init__()
        # Each stage is its own nn.Sequential (not items of one container), so that the
        # ``blocks`` policy finds the residual blocks rather than the four stages.
        previous = in_channels
        for index, width in enumerate(widths):
            stride = 1 if index == 0 else 2
            layers = [_Downsample(previous, width, stride)]
            layers += [ResidualBlock(width) for _ in range(blocks_per_stage)]
            self.add_module(f"stage{index}", nn.Sequential(*layers))
            previous = width
        self.stages = len(widths)
        self.head = nn.Linear(previous, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits of shape ``(batch, classes)`` for images ``(batch, C, H, W)``."""
        x = images
        for index in range(self.stages):
            x = getattr(self, f"stage{index}")(x)
        return self.head(x.mean(dim=(2, 3)))

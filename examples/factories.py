"""Model factories to try the ``python -m ckptwrap plan`` command on.

Each factory takes no arguments and returns a freshly initialised model; the command
builds it, profiles it on random inputs of the given shape and prints the plan::

    python -m ckptwrap plan examples/factories.py:gpt_small \\
        --input-shape 8,128 --vocab 512 --policy budget:50% --pareto gpt.png
    python -m ckptwrap plan examples/factories.py:conv_pyramid \\
        --input-shape 8,3,128,128 --policy budget:70% --pareto pyramid.png

The two differ in where memory goes. The GPT's blocks all cost the same, so a budget
checkpoints some number of interchangeable blocks. The pyramid's early, high-resolution
blocks each keep several times the bytes of a late one for about the same compute, so a
budget recomputes those first and keeps the late ones, which ``every:2`` does not.
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
            --input-shape 8,128 --vocab 512 --policy budget:50%

    ``--vocab 512`` draws token ids in [0, 512) (as ``--input-dtype long``).
    """
    return GPT(GPTConfig(vocab=512, width=128, heads=4, layers=8, seq_len=128))


def conv_pyramid() -> "ConvPyramid":
    """A convolutional pyramid for 3x128x128 images: 4 stages of 16, 48, 144, 432 channels.

    Try it with::

        python -m ckptwrap plan examples/factories.py:conv_pyramid \\
            --input-shape 8,3,128,128 --policy budget:70%

    Checkpointing its blocks cannot bring the training step's peak below about 50%: the
    stem's activations and every block's output stay (the next block saves it), one block
    is recomputed at a time, and the high-resolution stages' gradients come on top, so
    ``budget:25%`` is refused with the smallest reachable peak.
    """
    return ConvPyramid(in_channels=3, widths=PYRAMID_WIDTHS, blocks_per_stage=2, classes=10)


PYRAMID_WIDTHS = (16, 48, 144, 432)
"""Channels per stage of :func:`conv_pyramid`: tripling while the resolution halves, so a
block's compute grows 2.25-fold per stage while its activations shrink by a quarter."""


class ResidualBlock(nn.Module):
    """Conv-BN-ReLU-Conv-BN on a residual, then ReLU, as in ResNet's basic block.

    As there, the ReLUs and the residual add work in place, so a block holds no
    temporaries beside what it saves for backward.

    Args:
        in_channels: Channels of the input.
        out_channels: Channels of the output.
        stride: 2 to halve the resolution (the first block of a stage), else 1. When the
            shape changes, the residual goes through a strided 1x1 convolution and BN.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += self.shortcut(x)
        return self.relu(out)


class ConvPyramid(nn.Module):
    """An image classifier whose resolution halves at every stage as its width grows.

    Per block, activation memory scales with resolution x width and compute with
    resolution x width². With widths tripling (:func:`conv_pyramid`), a first-stage block
    keeps about 7 times the bytes of a last-stage block for a ninth of its FLOPs:
    recomputing early blocks buys the most memory per second of compute. (With widths
    doubling, FLOPs per block are equal across stages, but on a CPU the high-resolution,
    narrow convolutions of the first stage still take the longest.)

    Args:
        in_channels: Channels of the input images.
        widths: Channels of each stage; stage i runs at 1/2**i of the input resolution.
        blocks_per_stage: :class:`ResidualBlock` s per stage; the first block of every
            stage but the first halves the resolution.
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
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        # Every stage is its own nn.Sequential attribute, not an item of one container:
        # ``blocks`` then finds the residual blocks, not the four stages.
        previous = widths[0]
        for index, width in enumerate(widths):
            stride = 1 if index == 0 else 2
            blocks = [ResidualBlock(previous, width, stride)]
            blocks += [ResidualBlock(width, width) for _ in range(blocks_per_stage - 1)]
            self.add_module(f"stage{index}", nn.Sequential(*blocks))
            previous = width
        self.stages = len(widths)
        self.head = nn.Linear(previous, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits of shape ``(batch, classes)`` for images ``(batch, C, H, W)``."""
        x = self.stem(images)
        for index in range(self.stages):
            x = getattr(self, f"stage{index}")(x)
        return self.head(x.mean(dim=(2, 3)))

"""Small models shaped like the ones policies meet in practice, shared by the policy tests.

They hold tiny layers: selection reads only the module tree, never runs a forward.
"""

from __future__ import annotations

from typing import List

from torch import nn

WIDTH = 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )


class GPT(nn.Module):
    """Embedding, a ModuleList of blocks ``h.0`` .. ``h.{n-1}``, a final LayerNorm."""

    def __init__(self, n_layers: int = 12) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, WIDTH)
        self.h = nn.ModuleList(GPTBlock() for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(WIDTH)


class BertSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(WIDTH, WIDTH)
        self.key = nn.Linear(WIDTH, WIDTH)
        self.value = nn.Linear(WIDTH, WIDTH)


class BertAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self = BertSelfAttention()
        self.output = nn.Linear(WIDTH, WIDTH)


class BertLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = BertAttention()
        self.intermediate = nn.Linear(WIDTH, 4 * WIDTH)
        self.output = nn.Linear(4 * WIDTH, WIDTH)


class BertEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(16, WIDTH)
        self.position_embeddings = nn.Embedding(8, WIDTH)
        self.LayerNorm = nn.LayerNorm(WIDTH)


class BertEncoder(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer() for _ in range(n_layers))


class Bert(nn.Module):
    """Embeddings, ``encoder.layer.0`` .. ``encoder.layer.{n-1}``, a pooler Sequential."""

    def __init__(self, n_layers: int = 6) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings()
        self.encoder = BertEncoder(n_layers)
        self.pooler = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.downsample = None
        if channels_in != channels_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1), nn.BatchNorm2d(channels_out)
            )


class ResNet(nn.Module):
    """A stem, ``layer1`` .. ``layer3`` (Sequentials of two BasicBlocks), a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 2, 3)
        self.bn1 = nn.BatchNorm2d(2)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(2, 2), BasicBlock(2, 2))
        self.layer2 = nn.Sequential(BasicBlock(2, 4), BasicBlock(4, 4))
        self.layer3 = nn.Sequential(BasicBlock(4, 8), BasicBlock(8, 8))
        self.fc = nn.Linear(8, 10)


def mlp() -> nn.Sequential:
    """A plain Sequential MLP: Linear layers at ``0``, ``2``, ``4``, ReLUs between."""
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1)
    )


class NoRepeat(nn.Module):
    """Nothing repeats: no container holds two modules of one class."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.act = nn.ReLU()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, 2))


def module_names(model: nn.Module) -> List[str]:
    """Qualified names of every module but the root, in model order."""
    return [name for name, _ in model.named_modules()][1:]


def gpt_blocks(n_layers: int = 12) -> List[str]:
    return [f"h.{i}" for i in range(n_layers)]

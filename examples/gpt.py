"""A small GPT-style language model, used by the examples and the benchmarks.

Token and position embeddings, a stack of pre-LayerNorm transformer blocks (causal
multi-head self-attention and an MLP, with dropout), a final LayerNorm and an LM head.
Every block can be run through a checkpoint function, which is what the examples compare.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "synthetic_batch"]

#: Runs one block on the hidden states, e.g. ``lambda block, x: ckptwrap.checkpoint(block, x)``.
BlockRunner = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes of a :class:`GPT` model."""

    vocab: int = 512
    """Number of distinct token ids."""
    width: int = 128
    """Hidden size of every block."""
    heads: int = 4
    """Attention heads per block; must divide ``width``."""
    layers: int = 4
    """Number of transformer blocks."""
    seq_len: int = 128
    """Longest sequence the position embedding covers."""
    dropout: float = 0.1
    """Dropout probability on attention weights, residual branches and embeddings."""

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "heads", "layers", "seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {value}")
        if self.width % self.heads:
            raise ValueError(
                f"GPTConfig.width must be a multiple of heads, got width={self.width} "
                f"and heads={self.heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only earlier ones."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.attn_drop = nn.Dropout(config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)
        mask = torch.ones(config.seq_len, config.seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        head_dim = width // self.heads
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        # Written out rather than fused so that the attention weights and their dropout
        # mask are real activations, as in the models people checkpoint.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~self.causal_mask[:seq, :seq], float("-inf"))
        weights = self.attn_drop(scores.softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, width)
        return self.resid_drop(self.proj(out))


class MLP(nn.Module):
    """Position-wise feed-forward network, four times wider than the model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.proj = nn.Linear(4 * config.width, config.width)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: attention then MLP, each on a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """A decoder-only transformer language model.

    Args:
        config: The model's sizes.
        checkpoint_blocks: If given, every block is run as ``checkpoint_blocks(block, x)``
            while autograd is on, instead of ``block(x)``. May also be set later through
            the attribute of the same name.

    Example:
        >>> model = GPT(GPTConfig(layers=2), checkpoint_blocks=lambda block, x: checkpoint(block, x))
        >>> inputs, targets = synthetic_batch(model.config, batch=4)
        >>> model(inputs, targets).backward()
    """

    def __init__(self, config: GPTConfig, *, checkpoint_blocks: BlockRunner | None = None) -> None:
        super().__init__()
        self.config = config
        self.checkpoint_blocks = checkpoint_blocks
        self.tok_emb = nn.Embedding(config.vocab, config.width)
        self.pos_emb = nn.Embedding(config.seq_len, config.width)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Return the logits, or the mean cross-entropy loss when ``targets`` are given.

        Args:
            tokens: Token ids of shape ``(batch, seq)`` with ``seq <= config.seq_len``.
            targets: Optional next-token ids of the same shape.

        Returns:
            Logits of shape ``(batch, seq, vocab)``, or a scalar loss.
        """
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds config.seq_len={self.config.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        run = self.checkpoint_blocks if torch.is_grad_enabled() else None
        for block in self.blocks:
            x = block(x) if run is None else run(block, x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_batch(
    config: GPTConfig,
    batch: int,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets, the same for the same seed.

    Args:
        config: The model's sizes; ``vocab`` and ``seq_len`` are used.
        batch: Number of sequences.
        seed: Seed of the private generator, which leaves the global RNG untouched.
        device: Where to put the tensors.

    Returns:
        ``(tokens, targets)``, both of shape ``(batch, config.seq_len)``.
    """
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(config.vocab, (batch, config.seq_len + 1), generator=generator)
    ids = ids.to(device)
    return ids[:, :-1], ids[:, 1:]

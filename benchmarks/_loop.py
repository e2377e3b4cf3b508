"""The training loops the budget benchmarks and tests share: a model, batches of a length
drawn per step (dynamic padding), and the step itself.

Two models: Hugging Face GPT-2 built from a small config (random weights, nothing is
downloaded) and the GPT stack of ``examples/gpt.py``, both with dropout on, so that a
plan that disturbed the random streams would show in the gradients.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

__all__ = ["LoopModel", "gpt_stack", "hf_gpt2", "lengths", "train_step"]

Batch = Tuple[Tuple[Any, ...], Dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class LoopModel:
    """A model of a training loop and how its batches are made."""

    name: str
    build: Callable[[], nn.Module]
    """A fresh model in train mode, the same weights every call."""
    batch: Callable[[int, int, int], Batch]
    """``batch(rows, length, seed)``: the forward's positional and keyword inputs."""
    loss: Callable[[Any], torch.Tensor]
    """The loss, from the forward's output."""


def hf_gpt2(*, width: int = 128, layers: int = 4, heads: int = 4, vocab: int = 1024, longest: int = 256) -> LoopModel:
    """Hugging Face GPT-2 with eager attention; the batch carries ``labels``, so the
    output's ``loss`` is the loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_positions=longest, n_embd=width, n_layer=layers, n_head=heads,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(config).train()

    def batch(rows: int, length: int, seed: int) -> Batch:
        ids = torch.randint(vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
        return (), {"input_ids": ids, "labels": ids, "use_cache": False}

    return LoopModel("HF GPT-2", build, batch, lambda output: output.loss)


def gpt_stack(*, width: int = 128, layers: int = 4, heads: int = 4, vocab: int = 512, longest: int = 256) -> LoopModel:
    """The GPT of ``examples/gpt.py``; its forward takes the targets and returns the loss."""
    config = GPTConfig(vocab=vocab, width=width, heads=heads, layers=layers, seq_len=longest)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(config).train()

    def batch(rows: int, length: int, seed: int) -> Batch:
        ids = torch.randint(vocab, (rows, length + 1), generator=torch.Generator().manual_seed(seed))
        return (ids[:, :-1], ids[:, 1:]), {}

    return LoopModel("GPT stack", build, batch, lambda loss: loss)


def lengths(steps: int, low: int, high: int, seed: int = 0) -> List[int]:
    """Each step's length, drawn uniformly from ``low..high``, the longest once at least
    (so that a budget is judged where the model holds the most)."""
    rng = random.Random(seed)
    drawn = [rng.randint(low, high) for _ in range(steps)]
    drawn[rng.randrange(steps)] = high
    return drawn


def train_step(model: nn.Module, loop: LoopModel, batch: Batch, seed: int, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """One step from fresh gradients, dropout drawn from ``seed``: zero the gradients,
    forward, backward, optimizer step. Returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    args, kwargs = batch
    loss = loop.loss(model(*args, **kwargs))
    loss.backward()
    optimizer.step()
    return loss.detach()

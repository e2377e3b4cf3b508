"""Models and helpers shared by the marking-layer tests.

Every comparison runs the same model twice from the same seeds, once plain and once
checkpointed (or through ``torch.utils.checkpoint``), so tests compare results computed in
the same process, never stored numbers.
"""

from __future__ import annotations

import collections
import contextlib
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

import ckptwrap

VOCAB = 50
SEQ = 8
WIDTH = 16


# ---------------------------------------------------------------------------------------
# A GPT-like model
# ---------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        weights = self.attn_drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
        return self.proj((weights @ v).transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, width: int = WIDTH, heads: int = 2, p: float = 0.2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, p)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Embeddings, a ``ModuleList`` of ``Block``, a final norm and an LM head; dropout on."""

    def __init__(self, layers: int = 4, width: int = WIDTH, p: float = 0.2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(SEQ, width)
        self.drop = nn.Dropout(p)
        self.h = nn.ModuleList(Block(width, 2, p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1])))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def gpt_loss(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, targets = batch
    logits = model(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


# ---------------------------------------------------------------------------------------
# A conv net with BatchNorm
# ---------------------------------------------------------------------------------------


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.bn(self.conv(x))))


class ConvNet(nn.Module):
    """A stem, an ``nn.Sequential`` of residual ``ConvBlock`` (conv, BatchNorm, ReLU, dropout), a head."""

    def __init__(self, blocks: int = 3, channels: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels))
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))

    def forward_with(self, x: torch.Tensor, run_block: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The same forward, with each block run through ``run_block(block, x)``."""
        x = self.stem(x)
        for block in self.blocks:
            x = run_block(block, x)
        return self.head(x.mean(dim=(2, 3)))


def conv_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(4, 3, 6, 6, generator=generator), torch.randint(0, 5, (4,), generator=generator)


def conv_loss(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


# ---------------------------------------------------------------------------------------
# Running, comparing, observing
# ---------------------------------------------------------------------------------------


def make(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def step(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any, seed: int = 1) -> torch.Tensor:
    """Zero the gradients, run forward and backward from ``seed``; returns the loss."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach()


def grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {name: (p.grad.clone() if p.grad is not None else None) for name, p in model.named_parameters()}


def assert_same(actual: Dict[str, Any], expected: Dict[str, Any], what: str = "") -> None:
    """Same keys, and bit-for-bit equal tensors (or both None) under each key."""
    assert list(actual) == list(expected), f"{what}: keys differ"
    for name, e in expected.items():
        a = actual[name]
        if a is None or e is None:
            assert a is None and e is None, f"{what}: {name} is {a!r}, expected {e!r}"
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: {name} {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        assert torch.equal(a, e), f"{what}: {name} differs by {(a.double() - e.double()).abs().max().item()}"


def assert_close_to_rounding(actual: Dict[str, Any], expected: Dict[str, Any], what: str = "") -> None:
    """Same keys, and float32 tensors equal up to the rounding of summing a few gradient
    parts in another order: a few units in the last place, relative to each tensor's size."""
    assert list(actual) == list(expected), f"{what}: keys differ"
    for name, e in expected.items():
        a = actual[name]
        if a is None or e is None:
            assert a is None and e is None, f"{what}: {name} is {a!r}, expected {e!r}"
            continue
        scale = max(e.abs().max().item(), 1.0)
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7 * scale, msg=lambda m: f"{what}: {name}: {m}")


def structure(model: nn.Module) -> Dict[str, Any]:
    """Everything ``wrap_model`` promises to leave alone, in comparable form."""
    return {
        "parameters": [(name, id(p)) for name, p in model.named_parameters()],
        "modules": [(name, type(m), id(m)) for name, m in model.named_modules()],
        "state_dict": list(model.state_dict()),
    }


def markings(model: nn.Module) -> Dict[str, Any]:
    """The instance-level ``forward`` of each module (the mark wrap_model sets) and the plan."""
    marks: Dict[str, Any] = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    marks["<plan>"] = model.__dict__.get("ckptwrap_plan")
    return marks


def marked(model: nn.Module) -> List[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


class CallLog:
    """Counts forward calls of every submodule, split into plain calls and recomputations.

    Forward hooks run inside the checkpointed region for every module below the one that
    is marked, so a module's count of recomputed calls is how often its region was rerun.
    """

    def __init__(self) -> None:
        self.forward: collections.Counter = collections.Counter()
        self.recomputed: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def watching(self, model: nn.Module) -> Iterator["CallLog"]:
        handles = [
            module.register_forward_hook(self._hook(name)) for name, module in model.named_modules()
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            (self.recomputed if ckptwrap.is_recomputing() else self.forward)[name] += 1

        return record


def recompute_counts(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> CallLog:
    """Run one training step on ``model`` and return how often each submodule ran."""
    log = CallLog()
    with log.watching(model):
        step(model, loss_fn, batch)
    return log

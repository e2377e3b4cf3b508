"""Models, steps and comparisons shared by the CUDA tests.

Every helper runs the same model from the same seeds more than one way (plain,
``torch.utils.checkpoint``, ckptwrap) in the same process; nothing is compared with
stored numbers.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Callable, Dict, Optional

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckptwrap

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def gpt_module():
    """The examples' GPT (imported by path: examples/ is not a package)."""
    if _EXAMPLES not in sys.path:
        sys.path.insert(0, _EXAMPLES)
    import gpt  # noqa: PLC0415

    return gpt


def run(how: str, fn: Callable, *args, use_reentrant: bool = False):
    """``fn(*args)`` plainly, through torch.utils.checkpoint or through ckptwrap."""
    if how == "plain":
        return fn(*args)
    if how == "torch":
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=use_reentrant)
    return ckptwrap.checkpoint(fn, *args, use_reentrant=use_reentrant)


def weighted_sum(out: torch.Tensor) -> torch.Tensor:
    """A scalar in which every element has its own weight, in float32."""
    weights = torch.linspace(-1.0, 2.0, out.numel(), device=out.device).reshape(out.shape)
    return (out.float() * weights).sum()


def grads(named: Dict[str, torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
    return {name: (t.grad.detach().clone() if t.grad is not None else None) for name, t in named.items()}


def assert_same(actual: Dict, expected: Dict, what: str = "") -> None:
    """Bit-for-bit equality of two name -> tensor maps."""
    assert actual.keys() == expected.keys(), f"{what}: keys differ"
    for name, e in expected.items():
        a = actual[name]
        if a is None or e is None:
            assert a is None and e is None, f"{what}: {name} is {a!r}, expected {e!r}"
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: {name} {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        assert torch.equal(a, e), f"{what}: {name} differs, max abs diff {(a.double() - e.double()).abs().max().item()}"


def small_gpt(layers: int = 4, width: int = 256, seq: int = 128, dropout: float = 0.1):
    gpt = gpt_module()
    torch.manual_seed(0)
    config = gpt.GPTConfig(vocab=512, width=width, heads=4, layers=layers, seq_len=seq, dropout=dropout)
    return gpt.GPT(config).cuda().train(), config


def gpt_step(model, batch, *, seed: int = 1) -> Dict[str, Optional[torch.Tensor]]:
    """One training step from a fixed dropout seed; the parameters' gradients."""
    tokens, targets = batch
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(tokens, targets).backward()
    return grads(dict(model.named_parameters()))


def copy_of(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class LlamaBlock(nn.Module):
    """A Llama-style block: q, k and v projections read one normed input, gate and up
    projections another, so each is saved several times. Attention is written out, whose
    backward is deterministic (SDPA's is not)."""

    def __init__(self, width: int, heads: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(batch, seq, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        weights = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        x = x + self.o((weights @ v).transpose(1, 2).reshape(batch, seq, width))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class LlamaStack(nn.Module):
    """``LlamaBlock`` layers in an ``nn.ModuleList``: what the ``blocks`` policy selects."""

    def __init__(self, layers: int = 4, width: int = 1024, heads: int = 8, hidden: int = 2048, dropout: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaBlock(width, heads, hidden, dropout) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def llama(layers: int = 4, width: int = 1024, heads: int = 8, hidden: int = 2048, dropout: float = 0.1) -> LlamaStack:
    torch.manual_seed(0)
    return LlamaStack(layers, width, heads, hidden, dropout).cuda().train()


def llama_input(batch: int = 4, seq: int = 256, width: int = 1024, *, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, seq, width, device="cuda", generator=generator, requires_grad=True)


def llama_loss(model: nn.Module, x: torch.Tensor, *, seed: int = 1, autocast: bool = False) -> torch.Tensor:
    """The model's loss from a fixed dropout seed (under bf16 autocast if asked)."""
    torch.manual_seed(seed)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    return weighted_sum(out)


def step_grads(model: nn.Module, x: torch.Tensor, **options) -> Dict[str, Optional[torch.Tensor]]:
    """One forward and backward of ``llama_loss``; the parameters' and the input's gradients."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    llama_loss(model, x, **options).backward()
    return grads(dict(model.named_parameters()) | {"input": x})

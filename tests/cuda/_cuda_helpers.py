"""Models, steps and comparisons shared by the CUDA tests.

Every helper runs the same model from the same seeds more than one way (plain,
``torch.utils.checkpoint``, ckptwrap) in the same process; nothing is compared with
stored numbers.
"""

from __future__ import annotations

import copy
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

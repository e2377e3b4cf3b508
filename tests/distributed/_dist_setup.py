"""What the distributed ranks and the single-process reference share: the model, the data,
the optimizer and the number of steps."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict

import torch
from torch import nn

_EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

# Tiny on purpose: two ranks share the CI machine's two cores with the test process.
# No dropout, so that each rank draws exactly what one process would draw.
CONFIG = GPTConfig(vocab=64, width=32, heads=2, layers=4, seq_len=16, dropout=0.0)
GLOBAL_BATCH = 4
STEPS = 3


def build_model(kind: str) -> GPT:
    """The GPT of every scenario, from the same seed.

    ``kind`` is ``"gpt"``; ``"shared"``, whose second block is the first one again (one
    module run twice per forward); or ``"tied"``, whose final LayerNorm shares its weight
    with the last block's.
    """
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if kind == "shared":
        model.blocks[1] = model.blocks[0]
    elif kind == "tied":
        model.ln_f.weight = model.blocks[-1].ln_mlp.weight
    elif kind != "gpt":
        raise ValueError(f"unknown model kind {kind!r}; expected 'gpt', 'shared' or 'tied'")
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def reference_parameters(kind: str) -> Dict[str, torch.Tensor]:
    """Parameters after training the un-checkpointed model in one process on whole batches."""
    model = build_model(kind)
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        tokens, targets = synthetic_batch(CONFIG, GLOBAL_BATCH, seed=step)
        optimizer.zero_grad(set_to_none=True)
        model(tokens, targets).backward()
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def loopback_environment() -> Dict[str, str]:
    """Variables that keep gloo's connections on the loopback interface."""
    names = {"linux": "lo", "darwin": "lo0"}
    name = next((value for prefix, value in names.items() if sys.platform.startswith(prefix)), None)
    if name is None or "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    return {"GLOO_SOCKET_IFNAME": name}

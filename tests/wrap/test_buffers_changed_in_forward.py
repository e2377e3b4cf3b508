"""Buffers a checkpointed forward changes in place: spectral normalisation (both of
torch's forms), whose power iteration advances ``u`` and ``v`` and whose weight depends on
them, and a step counter. Each recomputation must compute from the buffers as the forward
found them and leave them as the step left them: gradients and buffers equal the plain
model's bit for bit, on both engines and at a selective level. A buffer too large to copy
that the forward changes is refused at the recomputation, by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import spectral_norm
from torch.nn.utils.parametrizations import spectral_norm as parametrized_spectral_norm

import ckptwrap
from ckptwrap.wrap import _region

NORMS = {"hook": spectral_norm, "parametrization": parametrized_spectral_norm}


class Block(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.fc = NORMS[norm](nn.Linear(16, 16))
        self.out = nn.Linear(16, 16)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return x + self.out(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(norm) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _train(model: nn.Module, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=generator)).backward()


CASES = [
    pytest.param(norm, policy, reentrant, id=f"{norm}-{policy}-{'reentrant' if reentrant else 'non_reentrant'}")
    for norm in NORMS
    for policy, reentrant in (("blocks", False), ("blocks", True), ("blocks;selective", False), ("type:Linear", False))
]


@pytest.mark.parametrize("norm, policy, reentrant", CASES)
def test_spectral_norm_and_a_counter_train_as_the_plain_model(norm, policy, reentrant):
    torch.manual_seed(0)
    plain = Net(norm).train()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), policy, use_reentrant=reentrant)
    _train(plain)
    _train(model)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), f"gradient of {name}"
    for (name, a), b in zip(plain.named_buffers(), model.buffers()):
        assert torch.equal(a, b), f"buffer {name}"
    assert all(int(block.steps) == 3 for block in model.blocks)


def test_without_the_replay_the_gradients_differ(monkeypatch):
    """The test above can fail: recomputed from the buffers as the forward left them, the
    power iteration runs once more and the weight differs."""
    monkeypatch.setattr(_region, "_replayed", lambda changed: _region.contextlib.nullcontext())
    torch.manual_seed(0)
    plain = Net("hook").train()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks")
    _train(plain, 1)
    _train(model, 1)
    assert not all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))


class Tally(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(_region._COPIED_BYTES // 4 + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        return self.lin(x)


def test_a_large_buffer_changed_in_forward_is_refused_by_name():
    model = nn.Sequential(Tally(), Tally())
    ckptwrap.wrap_model(model, "type:Tally")
    with pytest.raises(ckptwrap.CheckpointConfigError, match=r"'seen' of Tally .*changed in place.*too large"):
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()


def test_buffers_left_alone_cost_no_copy_kept():
    """Only what a forward changed is kept for the recomputation."""
    block = Block("hook")
    block.register_buffer("untouched", torch.ones(4))
    keep = _region._KeepStats(block, block)
    keep(torch.randn(2, 16))
    kept = sorted(_region._label(entry.where) for entry in keep._changed)
    assert kept == ["'fc.weight_u' of Block (Linear)", "'fc.weight_v' of Block (Linear)", "'steps' of Block (Block)"]


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_the_doctor_names_the_buffers_a_checkpointed_forward_changes(norm):
    from ckptwrap.diagnostics import doctor

    torch.manual_seed(0)
    model = ckptwrap.wrap_model(Net(norm), "blocks")
    report = doctor(model, example_inputs=(torch.randn(4, 16),))
    changed = [f for f in report.findings if f.check == "buffers-changed"]
    assert changed and changed[0].severity == "info", [f.check for f in report.findings]
    named = " ".join(changed[0].details)
    assert "blocks.0.steps" in named and ("weight_u" in named or "_u" in named), named
    assert not any(f.severity == "error" for f in report.findings), report.findings

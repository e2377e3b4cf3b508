"""The storage counter tells an operator's new outputs from its inputs by the operator's
schema (``outputs_of``) instead of looking at every input: checked here against the
inputs themselves for every operator a training step of several kinds of model runs,
forward, recomputation and backward, so that an operator whose schema misleads is found.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Set

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ckptwrap
from ckptwrap.measure import StorageCounter, tensors
from ckptwrap.measure._peak import outputs_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def _keys(value: Any) -> Set[int]:
    found = set()
    for tensor in tensors(value):
        try:
            found.add(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    return found


class _Audit(TorchDispatchMode):
    """Per operator, whether its outputs' storages were among its inputs'."""

    def __init__(self) -> None:
        super().__init__()
        self.wrong: Dict[str, str] = {}
        self.seen: Set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        before = _keys((args, kwargs))
        out = func(*args, **kwargs)
        inputs = before | _keys((args, kwargs))
        said = outputs_of(func)
        self.seen.add(str(func))
        for key in _keys(out):
            if said is True and key in inputs:
                self.wrong[str(func)] = "declared new, returned an input's storage"
            elif said is False and key not in inputs:
                self.wrong[str(func)] = "declared an input's, returned a new storage"
        return out


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=2)) for _ in range(2)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=(2, 3)))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.rnn = nn.LSTM(16, 16, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(ids))
        return self.out(self.norm(hidden)).logsumexp(-1)


def _gpt_step() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, width=32, heads=2, layers=2, seq_len=32, dropout=0.1)).train()
    ckptwrap.wrap_model(model, "blocks")
    ids = torch.randint(64, (2, 17))
    model(ids[:, :-1], ids[:, 1:]).backward()


def _conv_step() -> None:
    model = ckptwrap.wrap_model(_Conv().train(), "type:Sequential")
    model(torch.randn(2, 3, 8, 8)).sum().backward()


def _recurrent_step() -> None:
    model = ckptwrap.wrap_model(_Recurrent().train(), "name:rnn")
    model(torch.randint(32, (2, 6))).sum().backward()


def _views_and_in_place() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    y = x.t().contiguous().view(6, 4)[1:].unsqueeze(0).expand(2, 5, 4)
    z = torch.zeros(5, 4).add_(1).mul_(y[0]).clone()
    w = torch.cat([z, z], 0).split(3)[0].reshape(-1)
    (w.sum() + y.sum()).backward()
    torch.matmul(torch.randn(2, 3, 4), torch.randn(4, 5)).sum()


@pytest.mark.parametrize("step", [_gpt_step, _conv_step, _recurrent_step, _views_and_in_place])
def test_every_operator_s_schema_tells_new_outputs_as_its_inputs_do(step):
    audit = _Audit()
    with audit:
        step()
    assert len(audit.seen) > 5
    assert not audit.wrong, audit.wrong


def test_the_counter_counts_a_view_of_a_new_tensor_once_and_a_view_of_an_old_one_never():
    old = torch.randn(64, 64)
    with StorageCounter("cpu") as counter:
        new = old @ old  # 16 KiB, new
        flat = torch.ops.aten._unsafe_view(new, [4096])  # its own storage: nothing more
        seen = old.view(-1)[:10]  # a view of a tensor from before: nothing
        del flat, seen
    assert counter.created_bytes == 64 * 64 * 4
    assert counter.peak_bytes == 64 * 64 * 4
    with StorageCounter("cpu") as counter:
        torch.ops.aten._unsafe_view(old, [4096])  # declared new, but the old one's storage
    assert counter.created_bytes == 0

"""checkpoint_sequential: same results and partition as torch's, plus tuple-passing stages."""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn as nn

import ckptwrap
from _models import assert_same, grads_of, weighted_loss

VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]


class Counted(nn.Module):
    """Wraps a stage and counts its calls, to observe the segment partition."""

    def __init__(self, inner: nn.Module, counts: List[int], index: int):
        super().__init__()
        self.inner, self.counts, self.index = inner, counts, index

    def forward(self, *args):
        self.counts[self.index] += 1
        return self.inner(*args)


def _stages(n: int, counts: List[int]) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i in range(n):
        layer = nn.Linear(6, 6) if i % 3 == 0 else (nn.Dropout(0.2) if i % 3 == 1 else nn.Tanh())
        layers.append(Counted(layer, counts, i))
    return nn.Sequential(*layers)


def _run(how, n, segments, use_reentrant, as_list=False):
    counts = [0] * n
    model = _stages(n, counts)
    functions = list(model) if as_list else model
    x = torch.randn(4, 6, requires_grad=True)
    torch.manual_seed(7)
    if how == "plain":
        out = model(x)
    elif how == "torch":
        out = torch.utils.checkpoint.checkpoint_sequential(functions, segments, x, use_reentrant=use_reentrant)
    else:
        out = ckptwrap.checkpoint_sequential(functions, segments, x, use_reentrant=use_reentrant)
    weighted_loss(out).backward()
    named = {f"param:{k}": p for k, p in model.named_parameters()} | {"input:x": x}
    return counts, grads_of(named) | {"output": out.detach()}


@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("n, segments", [(6, 1), (6, 2), (6, 3), (7, 2), (7, 3), (8, 3), (5, 5), (6, 4)])
def test_equal_to_plain_and_torch_with_same_partition(n, segments, use_reentrant):
    plain_counts, plain = _run("plain", n, segments, use_reentrant)
    torch_counts, reference = _run("torch", n, segments, use_reentrant)
    our_counts, ours = _run("ours", n, segments, use_reentrant)
    assert_same(ours, plain, "ours vs plain")
    assert_same(ours, reference, "ours vs torch")
    assert our_counts == torch_counts, "stages were partitioned differently from torch"
    assert plain_counts == [1] * n


def test_partition_shape():
    """n // segments per segment, the last gets the rest and runs without checkpointing."""
    counts, _ = _run("ours", 7, 3, False)
    assert counts == [2, 2, 2, 2, 1, 1, 1]


def test_segments_equal_to_length_checkpoints_all_but_last():
    counts, ours = _run("ours", 4, 4, False)
    _, plain = _run("plain", 4, 4, False)
    assert counts == [2, 2, 2, 1]
    assert_same(ours, plain)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_list_of_modules(use_reentrant):
    _, plain = _run("plain", 6, 2, use_reentrant, as_list=True)
    _, ours = _run("ours", 6, 2, use_reentrant, as_list=True)
    assert_same(ours, plain)


@pytest.mark.parametrize("segments", [0, -1, 5, 100])
def test_segments_out_of_range_names_both_numbers(segments):
    functions = [nn.Tanh() for _ in range(4)]
    pattern = rf"(?s)(?=.*(?<![\d-]){segments}(?!\d))(?=.*(?<![\d-])4(?!\d))"
    with pytest.raises(ValueError, match=pattern) as info:
        ckptwrap.checkpoint_sequential(functions, segments, torch.randn(2, requires_grad=True))
    assert isinstance(info.value, ckptwrap.CheckpointError)


# --------------------------------------------------------------------------- tuple-passing stages


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x, y):
        return torch.tanh(self.a(x)), torch.sin(self.b(y)) * x


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x, y):
        return self.lin(x) + y, y * 0.5


class Merge(nn.Module):
    def forward(self, x, y):
        return x * y


def _tuple_model():
    torch.manual_seed(0)
    return nn.Sequential(Split(), Mix(), Mix(), Split(), Merge())


def _tuple_run(how, segments, use_reentrant):
    model = _tuple_model()
    torch.manual_seed(1)
    x = torch.randn(3, 5, requires_grad=True)
    y = torch.randn(3, 5, requires_grad=True)
    if how == "plain":
        out = (x, y)
        for stage in model:
            out = stage(*out) if isinstance(out, tuple) else stage(out)
    else:
        out = ckptwrap.checkpoint_sequential(model, segments, x, y, use_reentrant=use_reentrant)
    weighted_loss(out).backward()
    named = {f"param:{k}": p for k, p in model.named_parameters()} | {"input:x": x, "input:y": y}
    return grads_of(named) | {"output": out.detach()}


@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("segments", [1, 2, 3, 5])
def test_tuple_passing_stages_equal_plain(segments, use_reentrant):
    assert_same(_tuple_run("ours", segments, use_reentrant), _tuple_run("plain", segments, use_reentrant))

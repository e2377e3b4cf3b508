"""Nested checkpoints: how often each level runs, compared with torch's checkpoint."""

from __future__ import annotations

import functools
from typing import Dict, List

import pytest
import torch

import ckptwrap
from _models import assert_same, grads_of, weighted_loss

# torch's re-entrant variant warns when an inner region's forward runs under the outer's no_grad.
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")

SETTINGS = [
    pytest.param({"use_reentrant": False, "early_stop": True}, id="non_reentrant-early_stop"),
    pytest.param({"use_reentrant": False, "early_stop": False}, id="non_reentrant-no_early_stop"),
    pytest.param({"use_reentrant": True}, id="reentrant"),
]


def _checkpoint_for(how):
    if how == "torch":
        return torch.utils.checkpoint.checkpoint
    return ckptwrap.checkpoint


def _level(index, depth, weights, counts, checkpoint, options, inner_last, x):
    """One nesting level: a few saving ops, then the next level checkpointed.

    With ``inner_last`` nothing after the inner checkpoint saves a tensor, so early stop
    may end the outer recomputation before the inner function runs again.
    """
    counts[index] += 1
    h = torch.tanh(x @ weights[index])
    if index + 1 < depth:
        inner = functools.partial(_level, index + 1, depth, weights, counts, checkpoint, options, inner_last)
        h = checkpoint(inner, h, **options) if checkpoint else inner(h)
    return h * 2.0 + 1.0 if inner_last else torch.sin(h) * x


def _run(how: str, depth: int, options: Dict, inner_last: bool = False) -> tuple[List[int], Dict]:
    torch.manual_seed(0)
    weights = [torch.randn(4, 4, requires_grad=True) for _ in range(depth)]
    x = torch.randn(3, 4, requires_grad=True)
    counts = [0] * depth
    checkpoint = None if how == "plain" else _checkpoint_for(how)
    top = functools.partial(_level, 0, depth, weights, counts, checkpoint, options, inner_last)
    out = checkpoint(top, x, **options) if checkpoint else top(x)
    weighted_loss(out).backward()
    grads = grads_of({"x": x} | {f"w{i}": w for i, w in enumerate(weights)})
    return counts, grads


@pytest.mark.parametrize("inner_last", [False, True], ids=["inner_in_middle", "inner_last"])
@pytest.mark.parametrize("options", SETTINGS)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_recompute_counts_equal_torch(depth, options, inner_last):
    torch_counts, torch_grads = _run("torch", depth, options, inner_last)
    our_counts, our_grads = _run("ours", depth, options, inner_last)
    assert our_counts == torch_counts
    _, plain_grads = _run("plain", depth, {}, inner_last)
    assert_same(our_grads, plain_grads, "ours vs plain")
    assert_same(our_grads, torch_grads, "ours vs torch")


@pytest.mark.parametrize("options", SETTINGS)
def test_every_level_is_recomputed(options):
    """Guards the count comparison: checkpointing really re-ran the functions."""
    counts, _ = _run("ours", 3, options)
    plain_counts, _ = _run("plain", 3, {})
    assert plain_counts == [1, 1, 1]
    assert all(c >= 2 for c in counts), counts


@pytest.mark.parametrize("inner_reentrant", [False, True])
@pytest.mark.parametrize("outer_reentrant", [False, True])
def test_mixed_variants(outer_reentrant, inner_reentrant):
    results = {}
    for how in ["plain", "torch", "ours"]:
        torch.manual_seed(0)
        w1, w2 = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        x = torch.randn(3, 4, requires_grad=True)
        ckpt = _checkpoint_for(how)
        counts = [0, 0]

        def inner(h):
            counts[1] += 1
            return torch.sin(h @ w2)

        def outer(x):
            counts[0] += 1
            h = torch.tanh(x @ w1)
            h = inner(h) if how == "plain" else ckpt(inner, h, use_reentrant=inner_reentrant)
            return h * x

        out = outer(x) if how == "plain" else ckpt(outer, x, use_reentrant=outer_reentrant)
        weighted_loss(out).backward()
        results[how] = (counts, grads_of({"x": x, "w1": w1, "w2": w2}))
    assert results["ours"][0] == results["torch"][0]
    assert_same(results["ours"][1], results["plain"][1])
    assert_same(results["ours"][1], results["torch"][1])

"""Regions recomputed ahead of the backward (``recompute_ahead``), in the worker thread.

Each test runs the same stack three ways from the same seeds (plainly, through
``torch.utils.checkpoint``, and through ckptwrap with regions recomputed ahead) and
compares every gradient bit for bit; where it matters, it also checks which thread each
recomputation ran in and what the generators hold afterwards.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.flop_counter import FlopCounterMode

import ckptwrap
from ckptwrap import CheckpointError
from ckptwrap.engine import recompute_ahead

WORKER = "ckptwrap-recompute-ahead"


class Block(nn.Module):
    """A residual MLP block with dropout that notes the thread of every call."""

    def __init__(self, width: int = 16, dropout: float = 0.25) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)
        self.threads: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.append((threading.current_thread().name, ckptwrap.is_recomputing()))
        return x + self.drop(self.down(torch.relu(self.up(x))))


def _stack(count: int = 5, dropout: float = 0.25) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block(dropout=dropout) for _ in range(count))


def _run(blocks: nn.ModuleList, x: torch.Tensor, how: str) -> torch.Tensor:
    torch.manual_seed(1)
    h = x
    if how == "ahead":
        with recompute_ahead():
            for block in blocks:
                h = ckptwrap.checkpoint(block, h)
        return h
    for block in blocks:
        if how == "plain":
            h = block(h)
        elif how == "torch":
            h = torch_checkpoint.checkpoint(block, h, use_reentrant=False)
        else:
            h = ckptwrap.checkpoint(block, h)
    return h


def _grads(blocks: nn.ModuleList, x: torch.Tensor, how: str, steps: int = 1):
    blocks.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    for _ in range(steps):
        out = _run(blocks, x, how)
        (out * torch.linspace(-1, 2, out.numel()).reshape(out.shape)).sum().backward()
    return [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]


def _assert_equal(got, expected, what):
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"{what}: gradient {index} differs"


def test_gradients_equal_the_plain_run_and_torch_checkpoint_and_the_worker_recomputes():
    blocks = _stack()
    x = torch.randn(4, 8, 16)
    plain = _grads(copy.deepcopy(blocks), x, "plain")
    theirs = _grads(copy.deepcopy(blocks), x, "torch")
    ours = _grads(blocks, x, "ahead")
    _assert_equal(ours, plain, "ahead vs plain")
    _assert_equal(ours, theirs, "ahead vs torch.utils.checkpoint")
    recomputed_in = [[thread for thread, again in block.threads if again] for block in blocks]
    # The last block is met first in backward and recomputed there; each block before it
    # is recomputed by the worker while backward runs through the block after it.
    assert recomputed_in[-1] == [threading.current_thread().name]
    assert all(threads == [WORKER] for threads in recomputed_in[:-1]), recomputed_in


def test_each_region_is_recomputed_once_per_backward():
    blocks = _stack()
    _grads(blocks, torch.randn(2, 3, 16), "ahead", steps=3)
    for block in blocks:
        assert [again for _, again in block.threads].count(True) == 3


def test_the_generators_and_the_next_forward_are_as_after_a_plain_step():
    """The worker replays the forward's generator state; nothing it does is left behind
    when backward returns (a callback at the end of the backward waits for it)."""
    blocks = _stack()
    x = torch.randn(4, 8, 16)
    plain_copy = copy.deepcopy(blocks)
    for step in range(4):
        expected = _grads(plain_copy, x, "plain")
        expected_state = torch.get_rng_state()
        got = _grads(blocks, x, "ahead")
        _assert_equal(got, expected, f"step {step}")
        assert torch.equal(torch.get_rng_state(), expected_state)


def test_partial_backward_and_retained_graph_equal_the_plain_run():
    blocks = _stack()
    x = torch.randn(3, 5, 16, requires_grad=True)

    def run(how):
        torch.manual_seed(1)
        h, middle = x, None
        with recompute_ahead(how == "ahead"):
            for index, block in enumerate(blocks):
                h = block(h) if how == "plain" else ckptwrap.checkpoint(block, h)
                if index == 2:
                    middle = h
        first = torch.autograd.grad(h.sum(), middle, retain_graph=True)[0]
        second = torch.autograd.grad((h * h).sum(), [x, *blocks.parameters()])
        return [first, *second]

    _assert_equal(run("ahead"), run("plain"), "partial backward, retained graph")


def test_nested_regions_inside_a_region_recomputed_ahead_equal_the_plain_run():
    torch.manual_seed(0)
    inner = nn.ModuleList(Block() for _ in range(3))
    outer = nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(2, 4, 16)

    def stage(index, h):
        return inner[index](outer[index](h))

    def run(how):
        inner.zero_grad(set_to_none=True)
        outer.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        h = x.detach().requires_grad_()
        start = h
        with recompute_ahead(how == "ahead"):
            for index in range(3):
                if how == "plain":
                    h = stage(index, h)
                else:
                    h = ckptwrap.checkpoint(
                        lambda v, i=index: ckptwrap.checkpoint(inner[i], outer[i](v)), h
                    )
        h.sum().backward()
        return [p.grad.clone() for p in [*inner.parameters(), *outer.parameters()]] + [start.grad]

    _assert_equal(run("ahead"), run("plain"), "nested")


def test_a_recomputation_that_differs_fails_in_the_backward_with_the_engines_error():
    """The worker's failure is not swallowed: backward recomputes the region itself and
    raises there, with the determinism check's message."""
    calls = {"n": 0}

    class Changing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            calls["n"] += 1
            return self.lin(x) if calls["n"] == 1 else self.lin(torch.cat([x, x]))[: x.shape[0]].relu()

    first, second = Changing(), nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    with recompute_ahead():
        h = ckptwrap.checkpoint(first, x)
        h = ckptwrap.checkpoint(second, h)
    with pytest.raises(CheckpointError, match="recomputation"):
        h.sum().backward()


def test_under_a_dispatch_mode_every_region_is_recomputed_in_backward():
    """A mode around the backward (FlopCounterMode) would not see work in another thread,
    so nothing is handed to the worker there, and it counts what it counts without it."""
    blocks = _stack()
    x = torch.randn(4, 8, 16)

    def flops(how):
        for block in blocks:
            block.threads.clear()
        out = _run(blocks, x.requires_grad_(), how)
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        return counter.get_total_flops()

    assert flops("ahead") == flops("ours")
    assert all(thread != WORKER for block in blocks for thread, _ in block.threads)


def test_threads_training_their_own_stacks_at_once_each_equal_the_plain_run():
    """Several backwards in flight at once share the one worker and the one lock. (No
    dropout: threads interleaving their forwards would draw each other's numbers from the
    shared generator, plainly too.)"""
    stacks = [_stack(dropout=0.0) for _ in range(3)]
    x = torch.randn(4, 8, 16)
    expected = _grads(copy.deepcopy(stacks[0]), x, "plain", steps=2)
    results, errors = [None] * 3, []

    def train(index):
        try:
            results[index] = _grads(stacks[index], x, "ahead", steps=2)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index, result in enumerate(results):
        _assert_equal(result, expected, f"thread {index}")


def test_without_the_context_nothing_is_recomputed_ahead():
    blocks = _stack()
    _grads(blocks, torch.randn(2, 3, 16), "ours")
    assert all(thread != WORKER for block in blocks for thread, _ in block.threads)

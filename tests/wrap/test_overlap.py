"""``overlap``: chosen modules recomputed ahead of the backward, in the worker thread.

Models of every family the catalogue has (causal, encoder, encoder-decoder, speech,
vision, hierarchical vision, multimodal, state-space), built from their configs with
dropout on, train under ``blocks;overlap`` beside the plain model in the loops people
write (outputs held through the backward, padded batches of changing sizes): every loss
and gradient bit for bit. Misuse is refused, naming what to do.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import CheckpointConfigError
from ckptwrap.policy import Overlap, overlaps, parse_policy

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _architectures import ARCHITECTURES, available  # noqa: E402
from _budget_loops import _forward, _inputs, _same_grads, _same_model  # noqa: E402

WORKER = "ckptwrap-recompute-ahead"
ONE_PER_FAMILY = ("llama", "gpt2", "bert", "t5", "whisper", "vit", "swin", "clip", "mamba")


def _families():
    found = set(available())
    return [pytest.param(name, id=name) for name in ONE_PER_FAMILY if name in found]


def _recomputed_in_worker(model: nn.Module) -> list:
    """Hooks on every module: the names of those that ran in the worker thread."""
    seen: list = []
    handles = [
        module.register_forward_pre_hook(lambda module, args, name=name: seen.append(name)
                                         if threading.current_thread().name == WORKER else None)
        for name, module in model.named_modules()
    ]
    return seen, handles


@pytest.mark.parametrize("name", _families())
def test_overlap_trains_bit_exact_in_the_loops_people_write(name):
    arch = ARCHITECTURES[name]
    plain = arch.build()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks;overlap")
    assert model.ckptwrap_plan.options.recompute_ahead
    seen, handles = _recomputed_in_worker(model)
    low, high = arch.lengths
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, plain)]
    # Held outputs, padded batches of changing sizes, a tiny first batch.
    for step, (rows, length, held) in enumerate([(1, low, True), (3, high, False), (2, (low + high) // 2, True)]):
        losses = []
        for each, optimizer in zip((model, plain), optimizers):
            optimizer.zero_grad(set_to_none=True)
            losses.append(_forward(each, arch, (rows, length, step, True), held))
        assert torch.equal(losses[0], losses[1]), f"{name}: loss differs at step {step}"
        assert _same_grads(model, plain), f"{name}: a gradient differs at step {step}"
        for optimizer in optimizers:
            optimizer.step()
    for handle in handles:
        handle.remove()
    if len(model.ckptwrap_plan.selected) > 1:
        assert seen, f"{name}: nothing was recomputed ahead"
    ckptwrap.unwrap_model(model)
    assert _same_model(model, plain)


def test_the_term_reads_back_and_joins_recompute_and_selective():
    policy = parse_policy("blocks;overlap")
    assert overlaps(policy) and parse_policy(str(policy.describe())) == policy
    assert overlaps(parse_policy("overlap"))
    assert not overlaps(parse_policy("blocks"))
    model = ARCHITECTURES["gpt2"].build()
    plan = ckptwrap.plan(model, "blocks;selective;overlap")
    assert plan.tier == "selective" and plan.options.recompute_ahead
    assert "recompute_ahead=True" in str(plan)
    assert Overlap().describe() == "overlap"


@pytest.mark.parametrize(
    "policy, options, message",
    [
        ("budget:50%;overlap", {}, "cannot join budget:50%"),
        ("blocks;offload;overlap", {}, "offload recomputes nothing"),
        ("blocks;overlap", {"use_reentrant": True}, "needs use_reentrant=False"),
        ("blocks;overlap;overlap", {}, "at most one"),
        (parse_policy("blocks") | parse_policy("overlap"), {}, "cannot stand inside"),
    ],
)
def test_misuse_is_refused_and_nothing_is_applied(policy, options, message):
    model = ARCHITECTURES["gpt2"].build()
    before = [name for name, _ in model.named_modules()]
    with pytest.raises(CheckpointConfigError, match=message):
        ckptwrap.wrap_model(model, policy, **options)
    assert [name for name, _ in model.named_modules()] == before
    assert getattr(model, "ckptwrap_plan", None) is None


def test_the_option_on_the_decorator_and_the_wrapper_recomputes_ahead():
    torch.manual_seed(0)
    blocks = nn.ModuleList(ckptwrap.CheckpointWrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                                                      recompute_ahead=True) for _ in range(3))
    plain = copy.deepcopy(blocks)
    x = torch.randn(4, 8)
    for each in (blocks, plain):
        h = x
        for block in each:
            h = block(h)
        h.square().sum().backward()
    for a, b in zip(blocks.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(CheckpointConfigError, match="recompute_ahead must be True or False"):
        ckptwrap.CheckpointWrapper(nn.Linear(2, 2), recompute_ahead="yes")
    with pytest.raises(CheckpointConfigError, match="needs use_reentrant=False"):
        ckptwrap.checkpointed(lambda x: x, use_reentrant=True, recompute_ahead=True)

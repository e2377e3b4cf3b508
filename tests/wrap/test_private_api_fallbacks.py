"""The marking layer with each fallback of ``ckptwrap._torch_private`` in place (what a
torch without the private name leaves): gradients and running statistics still equal the
plain run's, bit for bit."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from ckptwrap import _torch_private
from ckptwrap.wrap import _selective
from ckptwrap.wrap._marks import apply_plan
from ckptwrap.engine._options import CheckpointOptions
from ckptwrap.planner._plan import Plan, PlanEntry
from ckptwrap import wrap_model

from ._models import CallLog, ConvNet, TinyGPT, assert_same, conv_batch, conv_loss, gpt_batch, gpt_loss, grads, make, step

_PUBLIC_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                 nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def _buffers(model: nn.Module):
    return {name: b.clone() for name, b in model.named_buffers()}


def _conv_step(policy: str):
    plain = make(lambda: ConvNet(blocks=3)).train()
    wrapped = wrap_model(copy.deepcopy(plain), policy)
    step(plain, conv_loss, conv_batch())
    step(wrapped, conv_loss, conv_batch())
    return plain, wrapped


@pytest.mark.parametrize("policy", ["blocks", "blocks;selective"])
def test_running_statistics_restored_with_public_norm_classes(monkeypatch, policy):
    monkeypatch.setattr(_torch_private, "norm_classes", _PUBLIC_NORMS)
    plain, wrapped = _conv_step(policy)
    assert_same(grads(wrapped), grads(plain), "gradients")
    assert_same(_buffers(wrapped), _buffers(plain), "running statistics")


def test_the_norm_check_is_what_keeps_running_statistics(monkeypatch):
    """The test above can fail: with no norm class recognised, the recomputation updates
    the running statistics a second time."""
    monkeypatch.setattr(_torch_private, "norm_classes", ())
    plain, wrapped = _conv_step("blocks")
    assert not all(torch.equal(a, b) for a, b in zip(_buffers(wrapped).values(), _buffers(plain).values()))


def test_statistics_snapshot_inside_dispatch_modes(monkeypatch):
    """Fallback of ``_disable_current_modes`` (nothing suspended): regions without
    dispatch modes of their own are unaffected."""
    monkeypatch.setattr(_torch_private, "disable_current_modes", contextlib.nullcontext)
    plain, wrapped = _conv_step("blocks")
    assert_same(grads(wrapped), grads(plain), "gradients")
    assert_same(_buffers(wrapped), _buffers(plain), "running statistics")


@pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 12),
    reason="torch before 2.12 keeps the selective storage as lists popped in order, so the snapshot's "
    "copies are not refused; its torch has _disable_current_modes, so the fallback never applies there",
)
def test_selective_region_with_running_statistics_fails_loudly_without_it(monkeypatch):
    """The documented cost of that fallback: a selective region that holds BatchNorm meets
    the snapshot's copies inside torch's replay mode, which refuses them in backward (an
    error, never statistics updated twice)."""
    monkeypatch.setattr(_torch_private, "disable_current_modes", contextlib.nullcontext)
    with pytest.raises(RuntimeError, match="not found in storage"):
        _conv_step("blocks;selective")


def _segment_plan() -> Plan:
    names = ("h.0", "h.1", "h.2")
    entries = [PlanEntry(names[0], "Block")]
    entries += [PlanEntry(name, "Block", joins=before) for before, name in zip(names, names[1:])]
    return Plan(policy="segments (test)", options=CheckpointOptions(), selected=tuple(entries))


def test_without_the_global_hook_registry_segments_run_block_by_block(monkeypatch):
    """Fallback of ``_global_forward_pre_hooks``: assume a hook may be watching, so a
    segment's members run as their own regions; gradients are unchanged."""
    monkeypatch.setattr(_torch_private, "global_forward_pre_hooks", None)
    model = make(lambda: TinyGPT(layers=4, width=32)).train()
    reference = copy.deepcopy(model)
    apply_plan(model, _segment_plan())
    log = CallLog()
    with log.watching(model):
        loss = step(model, gpt_loss, gpt_batch())
    assert torch.equal(loss, step(reference, gpt_loss, gpt_batch()))
    assert_same(grads(model), grads(reference), "segment members as regions")
    # Each member recomputed by its own region, not by the head's.
    assert [log.recomputed[f"h.{i}.attn"] for i in range(4)] == [1, 1, 1, 0]


def test_selective_without_torchs_private_modes(monkeypatch):
    """Fallback of torch's selective-checkpoint modes: torch's own contexts, same gradients."""
    monkeypatch.setattr(_selective, "_CachedTorchDispatchMode", None)
    plain = make(lambda: TinyGPT(layers=3, width=32)).train()
    wrapped = wrap_model(copy.deepcopy(plain), "blocks;selective")
    assert torch.equal(step(wrapped, gpt_loss, gpt_batch()), step(plain, gpt_loss, gpt_batch()))
    assert_same(grads(wrapped), grads(plain), "selective through torch's contexts")

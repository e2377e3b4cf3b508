"""Other libraries' own gradient checkpointing beside ckptwrap's: diffusers'
(``enable_gradient_checkpointing()``) and timm-style ``grad_checkpointing`` flags are
switched off by ``wrap_model`` (named, with how to keep them off) and put back by
``unwrap_model``; no module runs a third time; gradients stay the plain model's; the
doctor names the double checkpointing where something else marked the modules.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Dict

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap.diagnostics import doctor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policy"))
pytest.importorskip("diffusers")
from test_library_units import DIFFUSION, _Block, _Staged  # noqa: E402


def _flags(model: nn.Module) -> Dict[str, bool]:
    return {
        name: getattr(module, flag)
        for name, module in model.named_modules()
        for flag in ("gradient_checkpointing", "grad_checkpointing")
        if isinstance(getattr(module, flag, None), bool)
    }


def _switched(caught) -> list:
    return [w for w in caught if "own gradient checkpointing was on" in str(w.message)]


def test_diffusers_checkpointing_is_switched_off_named_and_put_back():
    arch = DIFFUSION["unet2d-condition"]
    plain = arch.build()
    model = copy.deepcopy(plain)
    model.model.enable_gradient_checkpointing()
    assert all(_flags(model).values())
    batch = arch.batch(2, arch.lengths[0], 0, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptwrap.wrap_model(model, "blocks")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            model(**batch).loss.backward()
    [said] = _switched(caught)
    assert "diffusers' own gradient checkpointing" in str(said.message)
    assert "enable_gradient_checkpointing()" in str(said.message)
    assert not any(_flags(model).values())
    torch.manual_seed(0)
    plain(**batch).loss.backward()
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(ours.grad, theirs.grad), name
    ckptwrap.unwrap_model(model)
    assert all(_flags(model).values()), "unwrap_model puts back what wrap_model switched off"


def _forward_counts(model: nn.Module) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, _Block):  # its MLP's calls: the block's own forward runs them
            module.mlp.register_forward_pre_hook(lambda m, a, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    return counts


def test_timm_style_flags_are_switched_off_so_no_block_runs_three_times():
    model = _Staged()
    for module in model.modules():
        if hasattr(module, "grad_checkpointing"):
            module.grad_checkpointing = True  # as timm's set_grad_checkpointing() does
    counts = _forward_counts(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptwrap.wrap_model(model, "blocks")
    assert len(_switched(caught)) == 1
    assert not any(_flags(model).values())
    model(torch.randn(2, 16)).backward()
    assert set(counts.values()) == {2}, counts  # the forward and ckptwrap's recomputation
    ckptwrap.unwrap_model(model)
    assert all(_flags(model).values())


def test_a_flag_turned_on_after_wrapping_is_switched_off_before_the_next_step():
    model = ckptwrap.wrap_model(_Staged(), "blocks")
    for stage in model.stages:
        stage.grad_checkpointing = True
    counts = _forward_counts(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 16)).backward()
    assert len(_switched(caught)) == 1
    assert set(counts.values()) == {2}, counts


def test_the_doctor_names_a_timm_style_flag_on_beside_ckptwrap():
    model = _Staged()
    for stage in model.stages:
        for index, block in enumerate(stage.blocks):
            stage.blocks[index] = ckptwrap.CheckpointWrapper(block)
        stage.grad_checkpointing = True
    report = doctor(model, example_inputs=(torch.randn(2, 16),))
    twice = [f for f in report.findings if f.check == "selected-twice" and "grad_checkpointing" in f.message]
    assert twice, [f.message for f in report.findings]
    assert "three times" in twice[0].message

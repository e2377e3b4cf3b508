"""timm models, as timm builds them: ``blocks`` selects what timm's own gradient
checkpointing (``model.set_grad_checkpointing()``) checkpoints, read from the models'
source and never by running them; timm's flags are switched off beside ckptwrap's
(named, with how to keep them off) and put back by ``unwrap_model``; gradients stay the
plain model's bit for bit.

The truth is timm itself: its checkpointing is switched on, every call to torch's
checkpoint is watched while the model runs once (in the test, as its user), and the
modules each call runs first are the units ``blocks`` must name (the innermost, where
timm nests them). timm needs torchvision, which has no build for every torch: these
tests run where timm installs beside the pinned torch without replacing it, and skip
elsewhere.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Set, Tuple

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import ckptwrap
from ckptwrap.policy import find_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policy"))
from _watch import checkpointed_units  # noqa: E402

timm = pytest.importorskip("timm")

# name: (timm model, its options at a test's size, image side)
MODELS: Dict[str, Tuple[str, Dict[str, Any], int]] = {
    "vit": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=3, embed_dim=48, num_heads=2), 32),
    "deit": ("deit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2), 32),
    "beit": ("beit_base_patch16_224", dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=2), 32),
    "eva02": ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=7, depth=2), 28),
    "cait": ("cait_xxs24_224", dict(img_size=32, patch_size=8, depth=2), 32),
    "convnext": ("convnext_atto", dict(), 32),
    "convnextv2": ("convnextv2_atto", dict(), 32),
    "swin": ("swin_tiny_patch4_window7_224",
             dict(img_size=64, window_size=4, embed_dim=24, depths=(1, 1, 2, 1), num_heads=(1, 1, 2, 2)), 64),
    "maxvit": ("maxvit_nano_rw_256", dict(img_size=64), 64),
    "coatnet": ("coatnet_nano_rw_224", dict(img_size=64), 64),
    "hiera": ("hiera_tiny_224", dict(img_size=64), 64),
    "pvt-v2": ("pvt_v2_b0", dict(), 64),
    "levit": ("levit_128s", dict(img_size=64), 64),
    "efficientformer": ("efficientformer_l1", dict(), 224),
    "fastvit": ("fastvit_t8", dict(), 64),
    "poolformer": ("poolformer_s12", dict(), 32),
    "mixer": ("mixer_s32_224", dict(img_size=64), 64),
    "resnet": ("resnet18", dict(), 32),
    "regnet": ("regnetx_002", dict(), 32),
    "efficientnet": ("efficientnet_b0", dict(), 32),
    "mobilenetv3": ("mobilenetv3_small_050", dict(), 32),
}


def _build(key: str) -> Tuple[nn.Module, torch.Tensor]:
    name, options, side = MODELS[key]
    torch.manual_seed(0)
    try:
        model = timm.create_model(name, pretrained=False, **options)
    except Exception as error:  # a timm without this model or option
        pytest.skip(f"timm {timm.__version__} cannot build {name} with {options}: {error}")
    return model.train(), torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))


def _timm_units(model: nn.Module, images: torch.Tensor) -> Set[str]:
    """The modules timm's own checkpointing hands to torch's checkpoint in one training step."""
    return checkpointed_units(model, lambda: model(images).sum().backward(), torch.utils.checkpoint)


@pytest.mark.parametrize("key", sorted(MODELS))
def test_blocks_are_what_timm_checkpoints(key):
    model, images = _build(key)
    selected = find_blocks(model)
    truth = _timm_units(copy.deepcopy(model), images)
    assert truth, f"timm checkpointed nothing in {key}: the watch saw no call"
    assert set(selected) == truth, (sorted(set(selected) - truth)[:5], sorted(truth - set(selected))[:5])


def _flags(model: nn.Module) -> Dict[str, bool]:
    return {name: module.grad_checkpointing for name, module in model.named_modules()
            if isinstance(getattr(module, "grad_checkpointing", None), bool)}


@pytest.mark.parametrize("key", ["vit", "convnext", "swin", "efficientnet", "regnet"])
def test_timm_checkpointing_is_switched_off_named_exact_and_put_back(key):
    plain, images = _build(key)
    model = copy.deepcopy(plain)
    model.set_grad_checkpointing(True)
    units = find_blocks(model)
    runs: Dict[str, int] = {}
    for name in units:  # a part of each unit: hooks on the unit itself run once a step
        inner = next(model.get_submodule(name).children())
        inner.register_forward_pre_hook(lambda module, args, name=name: runs.__setitem__(name, runs.get(name, 0) + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptwrap.wrap_model(model, "blocks")
        torch.manual_seed(0)
        model(images).sum().backward()
    said = [str(w.message) for w in caught if "own gradient checkpointing was on" in str(w.message)]
    assert len(said) == 1 and "timm" in said[0] and "set_grad_checkpointing" in said[0], said
    assert not any(_flags(model).values())
    # Each unit ran in the forward and ckptwrap's recomputation, not in timm's as well.
    assert set(runs.values()) == {2} and set(runs) == set(units), runs
    torch.manual_seed(0)
    plain(images).sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        assert (ours.grad is None) == (theirs.grad is None), name
        if ours.grad is not None:
            assert torch.equal(ours.grad, theirs.grad), name
    ckptwrap.unwrap_model(model)
    assert _flags(model) and all(_flags(model).values()), "unwrap_model puts timm's flags back"

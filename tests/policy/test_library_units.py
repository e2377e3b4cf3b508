"""``blocks`` selects what a library's own gradient checkpointing checkpoints, read from
the forwards of its flagged modules (never from class names, never by running the model):
diffusers' ``_gradient_checkpointing_func`` calls and timm-style ``checkpoint_seq`` /
``checkpoint(blk, x)`` loops.

The diffusers cases are checked against diffusers itself: its checkpointing is switched
on with a function that records the module each call hands it, the model runs once (in
the test, as its user), and the modules recorded are the ones ``blocks`` must name.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, List, Set

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ckptwrap
from ckptwrap.policy import find_blocks
from ckptwrap.policy._library_units import library_units

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("diffusers")
from _diffusion import DIFFUSION  # noqa: E402


def _innermost(names: Set[str]) -> Set[str]:
    return {name for name in names if not any(other.startswith(name + ".") for other in names)}


def _recorded(arch: Any) -> Set[str]:
    """The modules diffusers' own checkpointing hands to its checkpoint function in one
    training forward of ``arch``'s model (built fresh)."""
    wrapper = arch.build()
    names = {id(module): name for name, module in wrapper.named_modules()}
    seen: List[str] = []

    def record(module: Callable[..., Any], *args: Any) -> Any:
        owner = getattr(module, "__self__", module)
        seen.append(names[id(owner)])
        return module(*args)

    wrapper.model.enable_gradient_checkpointing(gradient_checkpointing_func=record)
    batch = arch.batch(2, arch.lengths[0], 0, False)
    wrapper(**batch).loss.backward()
    return set(seen)


@pytest.mark.parametrize("name", ["unet2d-condition", "autoencoder-kl", "dit"])
def test_blocks_on_a_diffusers_model_are_what_diffusers_checkpoints(name):
    arch = DIFFUSION[name]
    recorded = _recorded(arch)
    assert recorded, "diffusers checkpointed nothing: the recorder saw no call"
    model = arch.build()
    assert library_units(list(model.named_modules())) == recorded
    # Where diffusers nests its checkpoints, the innermost units are the blocks (as for
    # transformers' nested layers).
    assert set(find_blocks(model)) == _innermost(recorded)


def test_the_unet_checkpoints_its_down_path_and_reaches_a_lower_peak():
    # Before, repetition alone took the up path and the mid block (8 modules, 66% of the
    # plain peak at the least; 53% now, as diffusers' own checkpointing).
    arch = DIFFUSION["unet2d-condition"]
    model = arch.build()
    assert any(".down_blocks." in name for name in find_blocks(model))
    batch = arch.batch(2, arch.lengths[1], 0, False)
    old = {
        f"model.{path}.{index}" for index in (0, 1)
        for path in ("up_blocks.0.resnets", "up_blocks.1.resnets", "up_blocks.1.attentions", "mid_block.resnets")
    }

    def before(module: nn.Module, name: str) -> bool:
        return name in old

    ours = ckptwrap.plan(arch.build(), "blocks", example_kwargs=batch)
    repeated = ckptwrap.plan(arch.build(), before, example_kwargs=batch)
    assert len(repeated.names) == 8 and ours.names == find_blocks(model)
    assert ours.predicted_peak < repeated.predicted_peak


# ----------------------------------------------------------------------------- timm style


def checkpoint_seq(functions: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """timm's helper, as its models call it: each member checkpointed in turn."""
    for function in functions:
        x = checkpoint(function, x, use_reentrant=False)
    return x


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _Stage(nn.Module):
    """A ConvNeXt-style stage: its blocks checkpointed through ``checkpoint_seq``."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.down = nn.Linear(width, width)
        self.blocks = nn.Sequential(*[_Block(width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(x)
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint_seq(self.blocks, x)
        return self.blocks(x)


class _Staged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.Sequential(*[_Stage(16, 3) for _ in range(4)])
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(x)).sum()


class _Plain(nn.Module):
    """A ViT-style model: its blocks checkpointed one by one in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([_Block(16) for _ in range(3)])
        self.extra = _Block(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for index, blk in enumerate(self.blocks):
            x = checkpoint(blk, x, use_reentrant=False) if self.grad_checkpointing else blk(x)
        return self.extra(x).sum()


def test_timm_style_stages_give_their_blocks_not_the_stages():
    # The stages repeat, so repetition alone selects the 4 stages; the stages' forwards
    # checkpoint their 12 blocks, and those are the blocks.
    model = _Staged()
    assert find_blocks(model) == [f"stages.{s}.blocks.{b}" for s in range(4) for b in range(3)]


def test_a_loop_over_a_module_list_gives_its_members_and_nothing_else():
    model = _Plain()
    assert library_units(list(model.named_modules())) == {f"blocks.{i}" for i in range(3)}
    assert find_blocks(model) == [f"blocks.{i}" for i in range(3)]


def test_the_selection_matches_what_the_flag_checkpoints_when_run():
    # The recorded truth for the timm-style models: switch their flags on and count the
    # modules checkpoint() is handed.
    for model in (_Staged(), _Plain()):
        names = {id(module): name for name, module in model.named_modules()}
        seen: Set[str] = set()
        for module in model.modules():
            if hasattr(module, "grad_checkpointing"):
                module.grad_checkpointing = True
        original = torch.utils.checkpoint.checkpoint

        def spy(function, *args, **kwargs):
            seen.add(names[id(function)])
            return original(function, *args, **kwargs)

        globals()["checkpoint"] = spy
        try:
            model(torch.randn(2, 16 if isinstance(model, _Staged) else 8)).backward()
        finally:
            globals()["checkpoint"] = original
        assert set(find_blocks(model)) == seen


class _Unresolved(nn.Module):
    """A flagged module whose checkpoint call gets a unit made on the fly: not followed."""

    def __init__(self) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        self.layers = nn.ModuleList([_Block(8) for _ in range(2)])

    def pick(self, index: int) -> nn.Module:
        return self.layers[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in range(2):
            x = checkpoint(self.pick(index), x, use_reentrant=False)
        return x.sum()


def test_a_unit_that_cannot_be_followed_leaves_blocks_to_repetition():
    model = _Unresolved()
    assert library_units(list(model.named_modules())) == set()
    assert find_blocks(model) == ["layers.0", "layers.1"]


def test_a_class_without_source_is_left_out():
    made = type("Made", (nn.Module,), {
        "__init__": lambda self: (nn.Module.__init__(self), setattr(self, "gradient_checkpointing", False),
                                  setattr(self, "inner", _Block(4)))[0],
        "forward": eval("lambda self, x: self.inner(x)"),
    })
    model = made()
    assert library_units(list(model.named_modules())) == set()

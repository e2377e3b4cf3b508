"""``blocks`` selects what a library's own gradient checkpointing checkpoints, read from
the forwards of its flagged modules (never from class names, never by running the model):
diffusers' ``_gradient_checkpointing_func`` calls and timm-style ``checkpoint_seq`` /
``checkpoint(blk, x)`` loops.

The diffusers cases are checked against diffusers itself: its checkpointing is switched
on with a function that records the module each call hands it, the model runs once (in
the test, as its user), and the modules recorded are the ones ``blocks`` must name.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any, Callable, List, Set

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ckptwrap
from ckptwrap.measure import measure_peak
from ckptwrap.policy import find_blocks
from ckptwrap.policy._library_units import library_units

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("diffusers")
from _diffusion import DIFFUSION  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _watch import checkpointed_units  # noqa: E402


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
    # Where diffusers nests its checkpoints, the blocks are both the outer and the inner
    # units (the plan keeps the outer and lists the inner ones as nested), except where the
    # inner ones hold most of the outer one: then only the innermost.
    assert set(find_blocks(model)) == recorded


def _peak(model: nn.Module, batch: Any) -> int:
    def step() -> None:
        torch.manual_seed(0)
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm: lazily made state outside the peak
    with measure_peak("cpu") as peak:
        step()
    return peak.peak_bytes


@pytest.mark.parametrize("name", ["unet2d-condition", "autoencoder-kl"])
def test_blocks_reach_the_peak_of_diffusers_own_checkpointing(name):
    # Before, the autoencoder's blocks left its mid blocks' attention and first resnet
    # unchecked: 63% of the plain peak against diffusers' 39%.
    arch = DIFFUSION[name]
    batch = arch.batch(2, arch.lengths[1], 0, False)
    theirs = arch.build()
    theirs.model.enable_gradient_checkpointing()
    ours = ckptwrap.wrap_model(arch.build(), "blocks")
    plain = _peak(arch.build(), batch)
    assert _peak(ours, batch) <= _peak(theirs, batch) + 0.02 * plain


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


def checkpoint_seq(functions: Any, x: torch.Tensor, flatten: bool = False, skip_last: bool = False) -> torch.Tensor:
    """timm's helper, as its models call it: each member checkpointed in turn (with
    ``flatten``, each member of each member), the last one not with ``skip_last``."""
    functions = list(itertools.chain.from_iterable(functions) if flatten else functions)
    for index, function in enumerate(functions):
        last = skip_last and index == len(functions) - 1
        x = function(x) if last else checkpoint(function, x, use_reentrant=False)
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


class _Layered(nn.Module):
    """A ResNet/EfficientNet-style model: stem, stages of blocks run by ``checkpoint_seq``
    from ``forward_features`` (flattened), a stage that runs its own children; and a
    repeated stem timm leaves unchecked."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.stem = nn.Sequential(_Block(8), _Block(8))
        self.layer1 = nn.Sequential(_Block(8), _Block(8))
        self.layer2 = nn.Sequential(_Block(8), _Block(8), _Block(8))
        self.blocks = nn.Sequential(nn.Sequential(_Block(8)), nn.Sequential(_Block(8), _Block(8)))
        self.tail = _Children()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = self.tail.grad_checkpointing = enable

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.grad_checkpointing:
            x = checkpoint_seq([self.layer1, self.layer2], x, flatten=True)
            x = checkpoint_seq(self.blocks, x, flatten=True, skip_last=True)
        else:
            x = self.blocks(self.layer2(self.layer1(x)))
        return self.tail(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x).sum()


class _Children(nn.Module):
    """A RegNet-style stage: blocks as its own children, run by ``checkpoint_seq``."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.b1, self.b2 = _Block(8), _Block(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing:
            return checkpoint_seq(self.children(), x)
        return self.b2(self.b1(x))


def test_units_from_methods_forward_calls_flattened_children_and_all_but_the_last():
    model = _Layered()
    truth = checkpointed_units(model, lambda: model(torch.randn(2, 8)).backward(), sys.modules[__name__])
    assert truth == {"layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2", "blocks.0.0", "blocks.1.0",
                     "tail.b1", "tail.b2"}
    assert library_units(list(model.named_modules())) == truth
    # The stem repeats, but the model's own checkpointing leaves it: so does blocks.
    assert set(find_blocks(model)) == truth


def test_repetition_still_counts_outside_what_a_library_decides():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.timm_part = _Layered()
            self.mine = nn.ModuleList([_Block(8), _Block(8)])

    model = Outer()
    assert {"mine.0", "mine.1"} <= set(find_blocks(model))
    assert not any(name.startswith("timm_part.stem") for name in find_blocks(model))


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

"""``blocks`` takes every block list a library checkpoints: the checkpoint calls of a
library's forwards are followed by what the loops around them run over, not by the loop
variable's name (Flux runs ``for block in self.transformer_blocks`` and then ``for block
in self.single_transformer_blocks``: both lists are checkpointed), through attribute
chains (``self.up[i].block[j]``, ``self.mid.block_1``) and loops over a loop variable's
members.

The truth is the library itself: its own checkpointing is switched on with a function that
records the module each call hands it, and the model runs one training forward. Every
model class diffusers exports is held to it, at the tiny configs of
``benchmarks/_diffusion.py`` (most as diffusers' own model tests make them; those not
built say why), on the meta device where its forward runs there (no compute), else on the
CPU; transformers' Zamba2, whose hybrid layers checkpoint their Mamba layer inside, too.
On a few of them the training step's peak, read at the allocator, is held to that of the
library's own checkpointing, and every gradient to the plain model's, bit for bit.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Dict, Set, Tuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ckptwrap
from ckptwrap.policy import Name, find_blocks, library_nests
from ckptwrap.policy._library_units import library_units, unfollowed_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _allocator import allocator_peak  # noqa: E402
from _watch import recording  # noqa: E402

SLACK = 0.02
"""A step's peak under ``blocks`` may pass the library's own by this share of the plain
peak (what the allocator holds besides, as in the library tests beside this one)."""


# ----------------------------------------------------------------------- the parser


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


def _blocks(n: int) -> nn.ModuleList:
    return nn.ModuleList(_Block() for _ in range(n))


class _TwoLists(nn.Module):
    """Flux's forward: two block lists, one loop variable."""

    def __init__(self) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        self.transformer_blocks = _blocks(2)
        self.single_transformer_blocks = _blocks(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.transformer_blocks):
            x = checkpoint(block, x, use_reentrant=False) if self.gradient_checkpointing else block(x)
        for index, block in enumerate(self.single_transformer_blocks):
            x = checkpoint(block, x, use_reentrant=False) if self.gradient_checkpointing else block(x)
        return x


class _Level(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _blocks(2)
        self.resnets = _blocks(3)


class _Paths(nn.Module):
    """KVAE's ``self.down[i].block[j]`` and ``self.mid.block_1``; a loop over a loop
    variable's members; AudioLDM2's ``self.resnets[i + 1]`` (all but the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        self.down = nn.ModuleList(_Level() for _ in range(2))
        self.mid = nn.Module()
        self.mid.block_1, self.mid.block_2 = _Block(), _Block()
        self.levels = nn.ModuleList(_Level() for _ in range(2))
        self.resnets = _blocks(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            for j in range(2):
                x = checkpoint(self.down[i].block[j], x, use_reentrant=False)
        x = checkpoint(self.mid.block_1, x, use_reentrant=False)
        for level in self.levels:
            for resnet in level.resnets:
                x = checkpoint(resnet, x, use_reentrant=False)
        x = self.resnets[0](x)
        for i in range(len(self.resnets) - 1):
            x = checkpoint(self.resnets[i + 1], x, use_reentrant=False)
        return x


def _watched(model: nn.Module, x: torch.Tensor) -> Set[str]:
    units, record, remove = recording(model)
    this = sys.modules[__name__]
    original = this.checkpoint
    this.checkpoint = record  # type: ignore[attr-defined]
    model.gradient_checkpointing = True
    try:
        model(x)
    finally:
        this.checkpoint = original  # type: ignore[attr-defined]
        model.gradient_checkpointing = False
        remove()
    return units


def test_two_loops_with_one_variable_give_both_lists():
    model = _TwoLists()
    expected = {f"transformer_blocks.{i}" for i in range(2)} | {f"single_transformer_blocks.{i}" for i in range(3)}
    assert _watched(model, torch.randn(2, 4)) == expected
    assert library_units(list(model.named_modules())) == expected
    assert set(find_blocks(model)) == expected
    assert find_blocks(model) == find_blocks(model)  # a function of the model alone


def test_attribute_chains_loops_over_members_and_offsets_are_followed():
    model = _Paths()
    expected = (
        {f"down.{i}.block.{j}" for i in range(2) for j in range(2)} | {"mid.block_1"}
        | {f"levels.{i}.resnets.{j}" for i in range(2) for j in range(3)} | {"resnets.1", "resnets.2"}
    )
    assert _watched(model, torch.randn(2, 4)) == expected
    assert library_units(list(model.named_modules())) == expected


# ------------------------------------------------------------------------ diffusers

diffusers = pytest.importorskip("diffusers")
from _diffusion import NOT_BUILT, TINY, Tiny, model_classes  # noqa: E402

_ON_CPU = frozenset({
    "AutoencoderKLCosmos", "AutoencoderKLTemporalDecoder", "AutoencoderVidTok", "BriaFiboTransformer2DModel",
    "ConsistencyDecoderVAE", "Cosmos3OmniTransformer", "ErnieImageTransformer2DModel", "GlmImageTransformer2DModel",
    "HeliosTransformer3DModel", "HiDreamImageTransformer2DModel", "HunyuanImageTransformer2DModel",
    "HunyuanVideo15Transformer3DModel", "HunyuanVideoFramepackTransformer3DModel", "Ideogram4Transformer2DModel",
    "Lumina2Transformer2DModel", "MochiTransformer3DModel", "OmniGenTransformer2DModel",
    "UNetSpatioTemporalConditionModel", "ZImageTransformer2DModel",
})
"""Models whose forwards read tensors' values (``.item()``, ``nonzero``, ``bincount``),
cast under autocast or make tensors on the CPU beside their inputs: they run on the CPU.
The others run on the meta device, where a forward computes nothing."""


def _built(tiny: Tiny, device: str) -> Tuple[nn.Module, Dict[str, Any]]:
    # Imported first: a module imported under torch.device("meta") makes its globals there.
    getattr(diffusers, tiny.cls)
    with torch.device(device):
        model = tiny.build()
    batch = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in tiny.batch().items()}
    return model, batch


def _diffusers_units(model: nn.Module, batch: Dict[str, Any]) -> Set[str]:
    """What diffusers' own checkpointing hands its checkpoint function in one training
    forward: switched on as ``enable_gradient_checkpointing`` does, on every module that
    carries its flag (also in a model that refuses the switch, such as UNet3D, whose
    transformers checkpoint their own blocks)."""
    units, record, remove = recording(model)
    flagged = [module for module in model.modules() if hasattr(module, "gradient_checkpointing")]
    if getattr(model, "_supports_gradient_checkpointing", False):
        model.enable_gradient_checkpointing(gradient_checkpointing_func=record)
    for module in flagged:
        module._gradient_checkpointing_func, module.gradient_checkpointing = record, True
    try:
        with torch.enable_grad():
            model(**batch)
    finally:
        for module in flagged:
            module.gradient_checkpointing = False
        remove()
    return units


def test_every_diffusers_model_class_is_built_or_said_why_not():
    classes = set(model_classes())
    assert classes, "diffusers exports no model class"
    assert not set(TINY) & set(NOT_BUILT)
    assert classes == set(TINY) | set(NOT_BUILT), sorted(classes ^ (set(TINY) | set(NOT_BUILT)))


def test_every_checkpoint_call_in_diffusers_is_followed():
    # Built or not, each forward in diffusers that hands a module to a checkpoint function
    # hands one that blocks can follow back to the model's modules.
    model_classes()  # imports every model's module
    read, unfollowed = 0, {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("diffusers."):
            continue
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == name and _calls_a_checkpoint(cls):
                read += 1
                if unfollowed_calls(cls):
                    unfollowed[cls.__qualname__] = unfollowed_calls(cls)
    assert read > 100
    assert not unfollowed


def _calls_a_checkpoint(cls: type) -> bool:
    """Whether a method of ``cls`` (or a function inside one) names a checkpoint function."""
    codes = [value.__code__ for value in vars(cls).values() if inspect.isfunction(value)]
    while codes:
        code = codes.pop()
        if _CHECKPOINT_NAMES.intersection(code.co_names):
            return True
        codes.extend(const for const in code.co_consts if inspect.iscode(const))
    return False


_CHECKPOINT_NAMES = frozenset({"_gradient_checkpointing_func", "checkpoint", "checkpoint_seq", "checkpoint_sequential"})


@pytest.mark.parametrize("name", sorted(TINY))
def test_blocks_take_what_diffusers_checkpoints(name):
    tiny = TINY[name]
    model, batch = _built(tiny, "cpu" if name in _ON_CPU else "meta")
    recorded = _diffusers_units(model, batch)
    assert library_units(list(model.named_modules())) == recorded
    blocks = set(find_blocks(model))
    # Each module diffusers checkpoints is a block.
    assert recorded <= blocks
    if getattr(type(model), "_supports_gradient_checkpointing", False) and recorded:
        # Where diffusers' model decides what it checkpoints, blocks adds nothing to it.
        assert blocks <= recorded
    if not blocks:
        return
    plan = ckptwrap.plan(model, "blocks")
    # The plan checkpoints every unit diffusers checkpoints, nested as it nests them (or
    # the items of one its forward never calls, with the reason).
    dropped = dict(plan.dropped)
    assert blocks <= set(plan.names) | set(dropped)
    assert not any("inside checkpointed" in reason for reason in dropped.values())


def test_units_diffusers_nests_are_nested_under_blocks_and_candidates_apart_under_a_budget():
    tiny = TINY["AutoencoderKLHunyuanVideo"]
    model = tiny.build()
    recorded = _diffusers_units(model, tiny.batch())
    nests = library_nests(model)
    inner = {unit for unit in recorded if any(unit.startswith(other + ".") for other in recorded)}
    assert inner and set(nests) == inner
    assert all(unit.startswith(holder + ".") and holder in recorded for unit, holder in nests.items())
    # blocks checkpoints both, nested as diffusers nests them; so does nested=True.
    assert set(ckptwrap.plan(model, "blocks").names) == recorded
    assert set(ckptwrap.plan(model, "blocks", nested=True).names) == recorded
    # A budget's candidates do not nest: the inner units are listed as inside the outer.
    plan = ckptwrap.plan(model, "budget:70%", example_kwargs=tiny.batch())
    assert plan.names and set(plan.names) <= recorded - inner
    assert {name for name, reason in plan.dropped if "inside checkpointed" in reason} == inner
    # Modules the library does not nest in one it checkpoints are left out as before.
    outer = sorted(set(nests.values()))[0]
    leaf = next(n for n, m in model.named_modules() if n.startswith(outer + ".") and isinstance(m, nn.Conv3d) and n not in recorded)
    plan = ckptwrap.plan(model, Name(outer) | Name(leaf))
    assert list(plan.names) == [outer]
    assert [name for name, _ in plan.dropped] == [leaf]


def test_unet3d_takes_its_resnets_and_temporal_layers_beside_its_transformers():
    # UNet3D refuses diffusers' switch; only the transformers inside it checkpoint their
    # own blocks. Its blocks decide nothing, so its repeated resnets and temporal layers
    # are blocks too.
    model, batch = _built(TINY["UNet3DConditionModel"], "meta")
    recorded = _diffusers_units(model, batch)
    blocks = set(find_blocks(model))
    assert recorded < blocks
    assert {"up_blocks.0.resnets.0", "up_blocks.0.temp_convs.0", "mid_block.resnets.0", "up_blocks.1.temp_attentions.0"} <= blocks


def _peak(model: nn.Module, batch: Dict[str, Any]) -> int:
    def step() -> None:
        torch.manual_seed(0)
        Tiny.loss(model(**batch)).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm: lazily made state outside the peak
    return allocator_peak(step)


def _gradients(model: nn.Module, batch: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    Tiny.loss(model(**batch)).backward()
    found = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


_PEAKS = [
    "AudioLDM2UNet2DConditionModel", "AuraFlowTransformer2DModel", "AutoencoderKL",
    "AutoencoderKLCogVideoX", "AutoencoderKLHunyuanVideo", "AutoencoderKLKVAE",
    "AutoencoderKLLTXVideo", "AutoencoderKLMochi", "ControlNetModel",
    "FluxTransformer2DModel", "PixArtTransformer2DModel", "UNet2DModel", "UNet3DConditionModel",
    "WanVACETransformer3DModel",
]
"""Models whose peaks are measured: those that run two block lists in one forward (Flux,
AuraFlow, WanVACE), attribute chains (KVAE's VAE), a model that refuses diffusers' switch
(UNet3D), nested units (AutoencoderKL's mid blocks; the video autoencoders' and AudioLDM2's
blocks around their resnets, where neither the outer nor the inner units alone reach the
library's peak), and a ControlNet, a UNet and a DiT."""


@pytest.mark.parametrize("name", _PEAKS)
def test_blocks_reach_the_peak_of_diffusers_own_checkpointing_exactly(name):
    tiny = TINY[name]
    batch = tiny.batch()
    plain = tiny.build()
    theirs = tiny.build()
    if type(theirs)._supports_gradient_checkpointing:
        theirs.enable_gradient_checkpointing()
    ours = ckptwrap.wrap_model(tiny.build(), "blocks")
    plain_peak = _peak(plain, batch)
    assert _peak(ours, batch) <= _peak(theirs, batch) + SLACK * plain_peak
    expected, found = _gradients(plain, batch), _gradients(ours, batch)
    assert expected.keys() == found.keys()
    assert all(torch.equal(expected[key], found[key]) for key in expected), name


# ----------------------------------------------------------------------- transformers


def test_zamba2_blocks_are_every_region_transformers_checkpoints():
    pytest.importorskip("transformers")
    from _architectures import ARCHITECTURES

    arch = ARCHITECTURES["zamba2"]
    batch = arch.batch(2, arch.lengths[0], 0, False)
    model = arch.build()
    units, record, remove = recording(model)
    model.gradient_checkpointing_enable()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", None) is True:
            module._gradient_checkpointing_func = record
    try:
        model(**batch)
    finally:
        model.gradient_checkpointing_disable()
        remove()
    nested = {unit for unit in units if any(unit.startswith(other + ".") for other in units)}
    assert nested and all(unit.endswith(".mamba_decoder") for unit in nested)
    assert set(find_blocks(model)) == units
    # The plan checkpoints the outer regions and lists the Mamba layers inside them;
    # nested=True checkpoints both, as transformers does.
    plan = ckptwrap.plan(model, "blocks")
    assert set(plan.names) == units - nested
    assert {name for name, reason in plan.dropped if "inside checkpointed" in reason} == nested
    assert set(ckptwrap.plan(model, "blocks", nested=True).names) == units
    for nest in (False, True):
        theirs = arch.build()
        theirs.gradient_checkpointing_enable()
        ours = ckptwrap.wrap_model(arch.build(), "blocks", nested=nest)
        plain = arch.build()

        def peak(m: nn.Module) -> int:
            def step() -> None:
                torch.manual_seed(0)
                m(**batch).loss.backward()
                m.zero_grad(set_to_none=True)

            step()
            return allocator_peak(step)

        assert peak(ours) <= peak(theirs) + SLACK * peak(plain), nest
        expected, found = {}, {}
        for m, into in ((plain, expected), (ours, found)):
            torch.manual_seed(0)
            m(**batch).loss.backward()
            into.update({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        assert expected.keys() == found.keys()
        assert all(torch.equal(expected[key], found[key]) for key in expected)

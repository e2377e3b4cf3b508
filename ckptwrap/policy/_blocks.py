"""Detection of a model's repeated blocks, such as the layers of a transformer.

The ``blocks`` policy term rests on it, and so does every picker term (``every``,
``first``, ``last``, ``fraction``) that is given no set term to pick from.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Sequence, Set, Tuple

from torch import nn
from torch.nn.parameter import is_lazy

from .._errors import CheckpointConfigError
from .._hf import hf_layer_class
from ._library_units import decides, library_units

__all__ = ["detect_blocks", "find_blocks", "library_nests"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)

NamedModules = Sequence[Tuple[str, nn.Module]]


@dataclasses.dataclass(frozen=True)
class _Group:
    """Two or more direct children of one container that share a class."""

    cls: type
    """The class the members share."""
    members: Tuple[str, ...]
    """Qualified names of the members, in model order."""


def find_blocks(model: nn.Module) -> List[str]:
    """Find the repeated blocks of a model: what the ``blocks`` policy term selects.

    A *group* is a class that appears two or more times among the direct children of one
    ``nn.ModuleList`` or ``nn.Sequential`` (the model itself counts if it is one). A
    *block* is a member of a group that has submodules of its own: a layer built of
    layers, such as a transformer layer or a residual block. Every block family is
    selected, not only the most frequent one, so an encoder-decoder model gets both its
    encoder and its decoder layers. Where blocks nest, the outermost are kept: the
    ``Sequential`` MLP inside each transformer layer is part of the layer. Repeated
    modules without submodules (``Linear`` heads, ``Dropout``, activations) are single
    operators, not blocks: checkpointing one saves little and costs a recomputation.

    Hugging Face models declare the layers that transformers' own gradient checkpointing
    checkpoints (instances of its ``GradientCheckpointingLayer``): each of them is a block,
    repeated or not, and where they nest (Swin's stages hold its layers) the innermost
    are kept, since checkpointing only the outer ones would hold a whole stage's
    activations at once during its recomputation; unless the inner ones hold less than
    60% of the outer one's parameters: then both are blocks (Zamba2's hybrid layers and
    the Mamba layers inside them), so that a plan keeps the outer one and lists the
    inner ones as inside it, and ``nested=True`` checkpoints both as transformers does.
    A repeated block that holds declared layers gives way to them, and one inside a kept
    declared layer is part of it. transformers is never imported here: the class is
    looked up only if the model's library has loaded it.
    Modules of other libraries that checkpoint parts of themselves (diffusers, timm: a
    ``gradient_checkpointing`` or ``grad_checkpointing`` flag) declare the units their
    forwards hand to a checkpoint function, read from their source, each call's module
    followed back through the loop that runs over it (``_library_units``); a repeated
    group of which the library checkpoints only some members gives only those, and
    inside a module whose library decides what it checkpoints, nothing else that repeats
    is taken (a flag on a module that checkpoints nothing itself decides nothing:
    UNet3D's resnets and temporal layers around its checkpointed transformers are
    blocks). Where such a library checkpoints units inside others (a diffusers video
    autoencoder's resnets inside its down and up blocks), both are blocks, and a plan
    of fixed modules nests them as the library does (:func:`library_nests`): neither
    the outer nor the inner units alone reach the library's peak on every model (the
    outer ones alone hold a whole block during its recomputation, the inner ones alone
    keep what lies between them, such as an up-sampling convolution's input at twice
    the resolution).

    A model whose only repetition is of modules without submodules (a plain
    ``nn.Sequential`` MLP) has no blocks in that sense; there the members of the class
    with the most members in all are selected, ties going to the class with more
    parameters per module, then to the class that appears first.

    Args:
        model: The model to search.

    Returns:
        Qualified names of the selected modules, in the order of ``model.named_modules()``;
        empty if nothing repeats and the model declares no layers.

    Raises:
        CheckpointConfigError: If ``model`` is not an ``nn.Module``.

    Example:
        >>> find_blocks(bart)  # doctest: +SKIP
        ['model.encoder.layers.0', ..., 'model.decoder.layers.0', ...]
    """
    if not isinstance(model, nn.Module):
        raise CheckpointConfigError(
            f"find_blocks needs an nn.Module; got {type(model).__name__}"
        )
    return list(detect_blocks(list(model.named_modules())))


def detect_blocks(named: NamedModules) -> Tuple[str, ...]:
    """:func:`find_blocks` on the output of ``named_modules()``, root first."""
    modules: Dict[str, nn.Module] = dict(named)
    position = {name: i for i, (name, _) in enumerate(named)}
    groups = [
        group
        for name, module in named
        if isinstance(module, _CONTAINERS)
        for group in _groups_in(name, module, position)
    ]
    from_source = library_units(named)
    from_class = _transformers_layers(named)
    declared = from_source | from_class
    holding_declared = {ancestor for name in declared for ancestor in _ancestors(name)}
    kept = _nesting_resolved(from_class, modules) | from_source
    # A module whose library decides what it checkpoints (see decides) and that holds
    # declared units decides for all it holds: what else repeats in it (timm's stems,
    # CaiT's class-attention blocks) its library leaves unchecked, and so does blocks.
    deciding = {
        name for name, module in named
        if decides(module) and any(_inside(unit, name) for unit in declared)
    }
    repeated = {
        member
        for group in groups
        # A library that checkpoints some members of a group (diffusers' mid blocks, all
        # resnets but the first) chose which: the rest are not blocks.
        if not declared.intersection(group.members)
        for member in group.members
        if _has_submodules(modules[member])
        # The declared layers decide inside and around themselves.
        and member not in holding_declared
        and not any(ancestor in kept for ancestor in _ancestors(member))
        and not any(_inside(member, name) for name in deciding)
    }
    blocks = kept | _outermost(repeated)
    if blocks:
        return tuple(sorted(blocks, key=position.__getitem__))
    return _most_frequent_class(groups, modules, position)


def _groups_in(name: str, container: nn.Module, position: Dict[str, int]) -> List[_Group]:
    """The groups among the direct children of one container."""
    prefix = f"{name}." if name else ""
    by_class: Dict[type, List[str]] = {}
    for key, child in container.named_children():
        qualified = prefix + key
        # A module shared with an earlier part of the model is named after its first
        # occurrence by named_modules(); here it would have a name that does not exist.
        if qualified in position:
            by_class.setdefault(type(child), []).append(qualified)
    return [
        _Group(cls=cls, members=tuple(members))
        for cls, members in by_class.items()
        if len(members) >= 2
    ]


def _transformers_layers(named: NamedModules) -> Set[str]:
    """Non-root modules that transformers' own gradient checkpointing would checkpoint."""
    layer_class = hf_layer_class()
    if layer_class is None:
        return set()
    return {name for name, module in named if name and isinstance(module, layer_class)}


def library_nests(model: nn.Module) -> Dict[str, str]:
    """The units a model's library hands to a checkpoint function inside another unit
    it checkpoints (read from its source, see :func:`find_blocks`), each with the
    innermost such unit that holds it (``{"decoder.up_blocks.0.resnets.1":
    "decoder.up_blocks.0"}``): a plan of fixed modules that selects both nests them as
    the library does, ``nested`` or not."""
    units = library_units(list(model.named_modules()))
    nests = {}
    for name in units:
        holders = [ancestor for ancestor in _ancestors(name) if ancestor in units]
        if holders:
            nests[name] = holders[-1]
    return nests


_COVERED = 0.6
"""Share of a transformers layer's parameters that the layers inside it must hold for
those to stand for it."""


def _nesting_resolved(declared: Set[str], modules: Dict[str, nn.Module]) -> Set[str]:
    """Where transformers' layers nest, the inner ones alone if they hold most of the
    outer one's parameters (Swin's layers in its stages, 75% beside the downsampling):
    the outer one is left out, and they bound the peak as nested checkpoints would, with
    one recomputation instead of two. Else both, as transformers nests them: a plan keeps the
    outer one and lists the inner ones as inside it, and ``nested=True`` nests them
    (Zamba2's hybrid layers and the Mamba layers inside them)."""
    chosen = set(declared)
    for outer in sorted(declared, key=lambda name: name.count(".")):
        if outer not in chosen:
            continue
        inner = _outermost({name for name in chosen if name.startswith(outer + ".")})
        covered = sum(_parameter_count(modules[name]) for name in inner)
        if inner and covered >= _COVERED * _parameter_count(modules[outer]):
            chosen.discard(outer)
    return chosen


def _outermost(names: Set[str]) -> FrozenSet[str]:
    """``names`` without those that lie inside another of them."""
    return frozenset(
        name for name in names if not any(ancestor in names for ancestor in _ancestors(name))
    )


def _most_frequent_class(
    groups: List[_Group], modules: Dict[str, nn.Module], position: Dict[str, int]
) -> Tuple[str, ...]:
    """Members of the class with the most members in all, for models without blocks.

    Only called when no group member has submodules, so no group lies inside another.
    """
    if not groups:
        return ()
    by_class: Dict[type, List[str]] = {}
    for group in groups:
        by_class.setdefault(group.cls, []).extend(group.members)

    def rank(cls: type) -> Tuple[int, float, int]:
        members = by_class[cls]
        per_module = sum(_parameter_count(modules[m]) for m in members) / len(members)
        first = min(position[m] for m in members)
        return (-len(members), -per_module, first)

    winner = min(by_class, key=rank)
    return tuple(sorted(by_class[winner], key=position.__getitem__))


def _inside(name: str, holder: str) -> bool:
    """Whether module ``name`` lies inside module ``holder`` (``""``, the root, holds all)."""
    return name != holder and (not holder or name.startswith(holder + "."))


def _ancestors(name: str) -> List[str]:
    """Qualified names of the modules that hold ``name``, root excluded."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _has_submodules(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _parameter_count(module: nn.Module) -> int:
    # Lazy modules (nn.LazyLinear) hold parameters whose size is not known yet.
    return sum(0 if is_lazy(p) else p.numel() for p in module.parameters())

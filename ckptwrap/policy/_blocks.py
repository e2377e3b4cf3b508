"""Detection of a model's repeated blocks, such as the layers of a transformer.

The ``blocks`` policy term rests on it, and so does every picker term (``every``,
``first``, ``last``, ``fraction``) that is given no set term to pick from.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Set, Tuple

from torch import nn
from torch.nn.parameter import is_lazy

from .._errors import CheckpointConfigError

__all__ = ["find_blocks"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)

NamedModules = Sequence[Tuple[str, nn.Module]]


@dataclasses.dataclass(frozen=True)
class _Group:
    """Two or more direct children of one container that share a class."""

    container: str
    """Qualified name of the ``nn.ModuleList`` or ``nn.Sequential`` ("" for the root)."""
    cls: type
    """The class the members share."""
    members: Tuple[str, ...]
    """Qualified names of the members, in model order."""


def find_blocks(model: nn.Module) -> List[str]:
    """Find the repeated blocks of a model: what the ``blocks`` policy term selects.

    A *group* is a class that appears two or more times among the direct children of one
    ``nn.ModuleList`` or ``nn.Sequential`` (the model itself counts if it is one). Groups
    inside a member of another group are ignored, so the outermost repetition wins: the
    ``Linear`` layers in each transformer block's MLP do not compete with the blocks.
    Of the remaining groups, the class with the most members in all wins; ties go to the
    class with more parameters per module, then to the class that appears first.

    Args:
        model: The model to search.

    Returns:
        Qualified names of every member of every group of the winning class, in the
        order of ``model.named_modules()``; empty if nothing repeats.

    Raises:
        CheckpointConfigError: If ``model`` is not an ``nn.Module``.

    Example:
        >>> find_blocks(gpt2)  # doctest: +SKIP
        ['transformer.h.0', 'transformer.h.1', ..., 'transformer.h.11']
    """
    if not isinstance(model, nn.Module):
        raise CheckpointConfigError(
            f"find_blocks needs an nn.Module; got {type(model).__name__}"
        )
    return list(_detect_blocks(list(model.named_modules())))


def _detect_blocks(named: NamedModules) -> Tuple[str, ...]:
    """:func:`find_blocks` on the output of ``named_modules()``, root first."""
    modules: Dict[str, nn.Module] = dict(named)
    position = {name: i for i, (name, _) in enumerate(named)}
    groups = [
        group
        for name, module in named
        if isinstance(module, _CONTAINERS)
        for group in _groups_in(name, module, position)
    ]
    members_of_any_group = {member for group in groups for member in group.members}
    outermost = [g for g in groups if not _inside_any(g.container, members_of_any_group)]
    if not outermost:
        return ()

    by_class: Dict[type, List[_Group]] = {}
    for group in outermost:
        by_class.setdefault(group.cls, []).append(group)

    def rank(cls: type) -> Tuple[int, float, int]:
        members = [m for g in by_class[cls] for m in g.members]
        per_module = sum(_parameter_count(modules[m]) for m in members) / len(members)
        first = min(position[m] for m in members)
        return (-len(members), -per_module, first)

    winner = min(by_class, key=rank)
    members = [m for g in by_class[winner] for m in g.members]
    return tuple(sorted(members, key=position.__getitem__))


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
        _Group(container=name, cls=cls, members=tuple(members))
        for cls, members in by_class.items()
        if len(members) >= 2
    ]


def _inside_any(name: str, members: Set[str]) -> bool:
    """Whether the module ``name`` is one of ``members`` or lies inside one of them."""
    parts = name.split(".") if name else []
    return any(".".join(parts[: i + 1]) in members for i in range(len(parts)))


def _parameter_count(module: nn.Module) -> int:
    # Lazy modules (nn.LazyLinear) hold parameters whose size is not known yet.
    return sum(0 if is_lazy(p) else p.numel() for p in module.parameters())

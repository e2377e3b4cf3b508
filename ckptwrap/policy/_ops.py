"""Operator names for ``selective:``, resolved to aten operator packets."""

from __future__ import annotations

import functools
from typing import FrozenSet, Iterable, Tuple

import torch

from .._errors import CheckpointConfigError

__all__ = ["resolve_ops"]

# The public attention function reaches the dispatcher as one of these kernels.
_ALIASES = {
    "scaled_dot_product_attention": (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
    ),
}


@functools.lru_cache(maxsize=None)
def resolve_ops(names: Tuple[str, ...]) -> FrozenSet[object]:
    """The aten operator packets that ``names`` stand for.

    Raises:
        CheckpointConfigError: A name is not an aten operator.
    """
    packets = set()
    for name in names:
        for target in _ALIASES.get(name, (name,)):
            packet = _packet(target)
            if packet is None and name not in _ALIASES:
                raise CheckpointConfigError(
                    f"selective:{','.join(names)} names {name!r}, which is not an aten operator; "
                    f"use names such as mm, addmm, bmm, baddbmm, scaled_dot_product_attention"
                )
            if packet is not None:
                packets.add(packet)
    return frozenset(packets)


def _packet(name: str) -> object:
    if not name.isidentifier():
        return None
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


def describe_ops(packets: Iterable[object]) -> str:
    return ", ".join(sorted(str(p) for p in packets))

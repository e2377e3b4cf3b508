"""Operator names for ``selective:``, resolved to aten operator packets."""

from __future__ import annotations

import functools
from typing import Any, Dict, FrozenSet, Optional, Tuple

import torch

from .._errors import CheckpointConfigError

__all__ = ["draws_random", "resolve_ops"]

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
            if packet is not None and _always_draws(packet):
                raise CheckpointConfigError(
                    f"selective:{','.join(names)} names {name!r}, which draws random numbers whenever "
                    f"it runs in training: its output is never saved (the recomputation must draw "
                    f"the same numbers again), so naming it saves nothing; use names such as mm, "
                    f"addmm, bmm, baddbmm, scaled_dot_product_attention"
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


def draws_random(func: Any, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None) -> bool:
    """Whether this call of ``func`` draws from a random number generator: an operator
    torch tags as seeded-nondeterministic (dropout, ``rand``, ``bernoulli``, fused
    attention and recurrent kernels), unless its arguments say it draws nothing here (a
    ``dropout_p`` or ``dropout`` of 0, ``train=False``).

    A selective checkpoint must never save such an output: the recomputation replays the
    forward's generator state and draws the same numbers only if it runs every operator
    that drew, in order; a saved one is skipped, and every draw after it in the region
    shifts (different dropout masks, inexact gradients). On a GPU the fused dropout and
    attention kernels are such operators.

    Example:
        >>> draws_random(torch.ops.aten.native_dropout.default)
        True
        >>> draws_random(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        ...              (None, None, None, 0.0))
        False
    """
    rates = _random_rates(func)
    if rates is None:
        return False
    kwargs = kwargs or {}
    for position, name, default in rates:
        value = kwargs.get(name, default) if position >= len(args) else args[position]
        if name == "train" and value is False:
            return False
        if name in ("dropout_p", "dropout") and value == 0:
            return False
    return True


@functools.lru_cache(maxsize=None)
def _random_rates(func: Any) -> Optional[Tuple[Tuple[int, str, Any], ...]]:
    """None if ``func`` never draws; else (position, name, default) of its arguments that
    may say it draws nothing (``dropout_p``, ``dropout``, ``train``)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return None
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (position, argument.name, argument.default_value if argument.has_default_value() else None)
        for position, argument in enumerate(schema.arguments)
        if argument.name in ("dropout_p", "dropout", "train")
    )


def _always_draws(packet: Any) -> bool:
    """Whether every overload of ``packet`` draws random numbers whenever it runs in
    training (none has a ``dropout_p`` or ``dropout`` that could be 0)."""
    overloads = [getattr(packet, name) for name in packet.overloads()]
    rates = [_random_rates(overload) for overload in overloads]
    return bool(rates) and all(
        found is not None and not any(name != "train" for _, name, _ in found) for found in rates
    )

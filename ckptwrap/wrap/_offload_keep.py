"""Which saved tensors an offloaded region leaves on the device however large they are:
its owner's parameters and buffers, and casts of those parameters (autocast's bf16 copies
of fp32 weights, a model's own ``weight.to(dtype)``), which the plain run holds anyway.
Nested FSDP units are refused: FSDP frees their gathered parameters under the copy.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from typing import Dict, Optional, Set, Tuple

import torch

from .._errors import CheckpointConfigError

__all__ = ["Keep"]

# Where FSDP's module classes live, by torch version (FSDP2 public from 2.6, composable
# before; FSDP1). Only modules already imported are consulted: a model cannot hold an FSDP
# unit unless FSDP was imported. The check walks the owner's submodules at each entry.
_FSDP_CLASSES = (
    ("torch.distributed.fsdp", "FSDPModule"),
    ("torch.distributed._composable.fsdp", "FSDPModule"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel"),
)


def _fsdp_types() -> Tuple[type, ...]:
    found = []
    for module_name, attribute in _FSDP_CLASSES:
        cls = getattr(sys.modules.get(module_name), attribute, None)
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


def _refuse_nested_fsdp(owner: torch.nn.Module) -> None:
    types = _fsdp_types()
    nested = next((m for m in owner.modules() if m is not owner and isinstance(m, types)), None) if types else None
    if nested is None:
        return
    name = next(name for name, module in owner.named_modules() if module is nested)
    kind = type(owner).__name__
    raise CheckpointConfigError(
        f"{kind} is offloaded (the 'offload' tier) but its submodule {name!r} "
        f"({type(nested).__name__}) is an FSDP unit of its own: FSDP frees that unit's "
        f"gathered parameters after its forward, while the offload tier may still be "
        f"copying them to host memory. Apply fully_shard to {kind} itself or to a module "
        f"above it, not inside it, or leave {kind} out of the offload policy."
    )


def _autocast_dtypes(device_types: Set[str]) -> Dict[str, torch.dtype]:
    found = {}
    for device in device_types:
        with contextlib.suppress(RuntimeError, TypeError):  # a device type autocast does not know
            if torch.is_autocast_enabled(device):
                found[device] = torch.get_autocast_dtype(device)
    return found


def _storage(tensor: torch.Tensor) -> Optional[int]:
    with contextlib.suppress(RuntimeError, NotImplementedError):  # lazy tensors, subclasses
        return tensor.untyped_storage().data_ptr()
    return None


class Keep:
    """The storages one region keeps on the device, from its owner.

    During the owner's forward its parameters are the ones it computes with (FSDP2 has
    swapped in the gathered, unsharded ones by then), so their storages are known at
    entry. Casts are recognised as they are saved: a tensor (or a view of one) made by
    ``_to_copy`` straight from one of those parameters; under autocast (on at entry), also
    a cast of a frozen parameter, which has no autograd history: a tensor that does not
    require grad, in autocast's dtype, shaped like a frozen parameter of the owner. That
    last rule can keep an activation of the same shape too: it costs memory, never
    correctness.

    Args:
        owner: The region's module, or None for a plain function (nothing kept).

    Raises:
        CheckpointConfigError: ``owner`` holds an FSDP unit of its own below it.
    """

    __slots__ = ("storages", "frozen", "autocast")

    def __init__(self, owner: Optional[torch.nn.Module]) -> None:
        self.storages: Set[int] = set()
        self.frozen: Set[Tuple[int, ...]] = set()
        self.autocast: Dict[str, torch.dtype] = {}  # device type -> dtype, where enabled
        if owner is None:
            return
        _refuse_nested_fsdp(owner)
        for tensor in itertools.chain(owner.parameters(), owner.buffers()):
            pointer = _storage(tensor)
            if pointer is not None:
                self.storages.add(pointer)
        frozen = [p for p in owner.parameters() if not p.requires_grad]
        if frozen:
            self.frozen = {tuple(p.shape) for p in frozen}
            # Read here, not as tensors are saved: inside an operator autocast redispatches
            # to, torch.is_autocast_enabled() is False.
            self.autocast = _autocast_dtypes({p.device.type for p in frozen})

    def holds(self, tensor: torch.Tensor, pointer: int) -> bool:
        """Whether ``tensor`` (whose storage is at ``pointer``) stays on the device."""
        if pointer in self.storages:
            return True
        if self._is_cast(tensor):
            self.storages.add(pointer)  # its other views, saved later, are decided at once
            return True
        return False

    def _is_cast(self, tensor: torch.Tensor) -> bool:
        root = tensor._base if tensor._base is not None else tensor
        node = root.grad_fn
        if node is not None:
            if type(node).__name__ != "ToCopyBackward0" or not node.next_functions:
                return False
            variable = getattr(node.next_functions[0][0], "variable", None)  # AccumulateGrad's leaf
            return variable is not None and _storage(variable) in self.storages
        if root.requires_grad or self.autocast.get(root.device.type) != root.dtype:
            return False
        return tuple(root.shape) in self.frozen

"""Device state a recomputation must replay: RNG streams, autocast settings, default device.

State is captured when a region's forward starts and restored around its recomputation,
so dropout draws the same masks and autocast picks the same dtypes. RNG state is saved
for the CPU and for every accelerator that the region's tensors live on, of any device
type; an accelerator the forward did not touch is never initialized.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import _torch_private

__all__ = ["DeviceState", "capture_device_state", "replayed", "devices_of"]

# Device types whose autocast state is worth looking at even when no argument lives there,
# because a region may move its inputs to that device itself.
_AUTOCAST_CANDIDATES = ("cuda", "xpu", "mps", "hpu", "xla", "mtia")

_Device = Tuple[str, int]


def devices_of(tensors: Iterable[torch.Tensor]) -> List[_Device]:
    """Distinct accelerator devices (type, index) among ``tensors``, in first-seen order."""
    seen: List[_Device] = []
    for tensor in tensors:
        device = tensor.device
        if device.type in ("cpu", "meta"):
            continue
        key = (device.type, device.index if device.index is not None else 0)
        if key not in seen:
            seen.append(key)
    return seen


@functools.lru_cache(maxsize=None)
def _autocast_types() -> Tuple[str, ...]:
    names = list(_AUTOCAST_CANDIDATES)
    private = _torch_private.privateuse1_backend_name()
    if private not in names:
        names.append(private)
    return tuple(name for name in names if torch.amp.is_autocast_available(name))


def _get_rng(device_type: str, index: int) -> torch.Tensor:
    module = torch.get_device_module(device_type)
    try:
        return module.get_rng_state(index)
    except TypeError:  # single-device backends (mps) take no index
        return module.get_rng_state()


def _set_rng(device_type: str, index: int, state: torch.Tensor) -> None:
    module = torch.get_device_module(device_type)
    try:
        module.set_rng_state(state, index)
    except TypeError:
        module.set_rng_state(state)


class DeviceState(NamedTuple):
    """What was in force when a region's forward started."""

    cpu_rng: Optional[torch.Tensor]
    device_rngs: List[Tuple[str, int, torch.Tensor]]
    autocast: List[Tuple[str, bool, torch.dtype]]
    autocast_cache: bool
    device_context: Any


def capture_device_state(devices: Sequence[_Device], *, preserve_rng_state: bool) -> DeviceState:
    """Record RNG (if asked), autocast and default-device state for a forward starting now."""
    cpu_rng = torch.get_rng_state() if preserve_rng_state else None
    device_rngs = (
        [(kind, index, _get_rng(kind, index)) for kind, index in devices]
        if preserve_rng_state
        else []
    )
    wanted = {"cpu", *(kind for kind, _ in devices)}
    autocast = []
    for kind in ("cpu",) + _autocast_types():
        enabled = torch.is_autocast_enabled(kind)
        if enabled or kind in wanted:
            autocast.append((kind, enabled, torch.get_autocast_dtype(kind)))
    return DeviceState(
        cpu_rng, device_rngs, autocast, torch.is_autocast_cache_enabled(), _current_device_context()
    )


def _current_device_context() -> Any:
    """The innermost ``with torch.device(...)`` in force, so recomputation allocates alike."""
    kind = _torch_private.device_context_class
    if kind is None:
        return None
    for mode in reversed(_torch_private.function_mode_stack()):
        if isinstance(mode, kind):
            return mode
    return None


@contextlib.contextmanager
def replayed(state: DeviceState) -> Iterator[None]:
    """Run the block under ``state`` and leave the surrounding RNG streams as they were."""
    outer_cpu = torch.get_rng_state() if state.cpu_rng is not None else None
    outer_devices = [(kind, index, _get_rng(kind, index)) for kind, index, _ in state.device_rngs]
    try:
        if state.cpu_rng is not None:
            torch.set_rng_state(state.cpu_rng)
        for kind, index, rng in state.device_rngs:
            _set_rng(kind, index, rng)
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in state.autocast:
                stack.enter_context(
                    torch.autocast(
                        kind, dtype=dtype, enabled=enabled, cache_enabled=state.autocast_cache
                    )
                )
            if state.device_context is not None:
                stack.enter_context(state.device_context)
            yield
    finally:
        if outer_cpu is not None:
            torch.set_rng_state(outer_cpu)
        for kind, index, rng in outer_devices:
            _set_rng(kind, index, rng)

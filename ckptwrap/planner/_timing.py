"""Timing one module's forward on its device, and keeping the random number generators'
state so that measuring a call changes neither what it draws nor what the model draws next.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ._ops import OpTimer
from ..measure import SavePolicy

__all__ = ["RngState", "device_of", "time_forward", "time_ops", "time_replay", "time_unsaved_replay"]


class RngState:
    """The CPU RNG state and that of each accelerator device given, to put back later."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self._cpu = torch.get_rng_state()
        self._devices = []
        for device in devices:
            module = torch.get_device_module(device.type)
            if hasattr(module, "get_rng_state"):
                self._devices.append((module, device, module.get_rng_state(device)))

    def restore(self) -> None:
        torch.set_rng_state(self._cpu)
        for module, device, state in self._devices:
            module.set_rng_state(state, device)

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Run the block, then put the RNG states back as they were before it."""
        try:
            yield
        finally:
            self.restore()


def device_of(inputs: Sequence[torch.Tensor], module: nn.Module) -> torch.device:
    """Where the module computes: its first accelerator input, else its first parameter."""
    for tensor in [*inputs, *module.parameters(), *module.buffers()]:
        if tensor.device.type != "cpu":
            return tensor.device
    return torch.device("cpu")


def time_forward(
    module: nn.Module, args: Any, kwargs: Dict[str, Any], device: torch.device
) -> float:
    """Seconds one ``module.forward`` takes, waiting for the device to finish its work."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            output = module.forward(*args, **kwargs)
            end.record()
            end.synchronize()
        # The output lives until here so that freeing its graph is not timed.
        del output
        return start.elapsed_time(end) / 1000.0
    synchronize = _synchronizer(device)
    synchronize()
    start_time = time.perf_counter()
    output = module.forward(*args, **kwargs)
    synchronize()
    elapsed = time.perf_counter() - start_time
    del output
    return elapsed


def time_replay(
    module: nn.Module, args: Any, kwargs: Dict[str, Any], device: torch.device, policy: SavePolicy
) -> float:
    """Seconds a selective recomputation of ``module`` takes: its forward, with the outputs
    ``policy`` saves taken from a first, untimed forward instead of computed."""
    record, replay = create_selective_checkpoint_contexts(policy)
    with record:
        output = module.forward(*args, **kwargs)
    del output
    with replay:
        return time_forward(module, args, kwargs, device)


def time_unsaved_replay(
    module: nn.Module, args: Any, kwargs: Dict[str, Any], device: torch.device
) -> float:
    """Seconds ``module.forward`` takes under torch's selective checkpointing saving
    nothing: the plain forward plus what the selective dispatch mode adds."""
    return time_replay(module, args, kwargs, device, _save_nothing)


def _save_nothing(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def time_ops(
    module: nn.Module, args: Any, kwargs: Dict[str, Any], device: torch.device
) -> List[Tuple[str, float]]:
    """(operator packet, seconds) for each operator of one ``module.forward``, in order.

    Each operator waits for the device before and after it, so its time is its own; the
    forward's time is measured apart (:func:`time_forward`), without this overhead.
    """
    timer = OpTimer(_synchronizer(device))
    with timer:
        output = module.forward(*args, **kwargs)
    del output
    return timer.times


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for ``device``; a no-op for the CPU and devices that cannot wait."""
    if device.type in ("cpu", "meta"):
        return lambda: None
    synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
    if not callable(synchronize):
        return lambda: None
    return lambda: synchronize(device)

"""Keeping the random number generators' state, so that a step run to be measured changes
neither what it draws nor what the model draws next; and what one operator costs to run
through a measuring dispatch mode, so that times metered under one are told apart from
the work itself.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

from .. import _torch_private

__all__ = ["RngState", "dispatch_cost", "selective_cost"]


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


_CALIBRATION_OPS = 400


@functools.lru_cache(maxsize=1)
def dispatch_cost() -> float:
    """Seconds one operator spends in a measuring dispatch mode (the phase meter's storage
    counter, following moments) beyond running: measured once per process on tiny CPU
    tensors, where an operator's own time is negligible. Times of a metered step are
    corrected by it (times only rank plans; bytes are exact)."""
    from ._phases import PhaseMeter  # the meter whose cost this is

    return _added_per_op(lambda: PhaseMeter(torch.device("cpu")))


@functools.lru_cache(maxsize=1)
def selective_cost() -> float:
    """Seconds torch's selective checkpointing adds to one operator of a forward (its
    dispatch mode, saving nothing): measured once per process on tiny CPU tensors. A
    selective level pays it twice per operator (forward and recomputation)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def nothing(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    return _added_per_op(lambda: create_selective_checkpoint_contexts(nothing)[0])


def _added_per_op(context: Callable[[], ContextManager[Any]]) -> float:
    """Seconds the context made by ``context()`` adds to one tiny CPU operator (read
    outside any dispatch mode in force, a fake step's included: it is kept per process)."""
    with _torch_private.disable_current_modes():
        return _timed_per_op(context)


def _timed_per_op(context: Callable[[], ContextManager[Any]]) -> float:
    x = torch.zeros(1)

    def work() -> float:
        start = time.perf_counter()
        value = x
        for _ in range(_CALIBRATION_OPS):
            value = value + 1.0
        return time.perf_counter() - start

    work()
    plain = min(work() for _ in range(3))
    with context():
        inside = min(work() for _ in range(3))
    return max(0.0, (inside - plain) / _CALIBRATION_OPS)

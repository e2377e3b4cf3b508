"""The activation meter the prediction tests share: peak live bytes of the storages that
the forward or a recomputation creates (what the budget planner predicts)."""

from __future__ import annotations

import sys
import threading
import weakref
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ckptwrap

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _allocator import allocator_peak  # noqa: E402


class ActivationMeter(TorchDispatchMode):
    """Peak live bytes of the storages that the forward or a recomputation creates.

    Once ``in_backward`` is set, only storages created while ``ckptwrap.is_recomputing()``
    count: gradients and backward's temporaries do not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.in_backward = False
        self.peak = 0
        self._live = 0
        self._sizes: Dict[int, int] = {}
        self._freed: List[int] = []  # finalizers may run mid-update, so they only append
        self._finalizers: List[weakref.finalize] = []
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_backward and not ckptwrap.is_recomputing():
            return out
        # An output sharing an input's storage is a view or an in-place result: not new.
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                key = storage._cdata
                with self._lock:
                    if key in inputs or key in self._sizes:
                        continue
                    self._sizes[key] = storage.nbytes()
                    self._finalizers.append(weakref.finalize(storage, self._release, key))
                    while self._freed:
                        self._live -= self._freed.pop()
                    self._live += storage.nbytes()
                    self.peak = max(self.peak, self._live)
        return out

    def _release(self, key: int) -> None:
        # Forget the address at once: a new storage may take it before the next count.
        self._freed.append(self._sizes.pop(key, 0))

    def __exit__(self, *exc):
        for finalizer in self._finalizers:
            finalizer.detach()
        return super().__exit__(*exc)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def allocator_step_peak(step: Callable[[], None]) -> int:
    """Peak bytes the CPU allocator held during ``step()`` above what it held before:
    every allocation and free of the step's own blocks, operators' own workspaces included,
    from ``torch.profiler``'s memory events (a meter independent of ckptwrap's)."""
    return allocator_peak(step)

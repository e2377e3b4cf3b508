"""Which backward pass an unpack belongs to, and a call when that pass ends.

The offload tier fetches each region once per backward pass (``retain_graph=True``, a
second ``backward``, a partial ``torch.autograd.grad`` are each a pass of their own) and
drops, when the pass ends, the copies it fetched that the pass did not use.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Optional, Set

from .. import _torch_private

__all__ = ["PassClock"]


def _queue_callback(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the current backward pass ends; False outside backward (or
    on a torch without the engine's callbacks)."""
    queue = _torch_private.queue_callback
    if queue is None:
        return False
    try:
        queue(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


class PassClock:
    """Keys for backward passes: one per pass, None outside backward.

    A pass is keyed by the autograd engine's graph task id (``_torch_private``: present in
    the torch 2.11 of the GPU machine and the 2.13 here). Where that reads -1 (outside
    backward, or a torch without it), a final callback of our own tells whether a backward
    runs and keys it until it ends; it cannot tell a backward nested in another from the
    outer one, which then share copies: still correct, fetched on demand. Without the
    engine's callbacks every unpack counts as outside backward: a copy of its own each
    time, the same gradients, no prefetch.

    Args:
        on_end: Called with a pass's key when that pass ends (not when it raises).
    """

    def __init__(self, on_end: Callable[[int], None]) -> None:
        self._on_end = on_end
        self._open: Set[int] = set()
        self._lock = threading.Lock()
        self._fallback: Optional[int] = None
        self._fallback_ids = itertools.count(start=-2, step=-1)  # apart from task ids (>= 0)

    def current(self) -> Optional[int]:
        """The key of the backward pass running now, or None outside backward."""
        task = _torch_private.graph_task_id()
        if task < 0:
            return self._current_fallback()
        with self._lock:
            if task in self._open:
                return task
        if not _queue_callback(lambda: self._close(task)):
            return None
        with self._lock:
            self._open.add(task)
        return task

    def is_open(self, key: int) -> bool:
        """Whether the pass ``key`` has begun and not ended yet."""
        with self._lock:
            return key in self._open or key == self._fallback

    def _current_fallback(self) -> Optional[int]:
        with self._lock:
            if self._fallback is not None:
                return self._fallback
        key = next(self._fallback_ids)
        if not _queue_callback(lambda: self._close(key)):
            return None
        with self._lock:
            self._fallback = key
        return key

    def _close(self, key: int) -> None:
        with self._lock:
            self._open.discard(key)
            if self._fallback == key:
                self._fallback = None
        self._on_end(key)

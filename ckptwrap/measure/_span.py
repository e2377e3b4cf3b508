"""Following one training step with a count of storages, through code the caller runs.

A dispatch mode counts only while it sits on the thread's mode stack, and a training
step runs partly in the caller's code: the forward (between the model's pre-hook and its
forward hook), whatever the caller does with the output, then the backward, which
autograd's engine runs under a copy of the thread-local state it took when the backward
was called, put back around every node. So the counter is on the caller's stack while
the forward runs, and off it as soon as the forward returns (a mode left there would be
popped by the caller's own modes leaving, in place of theirs); in the backward, every
node of the graph pushes it onto the engine's copy before it runs, which the engine puts
back after. Nothing is left on any stack when the step ends.

What the caller's code between forward and backward allocates (a loss computed outside
the model) is not seen; its storages that are still alive when the backward reaches the
model's graph are counted from there (see :meth:`StepSpan.follow`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..engine import graph_nodes
from ._peak import StorageCounter, _AllocatorStats, _allocator_stats

__all__ = ["SpanPeak", "StepSpan"]


class StepSpan:
    """A :class:`StorageCounter` following one training step (see the module).

    Call :meth:`enter` as the forward begins, :meth:`leave` when it returns,
    :meth:`follow` with the tensors the backward will reach (the model's outputs, or
    the loss), and :meth:`close` once the backward has ended.
    """

    def __init__(self, counter: StorageCounter) -> None:
        self.counter = counter
        self._handles: List[Any] = []
        self.closed = False

    def enter(self) -> None:
        """Put the counter on this thread's mode stack (the forward begins)."""
        torch._C._push_on_torch_dispatch_stack(self.counter)

    def leave(self) -> None:
        """Take the counter off this thread's mode stack, wherever it sits (the forward
        returned, or raised); the storages it counted are still followed until freed."""
        _remove(self.counter)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Count a block of the caller's own that runs between forward and backward."""
        torch._C._push_on_torch_dispatch_stack(self.counter)
        try:
            yield
        finally:
            _remove(self.counter)

    def follow(self, roots: Sequence[torch.Tensor]) -> None:
        """Count every node of the backward from ``roots`` as it runs. The gradients a node
        receives that were made before (by a loss computed outside the count) are counted
        from then on, until freed."""
        for node in graph_nodes([t for t in roots if t.requires_grad]):
            self._handles.append(node.register_prehook(self._node_begins))

    def loss_outside(self, grad: torch.Tensor, share: int = 2) -> None:
        """The backward reached the model with ``grad`` from a loss made outside the
        count: count the gradient from now on, and a moment at ``share`` times its bytes
        above what is alive, for what the loss is taken to have held at its highest."""
        counter = self.counter
        if self.closed or counter._closed:
            return
        counter.adopt(grad)
        live = counter.live_bytes
        with counter._lock:
            counter._peak_at(live + share * grad.untyped_storage().nbytes())

    def close(self) -> None:
        """Stop counting; unhook the graph."""
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.counter.close()
        _remove(self.counter)

    def _node_begins(self, grad_outputs: Sequence[Any]) -> None:
        counter = self.counter
        if self.closed or counter._closed:
            return None
        if not _on_top(counter) and counter not in _get_current_dispatch_mode_stack():
            # The engine puts its state back after the node: nothing to pop.
            torch._C._push_on_torch_dispatch_stack(counter)
        for grad in grad_outputs:
            if isinstance(grad, torch.Tensor):
                counter.adopt(grad)
        return None


def _on_top(mode: Any) -> bool:
    """Whether ``mode`` is the innermost on this thread's dispatch mode stack (the common
    case in a backward the counter follows, told without listing the stack)."""
    depth = torch._C._len_torch_dispatch_stack()
    return depth > 0 and torch._C._get_dispatch_stack_at(depth - 1) is mode


def _remove(mode: Any) -> None:
    """Take ``mode`` off this thread's dispatch mode stack, the modes above it staying."""
    if mode not in _get_current_dispatch_mode_stack():
        return
    above = []
    while True:
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_dispatch_stack(other)


class SpanPeak:
    """The peak memory of one training step followed from its forward's pre-hook to the end
    of its backward.

    On the CPU the storages operators create are counted (a :class:`StorageCounter` that
    also counts what CPU convolutions hold while they run), driven through the step by a
    ``StepSpan``: see :meth:`leave` and :meth:`follow`. On an accelerator the allocator's
    peak statistics are read without resetting them, unless ``reset``: if the step raised
    the device's peak, its own peak is known exactly; if not, only an upper bound is (the
    earlier peak), and ``exact`` says so.

    Args:
        device: The device the step allocates on.
        reset: On an accelerator, reset the peak statistics at :meth:`start`, so that the
            reading is exact (and the caller's own peak statistics restart there).

    Attributes:
        peak_bytes: After :meth:`stop`, the step's peak above what was allocated at
            :meth:`start` (or an upper bound of it, where ``exact`` is False).
        exact: Whether ``peak_bytes`` is the peak itself.
    """

    def __init__(self, device: torch.device, *, reset: bool = False) -> None:
        self.device = device
        self.reset = reset
        self.peak_bytes = 0
        self.exact = True
        self.span: Any = None
        self._stats: _AllocatorStats | None = None
        self._start = self._max = 0

    def start(self) -> "SpanPeak":
        if self.device.type in ("cpu", "meta"):
            self.span = StepSpan(StorageCounter(self.device.type, workspaces=True))
            self.span.enter()
            return self
        self._stats = _allocator_stats(self.device)
        _synchronize(self.device)
        if self.reset:
            self._stats.reset_peak(self.device)
        self._start = self._stats.allocated(self.device)
        self._max = self._stats.max_allocated(self.device)
        return self

    def leave(self, roots: Sequence[torch.Tensor]) -> None:
        """The forward returned with these outputs: follow the backward from them."""
        if self.span is not None:
            self.span.leave()
            self.span.follow(roots)

    def stop(self) -> int:
        """End the step; returns ``peak_bytes``."""
        if self.span is not None:
            self.peak_bytes = self.span.counter.peak_bytes
            self.span.close()
            return self.peak_bytes
        if self._stats is None:
            return 0
        _synchronize(self.device)
        highest = self._stats.max_allocated(self.device)
        self.exact = self.reset or highest > self._max
        self.peak_bytes = max(0, highest - self._start)
        return self.peak_bytes


def _synchronize(device: torch.device) -> None:
    module = getattr(torch, device.type, None)
    synchronize = getattr(module, "synchronize", None)
    if callable(synchronize):
        synchronize(device)

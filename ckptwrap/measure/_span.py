"""Following one training step with a count of storages, through code the caller runs.

A dispatch mode counts only while it sits on the thread's mode stack, and a training
step runs partly in the caller's code: the forward (between the model's pre-hook and its
forward hook), whatever the caller does with the output, then the backward. So the
counter is on the caller's stack while the forward runs, and off it as soon as the
forward returns (a mode left there would be popped by the caller's own modes leaving, in
place of theirs).

The backward is followed so that it allocates what it would unfollowed. Autograd adds a
gradient into the one a node's input holds already in place only where nothing else
refers to it, and treats every tensor as a subclass while any dispatch mode is in force
(``isTensorSubclassLike``): a counting mode where autograd sums gradients, or a storage
object made from Python for a gradient (it keeps a reference to the storage for good),
turns those sums into new buffers (Mamba's scan, which sums 63 slices into one buffer per
layer, then holds a second buffer at once). So no gradient's storage is ever touched, and
no mode is on the stack where autograd sums:

- every node of the graph has a pre-hook and a post-hook, and the gradients are followed
  by where they go (:class:`_Gradients`): by address and size, from the node that
  returns them, through the input of the node they are for, to the node that receives
  them, until nothing holds them (or a parameter's ``.grad`` does);
- on the CPU, what a node allocates meanwhile (its temporaries, a convolution's
  workspace, a region recomputed inside it) is read from the allocator's events on the
  calling thread (``StorageCounter.open_reading``): nothing is on the stack at all, and
  each node's moment is the most it held;
- where no reading can be taken (a profiler of the caller's records on the thread), a
  mode counts inside the node's function alone (:class:`_InsideNode`: pushed by its
  pre-hook, popped by its post-hook, before autograd sums what it returns; never in
  ``AccumulateGrad``), by the addresses and sizes of what operators return, touching no
  storage. Formulas with a path of their own for subclasses (``index``'s backward sums
  out of place) take it there;
- a region's recomputation, a forward that sums no gradient, is counted by storages as
  the forward was (:meth:`StepSpan.counting`, or by :class:`_InsideNode` where it runs
  inside one).

Where the backward runs under dispatch modes already (a step on fake tensors, a mode of
the caller's), the counter joins them in each node, as a mode: autograd sums out of
place there whatever the counter does.

What the caller's code between forward and backward allocates (a loss computed outside
the model) is not seen; its storages that are still alive when the backward reaches the
model's graph are counted from there (see :meth:`StepSpan.follow`). Nothing is left on
any stack, and no profiler left running, when the step ends.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _torch_private
from ..engine import graph_nodes, is_recomputing
from ._peak import StorageCounter, AllocatorStats, allocator_stats, ready_libraries
from ._storages import tensors
from ._workspace import may_hold, run_held

__all__ = ["SpanPeak", "StepSpan"]

# How a node runs, as its pre-hook found the thread.
_UNDER_MODES = 0  # under dispatch modes already: the counter joins them
_READ = 1  # the allocator's events read around it
_IN_READING = 2  # inside another node's reading (a backward run inside a node)
_INSIDE = 3  # a mode inside its function (no reading could be taken)
_HANDED = 4  # counted by what it receives and returns alone

_LOSS_OUTSIDE = 2
"""A loss made outside the model's forward is not counted as it is made; it is taken to
have held this many times the gradient it hands the model (a cross entropy's log-softmax
and the gradient of it, beside the gradient itself)."""


class _Running(NamedTuple):
    index: int
    how: int
    inside: Optional["_InsideNode"]


class StepSpan:
    """A :class:`StorageCounter` following one training step (see the module).

    Call :meth:`enter` as the forward begins, :meth:`leave` when it returns,
    :meth:`follow` with the tensors the backward will reach (the model's outputs, or
    the loss), and :meth:`close` once the backward has ended.
    """

    def __init__(self, counter: StorageCounter) -> None:
        self.counter = counter
        self._handles: List[Any] = []
        self._gradients = _Gradients(counter)
        self._accumulators: Set[int] = set()  # indices of AccumulateGrad nodes
        self._nodes: List[_Running] = []  # begun and not ended, innermost last
        self.closed = False

    def enter(self) -> None:
        """Put the counter on this thread's mode stack (the forward begins)."""
        _push(self.counter)

    def leave(self) -> None:
        """Take the counter off this thread's mode stack, wherever it sits (the forward
        returned, or raised); the storages it counted are still followed until freed."""
        _remove(self.counter)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count a forward run inside a node of the backward (a region's recomputation),
        or a block of the caller's own between forward and backward, by storages,
        operator by operator, as the forward was: the counter is on the stack for the
        block alone (a forward sums no gradient), and a reading open around it goes on
        (its events hold what the operators hold beyond their outputs)."""
        counter = self.counter
        running = self._nodes[-1] if self._nodes else None
        pushed = (
            not counter.closed
            and not _on_stack(counter)
            and not (running is not None and running.inside is not None)  # it counts them
        )
        if pushed:
            _push(counter)
        try:
            yield
        finally:
            if pushed:
                _remove(counter)

    def settle(self) -> None:
        """Take what the node in progress held so far into the count, and go on (a phase
        ends inside a node: that belongs to it)."""
        counter = self.counter
        if counter.reading:
            counter.close_reading(self._gradients.made_in_reading())
            counter.open_reading()
            return
        running = self._nodes[-1] if self._nodes else None
        if running is not None and running.inside is not None:
            running.inside.settle()

    def follow(self, roots: Sequence[torch.Tensor]) -> None:
        """Follow every node of the backward from ``roots`` as it runs (see the module).
        The gradients a node receives that were made before (by a loss computed outside
        the count) are counted from then on, until freed. Nothing once closed."""
        if self.closed:
            return
        nodes = list(graph_nodes([t for t in roots if t.requires_grad]))
        self._gradients.graph(nodes, [t.grad_fn for t in roots if t.requires_grad and t.grad_fn is not None])
        for index, node in enumerate(nodes):
            if type(node).__name__ == "AccumulateGrad":
                self._accumulators.add(index)
            self._handles.append(node.register_prehook(functools.partial(self._node_begins, index)))
            self._handles.append(node.register_hook(functools.partial(self._node_ends, index)))

    def loss_outside(self, grad: torch.Tensor) -> None:
        """The backward reached the model with ``grad`` from a loss made outside the
        count: a moment at :data:`_LOSS_OUTSIDE` times its bytes above what is alive with
        it, for what the loss is taken to have held at its highest (the gradient itself is
        counted from the node that receives it on)."""
        counter = self.counter
        if self.closed or counter.closed:
            return
        self._gradients.outside = True
        counter.moment((1 + _LOSS_OUTSIDE) * _extent(grad)[1])

    def close(self) -> None:
        """Stop counting; unhook the graph."""
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        counter = self.counter
        if counter.reading:
            # Only a node that raised leaves one: autograd's engine dropped it with the
            # node's thread-local state, and a profiler recording now is not ours.
            counter.drop_reading()
        self._nodes.clear()
        self._gradients.clear()
        counter.close()
        _remove(counter)

    def _node_begins(self, index: int, grad_outputs: Sequence[Any]) -> None:
        counter = self.counter
        if self.closed or counter.closed:
            return None
        if _torch_private.dispatch_modes_active():
            # Under modes already (the engine puts its state back after the node).
            if not _on_stack(counter):
                _push(counter)
            counter.adopt([grad for grad in grad_outputs if isinstance(grad, torch.Tensor)])
            self._nodes.append(_Running(index, _UNDER_MODES, None))
            return None
        if counter.reading and not _torch_private.profiler_enabled():
            # A node that opened it raised, and the engine dropped it with its state.
            counter.drop_reading()
            self._nodes.clear()
        self._gradients.received(index, grad_outputs)
        if counter.reading:
            how, inside = _IN_READING, None
        elif counter.open_reading():
            how, inside = _READ, None
        elif counter.device_type == "cpu" and index not in self._accumulators:
            how, inside = _INSIDE, _InsideNode(counter)
        else:
            how, inside = _HANDED, None
        self._nodes.append(_Running(index, how, inside))
        if inside is not None:
            _push(inside)
        return None

    def _node_ends(self, index: int, grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> None:
        counter = self.counter
        if self.closed or counter.closed or not self._nodes or self._nodes[-1].index != index:
            return None
        running = self._nodes.pop()
        if running.how == _UNDER_MODES:
            return None
        if running.inside is not None:
            # Off the stack before autograd sums what the node returns.
            _remove(running.inside)
        gradients = self._gradients
        gradients.returned(index, grad_inputs)
        if running.how == _READ:
            counter.close_reading(gradients.made_in_reading())
        elif running.how != _IN_READING:
            gradients.made_in_reading()
            if running.inside is not None:
                running.inside.settle()
            counter.moment()  # what it received and returns, alive together
        gradients.released(index)
        return None


class _InsideNode(TorchDispatchMode):
    """Inside one node's function, where no reading of the allocator can be taken: what
    its operators return, by address and size (their storages are never asked for: one
    of them may be a gradient the node returns, see ``_Gradients``), as a running sum
    that an address met again takes for a block freed and made anew; the most it and
    the count reached together is the node's moment. A recomputation run inside the node
    (a forward) is counted by the counter itself, by storages."""

    def __init__(self, counter: StorageCounter) -> None:
        super().__init__()
        self.counter = counter
        self._blocks: Dict[int, int] = {}
        self._live = 0
        self._high = counter.live_bytes

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if kwargs is None:
            kwargs = {}
        counter = self.counter
        if counter.closed:
            return func(*args, **kwargs)
        if is_recomputing():
            return counter.__torch_dispatch__(func, types, args, kwargs)
        held = 0
        if may_hold(func):
            out, held = run_held(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        before = self._live
        given = {_extent(leaf)[0] for leaf in tensors((args, kwargs))}
        for leaf in tensors(out):
            address, nbytes = _extent(leaf)
            if address is None or address in given:
                continue  # an input, or a view of one
            self._live += nbytes - self._blocks.get(address, 0)
            self._blocks[address] = nbytes
        self._high = max(self._high, counter.live_bytes + max(self._live, before + held))
        return out

    def settle(self) -> None:
        """A moment at the most the node and the count held together so far; what it
        returns is counted after it."""
        counter = self.counter
        live = counter.live_bytes
        counter.moment(max(0, self._high - live))
        self._high = live + self._live


class _Gradients:
    """Where the backward's gradients are, followed without touching their storages (a
    storage object made from Python keeps a reference that stops autograd from summing
    into it in place): each block of memory by its address and the bytes its tensors
    reach, with how many hold it (the input of a node it is for, a node running on it, a
    parameter's ``.grad``); its bytes are in the counter's count while any does.

    A node's returned gradients go to the inputs of the nodes after it (``graph``).
    Where one goes to an input that holds one already, autograd sums it there as the node
    ends: into the first where nothing else holds its memory (it is no view, which keeps
    its base, and dense), else into a new buffer, the parts let go; the gradient added is
    let go either way (its address may be a new gradient's at the next node). The node receives what the input holds then:
    a block other than the one expected was summed into a new buffer after all.
    """

    def __init__(self, counter: StorageCounter) -> None:
        self._counter = counter
        self._blocks: Dict[int, List[int]] = {}  # address -> [bytes, holders]
        # (node, input) -> the address it holds, whether a sum can go into it in place, and
        # the gradient's own bytes
        self._inputs: Dict[Tuple[int, int], Tuple[int, bool, int]] = {}
        self._sums: Dict[Tuple[int, int], int] = {}  # (node, input) -> bytes of a new buffer it holds
        self._receiving: Dict[int, List[int]] = {}  # node -> addresses it holds while it runs
        self._next: List[List[Tuple[int, int]]] = []  # per node, per output: (node, input) or (-1, 0)
        self._variables: Dict[int, torch.Tensor] = {}  # per AccumulateGrad node: its parameter
        self._had: Dict[int, Optional[int]] = {}  # per AccumulateGrad node running: its .grad's address before
        self._made = 0  # bytes of blocks first met among what the running node returns
        self._roots: Set[int] = set()  # the nodes of the step's outputs
        # Whether the backward reached the outputs from a loss made outside the step: the
        # gradients they receive then were made by nodes not followed, and go when they
        # have run. A scalar output's gradient otherwise is the caller's (the ones that
        # ``loss.backward()`` makes), held by it until the backward returns.
        self.outside = False

    def graph(self, nodes: List[Any], roots: Sequence[Any] = ()) -> None:
        """The nodes of the graph, in the order of the indices the hooks give, and those
        of the step's outputs (``roots``)."""
        at = {node: index for index, node in enumerate(nodes)}
        self._roots = {at[node] for node in roots if node in at}
        self._next = [
            [(at.get(after, -1), input_nr) if after is not None else (-1, 0) for after, input_nr in node.next_functions]
            for node in nodes
        ]
        for index, node in enumerate(nodes):
            variable = getattr(node, "variable", None)
            if isinstance(variable, torch.Tensor):
                self._variables[index] = variable

    def received(self, index: int, grads: Sequence[Any]) -> None:
        """Node ``index`` begins with ``grads``: what each input holds, held while it runs."""
        holding = self._receiving.setdefault(index, [])
        variable = self._variables.get(index)
        if variable is not None:
            self._had[index] = _extent(variable.grad)[0] if isinstance(variable.grad, torch.Tensor) else None
        for slot, grad in enumerate(grads):
            first, _, _ = self._inputs.pop((index, slot), (None, False, 0))
            summed = self._sums.pop((index, slot), None)
            if isinstance(grad, torch.Tensor):
                address, new = self._hold(grad)
                from_caller = (
                    first is None and summed is None and index in self._roots and not self.outside
                    and grad.dim() == 0
                )
                if address is not None and not from_caller:
                    holding.append(address)
                    if new and first is not None:
                        # Summed into a new buffer after all: it and the first part
                        # were alive together.
                        self._counter.moment()
            if first is not None:
                self._release(first)
            if summed is not None:
                self._counter.hold(-summed)

    def returned(self, index: int, grads: Sequence[Any]) -> None:
        """Node ``index`` returns ``grads``, each for the input of the node after it (or
        for none: dropped)."""
        self._made = 0
        nexts = self._next[index] if index < len(self._next) else []
        for output, grad in enumerate(grads):
            if not isinstance(grad, torch.Tensor) or output >= len(nexts):
                continue
            target = nexts[output]
            if target[0] < 0:
                address, nbytes = _extent(grad)
                if address is not None and address not in self._blocks:
                    self._made += nbytes  # made here, and dropped as the node ends
                continue
            address, new = self._hold(grad)
            if address is None:
                continue
            if new:
                self._made += self._blocks[address][0]
            if target in self._inputs or target in self._sums:
                self._sum(target)
                self._release(address)  # summed into what the input holds, and let go
            else:
                in_place = _dense(grad) and not _torch_private.tensor_is_view(grad)
                self._inputs[target] = (address, in_place, grad.numel() * grad.element_size())
        variable = self._variables.get(index)
        if variable is not None:
            # A parameter's gradient set here (the one received, or a copy): held by the
            # parameter from now on. One summed into in place was there before the step.
            grad = variable.grad
            had = self._had.pop(index, None)
            if isinstance(grad, torch.Tensor) and _extent(grad)[0] != had:
                address, new = self._hold(grad)
                if new and address is not None:
                    self._made += self._blocks[address][0]

    def _sum(self, target: Tuple[int, int]) -> None:
        """A gradient is added into what input ``target`` holds, as the node ends: in place
        where nothing else holds a dense first part; else into a new buffer (the parts and
        it alive together, then the first let go)."""
        first, in_place, own = self._inputs.get(target, (None, False, 0))
        block = None if first is None else self._blocks.get(first)
        if block is not None and block[1] == 1 and in_place:
            return
        # The new buffer is the size of the gradient (a view of a larger block included).
        nbytes = own if first is not None else self._sums.get(target, 0)
        counter = self._counter
        counter.hold(nbytes)
        counter.moment()
        if first is not None:
            del self._inputs[target]
            self._release(first)
        else:
            counter.hold(-self._sums.pop(target, 0))
        self._sums[target] = nbytes

    def made_in_reading(self) -> int:
        """Bytes of the blocks the running node made that are followed here (or dropped as
        it ends): among its reading's events, not unattributed. Counted once."""
        made, self._made = self._made, 0
        return made

    def released(self, index: int) -> None:
        """Node ``index`` ended: it lets go of what it received."""
        for address in self._receiving.pop(index, ()):
            self._release(address)

    def clear(self) -> None:
        self._blocks.clear()
        self._inputs.clear()
        self._sums.clear()
        self._receiving.clear()
        self._variables.clear()
        self._had.clear()

    def _hold(self, grad: torch.Tensor) -> Tuple[Optional[int], bool]:
        """One more holder of ``grad``'s block: its address, and whether it was new."""
        address, nbytes = _extent(grad)
        if address is None or nbytes <= 0:
            return None, False
        block = self._blocks.get(address)
        if block is None:
            self._blocks[address] = [nbytes, 1]
            self._counter.hold(nbytes)
            return address, True
        block[1] += 1
        if nbytes > block[0]:  # a view reaching further into it than those met before
            self._counter.hold(nbytes - block[0])
            block[0] = nbytes
        return address, False

    def _release(self, address: int) -> None:
        block = self._blocks.get(address)
        if block is None:
            return
        block[1] -= 1
        if block[1] <= 0:
            del self._blocks[address]
            self._counter.hold(-block[0])


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers its memory without gaps or overlaps (autograd sums into
    such a gradient in place), from its sizes and strides."""
    expected = 1
    for length, stride in sorted((d for d in zip(tensor.shape, tensor.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= length
    return True


def _extent(tensor: torch.Tensor) -> Tuple[Optional[int], int]:
    """The address of the memory block ``tensor`` views and the bytes it reaches into it,
    from its metadata alone (its storage is never asked for: see ``_Gradients``); None
    where it has no memory of its own to follow (sparse, nested, meta, fake)."""
    try:
        if tensor.layout != torch.strided or tensor.is_meta or type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            return None, 0
        size = tensor.element_size()
        pointer = tensor.data_ptr()
        if not pointer:
            return None, 0
        offset = tensor.storage_offset()
        if tensor.numel() == 0:
            return pointer - offset * size, 0
        reach = sum((length - 1) * abs(stride) for length, stride in zip(tensor.shape, tensor.stride()))
        return pointer - offset * size, (offset + reach + 1) * size
    except (RuntimeError, NotImplementedError, TypeError):
        return None, 0


def _on_stack(mode: Any) -> bool:
    """Whether ``mode`` is on this thread's dispatch mode stack (innermost first: where a
    counter in use sits)."""
    stack = _torch_private.dispatch_stack
    if stack is None:
        return False
    return any(stack.at(i) is mode for i in reversed(range(stack.length())))


def _push(mode: Any) -> None:
    stack = _torch_private.dispatch_stack
    if stack is not None:
        stack.push(mode)


def _remove(mode: Any) -> None:
    """Take ``mode`` off this thread's dispatch mode stack, the modes above it staying."""
    stack = _torch_private.dispatch_stack
    if stack is None or not _on_stack(mode):
        return
    above = []
    while True:
        top = stack.pop()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        stack.push(other)


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
        self._stats: AllocatorStats | None = None
        self._start = self._max = 0

    def start(self) -> "SpanPeak":
        if self.device.type in ("cpu", "meta"):
            self.span = StepSpan(StorageCounter(self.device.type, workspaces=True))
            self.span.enter()
            return self
        self._stats = allocator_stats(self.device)
        ready_libraries(self.device)
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

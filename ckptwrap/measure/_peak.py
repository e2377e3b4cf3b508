"""Peak memory of a block of code, such as one training step.

On CUDA and other accelerators the caching allocator's peak statistics are used. On the
CPU, which keeps no such statistics, the bytes of tensor storages created inside the
block are counted as they are allocated and freed, through a dispatch mode; where no
dispatch mode may be (a backward, see ``_span``), by the storages a counter is handed,
with the allocator's events read around stretches of code
(:meth:`StorageCounter.open_reading`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _torch_private
from .._errors import CheckpointConfigError
from ._storages import tensors
from ._workspace import end_reading, may_hold, run_held, start_reading

__all__ = [
    "allocator_stats",
    "AllocatorStats",
    "measure_peak",
    "outputs_of",
    "PeakMemory",
    "ready_libraries",
    "StorageCounter",
]

_MIB = 1024 * 1024


@dataclasses.dataclass
class PeakMemory:
    """What :func:`measure_peak` found; filled in when its block exits.

    Attributes:
        device: The device that was measured.
        peak_bytes: Highest number of bytes allocated on ``device`` during the block,
            above what was already allocated when the block began.
    """

    device: torch.device
    peak_bytes: int = 0

    @property
    def peak_mib(self) -> float:
        """``peak_bytes`` in mebibytes."""
        return self.peak_bytes / _MIB


_READY: Set[Tuple[str, Any]] = set()
"""The (device, stream) pairs :func:`ready_libraries` has made ready."""


def _products(device: torch.device) -> None:
    """A few tiny matrix products on ``device``, in the dtypes training uses, with and
    without a bias (the second goes through cuBLASLt on CUDA)."""
    for dtype in (torch.float32, torch.bfloat16):
        try:
            square = torch.ones(16, 16, device=device, dtype=dtype)
            torch.mm(square, square)
            torch.addmm(torch.ones(16, device=device, dtype=dtype), square, square)
        except (RuntimeError, TypeError):  # a device or dtype without these products
            continue


class _ProductsInBackward(torch.autograd.Function):
    """The identity, whose backward runs :func:`_products` on the thread that runs the
    device's backward (autograd keeps one per accelerator, with its own library handles)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _products(grad.device)
        return grad


def ready_libraries(device: torch.device) -> None:
    """Make the matrix libraries' workspaces on ``device``'s current stream, as any
    training step's first matrix product does: cuBLAS and cuBLASLt keep them (tens of MiB
    on a Hopper GPU) per thread and stream from the first product until the process ends,
    and a backward runs on a thread of autograd's, not the caller's. A step or block
    measured before any product would take them for its own memory (on an H200, a plan
    made first in a fresh process read 63.6 MiB above every later iteration of a step
    that holds 9 MiB: 32 MiB from the forward's thread, as much from the backward's).
    Runs a few tiny products, forward and in a backward, on tensors of its own (nothing
    of the model's, no random numbers), once per device and stream, outside the caller's
    dispatch modes and never while the stream is being captured into a graph; a no-op on
    the CPU and on the meta device."""
    if device.type in ("cpu", "meta"):
        return
    module = torch.get_device_module(device.type)
    if hasattr(module, "is_available") and not module.is_available():
        return
    capturing = getattr(module, "is_current_stream_capturing", None)
    if capturing is not None and capturing():
        return  # products now would be captured into the caller's graph
    stream = module.current_stream(device) if hasattr(module, "current_stream") else None
    key = (str(device), getattr(stream, "stream_id", None))
    if key in _READY:
        return
    # Outside any mode of the caller's (a fake-tensor mode would make fakes of these).
    with _torch_private.disable_current_modes():
        with torch.no_grad():
            _products(device)
        with torch.enable_grad():
            seed = torch.zeros(1, device=device, requires_grad=True)
            torch.autograd.grad(_ProductsInBackward.apply(seed).sum(), seed)
    if hasattr(module, "synchronize"):
        module.synchronize(device)
    _READY.add(key)


@contextlib.contextmanager
def measure_peak(device: torch.device | str | int | None = None) -> Iterator[PeakMemory]:
    """Measure the peak memory allocated on one device while the block runs.

    Memory that is live when the block begins is not counted, so the result is what
    the block itself added at its highest point: for a training step, the activations,
    gradients and temporaries.

    On CUDA this resets the device's peak statistics (``torch.cuda.reset_peak_memory_stats``),
    and likewise on other accelerators that keep them; the matrix libraries' workspaces,
    which a process's first matrix product makes and keeps to its end, are made first
    (:func:`ready_libraries`), so that a first measurement reads the block's own memory.
    On the CPU it counts the bytes of every tensor storage that an operator creates inside
    the block, forward and backward, until that storage is freed; storages that existed
    before the block, and views of them, are not counted. The CPU count runs every
    operator through a Python dispatch mode, which slows the block down: do not time a
    measured block.

    Args:
        device: The device to measure. ``None`` means the current accelerator if one is
            available, else the CPU. An integer is an index on the current accelerator.

    Yields:
        A :class:`PeakMemory` whose ``peak_bytes`` is set when the block exits.

    Raises:
        CheckpointConfigError: If the device keeps no memory statistics that can be read.

    Example:
        >>> with measure_peak("cpu") as peak:
        ...     loss = model(inputs).sum()
        ...     loss.backward()
        >>> print(f"{peak.peak_mib:.1f} MiB")
    """
    resolved = _resolve_device(device)
    result = PeakMemory(device=resolved)
    if resolved.type == "cpu":
        with StorageCounter(resolved.type) as counter:
            try:
                yield result
            finally:
                result.peak_bytes = counter.peak_bytes
        return
    stats = allocator_stats(resolved)
    ready_libraries(resolved)
    stats.reset_peak(resolved)
    at_entry = stats.allocated(resolved)
    try:
        yield result
    finally:
        result.peak_bytes = max(0, stats.max_allocated(resolved) - at_entry)


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    """Turn the ``device`` argument into a device with an index where one applies."""
    if device is None:
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        if accelerator is None:
            return torch.device("cpu")
        device = accelerator
    elif isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        if accelerator is None:
            raise CheckpointConfigError(
                f"measure_peak got device index {device}, but no accelerator is available; "
                "pass a device such as 'cpu' or 'cuda:0'"
            )
        return torch.device(accelerator.type, device)
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        # The peak statistics are per device; pin the one that is current now so that
        # entry and exit read the same device even if the block switches devices.
        module = getattr(torch, device.type, None)
        current_device = getattr(module, "current_device", None)
        if callable(current_device):
            device = torch.device(device.type, current_device())
    return device


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
    """The three allocator calls a device must offer to be measured by its statistics."""

    reset_peak: Any
    allocated: Any
    max_allocated: Any


def allocator_stats(device: torch.device) -> AllocatorStats:
    """Find the allocator statistics for ``device``, or explain why there are none."""
    if device.type == "cuda":
        return AllocatorStats(
            reset_peak=torch.cuda.reset_peak_memory_stats,
            allocated=torch.cuda.memory_allocated,
            max_allocated=torch.cuda.max_memory_allocated,
        )
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and accelerator.type == device.type:
        return AllocatorStats(
            reset_peak=torch.accelerator.reset_peak_memory_stats,
            allocated=torch.accelerator.memory_allocated,
            max_allocated=torch.accelerator.max_memory_allocated,
        )
    module = getattr(torch, device.type, None)
    names = ("reset_peak_memory_stats", "memory_allocated", "max_memory_allocated")
    functions = [getattr(module, name, None) for name in names]
    if all(callable(function) for function in functions):
        return AllocatorStats(*functions)
    raise CheckpointConfigError(
        f"measure_peak cannot measure device {str(device)!r}: it keeps no peak memory "
        f"statistics (torch.{device.type} lacks {', '.join(names)}). Supported: 'cpu', "
        "'cuda' and accelerators whose device module offers those functions"
    )


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of storages that operators create, from creation until freed.

    Each storage is keyed by the address of its C++ object (``_cdata``). Its Python
    object is kept by torch for as long as the C++ storage lives, so a weak reference to
    it calls back exactly when the memory is released, and never keeps it alive.

    Args:
        device_type: The device whose storages count (``"cpu"``, ``"cuda"``...).
        trace: Also keep ``moments``: the live bytes after each operator that created a
            storage, the points at which the count can reach its peak.
        workspaces: Also count, as a moment of its own, what an operator is known to hold
            while it runs beyond its outputs (``_workspace``: CPU convolutions), so that
            the peak is the allocator's, not only the outputs'.

    Code that must run with no dispatch mode on the stack (a node of a backward: any mode
    makes autograd accumulate gradients out of place) is counted otherwise: bytes its
    caller follows by other means are added with :meth:`hold`, and on the CPU what the
    code allocates and frees meanwhile is read from the allocator's events
    (:meth:`open_reading`, :meth:`close_reading`); while a counter on the CPU is open,
    the allocator keeps the size of every block, so that a reading reports the free of
    any storage counted, at its own size. What a reading saw allocated that
    outlives it, in no storage the counter follows and not held by the caller (a tensor
    recomputed inside a node that a later node unpacks), is kept as ``unattributed``
    bytes, which later readings' frees take down.

    Attributes:
        closed: Whether counting has stopped (:meth:`close`).
        peak_bytes: The highest count so far.
        created_bytes: Bytes of every storage counted, freed or not.
        moments: With ``trace``, the live bytes after each operator that created storage.
        unattributed: Bytes of ``live_bytes`` that readings saw allocated and not freed,
            in no storage the counter follows and not held (see :meth:`hold`).
    """

    def __init__(self, device_type: str, *, trace: bool = False, workspaces: bool = False) -> None:
        super().__init__()
        self.device_type = device_type
        self._trace = trace
        self._workspaces = workspaces
        self.moments: List[int] = []
        self.created_bytes = 0
        # Storages counted and still alive: key -> the weak reference whose callback
        # reports its release (dropping it cancels the callback), with the bytes counted.
        self._refs: Dict[int, _Counted] = {}
        self._on_release: Any = self._release  # one bound method for every reference
        # Finalizers only append here: they can fire in the middle of our own
        # bookkeeping (a garbage collection) or on another thread, and a list append is
        # atomic, whereas updating the running total from there could be lost.
        self._freed: List[int] = []
        self._lock = threading.Lock()
        self._live = 0
        self.closed = False
        self.peak_bytes = 0
        self.ops = 0
        # The reading in progress (see ``open_reading``): its thread (None: no reading),
        # the bytes alive as it opened, the bytes of the storages counted while it is
        # open (in its events too), and those of the ones freed on its thread while it is
        # open that were counted during a reading (the allocator reports their free among
        # its events).
        self._reading_thread: Optional[int] = None
        self._reading_start = 0
        self._counted_in_reading = 0
        self._reported_frees: List[int] = []
        self.unattributed = 0
        # Storages resized in place (UntypedStorage.resize_) are told to it until it closes.
        _follow_resizes(self)
        # While it counts, the CPU allocator keeps the sizes of every block (see
        # ``open_reading``): a reading reports the free of any storage it counted.
        self._table_kept = device_type == "cpu" and _torch_private.keep_cpu_allocation_table()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A meter: torch.compile compiles as if it were not there (and a closed one left on
        # the stack never keeps a frame from compiling); compiled code's operators count.
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is ever compiled: no wrapper to disable the compiler around every
        # operator (which would cost more than counting it).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        # Every operator of a metered step passes here: the common case is kept short.
        if kwargs is None:
            kwargs = {}
        if self.closed:
            return func(*args, **kwargs)
        self.ops += 1
        # (Inside a reading of the allocator's events, they hold the operator's workspace.)
        if self._workspaces and may_hold(func) and self._reading_thread != threading.get_ident():
            before = self.live_bytes
            out, held = run_held(func, args, kwargs)
            self._record(func, out, args, kwargs)
            if held and before + held > self.live_bytes:
                with self._lock:
                    self._peak_at(before + held)
            return out
        out = func(*args, **kwargs)
        self._record(func, out, args, kwargs)
        return out

    def __exit__(self, exc_type, exc_value, traceback):
        self.close()
        return super().__exit__(exc_type, exc_value, traceback)

    @property
    def live_bytes(self) -> int:
        """Bytes of the storages counted that are alive now."""
        with self._lock:
            while self._freed:
                self._live -= self._freed.pop()
            return self._live

    def close(self) -> None:
        """Stop counting (operators met afterwards run through uncounted). Storages that
        outlive the count must not call back into it, and dropping them now lets this
        object be freed before they are."""
        self.closed = True
        _unfollow_resizes(self)
        if self._table_kept:
            self._table_kept = False
            _torch_private.let_cpu_allocation_table_go()
        with self._lock:
            self._refs.clear()
        self._on_release = None  # no cycle through it once nothing is counted

    def _record(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        """Count the storages among ``out`` that this operator created."""
        if self._count_outputs(outputs_of(func), out, args, kwargs) and self._trace:
            with self._lock:
                self.moments.append(self._live)

    def adopt(self, tensor: Any, *, moment: bool = True) -> None:
        """Count the storages of ``tensor`` (a tensor, or a sequence of them) from now until
        they are freed, as if an operator had made them: tensors made outside the
        dispatcher (a generator's state, the gradients a node of a backward receives and
        returns). With ``moment`` (and ``trace``), a moment after them if any was new."""
        if self.closed:
            return
        created = self._count_outputs(True, tensor, (), {})
        if created and moment and self._trace:
            with self._lock:
                self.moments.append(self._live)

    def hold(self, nbytes: int) -> None:
        """Bytes the caller follows by other means were allocated (or, negative, freed):
        the count goes up (or down) by them."""
        if self.closed or not nbytes:
            return
        with self._lock:
            if nbytes > 0:
                self._add(nbytes)
                self.created_bytes -= nbytes  # (none of the storages it counts)
            else:
                self._live += nbytes

    def moment(self, above: int = 0) -> None:
        """A moment at the bytes alive now (the end of a stretch counted by what it was
        handed, see :meth:`adopt`), or ``above`` them (what is known to have been held
        briefly on top)."""
        if not self.closed:
            live = self.live_bytes
            with self._lock:
                self._peak_at(live + above)

    # ------------------------------------------------------------------ readings

    @property
    def reading(self) -> bool:
        """Whether a reading of this counter's is open."""
        return self._reading_thread is not None

    def open_reading(self) -> bool:
        """Read the allocator's events on this thread from now until :meth:`close_reading`
        (on the CPU, where no profiler records on this thread); False where none can be
        taken: the code is then counted by the storages it is handed alone."""
        if self.closed or self.device_type != "cpu" or self._reading_thread is not None:
            return False
        start = self.live_bytes
        with self._lock:
            self._reading_thread = threading.get_ident()
            self._reading_start = start
            self._counted_in_reading = 0
            self._reported_frees.clear()
        if not start_reading():
            self._reading_thread = None
            return False
        return True

    def close_reading(self, held: int = 0) -> None:
        """End the reading in progress: a moment at the highest its events reached above
        the bytes alive when it opened, and what it saw allocated that outlives it in no
        storage counted taken into ``unattributed`` (see the class). ``held``: bytes among
        its events that the caller follows (:meth:`hold`), or knows freed after it."""
        if self._reading_thread is None:
            return
        net, high = end_reading()
        with self._lock:
            self._reading_thread = None
            while self._freed:
                self._live -= self._freed.pop()
            reported = 0
            while self._reported_frees:
                reported += self._reported_frees.pop()
            # The events: what it allocated, less what it freed of blocks allocated during
            # readings. Storages counted during it are in the events and in the count;
            # those of them freed are in both, and the count has let them go already.
            change = net - held - self._counted_in_reading + reported
            held = max(0, self.unattributed + change)
            self._live += held - self.unattributed
            self.unattributed = held
            self._peak_at(max(self._reading_start + high, self._live))

    def drop_reading(self) -> None:
        """Forget a reading that the code it read left open (it raised, and autograd's
        engine dropped the profiler with the node's thread-local state): nothing of it is
        read, and nothing is disabled (a profiler on the thread now is another's)."""
        self._reading_thread = None

    def _peak_at(self, nbytes: int) -> None:
        """A moment at which ``nbytes`` were held; the lock is held."""
        self.peak_bytes = max(self.peak_bytes, nbytes)
        if self._trace:
            self.moments.append(nbytes)

    def _count_outputs(self, outputs: Optional[bool], out: Any, args: Any, kwargs: Any) -> bool:
        """Count the storages among ``out`` that the operator created; whether it created
        any. ``outputs`` is what its schema says of them (``outputs_of``): True, new
        tensors; False, its inputs or views of them; None, either (the inputs are then
        looked at). Every operator of a metered step passes here: kept to plain statements."""
        created = False
        input_keys: Set[int] | None = None
        refs = self._refs
        for leaf in (out,) if type(out) is torch.Tensor else tensors(out):
            storage = self._storage_of(leaf)
            if storage is None:
                continue
            key = storage._cdata
            nbytes = storage.nbytes()
            counted = refs.get(key)
            if counted is not None:
                if nbytes > counted.nbytes:  # resized in place, e.g. by an out= operator
                    with self._lock:
                        self._add(nbytes - counted.nbytes)
                        if self._reading_thread is not None:
                            self._counted_in_reading += nbytes - counted.nbytes
                        counted.nbytes = nbytes
                    created = True
                continue
            if outputs is False:
                # An input or a view of one that was not counted: it existed before.
                continue
            if outputs is None:
                if input_keys is None:
                    # Read after the operator ran, so an in-place one that swapped its
                    # input's storage (``set_``) shows the storage that input holds now.
                    input_keys = self._input_keys(args, kwargs)
                if key in input_keys:
                    # Returned an input or a view of one: no new memory. An input
                    # storage we do not count existed before the block.
                    continue
            ref = _Counted(storage, self._on_release)
            ref.key, ref.nbytes = key, nbytes
            # Its free is among the events of a reading open then: always while the
            # allocator keeps every block's size, else if it was counted during a reading.
            ref.reported = self._table_kept or (
                self._reading_thread is not None and self._reading_thread == threading.get_ident()
            )
            with self._lock:
                if key in refs:
                    continue
                refs[key] = ref
                self._add(nbytes)
                if ref.reported:
                    self._counted_in_reading += nbytes
            created = created or nbytes > 0
        return created

    def _add(self, nbytes: int) -> None:
        """Apply the frees reported so far, then the new allocation; the lock is held."""
        while self._freed:
            self._live -= self._freed.pop()
        self._live += nbytes
        self.created_bytes += nbytes
        if self._live > self.peak_bytes:
            self.peak_bytes = self._live

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """``storage`` was resized in place to ``nbytes`` (``UntypedStorage.resize_``, which
        no dispatch mode sees: FSDP2 frees a layer's all-gathered parameters so, and
        allocates them again): a storage counted takes its new size; one not counted that
        grows (made before the block, empty) is counted from now, as if made."""
        if self.closed:
            return
        with self._lock:
            counted = self._refs.get(storage._cdata)
            if counted is None:
                if nbytes <= 0 or storage.device.type not in (self.device_type, "meta"):
                    return
                ref = _Counted(storage, self._on_release)
                ref.key, ref.nbytes, ref.reported = storage._cdata, 0, self._table_kept
                self._refs[ref.key] = ref
                counted = ref
            change = nbytes - counted.nbytes
            if not change:
                return
            counted.nbytes = nbytes
            if change > 0:
                self._add(change)
            else:
                self._live += change
            if self._reading_thread is not None and self._reading_thread == threading.get_ident():
                # The allocator's events of the reading hold the resize too.
                self._counted_in_reading += change
            if self._trace:
                self.moments.append(self._live)

    def _release(self, ref: "_Counted") -> None:
        """Called back when a counted storage is released: report its bytes as freed."""
        refs = self._refs
        if refs.get(ref.key) is ref and refs.pop(ref.key, None) is not None:
            self._freed.append(ref.nbytes)
            if ref.reported and self._reading_thread == threading.get_ident():
                self._reported_frees.append(ref.nbytes)

    def _storage_of(self, value: Any) -> torch.UntypedStorage | None:
        """The storage behind ``value`` if it is a dense tensor on the measured device."""
        if not isinstance(value, torch.Tensor):
            return None
        on_device = value.is_cpu if self.device_type == "cpu" else value.device.type == self.device_type
        if not on_device:
            return None
        try:
            # Empty storages are kept too: an ``out=`` operator may grow one later.
            return value.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            # Sparse tensors and wrapper subclasses have no single storage of their own.
            return None

    def _input_keys(self, args: Any, kwargs: Any) -> Set[int]:
        """Keys of the storages of every tensor among the operator's inputs."""
        keys = set()
        for leaf in (*tensors(args), *tensors(kwargs)):
            try:
                keys.add(leaf.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError, TypeError):
                pass
        return keys


_resize_followers: "weakref.WeakSet[StorageCounter]" = weakref.WeakSet()
_resize_lock = threading.Lock()
_plain_resize: Any = None


def _follow_resizes(counter: StorageCounter) -> None:
    """Tell ``counter`` of every ``UntypedStorage.resize_`` until it closes: the method is
    wrapped while any counter is open (as torch's own ``MemTracker`` does)."""
    global _plain_resize
    with _resize_lock:
        _resize_followers.add(counter)
        if _plain_resize is None:
            _plain_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]


def _unfollow_resizes(counter: StorageCounter) -> None:
    global _plain_resize
    with _resize_lock:
        _resize_followers.discard(counter)
        if not _resize_followers and _plain_resize is not None:
            if torch.UntypedStorage.resize_ is _resize:
                torch.UntypedStorage.resize_ = _plain_resize  # type: ignore[method-assign]
            _plain_resize = None


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    resize = _plain_resize if _plain_resize is not None else _original_resize
    result = resize(storage, size)
    nbytes = storage.nbytes()
    for counter in list(_resize_followers):
        counter._resized(storage, nbytes)
    return result


_original_resize = torch.UntypedStorage.resize_


class _Counted(weakref.ref):
    """A weak reference to a counted storage, with its key, the bytes counted for it and
    whether it was counted during a reading (whose events then report its free)."""

    __slots__ = ("key", "nbytes", "reported")


_aten = torch.ops.aten
_UNDECLARED_VIEWS = frozenset({_aten._unsafe_view.default})
"""Operators whose schema declares a new output where they return a view of an input."""


@functools.lru_cache(maxsize=None)
def outputs_of(func: Any) -> Optional[bool]:
    """What ``func``'s schema says of its outputs' storages: True if every output is a new
    tensor, False if every one is an input or a view of one (in-place, ``out=`` and view
    operators), None if some may be either or there is no schema to tell."""
    schema = getattr(func, "_schema", None)
    if schema is None or func in _UNDECLARED_VIEWS or not schema.returns:
        return None
    aliased = {ret.alias_info is not None for ret in schema.returns}
    return None if len(aliased) > 1 else not aliased.pop()

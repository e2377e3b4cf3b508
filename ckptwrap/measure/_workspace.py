"""Memory an operator holds while it runs beyond its outputs, where no meter of operators'
outputs can see it: on the CPU, a convolution's reordered copies of its input, weight
and output (oneDNN's blocked layouts, or im2col columns).

The CPU keeps no allocator statistics. So a CPU convolution met by a meter that counts
workspaces runs once under torch's legacy autograd profiler, which reports the
allocator's events on the calling thread without starting any profiler library (no
output); the highest it held is kept per operator signature, so each distinct
convolution is read once. Where a profiler of the caller's records on the calling
thread, the convolution is read on a thread of its own (where no profiler records), on
the same inputs and without autograd, just before it runs for real: the reading holds
what the real call holds, then frees it, so the step's peak is unchanged, and the
caller's profiler does not see it. Channels-last convolutions hold far more than their
inputs and outputs (a depthwise 7x7 backward, 256 times its weight); only a reading
knows. Where no reading can be taken (a torch without that profiler), a bound fitted to
readings over contiguous convolutions of one to three dimensions, strides 1 to 5,
kernels 1 to 10, grouped and depthwise stands in: the forward held at most 0.9 times,
its backward at most 1.55 times the bytes of input, output (or output gradient) and
weight; rounded up to 1 and 1.6.

The same events read a stretch of code that runs where no dispatch mode may be (a node
of a backward, see ``_span``): :func:`start_reading`, :func:`end_reading`.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils._pytree import tree_map_only

from .. import _torch_private
from ._storages import tensors

__all__ = ["end_reading", "may_hold", "run_held", "start_reading"]

_aten = torch.ops.aten
_BOUND = {"convolution": 1.0, "convolution_backward": 1.6}
_KEPT = 512
_read: "collections.OrderedDict[Tuple[Any, ...], int]" = collections.OrderedDict()
_lock = threading.Lock()


def run_held(func: Any, args: Any, kwargs: Dict[str, Any]) -> Tuple[Any, int]:
    """Run ``func`` and return its output with the most it held at once while running,
    beyond what was allocated before it (its outputs included); 0 where it is known to
    hold nothing beyond its outputs (every operator but CPU convolutions)."""
    name = _convolution(func, args)
    if name is None:
        return func(*args, **kwargs), 0
    key = _signature(func, args, kwargs)
    with _lock:
        known = _read.get(key)
        if known is not None:
            _read.move_to_end(key)
    if known is not None:
        return func(*args, **kwargs), known
    if _fake_among(args):
        out, held = func(*args, **kwargs), _read_on_real(func, args, kwargs)
    else:
        out, held = _profiled(func, args, kwargs)
    if out is None:  # read aside: the operator runs here now
        out = func(*args, **kwargs)
    if held is None:
        return out, _bound(name, args, out)
    with _lock:
        _read[key] = held
        while len(_read) > _KEPT:
            _read.popitem(last=False)
    return out, held


@functools.lru_cache(maxsize=None)
def may_hold(func: Any) -> bool:
    """Whether ``func`` is an operator that may hold memory beyond its outputs while it
    runs (a convolution, forward or backward): the others need no :func:`run_held`."""
    return getattr(func, "overloadpacket", None) in (_aten.convolution, _aten.convolution_backward)


def _convolution(func: Any, args: Any) -> Optional[str]:
    if not may_hold(func):
        return None
    name = func.overloadpacket.__name__
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.device.type != "cpu" or first.layout != torch.strided:
        return None
    return name


_REAL_READING_BYTES = 1 << 30
"""A step on fake tensors reads a convolution on real tensors of its shapes up to this
many bytes of arguments; past it the fitted bound stands in."""


def _fake_among(args: Any) -> bool:
    fake = _torch_private.fake_tensor
    return fake is not None and any(isinstance(a, fake.tensor_class) for a in tensors(args))


def _read_on_real(func: Any, args: Any, kwargs: Dict[str, Any]) -> Optional[int]:
    """What ``func`` holds, read on real tensors of its fake arguments' shapes, strides and
    dtypes (a fake convolution allocates nothing, so a reading of it would say nothing, and
    kept under its signature it would stand for the real one); None where they would take
    more than :data:`_REAL_READING_BYTES`, or no reading can be taken."""
    if sum(t.numel() * t.element_size() for t in tensors(args)) > _REAL_READING_BYTES:
        return None
    fake = _torch_private.fake_tensor
    with fake.outside(), _torch_private.disable_current_modes(), torch.no_grad():  # type: ignore[union-attr]
        real_args = tree_map_only(torch.Tensor, _materialized, args)
        out, held = _profiled(func, real_args, kwargs)
        del out, real_args
    return held


def _materialized(value: torch.Tensor) -> torch.Tensor:
    real = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="cpu")
    return real.uniform_() if real.is_floating_point() else real.zero_()


def _signature(func: Any, args: Any, kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    # A reading is of the real operator at these shapes, whether the step's tensors are
    # real or fake (a fake step reads on real tensors of the same shapes): one signature.
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), tuple(value.stride()), str(value.dtype), value.requires_grad)
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        return value

    return (str(func), describe(tuple(args)), describe(tuple(sorted(kwargs.items()))), torch.get_num_threads())


def _profiled(func: Any, args: Any, kwargs: Dict[str, Any]) -> Tuple[Any, Optional[int]]:
    """Run ``func`` and read the highest its allocations reached under the legacy
    profiler; None where that profiler cannot run. Where a profiler records on this
    thread (the caller's), the reading is taken on a thread of its own, on the same
    inputs, before ``func`` runs here: it holds what ``func`` will, then frees it."""
    profiler = _torch_private.legacy_memory_profiler
    if profiler is None:
        return func(*args, **kwargs), None
    if _torch_private.profiler_enabled():
        return None, _aside(profiler, func, args, kwargs)
    return _reading(profiler, func, args, kwargs)


def _aside(profiler: Any, func: Any, args: Any, kwargs: Dict[str, Any]) -> Optional[int]:
    """:func:`_reading` on another thread, its output dropped there."""
    found: Dict[str, Optional[int]] = {}
    threads = torch.get_num_threads()

    def probe() -> None:
        try:
            # A new thread starts with OpenMP's default team size; the kernels size their
            # scratch memory by the team, so it must be the caller's.
            torch.set_num_threads(threads)
            with torch.no_grad():
                found["held"] = _reading(profiler, func, args, kwargs)[1]
        except Exception:  # noqa: BLE001 - no reading: the fitted bound stands in
            found["held"] = None

    thread = threading.Thread(target=probe, name="ckptwrap-workspace", daemon=True)
    thread.start()
    thread.join()
    return found.get("held")


def _reading(profiler: Any, func: Any, args: Any, kwargs: Dict[str, Any]) -> Tuple[Any, Optional[int]]:
    if not start_reading():
        return func(*args, **kwargs), None
    try:
        out = func(*args, **kwargs)
    finally:
        live, held = end_reading()
    # What it kept beyond its outputs (oneDNN's reordered weights, cached for the next
    # call of the same shape) is not held by later calls.
    made = sum(t.untyped_storage().nbytes() for t in tensors(out))
    return out, held - max(0, live - made)


def start_reading() -> bool:
    """Start reading the CPU allocator's events on the calling thread, until
    :func:`end_reading`: what the code between them allocates and frees, in order, read
    with torch's legacy autograd profiler (no profiler library, no output, no other
    thread). It allocates no tensor memory and changes no operator's path, so code read
    this way runs as unread. False where no reading can be taken: a profiler records on
    this thread already (the caller's, or one not ended), or this torch lacks the legacy
    profiler.

    The allocator reports a free only of a block whose size it kept: one allocated while
    some reading was open on the thread, or while a storage counter on the CPU counts
    (``_torch_private.keep_cpu_allocation_table``); what was allocated before is not
    among the events. Without that switch, a block allocated between readings at the
    address of one a reading saw may have its free read at the other's size.
    """
    profiler = _torch_private.legacy_memory_profiler
    if profiler is None or _torch_private.profiler_enabled():
        return False
    try:
        profiler[0](_config(profiler))
    except RuntimeError:
        return False
    return True


def end_reading() -> Tuple[int, int]:
    """End the reading :func:`start_reading` started: the bytes allocated less those freed
    (``net``), and the highest that running sum reached (``high``, at least 0), above
    where it began."""
    profiler = _torch_private.legacy_memory_profiler
    assert profiler is not None
    live = high = 0
    for thread in profiler[1]():
        for event in thread:
            if event.kind() == "memory_alloc":
                live += event.cpu_memory_usage()
                if live > high:
                    high = live
    return live, high


@functools.lru_cache(maxsize=1)
def _config(profiler: Any) -> Any:
    """The legacy profiler's configuration (made once: a reading is taken per node of a
    backward)."""
    return profiler[2]()


def _bound(name: str, args: Any, out: Any) -> int:
    """Its outputs, and the fitted share of what it reads and writes."""
    made = sum(t.numel() * t.element_size() for t in tensors(out))
    seen = (args[0], args[1], out) if name == "convolution" else (args[0], args[1], args[2])
    read = sum(t.numel() * t.element_size() for t in seen if isinstance(t, torch.Tensor))
    return made + int(_BOUND[name] * read)

"""Recomputing the next region ahead of the backward, in a worker thread, on a side stream.

On an accelerator a checkpointed region costs more than its recomputed kernels: it is run
again in Python in the middle of the backward, and while its operators are being launched
nothing else is. Regions whose forward runs inside :func:`recompute_ahead` get the region
before them recomputed while the backward of their own runs. The design, in five parts:

1. *Which region is next.* Each such region links to the one entered before it in the same
   context (forward order), at top level only: not inside another region's forward or
   inside a recomputation. Backward meets them in reverse order as a rule, so when it
   starts on one (its first unpack in a backward call), the one before it is the region it
   needs next, and that one is handed to the worker.
2. *Where it runs.* One worker thread per process runs the recomputation: its Python
   (module calls, hooks) runs while autograd's threads differentiate in C++, which needs
   no GIL. On a device with streams the worker launches on a side stream of each device
   the region's inputs are on, after an event recorded on the backward's stream when it
   asked; the backward makes its stream wait for an event the worker recorded at the end
   before it reads any value, and records each value handed over on its own stream, so the
   caching allocator does not hand that memory to the side stream while the backward
   still reads it. Where a region's inputs are all on the CPU, the worker runs on the
   current streams, in order with the backward's launches.
3. *One recomputation at a time.* Replaying a region sets the process's random number
   generators: every recomputation, in the worker or in the backward, runs under one lock,
   and a backward call does not end while a region it handed to the worker is being
   recomputed (a callback at the end of its graph task waits), so the next forward never
   draws random numbers while a replay holds the generators.
4. *Failure.* A recomputation ahead that fails (a region whose inputs are gone, one whose
   backward never comes) is dropped with what it made: when backward needs that region
   after all, it recomputes it itself, and any error is raised there, in its own thread.
5. *Cost.* The region recomputed ahead keeps its values beside those of the region being
   differentiated: one region's saved tensors more at the peak. Under a Python dispatch
   mode in the backward (``FlopCounterMode``, a mode of one's own), or within a
   ``GraphExecGroup``, nothing is handed to the worker, where the mode would not see it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _torch_private
from . import _tree

__all__ = ["Job", "recomputation_lock", "schedule", "take"]

_LOCK = threading.RLock()


def recomputation_lock() -> "threading.RLock":
    """Held around every recomputation, in whichever thread it runs (part 3)."""
    return _LOCK


# (device module, index, event): an event recorded on a stream of that device.
_Mark = Tuple[Any, int, Any]


class Job:
    """One region handed to the worker for one backward call."""

    __slots__ = ("frame", "gid", "done", "ok", "ends")

    def __init__(self, frame: Any, gid: Any) -> None:
        self.frame = weakref.ref(frame)
        self.gid = gid
        self.done = threading.Event()
        self.ok = False
        self.ends: List[_Mark] = []
        """Events recorded on the side streams after the recomputation's last launch."""


def _stream_module(kind: str) -> Optional[Any]:
    """The device module of ``kind`` if it has streams and events, else None."""
    try:
        module = torch.get_device_module(kind)
    except (RuntimeError, AttributeError):
        return None
    needed = ("Stream", "Event", "current_stream", "stream")
    return module if all(hasattr(module, name) for name in needed) else None


_SIDE: Dict[Tuple[str, int], Any] = {}  # the worker's stream, by device module and index


def schedule(
    frame: Any,
    gid: Any,
    run: Callable[[Any, Any, Tuple[Any, ...], Dict[str, Any]], None],
) -> None:
    """Hand ``frame`` to the worker to be recomputed for backward call ``gid`` by
    ``run(frame, gid, args, kwargs)``, unless it is done, in flight, or must not be.

    Called from inside a backward (a graph task), in the thread running it.
    """
    if gid in frame.recomputed or gid in frame.jobs or _torch_private.dispatch_modes_active():
        return
    queue_callback = _torch_private.queue_callback
    if queue_callback is None:
        return
    ready: List[_Mark] = []
    for kind, index in frame.inputs.devices:
        module = _stream_module(kind)
        if module is None:  # a device without streams: recomputed in backward, in order
            return
        event = module.Event()
        event.record(module.current_stream(index))
        ready.append((module, index, event))
    job = Job(frame, gid)
    frame.jobs[gid] = job
    frame_ref = weakref.ref(frame)
    queue_callback(lambda: _finish(frame_ref, job))  # type: ignore[misc]
    _worker().put((job, ready, run))


def take(frame: Any, gid: Any) -> bool:
    """If ``frame`` was handed to the worker for ``gid``: wait for it and, if it succeeded,
    hand its values to the calling thread's streams; True if they are ready to unpack."""
    job = frame.jobs.get(gid)
    if job is None:
        return False
    job.done.wait()
    if not job.ok:
        return False
    for module, index, event in job.ends:
        current = module.current_stream(index)
        current.wait_event(event)
        for ref in frame.holders:
            holder = ref()
            value = None if holder is None else holder.values.get(gid)
            if value is not None and value.device.type != "cpu":
                value.record_stream(current)
    return True


def _finish(frame_ref: "weakref.ref[Any]", job: Job) -> None:
    """At the end of the backward call: wait for the job, then drop what nobody unpacked."""
    job.done.wait()
    frame = frame_ref()
    if frame is not None:
        frame.jobs.pop(job.gid, None)
        frame.forget(job.gid)


def _work(job: Job, ready: List[_Mark], run: Callable[..., None]) -> None:
    frame = job.frame()
    if frame is None:
        return
    try:
        with contextlib.ExitStack() as stack:
            sides = []
            for module, index, event in ready:
                side = _SIDE.get((module.__name__, index))
                if side is None:
                    side = _SIDE[(module.__name__, index)] = module.Stream(device=index)
                side.wait_event(event)
                stack.enter_context(module.stream(side))
                sides.append((module, index, side))
            args, kwargs = frame.inputs.restore()
            if sides:
                _record_inputs((args, kwargs), {index: side for _, index, side in sides})
            run(frame, job.gid, args, kwargs)
            for module, index, side in sides:
                end = module.Event()
                end.record(side)
                job.ends.append((module, index, end))
        job.ok = True
    except BaseException:  # noqa: BLE001 - part 4: the backward recomputes and raises itself
        frame.forget(job.gid)


def _record_inputs(tree: Any, sides: Dict[int, Any]) -> None:
    """Tell the allocator that the side streams read the region's inputs, so that their
    memory is not reused while the worker's kernels may still read it."""
    for tensor in _tree.tensor_leaves(tree):
        if tensor.device.type != "cpu":
            side = sides.get(tensor.device.index if tensor.device.index is not None else 0)
            if side is not None:
                tensor.record_stream(side)


_WORKER: "Optional[queue.SimpleQueue[Any]]" = None
_WORKER_LOCK = threading.Lock()


def _worker() -> "queue.SimpleQueue[Any]":
    """The queue of the one thread that recomputes regions ahead, started on first use."""
    global _WORKER
    if _WORKER is None:
        with _WORKER_LOCK:
            if _WORKER is None:
                jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
                threading.Thread(target=_loop, args=(jobs,), name="ckptwrap-recompute-ahead", daemon=True).start()
                _WORKER = jobs
    return _WORKER


def _loop(jobs: "queue.SimpleQueue[Any]") -> None:
    while True:
        job, ready, run = jobs.get()
        try:
            _work(job, ready, run)
        finally:
            job.done.set()
            del job, ready, run


def _after_fork() -> None:
    # A forked child (a data loader's worker) has no worker thread and no streams yet.
    global _WORKER, _LOCK
    _WORKER = None
    _LOCK = threading.RLock()
    _SIDE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

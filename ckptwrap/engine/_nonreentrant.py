"""The non-re-entrant engine: saved-tensor hooks that keep placeholders, recompute on unpack.

During the forward of a region every tensor autograd wants to save is replaced by a small
``_Holder``. The first time backward unpacks one of them, the region is run again under
the forward's device state and each tensor it saves is routed into the matching holder;
with early stop the rerun ends as soon as the last holder still alive has been filled.

Regions entered inside ``recompute_ahead`` are recomputed one ahead of the backward, in
a worker thread (``_ahead`` has that design); every recomputation runs under one lock.

Nesting follows from two rules: a region's inputs are saved tensors of the enclosing
region (unpacking them recomputes the parent first), and a recomputation starts with no
placeholder hooks in force. Recomputed values belong to one backward call (its graph
task), dropped when unpacked or, for a partial backward, when that backward ends.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import saved_tensors_hooks

from .. import _torch_private
from .._errors import CheckpointConfigError, CheckpointError, input_changed_error, is_version_error
from . import _ahead, _device, _state, _tree
from ._debug import OpRecorder, describe_ops

__all__ = ["changed_input", "input_versions", "run_checkpointed"]

_Meta = Tuple[torch.Size, torch.dtype, torch.device]


class _Holder:
    """Stands in for one saved tensor; holds its recomputed value per backward call."""

    __slots__ = ("values", "__weakref__")

    def __init__(self) -> None:
        self.values: Dict[Any, torch.Tensor] = {}


class _StopRecomputation(Exception):
    """Raised from a pack hook to end a recomputation once nothing more is needed."""

    def __init__(self, run: "_Recomputation") -> None:
        super().__init__()
        self.run = run


def _meta(tensor: torch.Tensor) -> _Meta:
    return (tensor.shape, tensor.dtype, tensor.device)


def _describe(meta: _Meta) -> str:
    shape, dtype, device = meta
    return f"shape={tuple(shape)}, dtype={dtype}, device={device}"


class _SavedInputs:
    """A region's arguments, with tensors kept as saved tensors of the enclosing context.

    Saving them through autograd's own mechanism is what makes nesting work: inside an
    enclosing checkpoint they become that region's placeholders, outside they are plain
    references, and an in-place change before backward is caught by autograd's version
    check (reported naming the region, and whether its own forward made the change).
    """

    __slots__ = ("_items", "_spec", "_saved", "devices", "_versions", "changed")

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if kwargs or not all(_tree.is_plain(a) for a in args):
            leaves, self._spec = _tree.flatten((args, kwargs))
        else:
            leaves, self._spec = list(args), None
        tensors, self._items = _tree.split_tensors(leaves)
        # The accelerators whose RNG state the recomputation must replay.
        self.devices = _device.devices_of(tensors)
        # Held through the forward only: the region changing an input in place is named
        # when the recomputation finds it changed (see ``forward_done``).
        self._versions: Optional[List[Tuple[torch.Tensor, int]]] = input_versions(tensors)
        self.changed: Optional[str] = None
        """The input the region's forward changed in place, described; None if none."""
        if _torch_private.make_saved_tensor is not None:
            self._saved: Any = [_torch_private.make_saved_tensor(t, is_output=False) for t in tensors]
        else:  # torch before 2.12
            self._saved = _save_through_function(tensors)

    def forward_done(self) -> None:
        """After the region's forward: note an input it changed in place, and let go of
        the inputs (inside an enclosing region they are that region's placeholders)."""
        versions, self._versions = self._versions, None
        self.changed = changed_input(versions or [])

    def restore(self) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        if isinstance(self._saved, list):
            tensors = [saved.unpack() for saved in self._saved]
        else:
            tensors = self._saved.grad_fn.saved_tensors[1:]  # after the anchor
        leaves = _tree.merge_tensors(tensors, self._items)
        if self._spec is None:
            return tuple(leaves), {}
        return _tree.unflatten(leaves, self._spec)


class _SaveInputs(torch.autograd.Function):
    """Saves its inputs for a backward that never runs: the node is kept only to read
    them back (``node.saved_tensors``), through the same saved-tensor hooks."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(anchor, *tensors)
        return anchor.new_empty((0,))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        raise RuntimeError("the node that keeps a region's inputs is never differentiated")


def _save_through_function(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The empty output of a no-op Function that saved ``tensors``, kept rather than its
    node (``grad_fn``), whose Python object does not keep it alive before torch 2.12."""
    with torch.enable_grad():
        anchor = torch.empty((0,), requires_grad=True)
        return _SaveInputs.apply(anchor, *tensors)


def input_versions(tensors: List[torch.Tensor]) -> List[Tuple[torch.Tensor, int]]:
    """Each input tensor with its version counter now (inference tensors have none)."""
    found = []
    for tensor in tensors:
        try:
            found.append((tensor, tensor._version))
        except RuntimeError:  # an inference tensor cannot be changed in a training forward
            continue
    return found


def changed_input(versions: List[Tuple[torch.Tensor, int]]) -> Optional[str]:
    """The first of these inputs whose version moved since, described; None if none did."""
    changed = [tensor for tensor, version in versions if tensor._version != version]
    if not changed:
        return None
    first = changed[0]
    more = f", and {len(changed) - 1} more" if len(changed) > 1 else ""
    return f"(a {str(first.dtype).replace('torch.', '')} tensor of shape {tuple(first.shape)}{more})"


class _Frame:
    """Everything one checkpointed call needs to recompute itself later."""

    __slots__ = (
        "replay",
        "region",
        "inputs",
        "holders",
        "metas",
        "early_stop",
        "checked",
        "forward_done",
        "recomputed",
        "debug",
        "ahead",
        "jobs",
        "__weakref__",
    )

    def __init__(
        self,
        replay: Callable[[Tuple[Any, ...], Dict[str, Any]], None],
        region: Callable[..., Any],
        inputs: _SavedInputs,
        *,
        early_stop: bool,
        checked: bool,
        debug: Optional[Tuple[OpRecorder, OpRecorder]],
    ) -> None:
        self.replay = replay
        self.region = region
        """What the region runs (the module or function), for errors."""
        self.inputs = inputs
        self.holders: List[weakref.ref] = []
        self.metas: List[_Meta] = []
        self.early_stop = early_stop
        self.checked = checked
        self.forward_done = False
        self.recomputed: set = set()
        self.debug = debug
        self.ahead: Optional[Callable[[], Any]] = None
        """A weak reference to the region to recompute ahead when backward starts here."""
        self.jobs: Dict[Any, _ahead.Job] = {}
        """Recomputations handed to the worker, by backward call."""

    def forget(self, gid: Any) -> None:
        """Drop what was recomputed for backward call ``gid`` and not unpacked."""
        self.recomputed.discard(gid)
        for ref in self.holders:
            holder = ref()
            if holder is not None:
                holder.values.pop(gid, None)

    def fail(self, message: str) -> CheckpointError:
        if self.debug is not None:
            forward, recompute = self.debug
            message = f"{message}\n\n{describe_ops(forward.ops, recompute.ops)}"
        return CheckpointError(message)


class _Recomputation:
    """One rerun of a frame for one backward call: routes saved tensors into holders."""

    def __init__(self, frame: _Frame, gid: Any) -> None:
        self.frame = frame
        self.gid = gid
        self.count = 0
        self.mismatches: List[str] = []
        self.extra_allowed = False
        alive = [i for i, ref in enumerate(frame.holders) if ref() is not None]
        self.last_needed = alive[-1] if alive else -1

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        frame, index = self.frame, self.count
        self.count += 1
        # Detached so the stored value does not keep the recomputation's graph alive.
        value = tensor.detach() if tensor.requires_grad else tensor
        if index >= len(frame.holders):
            if not frame.forward_done:
                # Backward inside the region's own forward, without early stop: the rerun
                # goes past the point the forward has reached so far.
                self.extra_allowed = True
                return value
            raise frame.fail(
                f"The recomputation saved more tensors than the forward did "
                f"(the forward saved {len(frame.holders)}). The checkpointed function must run "
                f"the same operations when it is recomputed; guard side-effecting branches "
                f"with ckptwrap.is_recomputing() or pass determinism_check='none'."
            )
        holder = frame.holders[index]()
        if holder is not None:
            holder.values[self.gid] = value
            if frame.checked:
                recomputed = _meta(value)
                if recomputed != frame.metas[index]:
                    self.mismatches.append(
                        f"  tensor at position {index}: forward saved "
                        f"{_describe(frame.metas[index])}; recomputation saved "
                        f"{_describe(recomputed)}"
                    )
        if frame.early_stop and index == self.last_needed:
            raise _StopRecomputation(self)
        return value

    def verify(self, stopped: bool) -> None:
        frame = self.frame
        if not frame.checked:
            return
        if self.mismatches:
            raise frame.fail(
                "A recomputed tensor differs from the one saved in the forward:\n"
                + "\n".join(self.mismatches)
                + "\nThe checkpointed function must be deterministic in the shapes, dtypes and"
                " devices it produces; guard branches with ckptwrap.is_recomputing() or pass"
                " determinism_check='none'."
            )
        if not stopped and not self.extra_allowed and self.count != len(frame.holders):
            raise frame.fail(
                f"The forward saved {len(frame.holders)} tensors for backward but the "
                f"recomputation saved {self.count}. The checkpointed function must run the same "
                f"operations when it is recomputed; guard side-effecting branches with "
                f"ckptwrap.is_recomputing() or pass determinism_check='none'."
            )


def _identity(value: torch.Tensor) -> torch.Tensor:
    return value


_TASK, _GROUP, _ONCE = "task", "group", "once"


def _current_gid() -> Tuple[Any, str]:
    """The key under which recomputed values are kept, and what kind of key it is.

    A backward call (graph task) recomputes each region at most once; a GraphExecGroup
    shares one recomputation among its backward calls; an unpack outside any backward
    (reading ``grad_fn._saved_*`` by hand) recomputes just for itself.
    """
    group = _torch_private.graph_exec_group()
    if group is not None:
        return group, _GROUP
    task = _torch_private.graph_task_id()
    if task == -1:
        return object(), _ONCE
    return task, _TASK


def _recompute(frame: _Frame, gid: Any) -> None:
    # The inputs first, outside the lock: restoring them may recompute an enclosing region.
    try:
        args, kwargs = frame.inputs.restore()
    except RuntimeError as error:
        if not is_version_error(error):
            raise
        # Autograd's version check on the inputs kept: its words name neither the region
        # nor checkpointing.
        raise input_changed_error(frame.region, frame.inputs.changed, error) from error
    _rerun(frame, gid, args, kwargs)
    frame.recomputed.add(gid)


def _rerun(frame: _Frame, gid: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Run the region again from its restored inputs, filling its holders for ``gid``."""
    run = _Recomputation(frame, gid)
    stopped = False
    with _ahead.recomputation_lock():
        try:
            with saved_tensors_hooks(run.pack, _identity), torch.enable_grad(), _state.recomputing():
                frame.replay(args, kwargs)
        except _StopRecomputation as stop:
            if stop.run is not run:
                raise
            stopped = True
    run.verify(stopped)


def _make_hooks(frame: _Frame, observer: Optional[_state.Watch]) -> saved_tensors_hooks:
    holders, metas, checked = frame.holders, frame.metas, frame.checked

    def pack(tensor: torch.Tensor) -> _Holder:
        holder = _Holder()
        holders.append(weakref.ref(holder))
        if checked:
            metas.append(_meta(tensor))
        if observer is not None:
            observer.saved(tensor)
        return holder

    def unpack(holder: _Holder) -> torch.Tensor:
        gid, kind = _current_gid()
        if gid not in frame.recomputed:
            if frame.jobs and _ahead.take(frame, gid):
                frame.recomputed.add(gid)  # the job's callback drops what is left over
            else:
                _recompute(frame, gid)
                if kind is _TASK:
                    # Values recomputed but never unpacked (a partial backward with
                    # retain_graph=True) must not outlive the backward call.
                    frame_ref = weakref.ref(frame)
                    _torch_private.queue_callback(lambda: _forget(frame_ref, gid))  # type: ignore[misc]
            if kind is _TASK and frame.ahead is not None:
                before = frame.ahead()
                if before is not None:
                    _ahead.schedule(before, gid, _rerun)
        try:
            value = holder.values.pop(gid)
        except KeyError:
            raise frame.fail(
                "A tensor saved in a checkpointed region was unpacked twice in one backward call, "
                "or the recomputation never produced it. Read ctx.saved_tensors once per backward "
                "in custom autograd Functions, and make the checkpointed function deterministic."
            ) from None
        if kind is _ONCE:
            frame.forget(gid)
        return value

    return saved_tensors_hooks(pack, unpack)


def _forget(frame_ref: "weakref.ref[_Frame]", gid: Any) -> None:
    frame = frame_ref()
    if frame is not None:
        frame.forget(gid)


def run_checkpointed(
    fn: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    *,
    preserve_rng_state: bool,
    context_fn: Optional[Callable[[], Tuple[ContextManager, ContextManager]]],
    check: bool,
    debug: bool,
    early_stop: bool,
) -> Any:
    """Run ``fn(*args, **kwargs)`` so that its saved tensors are recomputed in backward."""
    observer = _state.saved_observer()
    inputs = _SavedInputs(args, kwargs)
    devices = inputs.devices
    cuda_was_ready = torch.cuda.is_initialized()
    state = _device.capture_device_state(devices, preserve_rng_state=preserve_rng_state)
    if observer is not None and observer.kept is not None and state.cpu_rng is not None:
        observer.kept(state.cpu_rng)

    forward_ctx: ContextManager = contextlib.nullcontext()
    recompute_ctx: ContextManager = contextlib.nullcontext()
    if context_fn is not None:
        forward_ctx, recompute_ctx = _contexts_from(context_fn)
    recorders = (OpRecorder(), OpRecorder()) if debug else None
    forward_log, recompute_log = recorders or (contextlib.nullcontext(), contextlib.nullcontext())

    def replay(replay_args: Tuple[Any, ...], replay_kwargs: Dict[str, Any]) -> None:
        with _device.replayed(state), recompute_ctx, recompute_log:
            fn(*replay_args, **replay_kwargs)

    frame = _Frame(
        replay, fn, inputs, early_stop=early_stop, checked=check, debug=recorders
    )
    frame.ahead = _state.link_ahead(frame)
    completed = False
    with contextlib.ExitStack() as stack:
        stack.enter_context(_state.in_region())
        stack.enter_context(_make_hooks(frame, observer))
        if observer is not None:  # regions entered inside this one report to no one
            stack.enter_context(_state.observe_saved(None))
        stack.enter_context(forward_ctx)
        stack.enter_context(forward_log)
        output = fn(*args, **kwargs)
        completed = True
    inputs.forward_done()
    if not completed:
        raise CheckpointError(
            "The forward context returned by context_fn suppressed an exception raised inside "
            "the checkpointed function, so there is no output to return. Let the exception "
            "propagate from that context manager."
        )
    frame.forward_done = True
    if preserve_rng_state and not cuda_was_ready and torch.cuda.is_initialized():
        raise CheckpointError(
            "CUDA was initialized for the first time inside a checkpointed region, so its RNG "
            "state could not be saved for the recomputation. Move the region's inputs to the "
            "device before calling it (or call torch.cuda.init() first), or pass "
            "preserve_rng_state=False if the region draws no random numbers on the GPU."
        )
    return output


def _contexts_from(
    context_fn: Callable[[], Tuple[ContextManager, ContextManager]],
) -> Tuple[ContextManager, ContextManager]:
    pair = context_fn()
    if not (
        isinstance(pair, tuple)
        and len(pair) == 2
        and all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in pair)
    ):
        raise CheckpointConfigError(
            f"context_fn must return a tuple of two context managers (one for the forward, "
            f"one for the recomputation), got {pair!r}."
        )
    return pair

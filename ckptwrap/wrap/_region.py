"""Running a module's forward as a checkpointed region, and the off switch for every
decorated and wrapped region (``disabled()``), for evaluation and debugging.

Modules with running statistics (BatchNorm, InstanceNorm with tracking) update them in
place during their forward; a recomputation would update them a second time. Their
statistics are put back after each recomputation, so a training step leaves them exactly
as the un-checkpointed step does.

Other buffers a forward changes in place (spectral normalisation's ``u`` and ``v``, which
its power iteration advances and the weight depends on; a step counter) are replayed: the
region's small buffers are copied before its forward, those the forward changed are kept,
and each recomputation runs from them and then puts back what the buffers held before it,
so it computes what the forward computed and the step changes each buffer once. A changed
buffer too large to copy is refused at the recomputation, naming it.

State a forward keeps in plain attributes is replayed the same way: a tensor attribute
(or one that is None) of the region's modules that the forward assigns anew (a causal
video convolution's ``self.prev_features``, the frames it pads the next chunk with) is
set back to what the forward found while the recomputation runs, then to what it holds
now. Without that the recomputation would pad with the frames of the last chunk, not of
the one before it, and compute other tensors than the forward saved. The attribute's
value from before the forward is kept until the region's backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, ContextManager, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .. import _torch_private
from .._compiling import outside_graph
from .._errors import CheckpointConfigError
from ..engine import checkpoint, is_recomputing, recompute_ahead
from ._clients import on_cache_copies
from ._distributed import check_reentrant_region
from ._offload import default_offloader
from ..engine import CheckpointOptions

__all__ = [
    "disabled",
    "is_disabled",
    "region_switched_off",
    "RngSnapshot",
    "run_unswitched_region",
    "run_offloaded",
    "run_region",
    "run_segment",
]

_STAT_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def run_region(
    owner: Any,
    call: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    options: CheckpointOptions,
) -> Any:
    """Call ``call(*args, **kwargs)`` checkpointed with the engine ``options``, unless
    autograd or ckptwrap is off; ``owner`` is the module whose forward ``call`` is, or None
    for a plain function."""
    if region_switched_off():
        return call(*args, **kwargs)
    return run_unswitched_region(owner, call, args, kwargs, options)


def run_unswitched_region(
    owner: Any, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
    options: CheckpointOptions,
) -> Any:
    """:func:`run_region` whether or not ckptwrap's regions are switched off
    (:func:`ckptwrap.disabled`): how a step the planner measures runs its regions, which
    are the planner's, not the model's marks."""
    compiling = torch.compiler.is_compiling()
    if options.use_reentrant and not compiling:
        check_reentrant_region(owner)
    if isinstance(owner, torch.nn.Module) and not compiling:
        # compiled code recomputes from its graph, never by calling back here
        call = _KeepStats(owner, call)
    call, args, kwargs = on_cache_copies(owner, call, args, kwargs)
    if options.use_reentrant and kwargs:
        # The re-entrant engine takes positional arguments only; handing it the keyword
        # arguments as one dict keeps their tensors in autograd (it flattens containers).
        return checkpoint(functools.partial(_keywords_first, call), kwargs, *args, **options.checkpoint_kwargs())
    if options.recompute_ahead and not compiling:
        with recompute_ahead():
            return checkpoint(call, *args, **options.checkpoint_kwargs(), **kwargs)
    return checkpoint(call, *args, **options.checkpoint_kwargs(), **kwargs)


def run_segment(
    owners: Sequence[torch.nn.Module],
    calls: Sequence[Callable[[Any], Any]],
    value: torch.Tensor,
    options: CheckpointOptions,
) -> Tuple[Tuple[Any, ...], List["RngSnapshot"]]:
    """Run ``calls`` one after another from ``value`` as one checkpointed region (a
    segment, as ``checkpoint_sequential`` makes).

    Only the first input is kept for backward; every output between is rebuilt when
    backward reaches the segment. The caller checks that regions are on
    (:func:`region_switched_off`) and that the engine is the non-re-entrant one.

    Returns:
        Every call's output, and the random number generators' state after each call.
        The generators are left as they were after the first call: the model's forward
        has not reached the others yet.
    """
    states: List[RngSnapshot] = []

    def segment(value: Any) -> Tuple[Any, ...]:
        outputs = []
        for call in calls:
            value = call(value)
            outputs.append(value)
            if not is_recomputing():
                states.append(RngSnapshot.take(value))
        return tuple(outputs)

    with recompute_ahead(options.recompute_ahead):
        outputs = checkpoint(_KeepStats(tuple(owners), segment), value, **options.checkpoint_kwargs())
    states[0].restore()
    return outputs, states


class RngSnapshot(NamedTuple):
    """The CPU generator's state and, for an accelerator tensor, its device's."""

    cpu: torch.Tensor
    device: Optional[torch.device]
    state: Optional[torch.Tensor]

    @classmethod
    def take(cls, value: Any) -> "RngSnapshot":
        device = value.device if isinstance(value, torch.Tensor) else None
        if device is None or device.type in ("cpu", "meta"):
            return cls(torch.get_rng_state(), None, None)
        module = torch.get_device_module(device.type)
        return cls(torch.get_rng_state(), device, module.get_rng_state(device))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.get_device_module(self.device.type).set_rng_state(self.state, self.device)

    def is_current(self) -> bool:
        """Whether the generators are in this state now."""
        if not torch.equal(torch.get_rng_state(), self.cpu):
            return False
        if self.device is None:
            return True
        current = torch.get_device_module(self.device.type).get_rng_state(self.device)
        return torch.equal(current, self.state)


def region_switched_off() -> bool:
    """Whether a region would run plainly now: autograd is off, or ckptwrap is (``disabled()``)."""
    if not torch.is_grad_enabled():
        return True
    return _disabled_when_compiled() if torch.compiler.is_compiling() else is_disabled()


_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptwrap_disabled", default=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run every ``@checkpointed`` function and wrapped module without checkpointing.

    Context-local like the engine's own settings; direct calls of ``checkpoint`` are not
    affected.

    Example:
        >>> with ckptwrap.disabled():
        ...     loss = model(batch).loss   # keeps activations, no recomputation
    """
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def is_disabled() -> bool:
    """Whether marked regions currently run without checkpointing."""
    return _DISABLED.get()


@torch.compiler.assume_constant_result
def _disabled_when_compiled() -> bool:
    # The compiler cannot trace a ContextVar; it calls this once, while compiling, and
    # builds the switch's value into the graph.
    return is_disabled()


def run_offloaded(
    owner: torch.nn.Module, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """Call ``call`` keeping the tensors it saves for backward in host memory.

    Nothing is recomputed. On CUDA (and accelerators with streams) saved tensors go to
    pinned host buffers on a side stream and come back ahead of the region's backward
    (see ``_offload``); on the CPU this moves nothing and only marks the region. Under
    ``torch.compile`` it is refused with a :class:`CheckpointConfigError`.
    """
    if region_switched_off():
        return call(*args, **kwargs)
    if torch.compiler.is_compiling():
        _refuse_compiled(owner)
    with default_offloader().region(owner):
        return call(*args, **kwargs)


_OFFLOAD_COMPILED = (
    "the offload tier cannot run under torch.compile: its copies to host memory are "
    "saved-tensor hooks with side streams, which the compiler does not trace. Compile the "
    "model without ';offload' (the compiler's own activation_memory_budget recomputes "
    "instead), or run the offloaded model eagerly."
)


def _refuse(owner: torch.nn.Module) -> None:
    raise CheckpointConfigError(f"{type(owner).__name__}: {_OFFLOAD_COMPILED}")


# Raised eagerly, outside the graph; under fullgraph=True the compiler reports the reason.
_refuse_compiled = outside_graph(_refuse, _OFFLOAD_COMPILED)


def _keywords_first(call: Callable[..., Any], kwargs: Dict[str, Any], *args: Any) -> Any:
    """``call`` taking its keyword arguments as a leading dict."""
    return call(*args, **kwargs)


class _KeepStats:
    """``call`` (one call of a region: made afresh for each) that leaves running
    statistics untouched when it runs as a recomputation, and replays the buffers its
    first run changed in place (see the module's docstring)."""

    __slots__ = ("owner", "call", "_changed", "_reassigned")

    def __init__(
        self, owner: Union[torch.nn.Module, Tuple[torch.nn.Module, ...]], call: Callable[..., Any]
    ) -> None:
        self.owner = owner
        self.call = call
        self._changed: Optional[List[_Buffer]] = None
        self._reassigned: List[_Attribute] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owners = self.owner if isinstance(self.owner, tuple) else (self.owner,)
        if self._changed is None:  # the first run: the forward (or inside an enclosing recomputation)
            before, attributes = _state_before(owners)
            out = self._run(owners, args, kwargs)
            self._changed = [entry for entry in before if entry.tensor._version != entry.version]
            self._reassigned = [
                (sub, name, value) for sub, name, value in attributes if sub.__dict__.get(name, _GONE) is not value
            ]
            return out
        with _replayed(self._changed), _attributes_replayed(self._reassigned):
            return self._run(owners, args, kwargs)

    def _run(self, owners: Tuple[torch.nn.Module, ...], args: Any, kwargs: Dict[str, Any]) -> Any:
        if not is_recomputing():
            return self.call(*args, **kwargs)
        with _statistics_restored(owners):
            return self.call(*args, **kwargs)


_COPIED_BYTES = 1 << 16
"""Buffers up to this size are copied before a region's forward, in case it changes them."""


class _Buffer(NamedTuple):
    """A buffer of a region as its forward found it."""

    where: Tuple[torch.nn.Module, str, torch.nn.Module, str]
    """(region's module, submodule's name in it, submodule, buffer's name): for errors."""
    tensor: torch.Tensor
    version: int
    copy: Optional[torch.Tensor]
    """Its value, if small enough to copy."""


def _label(where: Tuple[torch.nn.Module, str, torch.nn.Module, str]) -> str:
    owner, prefix, sub, name = where
    return f"{(prefix + '.' + name) if prefix else name!r} of {type(owner).__name__} ({type(sub).__name__})"


_GONE = object()
"""An attribute's value where the module no longer has it."""

_Attribute = Tuple[torch.nn.Module, str, Any]
"""(module, attribute's name, its value)."""


def _state_before(modules: Tuple[torch.nn.Module, ...]) -> Tuple[List[_Buffer], List[_Attribute]]:
    """What a forward of these modules may change, in one walk over their submodules:
    every buffer but running statistics (kept by ``_statistics_restored``), copied where
    small; and every public plain attribute that holds a tensor or None (state the
    forward may assign anew)."""
    found: List[_Buffer] = []
    attributes: List[_Attribute] = []
    seen, walked = set(), set()
    for module in modules:
        for prefix, sub in module.named_modules():
            if id(sub) not in walked:
                walked.add(id(sub))
                attributes.extend(
                    (sub, name, value) for name, value in sub.__dict__.items()
                    if not name.startswith("_") and (value is None or isinstance(value, torch.Tensor))
                )
            statistics = isinstance(sub, _torch_private.norm_classes)
            for name, buffer in sub._buffers.items():
                if buffer is None or id(buffer) in seen or (statistics and name in _STAT_NAMES):
                    continue
                seen.add(id(buffer))
                try:
                    version = buffer._version
                except RuntimeError:  # an inference tensor: it cannot change in a training forward
                    continue
                found.append(_Buffer((module, prefix, sub, name), buffer, version, None))
    if not found:
        return found, attributes
    # Outside any dispatch mode of the forward (selective checkpointing's, a meter's).
    with _torch_private.disable_current_modes(), torch.no_grad():
        return [
            entry._replace(copy=entry.tensor.detach().clone())
            if entry.tensor.numel() * entry.tensor.element_size() <= _COPIED_BYTES else entry
            for entry in found
        ], attributes


@contextlib.contextmanager
def _attributes_replayed(reassigned: List[_Attribute]) -> Iterator[None]:
    """Attributes the forward assigned anew, as the forward found them while a
    recomputation runs; as they are now once it ends."""
    if not reassigned:
        yield
        return
    now = [(sub, name, sub.__dict__.get(name, _GONE)) for sub, name, _ in reassigned]
    for sub, name, value in reassigned:
        sub.__dict__[name] = value
    try:
        yield
    finally:
        for sub, name, value in now:
            if value is _GONE:
                sub.__dict__.pop(name, None)
            else:
                sub.__dict__[name] = value


@contextlib.contextmanager
def _replayed(changed: List[_Buffer]) -> Iterator[None]:
    """Buffers as they were before the region's forward while a recomputation runs; as
    they are now once it ends."""
    if not changed:
        yield
        return
    large = [entry.where for entry in changed if entry.copy is None]
    if large:
        raise CheckpointConfigError(
            f"the buffer {_label(large[0])} was changed in place by a checkpointed forward and is too "
            f"large (over {_COPIED_BYTES} bytes) to keep for the recomputation, which would compute from "
            f"its new value; keep this module out of the policy, or change the buffer outside the forward."
        )
    with _kept([entry.tensor for entry in changed]):
        with _torch_private.disable_current_modes(), torch.no_grad():
            for entry in changed:
                entry.tensor.data.copy_(entry.copy)
        yield


def _statistics_restored(modules: Tuple[torch.nn.Module, ...]) -> ContextManager[None]:
    return _kept([
        buffer
        for sub in (sub for module in modules for sub in module.modules())
        if isinstance(sub, _torch_private.norm_classes) and sub.training and sub.track_running_stats
        for buffer in (getattr(sub, name, None) for name in _STAT_NAMES)
        if isinstance(buffer, torch.Tensor)
    ])


@contextlib.contextmanager
def _kept(buffers: List[torch.Tensor]) -> Iterator[None]:
    """Put ``buffers`` back as they are now when the block ends."""
    if not buffers:
        yield
        return
    # Outside any dispatch mode of the recomputation (selective checkpointing replays only
    # the operators its forward recorded, and these copies are not among them).
    with _torch_private.disable_current_modes():
        saved = [(buffer, buffer.detach().clone()) for buffer in buffers]
    try:
        yield
    finally:
        # Through .data, so the version counter does not move: the recomputed graph may
        # have saved these buffers, and autograd would take the restore for a mutation.
        with _torch_private.disable_current_modes(), torch.no_grad():
            for buffer, value in saved:
                buffer.data.copy_(value)

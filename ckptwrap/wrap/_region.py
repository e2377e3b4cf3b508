"""Running a module's forward as a checkpointed region.

Modules with running statistics (BatchNorm, InstanceNorm with tracking) update them in
place during their forward; a recomputation would update them a second time. Their
statistics are put back after each recomputation, so a training step leaves them exactly
as the un-checkpointed step does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .. import _torch_private
from .._compiling import outside_graph
from .._errors import CheckpointConfigError
from ..engine import checkpoint, is_recomputing
from ._clients import without_cache_writes
from ._distributed import check_reentrant_region
from ._offload import default_offloader
from ..engine import CheckpointOptions
from ._switch import is_disabled

__all__ = ["RngSnapshot", "run_region", "run_segment", "region_switched_off"]

_STAT_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def run_region(
    owner: Any,
    call: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    options: CheckpointOptions,
) -> Any:
    """Call ``call(*args, **kwargs)`` checkpointed, unless autograd or ckptwrap is off.

    Args:
        owner: The module whose forward ``call`` is, or None for a plain function.
        call: What to run.
        args: Positional arguments.
        kwargs: Keyword arguments.
        options: Engine options.
    """
    compiling = torch.compiler.is_compiling()
    if _switched_off(compiling):
        return call(*args, **kwargs)
    if options.use_reentrant and not compiling:
        check_reentrant_region(owner)
    if isinstance(owner, torch.nn.Module):
        args, kwargs = without_cache_writes(owner, args, kwargs)
        if not compiling:  # compiled code recomputes from its graph, never by calling back here
            call = _KeepStats(owner, call)
    if options.use_reentrant and kwargs:
        # The re-entrant engine takes positional arguments only; handing it the keyword
        # arguments as one dict keeps their tensors in autograd (it flattens containers).
        return checkpoint(_KeywordsFirst(call), kwargs, *args, **options.as_kwargs())
    return checkpoint(call, *args, **options.as_kwargs(), **kwargs)


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

    outputs = checkpoint(_KeepStats(tuple(owners), segment), value, **options.as_kwargs())
    states[0].restore()
    return outputs, states


class RngSnapshot:
    """The CPU generator's state and, for an accelerator tensor, its device's."""

    __slots__ = ("cpu", "device", "state")

    def __init__(self, cpu: torch.Tensor, device: Optional[torch.device], state: Optional[torch.Tensor]) -> None:
        self.cpu, self.device, self.state = cpu, device, state

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
    """Whether a region would run plainly now (autograd or ckptwrap off)."""
    return _switched_off(torch.compiler.is_compiling())


def _switched_off(compiling: bool) -> bool:
    """Autograd is off, or ckptwrap is (``disabled()``): run regions plainly."""
    if not torch.is_grad_enabled():
        return True
    return _disabled_when_compiled() if compiling else is_disabled()


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
    compiling = torch.compiler.is_compiling()
    if _switched_off(compiling):
        return call(*args, **kwargs)
    if compiling:
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


class _KeywordsFirst:
    """``call`` taking its keyword arguments as a leading dict."""

    __slots__ = ("call",)

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call

    def __call__(self, kwargs: Dict[str, Any], *args: Any) -> Any:
        return self.call(*args, **kwargs)


class _KeepStats:
    """``call`` that leaves running statistics untouched when it runs as a recomputation."""

    __slots__ = ("owner", "call")

    def __init__(
        self, owner: Union[torch.nn.Module, Tuple[torch.nn.Module, ...]], call: Callable[..., Any]
    ) -> None:
        self.owner = owner
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_recomputing():
            return self.call(*args, **kwargs)
        owners = self.owner if isinstance(self.owner, tuple) else (self.owner,)
        with _statistics_restored(owners):
            return self.call(*args, **kwargs)


@contextlib.contextmanager
def _statistics_restored(modules: Tuple[torch.nn.Module, ...]) -> Iterator[None]:
    saved: List[Tuple[torch.Tensor, torch.Tensor]] = []
    # Outside any dispatch mode of the recomputation (selective checkpointing replays only
    # the operators its forward recorded, and these copies are not among them).
    with _torch_private.disable_current_modes():
        for sub in (sub for module in modules for sub in module.modules()):
            if isinstance(sub, _torch_private.norm_classes) and sub.training and sub.track_running_stats:
                for name in _STAT_NAMES:
                    buffer = getattr(sub, name, None)
                    if isinstance(buffer, torch.Tensor):
                        saved.append((buffer, buffer.detach().clone()))
    try:
        yield
    finally:
        # Through .data, so the version counter does not move: the recomputed graph may
        # have saved these buffers, and autograd would take the restore for a mutation.
        with _torch_private.disable_current_modes(), torch.no_grad():
            for buffer, value in saved:
                buffer.data.copy_(value)

"""Running a module's forward as a checkpointed region.

Modules with running statistics (BatchNorm, InstanceNorm with tracking) update them in
place during their forward; a recomputation would update them a second time. Their
statistics are put back after each recomputation, so a training step leaves them exactly
as the un-checkpointed step does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import _disable_current_modes

from ..engine import checkpoint, is_recomputing
from ._clients import without_cache_writes
from ._distributed import check_reentrant_region
from ._options import CheckpointOptions
from ._switch import is_disabled

__all__ = ["run_region"]

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
    """Call ``call`` keeping the tensors it saves for backward in CPU memory.

    Nothing is recomputed; saved tensors of CUDA regions go to pinned host memory and come
    back in backward. On the CPU this moves nothing and only marks the region.
    """
    if _switched_off(torch.compiler.is_compiling()):
        return call(*args, **kwargs)
    # Pinned host memory speeds copies from CUDA and needs CUDA; whether CUDA is in use is
    # one flag read, where asking the module would walk its parameters on every call.
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_initialized()):
        return call(*args, **kwargs)


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

    def __init__(self, owner: torch.nn.Module, call: Callable[..., Any]) -> None:
        self.owner = owner
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_recomputing():
            return self.call(*args, **kwargs)
        with _statistics_restored(self.owner):
            return self.call(*args, **kwargs)


@contextlib.contextmanager
def _statistics_restored(module: torch.nn.Module) -> Iterator[None]:
    saved: List[Tuple[torch.Tensor, torch.Tensor]] = []
    # Outside any dispatch mode of the recomputation (selective checkpointing replays only
    # the operators its forward recorded, and these copies are not among them).
    with _disable_current_modes():
        for sub in module.modules():
            if isinstance(sub, _NormBase) and sub.training and sub.track_running_stats:
                for name in _STAT_NAMES:
                    buffer = getattr(sub, name, None)
                    if isinstance(buffer, torch.Tensor):
                        saved.append((buffer, buffer.detach().clone()))
    try:
        yield
    finally:
        # Through .data, so the version counter does not move: the recomputed graph may
        # have saved these buffers, and autograd would take the restore for a mutation.
        with _disable_current_modes(), torch.no_grad():
            for buffer, value in saved:
                buffer.data.copy_(value)

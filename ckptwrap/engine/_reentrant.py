"""The re-entrant engine: an autograd Function that runs the region without a graph and
runs it again, with a graph, inside its own backward.

Two things differ from torch's re-entrant variant. Tensors nested in lists, dicts,
dataclasses or any pytree-registered type, in the arguments and in the output, are
flattened into the Function's inputs and outputs, so they take part in autograd. And
when no input requires grad, an anchor input that does is added, so that parameters
used inside the region still receive their gradients (the frozen-embedding trap); the
outputs require grad exactly when the region touched a tensor that does.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from .._errors import CheckpointError
from . import _device, _state, _tree

__all__ = ["run_reentrant"]

_TENSOR = object()  # marks where a tensor goes among the non-tensor leaves of a structure


def _split(leaves: List[Any]) -> Tuple[List[torch.Tensor], List[Any]]:
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    rest = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return tensors, rest


def _merge(tensors: Tuple[torch.Tensor, ...], rest: List[Any]) -> List[Any]:
    supply = iter(tensors)
    return [next(supply) if leaf is _TENSOR else leaf for leaf in rest]


class _Region:
    """What the backward needs to rerun one region; filled in by the forward."""

    __slots__ = (
        "fn", "original_args", "arg_spec", "arg_leaves", "state", "out_spec", "out_leaves", "has_anchor"
    )

    def __init__(self, fn: Callable[..., Any], arg_leaves: List[Any], arg_spec: Any) -> None:
        self.fn = fn
        self.original_args: Tuple[Any, ...] = ()
        self.arg_leaves = arg_leaves  # non-tensor leaves, _TENSOR where a tensor goes
        self.arg_spec = arg_spec
        self.state: Optional[_device.DeviceState] = None
        self.out_spec: Any = None
        self.out_leaves: List[Any] = []  # same, for the output
        self.has_anchor = False

    def call(self, tensors: Tuple[torch.Tensor, ...]) -> Any:
        return self.fn(*_tree.unflatten(_merge(tensors, self.arg_leaves), self.arg_spec))


class _ReentrantRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, region: _Region, preserve_rng_state: bool, *tensors: torch.Tensor):  # type: ignore[override]
        inputs = tensors[:-1] if region.has_anchor else tensors
        region.state = _device.capture_device_state(
            _device.devices_of(inputs), preserve_rng_state=preserve_rng_state
        )
        ctx.region = region
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        # The forward gets the caller's own objects, so side effects on containers passed
        # in (auxiliary-loss lists, caches) reach the caller; only recomputation rebuilds them.
        args, region.original_args = region.original_args, ()
        with torch.no_grad():
            if region.has_anchor:
                with _GradUseDetector() as detector:
                    output = region.fn(*args)
                uses_grad = detector.found
            else:
                output = region.fn(*args)
                uses_grad = True
        leaves, region.out_spec = _tree.flatten(output)
        out_tensors, region.out_leaves = _split(leaves)
        ctx.mark_non_differentiable(
            *[
                t
                for t in out_tensors
                if not uses_grad or not (t.is_floating_point() or t.is_complex())
            ]
        )
        return tuple(out_tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        if not torch.autograd._is_checkpoint_valid():
            raise CheckpointError(
                "A region checkpointed with use_reentrant=True was reached by "
                "torch.autograd.grad() or by .backward(inputs=...), which that variant cannot "
                "serve. Call .backward() without `inputs`, or checkpoint with "
                "use_reentrant=False, which supports both."
            )
        region: _Region = ctx.region
        saved = ctx.saved_tensors
        detached = tuple(t.detach().requires_grad_(t.requires_grad) for t in saved)
        with _device.replayed(region.state), torch.enable_grad(), _state.recomputing():
            output = region.call(detached)
        out_tensors = [t for t in _tree.tensor_leaves(output)]
        if len(out_tensors) != len(grads):
            raise CheckpointError(
                f"The recomputation returned {len(out_tensors)} tensors but the forward returned "
                f"{len(grads)}. The checkpointed function must return the same structure when "
                f"it is recomputed."
            )
        pairs = [
            (out, grad)
            for out, grad in zip(out_tensors, grads)
            if grad is not None and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        input_grads = tuple(t.grad if t.requires_grad else None for t in detached)
        anchor_grad = (None,) if region.has_anchor else ()
        return (None, None) + input_grads + anchor_grad


class _GradUseDetector(TorchFunctionMode):
    """Notices whether any torch call in the region touches a tensor that requires grad.

    Only runs when no input requires grad, so the cost falls on the rare first region
    behind a frozen embedding, not on every region.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.found and not _is_inert(func):
            self.found = _any_requires_grad(args) or _any_requires_grad(kwargs.values())
        return func(*args, **kwargs)


_INERT = (torch.Tensor.detach, torch.Tensor.detach_, torch.Tensor.requires_grad_)


def _is_inert(func: Any) -> bool:
    """Calls that touch a tensor without making anything depend on it differentiably:
    detaching it, or reading an attribute such as ``.shape`` or ``.data``."""
    return func in _INERT or getattr(func, "__name__", "") == "__get__"


def _any_requires_grad(values: Any) -> bool:
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple)) and _any_requires_grad(value):
            return True
    return False


def run_reentrant(fn: Callable[..., Any], args: Tuple[Any, ...], *, preserve_rng_state: bool) -> Any:
    """Run ``fn(*args)`` through the re-entrant Function and rebuild its output structure."""
    leaves, spec = _tree.flatten(args)
    tensors, rest = _split(leaves)
    region = _Region(fn, rest, spec)
    region.original_args = args
    if not any(t.requires_grad for t in tensors):
        # The region may still use parameters that require grad; an anchor input that
        # requires grad lets their gradients flow. If the forward touches none, the
        # outputs are marked non-differentiable, as they would be without checkpointing.
        region.has_anchor = True
        tensors.append(torch.empty((), requires_grad=True))
    out_tensors = _ReentrantRegion.apply(region, preserve_rng_state, *tensors)
    return _tree.unflatten(_merge(out_tensors, region.out_leaves), region.out_spec)

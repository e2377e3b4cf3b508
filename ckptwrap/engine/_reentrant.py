"""The re-entrant engine: an autograd Function that runs the region keeping no
activations and runs it again, keeping them, inside its own backward.

Two things differ from torch's re-entrant variant. Tensors nested in lists, dicts,
dataclasses or any pytree-registered type, in the arguments and in the output, are
flattened into the Function's inputs and outputs, so they take part in autograd. And
when no input requires grad, an anchor input that does is added, so that parameters
used inside the region still receive their gradients (the frozen-embedding trap). The
forward runs with autograd on but keeps no saved tensors, so each output requires grad
exactly when it does in the plain run. A region whose forward changes an input in place
is refused at its backward, named, before the recomputation would start from the
changed input.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch.autograd.graph import saved_tensors_hooks

from .. import _torch_private
from .._errors import CheckpointError, input_changed_error, is_version_error
from . import _device, _state, _tree
from ._nonreentrant import changed_input, input_versions

__all__ = ["graph_nodes", "reaches_reentrant", "run_reentrant"]


class _Region:
    """What the backward needs to rerun one region; filled in by the forward."""

    __slots__ = (
        "fn", "original_args", "arg_spec", "arg_leaves", "state", "out_spec", "out_leaves", "has_anchor",
        "changed",
    )

    def __init__(self, fn: Callable[..., Any], args: Tuple[Any, ...], arg_leaves: List[Any], arg_spec: Any) -> None:
        self.fn = fn
        self.original_args = args
        self.arg_leaves = arg_leaves  # the other leaves, a marker where a tensor goes (_tree)
        self.arg_spec = arg_spec
        self.state: Optional[_device.DeviceState] = None
        self.out_spec: Any = None
        self.out_leaves: List[Any] = []  # same, for the output
        self.has_anchor = False
        self.changed: Optional[str] = None  # an input the forward changed in place, described


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
        versions = input_versions(list(inputs))
        # Autograd on, as in the plain run and the recomputation, so that autograd itself
        # says which outputs depend on a tensor that requires grad (inputs, parameters,
        # anything reached inside). The hooks drop every tensor the graph would save, so
        # the forward keeps no activations; the graph is cut from the outputs below.
        with torch.enable_grad(), saved_tensors_hooks(_drop, _dropped):
            output = region.fn(*args)
        region.changed = changed_input(versions)
        leaves, region.out_spec = _tree.flatten(output)
        out_tensors, region.out_leaves = _tree.split_tensors(leaves)
        constant = [not t.requires_grad for t in out_tensors]
        returned = _cut_from_graph(out_tensors, inputs)
        ctx.mark_non_differentiable(*[t for t, c in zip(returned, constant) if c])
        return tuple(returned)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        if not _torch_private.is_checkpoint_valid():
            raise CheckpointError(
                "A region checkpointed with use_reentrant=True was reached by "
                "torch.autograd.grad() or by .backward(inputs=...), which that variant cannot "
                "serve. Call .backward() without `inputs`, or checkpoint with "
                "use_reentrant=False, which supports both."
            )
        region: _Region = ctx.region
        if region.changed is not None:
            # The recomputation would start from the changed input (and change it again,
            # or fail on the detached copy, a leaf, in words that name neither).
            raise input_changed_error(region.fn, region.changed)
        try:
            saved = ctx.saved_tensors
        except RuntimeError as error:  # autograd's version check: changed after the forward
            if not is_version_error(error):
                raise
            raise input_changed_error(region.fn, None, error) from error
        detached = tuple(t.detach().requires_grad_(t.requires_grad) for t in saved)
        with _device.replayed(region.state), torch.enable_grad(), _state.recomputing():
            output = region.fn(*_tree.unflatten(_tree.merge_tensors(detached, region.arg_leaves), region.arg_spec))
        out_tensors = _tree.tensor_leaves(output)
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


def _drop(tensor: torch.Tensor) -> None:
    """Keeps nothing of a tensor the forward's graph would save."""
    return None


def _dropped(_: None) -> torch.Tensor:
    raise CheckpointError(
        "Backward reached a tensor computed in the forward of a region checkpointed with "
        "use_reentrant=True other than through the region's outputs. That forward keeps no "
        "activations, so only what the region returns can be differentiated; a tensor that "
        "leaves it another way (appended to a list, stored on a module) or a backward run "
        "inside the region cannot. Return the tensor from the region, detach it, or "
        "checkpoint with use_reentrant=False."
    )


def _cut_from_graph(
    out_tensors: List[torch.Tensor], inputs: Tuple[torch.Tensor, ...]
) -> List[torch.Tensor]:
    """The outputs to hand to autograd: inputs as they are, everything else without the
    graph the forward built (the Function's own node takes its place)."""
    input_ids = {id(t) for t in inputs}
    done: dict = {}
    returned = []
    for tensor in out_tensors:
        key = id(tensor)
        if key not in done:
            if key in input_ids or (tensor.grad_fn is None and not tensor.requires_grad):
                done[key] = tensor
            elif tensor.grad_fn is not None and not _torch_private.tensor_is_view(tensor):
                # In place, so a reference the region kept elsewhere (a cache) stays the
                # very object returned, as in a forward run without autograd.
                done[key] = tensor.detach_()
            else:
                done[key] = tensor.detach()  # a view, or a leaf such as a parameter
        returned.append(done[key])
    return returned


def run_reentrant(fn: Callable[..., Any], args: Tuple[Any, ...], *, preserve_rng_state: bool) -> Any:
    """Run ``fn(*args)`` through the re-entrant Function and rebuild its output structure."""
    leaves, spec = _tree.flatten(args)
    tensors, rest = _tree.split_tensors(leaves)
    region = _Region(fn, args, rest, spec)
    if not any(t.requires_grad for t in tensors):
        # The region may still use parameters that require grad; an anchor input that
        # requires grad lets their gradients flow. Outputs that depend on none of them
        # are still marked non-differentiable by the forward.
        region.has_anchor = True
        tensors.append(torch.empty((), requires_grad=True))
    out_tensors = _ReentrantRegion.apply(region, preserve_rng_state, *tensors)
    return _tree.unflatten(_tree.merge_tensors(out_tensors, region.out_leaves), region.out_spec)


def graph_nodes(roots: Sequence[torch.Tensor]) -> Iterator[Any]:
    """Every autograd node a backward from ``roots`` can reach, each once."""
    seen: set = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def reaches_reentrant(roots: Sequence[torch.Tensor]) -> bool:
    """Whether backward from ``roots`` would pass through a re-entrant region (this
    engine's, or ``torch.utils.checkpoint``'s with ``use_reentrant=True``), which only a
    full ``.backward()`` can serve: ``torch.autograd.grad`` there is an error."""
    kinds = (_ReentrantRegion, getattr(torch.utils.checkpoint, "CheckpointFunction", _ReentrantRegion))
    return any(getattr(type(node), "_forward_cls", None) in kinds for node in graph_nodes(roots))

"""The two training steps the doctor compares, one checkpointed and one plain, each on its
own deep copy of the model under the same seed, and what it observes in each region's
calls during the checkpointed one."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..engine import flatten, is_recomputing, tensor_leaves, unflatten
from ..wrap import disabled
from ._regions import Region

__all__ = [
    "CallLog",
    "Observer",
    "StepResult",
    "copy_model",
    "default_loss",
    "recording_calls",
    "run_step",
]

LossFn = Callable[[Any], torch.Tensor]

_SEED = 0


@dataclasses.dataclass
class CallLog:
    """What the calls of one region looked like during the checkpointed step."""

    calls: int = 0
    """Calls of any kind: forward, recomputation, with autograd on or off."""
    grad_calls: int = 0
    """Calls with autograd on outside any recomputation: the forward's checkpointed calls."""
    calls_without_grad_input: int = 0
    """Of those, calls in which no tensor input required grad."""
    keyword_tensors: Set[str] = dataclasses.field(default_factory=set)
    """Names of keyword arguments that carried tensors, in calls with autograd on."""
    draws_random: bool = False
    """Whether a call changed the RNG state: its forward draws random numbers."""


@dataclasses.dataclass
class StepResult:
    """The outcome of one training step."""

    loss: torch.Tensor
    grads: Dict[str, Optional[torch.Tensor]]
    """Gradient of each parameter, by qualified name; None where it got none."""
    input_grads: Dict[str, Optional[torch.Tensor]]
    """Gradient of each example input that requires grad, by a readable label."""


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy to run a step on, so the caller's model, gradients and state stay as they are."""
    try:
        return copy.deepcopy(model)
    except Exception as error:  # whatever the model's attributes raise when copied
        raise CheckpointConfigError(
            f"doctor runs its two steps on deep copies of the model, so that yours is left "
            f"untouched, but copy.deepcopy({type(model).__name__}) failed: "
            f"{type(error).__name__}: {error}. Make the model deep-copyable (keep "
            f"non-copyable handles such as open files or process groups out of it)."
        ) from error


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when the output has one, a scalar output itself, else a fixed random
    weighting of every floating-point output that requires grad.

    Random weights rather than a plain sum: a sum of softmax probabilities or normalized
    features is constant and would give zero gradients, which compare equal trivially.
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad:
        return loss
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.requires_grad:
        return output
    leaves = [
        t for t in tensor_leaves(output)
        if t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]
    if not leaves:
        raise CheckpointConfigError(
            f"the model's output ({type(output).__name__}) holds no floating-point tensor "
            f"that requires grad, so there is nothing to take gradients of; pass "
            f"loss_fn=lambda output: ... returning a scalar loss."
        )
    generator = torch.Generator().manual_seed(_SEED)
    total = torch.zeros((), dtype=leaves[0].real.dtype, device=leaves[0].device)
    for tensor in leaves:
        weights = torch.randn(tensor.shape, generator=generator).to(tensor.device, tensor.dtype)
        total = total + (tensor * weights).sum().real.to(total.device)
    return total


def run_step(
    model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], loss_fn: LossFn, *, plain: bool
) -> StepResult:
    """One forward and backward of ``model`` on fresh copies of the inputs, seeded.

    Args:
        model: The copy to train; its gradients are left in place.
        args: Positional example inputs.
        kwargs: Keyword example inputs.
        loss_fn: Turns the output into a scalar.
        plain: Run with every marked region switched off (``ckptwrap.disabled()``).
    """
    (args, kwargs), inputs = _fresh_inputs((args, kwargs))
    switch = disabled() if plain else contextlib.nullcontext()
    with _seeded(model), torch.enable_grad(), switch:
        output = model(*args, **kwargs)
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise CheckpointConfigError(
                f"loss_fn must return a one-element tensor that requires grad, got "
                f"{_describe(loss)}."
            )
        loss.backward()
    grads = {name: _detached(p.grad) for name, p in model.named_parameters()}
    input_grads = {label: _detached(t.grad) for label, t in inputs}
    return StepResult(loss.detach(), grads, input_grads)


@contextlib.contextmanager
def recording_calls(model: nn.Module) -> Iterator[Set[str]]:
    """The qualified names of the modules of ``model`` called inside the block, filled in
    as they are called: containers that are never called (``ModuleList``, ``ModuleDict``)
    and modules the forward goes around stay out. Forward hooks, removed on exit."""
    called: Set[str] = set()
    handles = [
        module.register_forward_hook(lambda module, args, output, name=name: called.add(name))
        for name, module in model.named_modules(remove_duplicate=False)
    ]
    try:
        yield called
    finally:
        for handle in handles:
            handle.remove()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
    return type(value).__name__


def _detached(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if grad is None else grad.detach()


def _fresh_inputs(value: Any) -> Tuple[Any, List[Tuple[str, torch.Tensor]]]:
    """Copies of every tensor in ``value`` (a model that changes its inputs in place must
    not change the other step's), and the copies that require grad, labelled."""
    leaves, spec = flatten(value)
    needing: List[Tuple[str, torch.Tensor]] = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            fresh = leaf.detach().clone().requires_grad_(leaf.requires_grad)
            leaves[index] = fresh
            if fresh.requires_grad:
                needing.append((f"example input #{len(needing)}", fresh))
    return unflatten(leaves, spec), needing


@contextlib.contextmanager
def _seeded(model: nn.Module) -> Iterator[None]:
    """The same seed for both steps, on the CPU and the model's accelerator; the caller's
    RNG state is put back afterwards."""
    accelerators = {
        t.device for t in [*model.parameters(), *model.buffers()] if t.device.type not in ("cpu", "meta")
    }
    kind = next(iter(accelerators)).type if accelerators else "cuda"
    indices = [d.index or 0 for d in accelerators if d.type == kind]
    with torch.random.fork_rng(devices=indices, device_type=kind):
        torch.manual_seed(_SEED)
        yield


class Observer:
    """Forward hooks on the regions of the checkpointed copy that fill in a ``CallLog`` each.

    Use as a context manager; the hooks are removed on exit.
    """

    def __init__(self, model: nn.Module, regions: List[Region]) -> None:
        modules = dict(model.named_modules())
        self.logs: Dict[str, CallLog] = {region.name: CallLog() for region in regions}
        self._targets = [(region.name, modules[region.name]) for region in regions]
        self._rng_before: Dict[str, List[Tuple[torch.Tensor, ...]]] = {}
        self._handles: List[Any] = []
        self._devices = sorted(
            {t.device.type for t in model.parameters() if t.device.type not in ("cpu", "meta")}
        )

    def __enter__(self) -> "Observer":
        for name, module in self._targets:
            self._handles.append(
                module.register_forward_pre_hook(self._pre(name), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post(name), with_kwargs=True, always_call=True)
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            log = self.logs[name]
            log.calls += 1
            self._rng_before.setdefault(name, []).append(self._rng_state())
            if not torch.is_grad_enabled() or is_recomputing():
                return None
            log.grad_calls += 1
            if not any(t.requires_grad for t in tensor_leaves((args, kwargs))):
                log.calls_without_grad_input += 1
            log.keyword_tensors.update(
                key for key, value in kwargs.items() if tensor_leaves(value)
            )
            return None

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            stack = self._rng_before.get(name)
            if not stack:
                return None
            before = stack.pop()
            # A recomputation replays the RNG state and so changes it by design.
            if not is_recomputing() and not _same(before, self._rng_state()):
                self.logs[name].draws_random = True
            return None

        return hook

    def _rng_state(self) -> Tuple[torch.Tensor, ...]:
        states = [torch.get_rng_state()]
        for kind in self._devices:
            device_module = torch.get_device_module(kind)
            if hasattr(device_module, "get_rng_state"):
                states.append(device_module.get_rng_state())
        return tuple(states)


def _same(first: Tuple[torch.Tensor, ...], second: Tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second))

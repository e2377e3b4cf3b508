"""What a device holds besides one training step, for budgets in a device's terms
(``budget:total=SIZE``, ``budget:device``): the parameters, buffers and gradients, and
the optimizer's state and step's temporaries, measured from two steps of it over fake
stand-ins of the model's parameters.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .. import _torch_private
from .._errors import CheckpointConfigError
from .._warn import warn
from ..measure import (
    RealWhereItCan,
    StorageCounter,
    device_rates,
    outside_fake,
    tensor_storages,
    tensors,
    unreal,
)
from ._peak_model import format_bytes

__all__ = [
    "DEVICE_MARGIN",
    "DeviceMemory",
    "DeviceTerms",
    "OPTIMIZERS",
    "OptimizerSpec",
    "StepBudget",
    "optimizer_spec",
]


OPTIMIZERS: Dict[str, str] = {
    "adamw": "AdamW",
    "adam": "Adam",
    "sgd": "SGD",
    "sgd-momentum": "SGD",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
}
"""Optimizers that can be named (``optimizer="adamw"``): ``torch.optim`` classes, with
their defaults (``sgd-momentum``: SGD with momentum 0.9)."""


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as plain data: its class and, per parameter group, the positions of its
    parameters among ``model.parameters()`` and its hyperparameters."""

    kind: type
    groups: Tuple[Tuple[Tuple[int, ...], Tuple[Tuple[str, Any], ...]], ...]
    defaults: Tuple[Tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.kind.__name__


def optimizer_spec(model: nn.Module, optimizer: Any) -> Optional[OptimizerSpec]:
    """``optimizer`` (None, a name of :data:`OPTIMIZERS`, or a ``torch.optim.Optimizer``
    over ``model``'s parameters) as an :class:`OptimizerSpec`. Parameters of the
    optimizer's that are not the model's are not counted.

    Raises:
        CheckpointConfigError: Anything else, or an optimizer none of whose parameters
            is the model's.
    """
    if optimizer is None:
        return None
    params = list(model.parameters())
    if isinstance(optimizer, str):
        name = optimizer.strip().lower()
        kind = getattr(torch.optim, OPTIMIZERS.get(name, ""), None)
        if kind is None:
            raise CheckpointConfigError(
                f"optimizer={optimizer!r} is not an optimizer ckptwrap knows by name; name one "
                f"of {', '.join(OPTIMIZERS)}, or pass the optimizer itself."
            )
        trainable = tuple(i for i, p in enumerate(params) if p.requires_grad)
        hyper = (("momentum", 0.9),) if name == "sgd-momentum" else ()
        return OptimizerSpec(kind, ((trainable, hyper),))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointConfigError(
            f"optimizer must be a torch.optim.Optimizer over the model's parameters or a name "
            f"({', '.join(OPTIMIZERS)}), got {type(optimizer).__name__}."
        )
    index = {id(p): i for i, p in enumerate(params)}
    groups = []
    for group in optimizer.param_groups:
        positions = tuple(index[id(p)] for p in group["params"] if id(p) in index)
        hyper = tuple((key, value) for key, value in group.items() if key != "params")
        groups.append((positions, hyper))
    if not any(positions for positions, _ in groups):
        raise CheckpointConfigError(
            f"the {type(optimizer).__name__} given as optimizer holds none of "
            f"{type(model).__name__}'s parameters: pass the optimizer that trains this model."
        )
    return OptimizerSpec(type(optimizer), tuple(groups), tuple(optimizer.defaults.items()))


def optimizer_costs(model: nn.Module, spec: OptimizerSpec, accelerator: bool) -> Tuple[int, int]:
    """(state, step temporaries) of ``spec``'s optimizer over stand-ins of ``model``'s
    parameters on fake tensors: the state its first step leaves, and the peak of its
    second step beyond it. On an accelerator the multi-tensor (foreach) implementation
    torch picks there is asked for where the optimizer leaves it to torch."""
    fake = _torch_private.fake_tensor
    if fake is None:
        raise CheckpointConfigError(
            "counting the optimizer's state needs fake tensors (torch 2.1 or later); write the "
            "budget as budget:SIZE of the training step instead."
        )
    params = list(model.parameters())
    with fake.outside():
        mode = fake.mode_class()
        mode.allow_non_fake_inputs = True  # the step counters are real (tiny, made for real)
        with mode:
            stand_ins = [_stand_in(p) for p in params]
        groups = _groups(spec, stand_ins, accelerator)
        counters = []
        optimizer = None
        try:
            for _ in range(2):
                counter = StorageCounter("cpu")
                with mode, RealWhereItCan(fake), counter:
                    # Some optimizers make their state when made (Adagrad), most at the first step.
                    if optimizer is None:
                        optimizer = _build(spec, groups)
                    optimizer.step()
                counters.append(counter)
        except CheckpointConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - said with the optimizer, then raised on
            raise _refused(f"{spec.name} could not step on fake tensors", error) from error
        # The second step's counter sees only what that step creates: the state is there.
        return counters[0].live_bytes, counters[1].peak_bytes


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    local = param.to_local() if hasattr(param, "to_local") else param
    made = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="cpu")
    stand_in = nn.Parameter(made, requires_grad=param.requires_grad)
    if param.requires_grad:
        stand_in.grad = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="cpu")
    return stand_in


def _build(spec: OptimizerSpec, groups: Any) -> torch.optim.Optimizer:
    try:
        return spec.kind(groups, **dict(spec.defaults))
    except TypeError:
        pass
    try:
        return spec.kind(groups)
    except Exception as error:  # noqa: BLE001 - said with the optimizer, then raised on
        raise _refused(f"ckptwrap could not make a {spec.name} over stand-ins of the parameters", error) from error


def _refused(what: str, error: Exception) -> CheckpointConfigError:
    return CheckpointConfigError(
        f"{what} to count its state ({type(error).__name__}: {error}); write the budget as "
        f"budget:SIZE of the training step instead."
    )


def _groups(spec: OptimizerSpec, stand_ins: List[torch.Tensor], accelerator: bool) -> List[Dict[str, Any]]:
    """``spec``'s parameter groups over the stand-ins; on an accelerator, the multi-tensor
    implementation where the optimizer has one and leaves the choice to torch."""
    groups = []
    for positions, hyper in spec.groups:
        group: Dict[str, Any] = dict(hyper)
        group["params"] = [stand_ins[i] for i in positions]
        if accelerator and group.get("foreach") is None and not group.get("fused"):
            try:
                options: Mapping[str, Any] = inspect.signature(spec.kind).parameters
            except (TypeError, ValueError):
                options = {}
            if "foreach" in options:
                group["foreach"] = True
        groups.append(group)
    return groups


DEVICE_MARGIN = 0.05
"""The share of a device's memory ``budget:device`` leaves free: the caching allocator's
fragmentation, and what other code on the device allocates meanwhile."""

@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """A device's memory, and what the model holds in it besides one training step.

    Attributes:
        total: What the device has for the model, bytes (None where only the parts are
            asked for).
        parameters: Bytes of the model's parameters on it.
        buffers: Bytes of its buffers.
        gradients: Bytes of the gradients of its trainable parameters, held from the end
            of the backward through the optimizer's step.
        optimizer_state: Bytes of the optimizer's state once it has stepped.
        optimizer_step: Bytes the optimizer's step allocates beyond its state (its
            temporaries), at its peak.
        optimizer: The optimizer's class name; None where none was given (nothing counted).
        source: Where ``total`` came from, for the plan's table.
        inputs: Bytes of the planned step's inputs on the device (the batch, made before
            the step and held through it).
        held_gradients: Bytes of gradients held from before the step: with gradient
            accumulation, every micro-step after the first starts with them.
    """

    total: Optional[int]
    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    optimizer_step: int
    optimizer: Optional[str]
    source: str
    inputs: int = 0
    held_gradients: int = 0

    @property
    def held(self) -> int:
        """Bytes held through every training step: parameters, buffers, optimizer state."""
        return self.parameters + self.buffers + self.optimizer_state

    @property
    def optimizer_peak(self) -> int:
        """The device's peak in the optimizer's step: what is held, the batch (a loop keeps
        it to the end of the iteration), the gradients and the step's temporaries."""
        return self.held + self.inputs + self.gradients + self.optimizer_step

    def whole_peak(self, step_peak: int) -> int:
        """The device's peak over a training iteration whose step peaks at ``step_peak``
        (above what is held, its inputs and the gradients it starts with).

        With gradients held from before the step, this is a bound: the step's own peak
        counts the parameter gradients its backward has made by then, which a step that
        accumulates into held ones does not allocate again."""
        return max(self.held + self.inputs + self.held_gradients + step_peak, self.optimizer_peak)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class StepBudget(int):
    """A step's budget in bytes read from a device's (:class:`DeviceMemory`): its total less
    what is held, the inputs and the gradients held at the step's start, at least 0."""

    memory: DeviceMemory

    def __new__(cls, memory: DeviceMemory) -> "StepBudget":
        taken = memory.held + memory.inputs + memory.held_gradients
        self = super().__new__(cls, max(0, int(memory.total or 0) - taken))
        self.memory = memory
        return self

    def describe_parts(self) -> str:
        """The budget as a sum, for messages."""
        m = self.memory
        parts = [f"parameters {format_bytes(m.parameters)}", f"buffers {format_bytes(m.buffers)}"]
        parts.append(
            f"{m.optimizer} state {format_bytes(m.optimizer_state)}" if m.optimizer else "no optimizer state (none given)"
        )
        if m.inputs:
            parts.append(f"the step's inputs {format_bytes(m.inputs)}")
        if m.held_gradients:
            parts.append(f"gradients held from earlier steps {format_bytes(m.held_gradients)}")
        # In bytes too: it is compared with a peak in messages, where rounded units alone
        # could show two that differ as equal.
        return f"{m.source} less {', '.join(parts)} leaves {format_bytes(int(self))} ({int(self)} bytes) for the step"

    def __reduce__(self) -> Tuple[object, ...]:
        return (StepBudget, (self.memory,))


def device_memory(
    model: nn.Module,
    device: torch.device,
    spec: Optional[OptimizerSpec],
    *,
    total: Optional[int] = None,
    written: str = "",
    from_device: bool = False,
    fake_step: bool = False,
    rates: Any = None,
) -> DeviceMemory:
    """The :class:`DeviceMemory` of ``model`` training on ``device`` with the optimizer
    ``spec``: a whole device of ``total`` bytes, or with ``from_device`` the memory the
    device has for it now (its free memory, what the allocator caches unused and what the
    model holds there already, less :data:`DEVICE_MARGIN` of the device; for a step on
    fake tensors, ``rates``' device's memory less the margin).

    Raises:
        CheckpointConfigError: ``from_device`` where the device's memory cannot be read;
            an optimizer that does not step on fake tensors.
    """
    parameters = _bytes(model.parameters())
    buffers = _bytes(model.buffers())
    gradients = _bytes(p for p in model.parameters() if p.requires_grad)
    accelerator = device.type not in ("cpu", "meta")
    if from_device:
        if fake_step:
            total, source = _rated_memory(rates, device)
        else:
            total, source = _free_memory(model, device)
    else:
        source = written or "the parts alone"
    if fake_step and rates is not None:
        accelerator = device_rates(device, rates).name != "cpu"
    state, step = optimizer_costs(model, spec, accelerator) if spec is not None else (0, 0)
    return DeviceMemory(
        total=total, parameters=parameters, buffers=buffers, gradients=gradients,
        optimizer_state=state, optimizer_step=step,
        optimizer=spec.name if spec is not None else None, source=source,
    )


class DeviceTerms:
    """A planner's budget in a device's terms (``budget:total=SIZE``, ``budget:device``)
    and what its model holds on the device, read at the first plan (also for an
    optimizer given beside another budget, for the plan's table). Plain data between calls."""

    def __init__(self, settings: Any) -> None:
        # What of the settings it reads (not the settings: their loss function may not pickle).
        self.budget, self.optimizer = settings.budget, settings.optimizer
        self.rates, self.fake = settings.rates, settings.fake
        self.accumulation = settings.accumulation
        self._memory: Optional[DeviceMemory] = None
        self.held_gradients = 0
        self.inputs = 0
        """Bytes of the inputs of the step being planned, on its device."""
        self._said = False

    @property
    def memory(self) -> Optional[DeviceMemory]:
        """The device's memory as read at the first plan, with the inputs of the step
        being planned and the gradients it starts with."""
        memory = self._memory
        if memory is None or (memory.inputs, memory.held_gradients) == (self.inputs, self.held_gradients):
            return memory
        return dataclasses.replace(memory, inputs=self.inputs, held_gradients=self.held_gradients)

    @property
    def in_terms(self) -> bool:
        """Whether the budget is a device's memory."""
        return self.budget is not None and self.budget.scope != "step"

    def before_step(
        self, model: nn.Module, device: torch.device, fresh: Callable[[], bool], args: Any = (), kwargs: Any = None
    ) -> None:
        """Before a training forward on these inputs: the memory read once; the gradients
        the step starts with (accumulation) and its inputs read each time."""
        if self.in_terms:
            self._read(model, device, fake_step=False)
            self.held_gradients = 0 if fresh() else sum(grad.numel() * grad.element_size() for grad in _grads(model))
            self.inputs = input_bytes(args, kwargs or {}, device)

    def before_example(self, model: nn.Module, device: torch.device, args: Any, kwargs: Any) -> None:
        """Before planning given inputs (from fresh gradients)."""
        if self.in_terms or self.optimizer is not None:
            fake_step = self.fake or unreal(model, args, kwargs) is not None
            self._read(model, device, fake_step=fake_step)
            # Accumulating, every micro-step after the first starts with the gradients.
            self.held_gradients = self._memory.gradients if self.accumulation > 1 else 0
            self.inputs = input_bytes(args, kwargs, device)

    def step_budget(self) -> "StepBudget":
        """What a training step may allocate beside its inputs and the gradients it
        starts with."""
        assert self.memory is not None and self.memory.total is not None, "read at the first plan"
        return StepBudget(self.memory)

    def check_optimizer(self, model: nn.Module, *, strict: bool) -> None:
        """The optimizer's step needs the gradients and its temporaries beside what is
        held, whatever the plan: past the device, an error with ``strict``, else said once."""
        memory = self.memory
        if not self.in_terms or memory is None or memory.total is None or memory.optimizer_peak <= memory.total:
            return
        message = (
            f"{self.budget.describe()}: {type(model).__name__}'s optimizer step alone needs "
            f"{format_bytes(memory.optimizer_peak)} (parameters, buffers, {memory.optimizer or 'no'} "
            f"optimizer state, the batch, gradients {format_bytes(memory.gradients)} and the step's temporaries "
            f"{format_bytes(memory.optimizer_step)}), more than {memory.source} ({format_bytes(memory.total)}), "
            f"whatever is checkpointed. Shard the model or its optimizer state (FSDP2), train "
            f"fewer parameters, or use a larger device."
        )
        if strict:
            error = CheckpointConfigError(message)
            error.needed = memory.optimizer_peak
            error.offered = memory.total
            raise error
        if not self._said:
            self._said = True
            warn(message)

    def _read(self, model: nn.Module, device: torch.device, *, fake_step: bool) -> None:
        """The device's memory, read once; said where a budget in a device's terms counts
        no optimizer."""
        if self._memory is not None:
            return
        budget = self.budget
        scope = budget.scope if budget is not None else "step"
        with outside_fake():
            memory = device_memory(
                model, device, self.optimizer,
                total=budget.parsed()[1] if scope == "total" else None,
                written=budget.describe() if budget is not None else "",
                from_device=scope == "device", fake_step=fake_step, rates=self.rates,
            )
        if self.optimizer is None and scope != "step":
            warn(
                f"{budget.describe()} counts the parameters, buffers and gradients of "
                f"{type(model).__name__}, but no optimizer state: pass optimizer= (the optimizer, "
                f"or a name such as 'adamw') to wrap_model or plan so that its state and step count too."
            )
        self._memory = memory


def input_bytes(args: Any, kwargs: Any, device: torch.device) -> int:
    """Bytes of the distinct storages of the tensors among a forward's inputs that lie on
    ``device`` (of its type: a meta model's inputs count as the device they stand for)."""
    found = [t for t in tensors((args, kwargs)) if t.device.type in (device.type, "meta")]
    return _bytes(found)


def _bytes(found: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind these tensors (a DTensor's local shard)."""
    seen = set()
    total = 0
    for tensor in found:
        for storage in tensor_storages(tensor):
            key = storage._cdata
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _rated_memory(rates: Any, device: torch.device) -> Tuple[int, str]:
    named = device_rates(device, rates) if rates is not None else None
    if named is None or named.memory_bytes is None:
        raise CheckpointConfigError(
            "budget:device reads the memory of the device the model trains on, and this step "
            "runs on fake tensors: name the device with device_rates= (such as "
            "device_rates='h100-sxm', whose memory is known), or write its memory as "
            "budget:total=80GiB."
        )
    usable = int(named.memory_bytes * (1 - DEVICE_MARGIN))
    return usable, f"{named.name}'s {format_bytes(named.memory_bytes)} less {DEVICE_MARGIN:.0%}"


def _free_memory(model: nn.Module, device: torch.device) -> Tuple[int, str]:
    module = getattr(torch, device.type, None)
    read = getattr(module, "mem_get_info", None)
    if device.type == "cpu" or read is None:
        raise CheckpointConfigError(
            f"budget:device reads the free memory of the device the model trains on, and "
            f"ckptwrap cannot read the free memory of a {device.type} device (the CPU's memory "
            f"is the host's, shared with everything else). Write the memory to use as budget:total=SIZE (the whole "
            f"iteration) or budget:SIZE (one training step)."
        )
    free, whole = read(device)
    cached = 0
    if hasattr(module, "memory_reserved") and hasattr(module, "memory_allocated"):
        cached = max(0, module.memory_reserved(device) - module.memory_allocated(device))
    present = _bytes(
        t for t in itertools.chain(model.parameters(), model.buffers(), _grads(model)) if t.device == device
    )
    usable = free + cached + present - int(whole * DEVICE_MARGIN)
    return max(0, usable), (
        f"{device}'s free memory ({format_bytes(free + cached)} now, with the model's "
        f"{format_bytes(present)}) less {DEVICE_MARGIN:.0%} of its {format_bytes(whole)}"
    )


def _grads(model: nn.Module) -> Iterable[torch.Tensor]:
    return (p.grad for p in model.parameters() if p.grad is not None)

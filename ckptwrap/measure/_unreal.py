"""Steps that allocate nothing real, and the rates they are timed at.

Where a step allocates (``step_device``), and steps that allocate nothing real: a
model on the meta device or made of fake tensors (``FakeTensorMode``), or any model asked
to, is measured from one step on fake tensors, whose storages have the sizes the device's
kernels give; real inputs stay real, and an operator that needs a tensor's values is
refused, named. Times are priced (``DeviceRates``).

What a device computes and moves per second: the rates at which a step run on fake
tensors (where no time means anything) is priced, from its operators' FLOPs and bytes.
Accelerators' dense peak rates come from a table; the CPU's are measured here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only

from .. import _torch_private
from .._errors import CheckpointConfigError
from ..engine import is_recomputing
from ._storages import tensor_storages, tensors
from ._costs import ModelProfile, ModuleCost, OpCost, op_flops

__all__ = [
    "DEVICE_RATES",
    "DeviceRates",
    "RealWhereItCan",
    "device_rates",
    "measure_unreal",
    "outside_fake",
    "step_device",
    "unreal",
]


_MOVED_PER_CREATED = 2
"""Bytes an operator moves per byte it creates: written once, read once."""


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """A device's arithmetic and memory rates, and its memory.

    Attributes:
        name: What the rates are of (``"h100-sxm"``, ``"cpu"``...).
        flops_per_second: Floating-point operations per second by dtype; a dtype not in it
            runs at the ``torch.float32`` rate.
        bytes_per_second: Memory bandwidth.
        memory_bytes: The device's memory, where known.
    """

    name: str
    flops_per_second: Mapping[torch.dtype, float]
    bytes_per_second: float
    memory_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        rates = dict(self.flops_per_second)
        if torch.float32 not in rates:
            raise CheckpointConfigError(
                f"DeviceRates {self.name!r}: flops_per_second needs a torch.float32 rate, "
                f"got rates for {sorted(str(dtype) for dtype in rates)}"
            )
        for dtype, rate in rates.items():
            if not isinstance(dtype, torch.dtype) or not rate > 0:
                raise CheckpointConfigError(
                    f"DeviceRates {self.name!r}: flops_per_second maps torch dtypes to rates "
                    f"above 0, got {dtype!r}: {rate!r}"
                )
        if not self.bytes_per_second > 0:
            raise CheckpointConfigError(
                f"DeviceRates {self.name!r}: bytes_per_second must be above 0, got {self.bytes_per_second!r}"
            )
        object.__setattr__(self, "flops_per_second", rates)

    def seconds(self, flops: int, created_bytes: int, dtype: torch.dtype) -> float:
        """What an operator (or a module's forward) of these FLOPs and created bytes takes."""
        rate = self.flops_per_second.get(dtype, self.flops_per_second[torch.float32])
        return flops / rate + _MOVED_PER_CREATED * created_bytes / self.bytes_per_second

    def __str__(self) -> str:
        return self.name


def _accelerator(name: str, fp32: float, half: float, bandwidth: float, memory_gib: int) -> DeviceRates:
    tera = 1e12
    return DeviceRates(
        name,
        {torch.float32: fp32 * tera, torch.bfloat16: half * tera, torch.float16: half * tera},
        bandwidth * tera,
        memory_gib << 30,
    )


DEVICE_RATES: Dict[str, DeviceRates] = {
    rates.name: rates
    for rates in (
        # name, FP32 TFLOP/s (no TF32), BF16/FP16 dense tensor TFLOP/s, TB/s, GiB
        _accelerator("h200", 67, 989, 4.8, 141),
        _accelerator("h100-sxm", 67, 989, 3.35, 80),
        _accelerator("h100-pcie", 51, 756, 2.0, 80),
        _accelerator("a100-80gb", 19.5, 312, 2.039, 80),
        _accelerator("a100-40gb", 19.5, 312, 1.555, 40),
        _accelerator("l40s", 91.6, 362, 0.864, 48),
        _accelerator("l4", 30.3, 121, 0.3, 24),
        _accelerator("a10g", 31.2, 70, 0.6, 24),
        _accelerator("rtx-4090", 82.6, 165, 1.008, 24),
        _accelerator("rtx-3090", 35.6, 71, 0.936, 24),
    )
}
"""Accelerators' dense peak rates and memory, by name (``device_rates`` also reads a GPU's
own name, "NVIDIA H100 80GB HBM3", to one of these)."""

_NAME_WORDS = (
    ("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100-sxm4-40gb", "a100-40gb"),
    ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100-80gb"), ("l40s", "l40s"), ("l4", "l4"),
    ("a10g", "a10g"), ("4090", "rtx-4090"), ("3090", "rtx-3090"),
)


def device_rates(device: torch.device, given: Any = None) -> DeviceRates:
    """The rates a step on ``device`` is priced at: ``given`` (a :class:`DeviceRates` or a
    name from :data:`DEVICE_RATES`, or ``"cpu"``), else the device's own: the CPU's
    measured here, or the table's entry for the accelerator present.

    Raises:
        CheckpointConfigError: ``given`` is neither, or no rates are known for ``device``.
    """
    if isinstance(given, DeviceRates):
        return given
    if isinstance(given, str):
        key = given.strip().lower()
        if key == "cpu":
            return cpu_rates()
        if key in DEVICE_RATES:
            return DEVICE_RATES[key]
        found = _by_device_name(key)
        if found is not None:
            return found
    if given is not None:
        raise CheckpointConfigError(
            f"device_rates must be a DeviceRates or one of {_names()}, got {given!r}"
        )
    if device.type in ("cpu", "meta"):
        return cpu_rates()
    module = getattr(torch, device.type, None)
    named = None
    if module is not None and getattr(module, "is_available", lambda: False)():
        try:
            named = _by_device_name(module.get_device_name(device).lower())
        except (AttributeError, RuntimeError, AssertionError):
            named = None
    if named is None:
        raise CheckpointConfigError(
            f"ckptwrap has no rates for {device} here to price a step on fake tensors; give "
            f"device_rates= one of {_names()} or a DeviceRates"
        )
    return named


def _by_device_name(name: str) -> Optional[DeviceRates]:
    for word, key in _NAME_WORDS:
        if word in name:
            return DEVICE_RATES[key]
    return None


def _names() -> str:
    return ", ".join(repr(name) for name in ("cpu", *DEVICE_RATES))


@functools.lru_cache(maxsize=1)
def cpu_rates() -> DeviceRates:
    """This CPU's rates at torch's thread count now: a matrix product per floating-point
    dtype and a copy, each the best of a few runs (about 0.1 s, once per process). Read
    outside any dispatch mode: first asked inside a step on fake tensors, it would time
    fake kernels, and keep that for every later plan."""
    size = 384
    flops = {}
    with _torch_private.disable_current_modes():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            flops[dtype] = 2 * size**3 / _best(lambda: torch.mm(a, b))
        source = torch.empty(1 << 21)  # 8 MiB: past the caches of most CPUs
        target = torch.empty_like(source)
        copy = _best(lambda: target.copy_(source))
    return DeviceRates("cpu", flops, 2 * source.numel() * source.element_size() / copy)


def _best(run: Any, repeats: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def priced(
    profile: ModelProfile, rates: DeviceRates, dtype: torch.dtype, *, step_time: Optional[float] = None
) -> ModelProfile:
    """``profile`` with its candidates' and operators' times priced at ``rates`` from
    their FLOPs and bytes: ``flops / flops_per_second[dtype] + 2 * bytes created /
    bytes_per_second`` (an output written once and read once at least), at dense peak
    rates, so a priced time is a lower bound, alike for every plan: the profile of a step
    that ran on fake tensors, whose measured times mean nothing. A selective recomputation
    is priced as the whole forward (an upper bound); the step's phases keep no seconds
    (nothing uses them to plan). ``step_time``: the priced step with nothing checkpointed."""

    def op(cost: OpCost) -> OpCost:
        return dataclasses.replace(cost, time=rates.seconds(cost.flops, cost.bytes, dtype))

    def module(cost: ModuleCost) -> ModuleCost:
        forward = rates.seconds(cost.flops, cost.created_bytes, dtype)
        return dataclasses.replace(
            cost,
            forward_time=forward,
            recompute_time=None if cost.recompute_time is None else forward,
            selective_overhead=0.0,
            ops=tuple(op(each) for each in cost.ops),
        )

    step = profile.step
    if step is not None:
        step = dataclasses.replace(step, seconds={key: 0.0 for key in step.seconds})
    return dataclasses.replace(
        profile, modules=tuple(module(cost) for cost in profile.modules), step=step, priced_at=rates.name,
        step_time=step_time,
    )


_VALUES = ".item(), a branch on a tensor's content, nonzero, a loss whose size follows its targets"


def unreal(model: nn.Module, args: Any, kwargs: Any, *, first_only: bool = False) -> Optional[str]:
    """What makes a step of ``model`` on these inputs allocate nothing real, if anything:
    a parameter, buffer or input on the meta device, or a fake tensor. With
    ``first_only`` (a check before every training forward), only the model's first
    parameter or buffer is looked at: a model is on the meta device or fake whole, and a
    real model does not run on meta or fake inputs."""
    own = itertools.chain(model.parameters(), model.buffers())
    found = itertools.islice(own, 1) if first_only else itertools.chain(tensors((args, kwargs)), own)
    for tensor in found:
        if tensor.device.type == "meta":
            return "it is on the meta device"
        if _fake_mode(tensor) is not None:
            return "it is made of fake tensors (FakeTensorMode)"
    return None


def outside_fake() -> Any:
    """A context in which no fake mode is active: the planner's own arithmetic, when
    ``plan`` is called inside the user's ``with FakeTensorMode():``."""
    fake = _torch_private.fake_tensor
    return contextlib.nullcontext() if fake is None else fake.outside()


def measure_unreal(
    measure: Callable[..., ModelProfile],
    model: nn.Module,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    why: str,
    rates: Any,
) -> ModelProfile:
    """``measure(model, args, kwargs)`` (one recorded step, untimed) run on fake tensors,
    its times priced at ``rates`` (see :func:`~ckptwrap.planner.device_rates`).

    Each meta (or real) parameter, buffer and meta input stands in as a fake tensor of its
    shape for that one step (on the CPU for a meta one; tied weights stay tied), and the
    model has its own back after. A fake operator gives the sizes, strides and dtypes its
    kernel gives, so what the recorder counts is what a real step allocates.

    Raises:
        CheckpointConfigError: This torch has no fake tensors; or the step needs a
            tensor's values, or failed on fake tensors (said with the operator or error).
    """
    fake = _torch_private.fake_tensor
    if fake is None:
        raise CheckpointConfigError(
            f"ckptwrap cannot measure {type(model).__name__}'s training step: {why}, and this "
            f"torch has no fake tensors to run it on (torch 2.1 or later has). Measure it on "
            f"the device it trains on, with real inputs."
        )
    with _on_fake_tensors(model, args, kwargs, fake) as (mode, fake_args, fake_kwargs):
        device = step_device(model, fake_args, fake_kwargs)
        rates_at = device_rates(device, rates)
        dtype = _step_dtype(model, device)
        counted = RealWhereItCan(fake, count=True)
        try:
            with mode, counted:
                profile = measure(model, fake_args, fake_kwargs)
        except CheckpointConfigError:
            raise
        except fake.data_dependent as error:
            operator = getattr(error, "func", None) or type(error).__name__
            raise CheckpointConfigError(
                f"{type(model).__name__}'s training step cannot run on fake tensors ({why}): "
                f"its forward or loss calls {operator}, whose result (or its shape) depends on "
                f"values a fake tensor does not have ({_VALUES}). Give real inputs (tensors "
                f"with values: they stay real, so code reading them runs), or measure on the "
                f"device it trains on."
            ) from None
        except Exception as error:  # noqa: BLE001 - said with what ran it, then raised on
            raise CheckpointConfigError(
                f"{type(model).__name__}'s training step failed on fake tensors ({why}): "
                f"{type(error).__name__}: {error}. {_where_it_failed(error)}"
            ) from error
    step_time = rates_at.seconds(counted.flops, counted.created_bytes, dtype)
    return priced(profile, rates_at, dtype, step_time=step_time)


def _where_it_failed(error: BaseException) -> str:
    """What to make of a step that failed on fake tensors, from where it was raised: in
    torch (an operator's fake kernel, which may differ from this device's) or in the
    model's own code (which fails alike on real tensors: its inputs or configuration)."""
    frames = traceback.extract_tb(error.__traceback__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    inner = next(
        (frame for frame in reversed(frames) if not os.path.abspath(frame.filename).startswith(ours)), None
    )
    if inner is None or os.path.abspath(inner.filename).startswith(torch_dir):
        return (
            "Where the same step runs on real tensors, an operator's fake kernel differs from this "
            "device's (one that accepts other dtypes here) and it cannot be planned so; measure on "
            "the device it trains on."
        )
    return (
        f"It was raised in the model's own code ({inner.filename}, line {inner.lineno}, in "
        f"{inner.name}), not by an operator: the same forward fails on real tensors. Check the "
        f"inputs and the configuration it reads there."
    )


@contextlib.contextmanager
def _on_fake_tensors(model: nn.Module, args: Any, kwargs: Any, fake: Any) -> Iterator[Tuple[Any, Any, Any]]:
    """The fake mode of the step and its inputs as fake tensors; meanwhile every meta or
    real parameter and buffer of ``model`` is a fake tensor of its own (put back after)."""
    found = map(_fake_mode, itertools.chain(tensors((args, kwargs)), model.parameters(), model.buffers()))
    mode = next((mode for mode in found if mode is not None), None)
    if mode is None:
        mode = fake.mode_class()
    # Real inputs stay real (their values decide a mask's shortcut, a check on the
    # labels), so the fake mode must take them beside its own tensors for the step.
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    made: Dict[int, torch.Tensor] = {}

    def as_fake(tensor: torch.Tensor) -> torch.Tensor:
        if _fake_mode(tensor) is not None:
            return tensor
        found = made.get(id(tensor))
        if found is None:
            found = _fake_of(tensor, mode)
            made[id(tensor)] = found
        return found

    _refuse_sharded_on_meta(model)
    swapped: List[Tuple[Dict[str, Any], str, Any]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, value in table.items():
                    if isinstance(value, torch.Tensor) and _fake_mode(value) is None:
                        swapped.append((table, name, value))
                        table[name] = as_fake(value)
        fake_args, fake_kwargs = tree_map_only(
            torch.Tensor, lambda t: as_fake(t) if t.device.type == "meta" else t, (args, kwargs)
        )
        yield mode, fake_args, fake_kwargs
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value
        mode.allow_non_fake_inputs = allowed


class RealWhereItCan(TorchDispatchMode):
    """Inside the fake mode: an operator none of whose inputs is fake (a check on the
    real labels, a mask's own arithmetic) runs for real, and so does a factory whose output
    is tiny (LayerDrop's ``torch.rand([])``), so that code that reads their values runs
    as in a real step; everything else stays fake. With ``count``, the FLOPs and bytes
    created of the fake operators outside recomputations are summed (``flops``,
    ``created_bytes``): the work of the step with nothing checkpointed."""

    def __init__(self, fake: Any, *, count: bool = False) -> None:
        super().__init__()
        self._outside = fake.outside
        self._count = count
        self.flops = 0
        self.created_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        given = tensors((args, kwargs))
        if any(_fake_mode(tensor) is not None for tensor in given):
            out = func(*args, **kwargs)
            if self._count and not is_recomputing():
                self.flops += op_flops(func, out, args, kwargs)
                self.created_bytes += _created(given, out)
            return out
        if not given:
            out = func(*args, **kwargs)
            if any(tensor.numel() > _TINY for tensor in tensors(out)):
                return out
        with self._outside():
            return func(*args, **kwargs)


def _created(given: List[torch.Tensor], out: Any) -> int:
    """Bytes of the storages ``out`` has that none of the inputs had (not views)."""
    had = {storage._cdata for tensor in given for storage in tensor_storages(tensor)}
    return sum(
        storage.nbytes() for tensor in tensors(out) for storage in tensor_storages(tensor) if storage._cdata not in had
    )


_TINY = 1 << 16
"""The most elements of a factory's output that is made for real inside a fake step."""


def _fake_of(tensor: torch.Tensor, mode: Any) -> torch.Tensor:
    """A fake stand-in for ``tensor``: of its device, or the CPU for a meta tensor."""
    if tensor.device.type != "meta":
        made = mode.from_tensor(tensor)
    else:
        with mode:
            made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(made, requires_grad=tensor.requires_grad)
    if tensor.requires_grad and made.is_leaf and not made.requires_grad:
        made.requires_grad_(True)
    return made


def _refuse_sharded_on_meta(model: nn.Module) -> None:
    """A parameter that wraps a shard (FSDP2's DTensor) on the meta device has no shard to
    stand in for: FSDP's first step would set itself up on stand-ins and keep them."""
    for name, param in model.named_parameters():
        if param.device.type == "meta" and is_traceable_wrapper_subclass(param):
            raise CheckpointConfigError(
                f"{type(model).__name__}'s parameter {name} is a {type(param).__name__} on the meta "
                f"device (sharded by FSDP2's fully_shard there): a step on stand-ins would run "
                f"FSDP's first-step setup on them and leave them in its state. To plan per rank, "
                f"build and shard the model under torch's FakeTensorMode, with a fake process "
                f"group of the world size (docs/capacity.md, 'Per rank under FSDP2')."
            )


def _fake_mode(tensor: torch.Tensor) -> Any:
    """The fake mode of ``tensor``, or of a wrapper subclass's inner tensors (a DTensor of
    a fake local shard: FSDP2 on a model made in ``FakeTensorMode``)."""
    fake = _torch_private.fake_tensor
    if fake is None:
        return None
    if isinstance(tensor, fake.tensor_class):
        return tensor.fake_mode
    if is_traceable_wrapper_subclass(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, name, None)
            if isinstance(inner, torch.Tensor):
                found = _fake_mode(inner)
                if found is not None:
                    return found
    return None


def step_device(model: nn.Module, args: Any, kwargs: Any) -> torch.device:
    """The device the step allocates on: that of the first accelerator tensor among the
    inputs, else the model's first parameter's (or buffer's), else the CPU."""
    for tensor in tensors((args, kwargs)):
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device if tensor.device.type != "meta" else torch.device("cpu")
    return torch.device("cpu")


def _step_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the step's arithmetic mostly runs in: autocast's where it is on, else the
    first floating-point parameter's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32

"""What a device computes and moves per second: the rates at which a step run on fake
tensors (where no time means anything) is priced, from its operators' FLOPs and bytes.
Accelerators' dense peak rates come from a table; the CPU's are measured here.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Dict, Mapping, Optional

import torch

from .. import _torch_private
from .._errors import CheckpointConfigError
from ._module_costs import ModelProfile, ModuleCost
from ._ops import OpCost

__all__ = ["DEVICE_RATES", "DeviceRates", "device_rates", "priced"]

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
    with _torch_private.disable_current_modes():
        return _timed_cpu_rates()


def _timed_cpu_rates() -> DeviceRates:
    size = 384
    flops = {}
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

"""What things cost: the peak-memory meter of a block of code and the storage bookkeeping
under it (``measure_peak``, ``StorageCounter``, ``SpanPeak``), and what a training step
costs module by module, as the budget planner reads it: the cost record (``OpCost``,
``ModuleCost``, ``ModelProfile``, ``StepPeaks``), a real step metered into one
(``StepRecorder``, ``measure_inputs``) and a step on fake tensors priced at a device's
rates (``unreal``, ``DEVICE_RATES``, ``DeviceRates``).

``measure_peak`` reads the allocator's peak statistics on CUDA and other accelerators,
and counts tensor storages as they are created and freed on the CPU (``StorageCounter``).
"""

from ._peak import PeakMemory, StorageCounter, measure_peak, ready_libraries
from ._span import SpanPeak
from ._storages import SavePolicy, tensor_storages, tensors
from ._costs import END, ModelProfile, ModuleCost, OpCost, StepPeaks, packet_name, region_bytes
from ._unreal import (
    DEVICE_RATES,
    DeviceRates,
    RealWhereItCan,
    device_rates,
    outside_fake,
    step_device,
    unreal,
)
from ._metering import (
    ProgressBar,
    RecomputePrices,
    StepRecorder,
    dispatch_cost,
    is_measuring,
    measure_inputs,
    recording_cost,
    resolve_targets,
    selective_cost,
    should_show,
)

__all__ = [
    "DEVICE_RATES",
    "DeviceRates",
    "END",
    "ModelProfile",
    "ModuleCost",
    "OpCost",
    "PeakMemory",
    "ProgressBar",
    "RealWhereItCan",
    "RecomputePrices",
    "SavePolicy",
    "SpanPeak",
    "StepPeaks",
    "StepRecorder",
    "StorageCounter",
    "device_rates",
    "dispatch_cost",
    "is_measuring",
    "measure_inputs",
    "measure_peak",
    "outside_fake",
    "packet_name",
    "ready_libraries",
    "recording_cost",
    "region_bytes",
    "resolve_targets",
    "selective_cost",
    "should_show",
    "step_device",
    "tensor_storages",
    "tensors",
    "unreal",
]

"""What things cost in memory: the peak-memory meter of a block of code, and the storage
bookkeeping the planner's profiler counts saved tensors with.

``measure_peak`` reads the allocator's peak statistics on CUDA and other accelerators,
and counts tensor storages as they are created and freed on the CPU (``StorageCounter``).
"""

from ._peak import PeakMemory, StorageCounter, measure_peak, outputs_of, ready_libraries
from ._span import SpanPeak, StepSpan
from ._storages import (
    SavePolicy,
    StorageMap,
    Tally,
    differentiable,
    policy_watch,
    saving,
    tensor_storages,
    tensors,
)

__all__ = [
    "PeakMemory",
    "SavePolicy",
    "SpanPeak",
    "StepSpan",
    "StorageCounter",
    "StorageMap",
    "Tally",
    "differentiable",
    "measure_peak",
    "outputs_of",
    "policy_watch",
    "ready_libraries",
    "saving",
    "tensor_storages",
    "tensors",
]

"""What things cost: per-module activation bytes, time and FLOPs, and the peak memory of a
training step.

``profile_modules`` measures candidate modules one at a time on the model's own inputs.
``measure_peak`` reads the allocator's peak statistics on CUDA and other accelerators,
and counts tensor storages as they are created and freed on the CPU.
"""

from ._peak import PeakMemory, measure_peak
from ._profile import ModelProfile, ModuleCost, profile_modules

__all__ = ["ModelProfile", "ModuleCost", "PeakMemory", "measure_peak", "profile_modules"]

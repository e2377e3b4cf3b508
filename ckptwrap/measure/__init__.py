"""What things cost: the peak memory of a training step.

``measure_peak`` reads the allocator's peak statistics on CUDA and other accelerators,
and counts tensor storages as they are created and freed on the CPU.
"""

from ._peak import PeakMemory, measure_peak

__all__ = ["PeakMemory", "measure_peak"]

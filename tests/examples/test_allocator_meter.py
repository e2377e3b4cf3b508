"""The allocator meter the benchmarks and the prediction tests read peaks with
(``benchmarks/_allocator.py``): what the device holds above the step's start."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _allocator import allocator_peak  # noqa: E402

_FLOATS = 1 << 16
_BYTES = 4 * _FLOATS


def test_a_step_peak_counts_what_the_step_allocates():
    def step() -> None:
        a = torch.ones(_FLOATS)
        b = torch.ones(_FLOATS)
        del a, b

    assert _BYTES * 2 <= allocator_peak(step) < _BYTES * 2 + 4096


def test_garbage_left_before_the_step_is_not_collected_halfway_through_it():
    """An unreachable object made before the step (an earlier test's, held in a reference
    cycle) is not collected while the step is read: a collection inside the step would
    lower its reading by bytes the step never held (it once read a budget step 14% below
    its true peak). The step allocates enough small objects to set the collector off."""

    def leave_garbage() -> None:  # under an earlier reading, so that the CPU reports its free
        cycle: list = [torch.ones(4 * _FLOATS)]
        cycle.append(cycle)

    allocator_peak(leave_garbage)

    def step() -> None:
        a = torch.ones(_FLOATS)
        churn = [[index] for index in range(50_000)]  # past every generation's threshold
        b = torch.ones(_FLOATS)
        del a, b, churn

    try:
        assert _BYTES * 2 <= allocator_peak(step) < _BYTES * 2 + 4096
    finally:
        gc.collect()


def test_a_block_found_and_freed_by_the_step_lowers_what_the_device_holds():
    """A step that lets go of memory it found (the previous step's outputs, replaced while
    it runs) holds that much less: the meter reads the device, not the step's own blocks.
    (The block is made under an earlier reading, as a loop's previous step is: the CPU's
    allocator reports a free only where a profiler saw the allocation.)"""
    held: list = []
    allocator_peak(lambda: held.append(torch.ones(4 * _FLOATS)))

    def step() -> None:
        a = torch.ones(_FLOATS)
        held.clear()
        b = torch.ones(_FLOATS)
        c = torch.ones(_FLOATS)
        del a, b, c

    assert _BYTES <= allocator_peak(step) < _BYTES + 4096

"""The allocator meter the benchmarks and the prediction tests read peaks with
(``benchmarks/_allocator.py``): only the step's own blocks count."""

from __future__ import annotations

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


def test_a_block_from_an_earlier_profiled_span_freed_in_the_step_does_not_lower_its_peak():
    """The allocator reports the free of any block an earlier profiled span saw allocated;
    such a block (an earlier test's object, collected halfway through a step) was never the
    step's, and subtracting it once read a budget step 14% below its true peak."""
    held = []
    allocator_peak(lambda: held.append(torch.ones(4 * _FLOATS)))

    def step() -> None:
        a = torch.ones(_FLOATS)
        held.clear()  # the earlier block goes while the step runs
        b = torch.ones(_FLOATS)
        del a, b

    assert _BYTES * 2 <= allocator_peak(step) < _BYTES * 2 + 4096

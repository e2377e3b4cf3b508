"""A step that runs over its budget because no plan reaches it at its shape is said on that
step: a ``UserWarning`` naming the shape, the budget and the peak, whether the step was
measured (under the plan of least memory) or solved, at a first-seen shape, at a shape met
again after others, and at shapes that never repeat. A shape in reach is never said of,
and a shape out of reach is said once while it stays.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ckptwrap

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _architectures import ARCHITECTURES, available  # noqa: E402
from _budget_loops import _forward, _inputs  # noqa: E402

MODELS = [name for name in ("gpt2", "llama", "bert", "t5", "whisper") if name in set(available())]


def _least_peak(model, arch, rows, length):
    """The predicted peak of the plan of least memory at this shape (every block)."""
    batch = _inputs(model, arch, (rows, length, 0, False))
    return ckptwrap.plan(copy.deepcopy(model), "blocks", example_kwargs=batch).predicted_peak


def _said(model, arch, rows, length, seed):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user sees: repeats of one line suppressed
        _forward(model, arch, (rows, length, seed, False), held=False)
    return [str(w.message) for w in caught if "budget:" in str(w.message)]


@pytest.mark.parametrize("name", MODELS)
def test_every_step_out_of_reach_is_said_on_that_step(name):
    arch = ARCHITECTURES[name]
    low, high = arch.lengths
    middle = (low + high) // 2
    model = arch.build()
    budget = _least_peak(model, arch, 2, middle)  # in reach up to about the middle length
    ckptwrap.wrap_model(model, f"blocks;budget:{budget}B")
    long, longer, longest = high - 2 * ((high - middle) // 3), high - (high - middle) // 3, high
    short = low
    # (length, said?): first seen over, the same again, in reach, met again after another,
    # three lengths that never repeat, in reach, and a length met again after those.
    steps = [(long, True), (long, False), (short, False), (long, True), (longer, True), (longest, True),
             (high - 1, True), (short, False), (longer, True)]
    for seed, (length, expected) in enumerate(steps):
        said = _said(model, arch, 2, length, seed)
        if expected:
            assert len(said) == 1, f"{name}, step {seed} at length {length}: {said}"
            assert f"{budget / 2**20:.1f} MiB" in said[0] and str(length) in said[0], said[0]
        else:
            assert not said, f"{name}, step {seed} at length {length}: {said}"

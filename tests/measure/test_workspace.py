"""What a CPU convolution holds beyond its outputs (``measure._workspace``): read once
per signature, the same with a profiler of the caller's recording as without, that
profiler never seeing the reading, and never below what the allocator saw."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from ckptwrap import _torch_private
from ckptwrap.measure import _workspace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _allocator import events_peak  # noqa: E402

aten = torch.ops.aten

pytestmark = pytest.mark.skipif(
    _torch_private.legacy_memory_profiler is None, reason="this torch has no legacy memory profiler"
)


def _backward_args(channels: int = 64, side: int = 4, kernel: int = 7, channels_last: bool = True):
    """A depthwise convolution's backward, as ConvNeXt runs it (channels last)."""
    x = torch.randn(2, channels, side, side)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(channels, 1, kernel, kernel)
    pad = [kernel // 2] * 2
    out = aten.convolution.default(x, w, None, [1, 1], pad, [1, 1], False, [0, 0], channels)
    grad = torch.randn_like(out)
    return (grad, x, w, [channels], [1, 1], pad, [1, 1], False, [0, 0], channels, [True, True, True])


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_reading_under_the_callers_profiler_matches_one_without(channels_last):
    args = _backward_args(channels_last=channels_last)
    _workspace._read.clear()
    expected_out, alone = _workspace.run_held(aten.convolution_backward.default, args, {})
    _workspace._read.clear()
    with profile(profile_memory=True) as prof:
        out, aside = _workspace.run_held(aten.convolution_backward.default, args, {})
    assert aside == alone
    for got, want in zip(out, expected_out):
        assert torch.equal(got, want)
    names = [event.name for event in prof.events()]
    assert names.count("aten::convolution_backward") == 1  # the reading was not recorded
    assert aside >= events_peak(prof)


def test_a_channels_last_depthwise_backward_holds_far_more_than_its_tensors():
    """Why a bound from sizes cannot stand in: the reading is many times the bytes of its
    inputs, outputs and weight, and it is what the allocator sees."""
    args = _backward_args()
    _workspace._read.clear()
    with profile(profile_memory=True) as prof:
        out, held = _workspace.run_held(aten.convolution_backward.default, args, {})
    tensors = sum(t.untyped_storage().nbytes() for t in (*args[:3], *out) if isinstance(t, torch.Tensor))
    assert events_peak(prof) > 10 * tensors
    assert held >= events_peak(prof)


def test_each_signature_is_read_once(monkeypatch):
    args = _backward_args(channels_last=False)
    _workspace._read.clear()
    calls = []
    reading = _workspace._reading
    monkeypatch.setattr(_workspace, "_reading", lambda *a: calls.append(1) or reading(*a))
    for _ in range(3):
        _workspace.run_held(aten.convolution_backward.default, args, {})
    assert len(calls) == 1

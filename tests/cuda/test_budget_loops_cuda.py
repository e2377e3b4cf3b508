"""A lazy ``budget:`` in the loops people write, on CUDA: the loops of
``benchmarks/_budget_loops`` (outputs held through the backward; right-padded masks with
changing batch sizes and lengths; accumulation with evaluation and ``generate`` between)
on Hugging Face models built from their configs, four times as wide as the catalogue's.

Every micro-step of the budget model and of the plain model trained beside it is read
through ``torch.profiler``'s CUDA allocator events (not the peak statistics that the
planner reads and resets): no step may peak above the budget by more than 3% of the plain
peak at the largest shape so far, every loss and gradient must equal the plain model's
bit for bit (deterministic kernels, math attention), the model must be left as plain training left it,
and no solved step may peak above its prediction by more than 5% of the plain peak at the
largest shape so far (a prediction above the peak costs recomputation, not memory; the
benchmark reports both ways).

Without CUDA every test here is skipped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from _cuda_helpers import requires_cuda

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _architectures import ARCHITECTURES, available, widened  # noqa: E402
from _budget_loops import memory_pass, shortfalls  # noqa: E402

pytestmark = requires_cuda

STEPS = 12
WIDTH = 4
PREDICTION = 0.05
"""A solved step's peak at the allocator may pass its prediction by this share of the
plain peak at the largest shape so far."""
CASES = [("gpt2", "padded"), ("llama", "padded"), ("llama", "held"), ("bert", "padded"), ("t5", "accumulate"),
         ("whisper", "held"), ("swin", "held")]
# BERT with padded batches and Whisper with held outputs once differed from the plain
# model on CUDA in about a quarter of runs (a selective level saved a fused dropout's
# output, so its recomputation drew other numbers); since levels no longer save a call
# that drew, 66 of 66 runs beside two plain copies were bit-equal on an H100 (docs/gpu.md,
# third run), so every case here must pass.


def _cases():
    found = set(available())
    return [pytest.param(name, loop, id=f"{name}-{loop}") for name, loop in CASES if name in found]


@pytest.fixture(autouse=True)
def _math_attention():
    """Attention on the math kernels, whose backward adds in a fixed order (the fused
    kernels' do not, so two plain runs could differ)."""
    switches = ("flash", "mem_efficient", "cudnn")
    before = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in switches}
    for name in switches:
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(False)
    yield
    for name, enabled in before.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(enabled)


@pytest.mark.parametrize("name, loop", _cases())
def test_budget_holds_on_cuda_in_the_loops_people_write(name, loop):
    arch = widened(ARCHITECTURES[name], WIDTH)
    result = memory_pass(arch, loop, STEPS, device="cuda")
    assert not shortfalls(result, arch, loop, STEPS), shortfalls(result, arch, loop, STEPS)
    assert result.worst_under <= PREDICTION, (
        f"a solved step peaked {result.worst_under:.1%} of plain above its prediction"
    )

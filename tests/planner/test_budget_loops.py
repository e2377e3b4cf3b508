"""The fast subset of ``benchmarks/budget_loops.py``: a lazy ``budget:`` wrapped with no
example inputs, on one architecture of each family built from its configuration, in each
loop people write (loss only; outputs held through the backward; right-padded masks with
changing batch sizes and lengths; accumulation with evaluation and ``generate`` between).

Every micro-step of the budget model and of the plain model trained beside it is read at
the CPU allocator (``torch.profiler``'s memory events, not ckptwrap's meters): no step may
peak above the budget by more than 3% of the plain peak at the largest shape so far, every
loss and gradient must equal the plain model's bit for bit, the model must be left as the
plain one's training left it, and the planner must have measured some steps (the loop
learned from its own steps) and fewer than it ran (it solved the rest).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _architectures import ARCHITECTURES, available  # noqa: E402
from _budget_loops import LOOPS, memory_pass, shortfalls  # noqa: E402

STEPS = 12
SUBSET = ("gpt2", "llama", "bert", "t5", "whisper", "swin", "clip", "mamba")
"""One of each family: causal, encoder, encoder-decoder, speech, hierarchical vision,
multimodal, state-space (and Llama, whose masks and rotary caches differ from GPT-2's)."""


def _diffusion():
    try:
        from _diffusion import DIFFUSION, available as diffusion_available
    except ImportError:
        return {}
    return {name: DIFFUSION[name] for name in diffusion_available()[:1]}


def _cases():
    found = set(available())
    archs = {name: ARCHITECTURES[name] for name in SUBSET if name in found}
    archs.update(_diffusion())
    return [pytest.param(arch, loop, id=f"{name}-{loop}") for name, arch in archs.items() for loop in LOOPS]


@pytest.mark.parametrize("arch, loop", _cases())
def test_budget_holds_in_the_loops_people_write(arch, loop):
    result = memory_pass(arch, loop, STEPS)
    assert not shortfalls(result, arch, loop, STEPS), shortfalls(result, arch, loop, STEPS)

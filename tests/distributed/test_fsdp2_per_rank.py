"""A model sharded by FSDP2 and planned per rank, on fake tensors over a fake process
group: the plan's whole-iteration peak per rank against torch's ``FSDPMemTracker`` over
two iterations of the same model, sharding, inputs and optimizer (an independent meter),
and a model sharded on the meta device refused with what to do instead.

FSDP2 frees a layer's all-gathered parameters with ``untyped_storage().resize_(0)`` and
gathers them again into the same storage, which no dispatch mode sees: counted as made
and never freed, every layer's gathered parameters were held at once (+5.9% at two
ranks, +8.8% at eight, under ``blocks``). The measured backward asked
``torch.autograd.grad`` for the registered parameters' gradients, so no layer's were
computed and FSDP2 reduce-scattered none: at 512 tokens, where the end of the backward
peaks, its sharded gradients and reduce-scatter input were missing (-2.2% at two ranks,
now exact). Operators save a unit's gathered parameters, and the forward's saved tensors
outside any candidate were counted as held to the backward at their size when saved:
under ``none`` every layer's gathered parameters were held at once (+9.6% at 16 layers,
128 tokens, 8 ranks), now the unit's state as a candidate's are. Each case runs in a
process of its own (the fake group is process-wide).

With nothing recomputed the tracker reads more than a real step holds: on fake tensors
Hugging Face's mask code takes the position ids for packed sequences (a fake tensor
counts as tracing there), so every layer's attention makes and keeps a float causal mask
of its own (4 MiB at 1024 tokens), which a step on real tensors, and the planned step
(tiny factories run for real), never make; FSDPMemTracker on real tensors reads what is
planned. Hence 3% there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
pytest.importorskip("transformers")
pytest.importorskip("torch.distributed._tools.fsdp2_mem_tracker")

_RANK = Path(__file__).resolve().parent / "_fsdp2_fake_rank.py"


def _run(*argv: str) -> dict:
    done = subprocess.run([sys.executable, str(_RANK), *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "world_size, policy, tokens, sharding, within",
    [
        (2, "blocks", 1024, "default", 0.01),
        (2, "blocks", 512, "default", 0.01),
        (8, "none", 1024, "default", 0.03),
        # Each layer's gathered parameters kept from its forward to its backward, and
        # bfloat16 parameters with gradients reduced in float32 (FSDP2's mixed precision).
        (2, "blocks", 512, "keep-gathered", 0.01),
        (2, "blocks", 512, "bf16-params", 0.01),
    ],
)
def test_the_iteration_peak_per_rank_is_fsdp_mem_trackers(world_size, policy, tokens, sharding, within):
    found = _run(str(world_size), policy, str(tokens), sharding)
    assert found["sharded"], "FSDP2's parameters were swapped for stand-ins"
    assert found["no_grads"], "planning left gradients on the model or in FSDP2's state"
    assert abs(found["predicted"] - found["tracked"]) <= within * found["tracked"], found


def test_the_plain_peak_measured_under_none_is_the_one_derived_from_blocks():
    # Operators save a unit's gathered parameters (a linear layer's weight), which FSDP2
    # frees after the unit's forward: counted as activations held to the backward, every
    # layer's were held at once under ``none``, whose peak is the larger of that count and
    # the step's (+9.6% here at 16 layers; at 8 the logits and their gradient hid it).
    found = _run("8", "plain", "128", "16")
    assert abs(found["none"] - found["blocks"]) <= 0.001 * found["blocks"], found


def test_a_model_sharded_on_the_meta_device_is_refused_saying_to_use_fake_tensors():
    found = _run("2", "meta")
    assert "FakeTensorMode" in found["refused"] and "fully_shard" in found["refused"], found

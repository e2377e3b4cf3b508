"""A plan made in a fresh process, before any matrix product ran on the GPU, predicts what
the training iterations after it hold; ``measure_peak`` around a process's first product
reads the block's own memory.

cuBLAS and cuBLASLt make their workspaces (tens of MiB on a Hopper GPU) at the first
product on a stream, on each thread (a backward runs on a thread of autograd's), and keep
them to the end of the process; a planned step that ran first took them for the step's
own memory (on an H200: 72.6 MiB predicted for an iteration that holds 9.0, and 40.6
after the forward's thread alone was readied). The plan runs in a process of its own, so
that no earlier test has made them already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _cuda_helpers import requires_cuda

_ROOT = Path(__file__).resolve().parents[2]

_FIRST_PRODUCT = r"""
import json, torch
from ckptwrap.measure import measure_peak

a = torch.ones(64, 64, device="cuda")
with measure_peak("cuda") as peak:
    out = a @ a
print(json.dumps({"peak": peak.peak_bytes, "out": out.untyped_storage().nbytes()}))
"""

_SCRIPT = r"""
import json, torch
from torch import nn
import ckptwrap
from ckptwrap.wrap._marks import apply_plan

torch.manual_seed(0)
device = torch.device("cuda")
blocks = [nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)]
model = nn.Sequential(*blocks).to(device).train()
optimizer = torch.optim.AdamW(model.parameters())
batch = torch.randn(64, 256, device=device)
found = {}
for policy in ("none", "blocks"):
    plan = ckptwrap.plan(model, policy, example_inputs=(batch,), optimizer=optimizer)
    apply_plan(model, plan)

    def iteration():
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    iteration()  # the optimizer makes its state
    held = [*model.parameters(), batch]
    held += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    held = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held}.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    iteration()
    torch.cuda.synchronize()
    found[policy] = {"predicted": plan.device_peak, "measured": torch.cuda.max_memory_allocated() - before + held}
print(json.dumps(found))
"""


def _fresh(script: str) -> dict:
    """The last line of ``script``'s output, run in a process of its own, as JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@requires_cuda
def test_measure_peak_around_the_first_product_reads_the_product_alone():
    found = _fresh(_FIRST_PRODUCT)
    assert found["peak"] <= found["out"] + 4096, found  # its 16 KiB output (the allocator rounds up)


@requires_cuda
def test_a_plan_made_before_any_product_on_the_gpu_predicts_the_iterations_after_it():
    found = _fresh(_SCRIPT)
    for policy, row in found.items():
        # The plan before the fix read 64 MiB above the iteration, which holds about 20.
        assert abs(row["predicted"] / row["measured"] - 1) < 0.02, (policy, row)

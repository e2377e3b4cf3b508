"""Planning a model on the meta device (a step on fake tensors) changes nothing a later plan
of a real model reads in the same process: its convolutions' workspace readings, its
rates, its per-operator costs. Each order runs in a fresh process (what one process has
read stays for its life), and the real plans must be the same to the byte."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    import ckptwrap

    def convs(kind, width):
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[kind]
        norm = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[kind]
        blocks = [nn.Sequential(conv(width, width, 3, padding=1), norm(width), nn.ReLU()) for _ in range(3)]
        return nn.Sequential(conv(3, width, 3, padding=1), *blocks)

    SHAPES = {1: (4, 3, 256), 2: (4, 3, 24, 24), 3: (2, 3, 8, 8, 8)}

    def plans(device):
        found = {}
        for kind, shape in SHAPES.items():
            for policy in ("none", "blocks", "budget:90%"):
                torch.manual_seed(0)
                with torch.device(device):
                    model = convs(kind, 16)
                x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device)
                plan = ckptwrap.plan(model, policy, example_inputs=(x,))
                found[f"{kind}d {policy}"] = [plan.plain_peak, plan.predicted_peak, plan.names]
        return found

    if sys.argv[1] == "meta-first":
        plans("meta")
    print(json.dumps(plans("cpu")))
    """
)


def _real_plans(order: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, order], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plans_of_real_models_are_the_same_after_planning_on_the_meta_device():
    fresh = _real_plans("fresh")
    after_meta = _real_plans("meta-first")
    assert after_meta == fresh

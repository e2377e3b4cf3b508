"""The same model, inputs and budget give the same plan whatever the clock read: the solver
weighs recomputations at prices from what they run (operators, FLOPs, bytes created:
counts that repeat exactly), calibrated by one factor common to them all, so a run's
timing noise decides no choice (``measure._metering.RecomputePrices``).

Noise is made on purpose: every measured time of a profile (each candidate's, each of its
operators', the selective mode's cost) multiplied by its own factor between a third and
three, as a busy machine measures them; the plan from the noisy profile must be the plan
from the measured one, on the catalogue's families and at budgets where levels, whole
blocks and segments compete. And across processes: two interpreters plan the same model
side by side (each the other's noise) and agree.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.wrap._planning import plan_and_profile

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "benchmarks"))
from _architectures import ARCHITECTURES, available  # noqa: E402

MODELS = [name for name in ("gpt2", "llama", "bert", "t5", "vit", "whisper", "mamba", "swin") if name in set(available())]
BUDGETS = ("60%", "70%", "80%", "90%")


def _batch(name: str):
    arch = ARCHITECTURES[name]
    return arch.batch(4, arch.lengths[1], 0, arch.family in ("causal", "encoder", "encoder-decoder"))


def _noisy(profile, seed: int):
    """``profile`` with every measured time scaled by its own factor in [1/3, 3]."""
    draw = random.Random(seed)

    def factor() -> float:
        return 3.0 ** draw.uniform(-1.0, 1.0)

    modules = []
    for cost in profile.modules:
        ops = tuple(dataclasses.replace(op, time=op.time * factor()) for op in cost.ops)
        modules.append(dataclasses.replace(
            cost,
            forward_time=cost.forward_time * factor(),
            recompute_time=None if cost.recompute_time is None else cost.recompute_time * factor(),
            selective_overhead=cost.selective_overhead * factor(),
            ops=ops,
        ))
    return dataclasses.replace(profile, modules=tuple(modules))


def _choices(plan):
    return [(entry.name, entry.option) for entry in plan.selected]


@pytest.mark.parametrize("name", MODELS)
def test_timing_noise_decides_no_plan(name):
    torch.manual_seed(0)
    model = ARCHITECTURES[name].build()
    batch = _batch(name)
    compared = 0
    for budget in BUDGETS:
        policy = f"budget:{budget}"
        try:
            measured, profile = plan_and_profile(model, policy, example_kwargs=batch)
        except CheckpointConfigError:
            continue  # below what any plan reaches here
        assert profile is not None
        for seed in range(3):
            noisy, _ = plan_and_profile(model, policy, example_kwargs=batch, profile=_noisy(profile, seed))
            assert _choices(noisy) == _choices(measured), (budget, seed)
            assert noisy.predicted_peak == measured.predicted_peak
        compared += 1
    assert compared >= 2, "too few budgets within reach to compare"


_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {benchmarks!r})
import ckptwrap
from _architectures import ARCHITECTURES
found = {{}}
for name in {models!r}:
    arch = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = arch.build()
    batch = arch.batch(4, arch.lengths[1], 0, arch.family in ("causal", "encoder", "encoder-decoder"))
    for budget in {budgets!r}:
        try:
            plan = ckptwrap.plan(model, "budget:" + budget, example_kwargs=batch)
        except ckptwrap.CheckpointConfigError:
            found[name + "/" + budget] = "unreachable"
            continue
        found[name + "/" + budget] = [[e.name, e.option] for e in plan.selected]
print(json.dumps(found))
"""


def test_two_processes_planning_side_by_side_agree():
    code = _SCRIPT.format(benchmarks=str(_ROOT / "benchmarks"), models=["gpt2"], budgets=["70%", "90%"])
    runs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_ROOT)
        for _ in range(2)
    ]
    outputs = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1]
    assert any(isinstance(plan, list) and plan for plan in outputs[0].values())

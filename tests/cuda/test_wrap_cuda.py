"""wrap_model, budget plans and the peak meter on CUDA, measured by the CUDA allocator.

Without CUDA every test here is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ckptwrap
from ckptwrap.measure import measure_peak
from _cuda_helpers import VARIANTS, assert_same, gpt_module, gpt_step, requires_cuda, small_gpt

pytestmark = requires_cuda

# A plan is made from predicted costs; the allocator adds rounding (512-byte blocks) and
# the odd workspace. The measured peak may pass the budget by this share of the
# un-checkpointed step's peak.
BUDGET_ALLOWANCE = 0.05


def _batch(config, batch=4):
    return gpt_module().synthetic_batch(config, batch, seed=0, device="cuda")


def _allocator_peak(step) -> int:
    """Peak bytes ``step()`` adds above what is allocated before it, read directly."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_wrap_model_blocks_gives_bit_exact_gradients_with_dropout(use_reentrant):
    plain, config = small_gpt()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks", use_reentrant=use_reentrant)
    batch = _batch(config)
    expected = gpt_step(plain, batch)
    assert_same(gpt_step(plain, batch), expected, "two plain runs")
    assert_same(gpt_step(model, batch), expected, "wrap_model blocks vs plain")


def test_measure_peak_equals_the_allocator_peak_delta():
    model, config = small_gpt()
    batch = _batch(config)

    def step():
        model.zero_grad(set_to_none=True)
        gpt_step(model, batch)
        model.zero_grad(set_to_none=True)

    step()  # warm-up: cuBLAS workspaces and the allocator's first blocks
    expected = _allocator_peak(step)
    torch.cuda.synchronize()
    with measure_peak("cuda") as peak:
        step()
        torch.cuda.synchronize()
    assert peak.peak_bytes == expected
    assert peak.device == torch.device("cuda", torch.cuda.current_device())


def test_budget_plan_is_honoured_on_the_device():
    plain, config = small_gpt(layers=6)
    batch = _batch(config)

    def stepper(model):
        # The training step alone: gpt_step also copies every gradient after the backward,
        # which no plan of the step accounts for.
        def step():
            model.zero_grad(set_to_none=True)
            model(*batch).backward()
            model.zero_grad(set_to_none=True)
        return step

    stepper(plain)()  # warm-up
    plain_peak = _allocator_peak(stepper(plain))
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "budget:50%", example_inputs=(batch[0], batch[1]))
    plan = model.ckptwrap_plan
    assert plan.budget is not None and 0 < plan.budget
    stepper(model)()  # warm-up
    peak = _allocator_peak(stepper(model))
    allowance = BUDGET_ALLOWANCE * plain_peak
    assert peak <= plan.budget + allowance, (
        f"measured {peak / 2**20:.2f} MiB, budget {plan.budget / 2**20:.2f} MiB "
        f"+ allowance {allowance / 2**20:.2f} MiB (plain step: {plain_peak / 2**20:.2f} MiB)"
    )
    assert peak < plain_peak
    assert_same(gpt_step(model, batch), gpt_step(plain, batch), "budget plan vs plain")

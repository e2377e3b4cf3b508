"""wrap_model, budget plans and the peak meter on CUDA, measured by the CUDA allocator.

Without CUDA every test here is skipped.
"""

from __future__ import annotations

import copy
import threading

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


def _worker_threads(model):
    """The names of the threads each block's first submodule ran in (in the forward and
    in each recomputation), per block."""
    seen = {}
    handles = []
    for block in model.blocks:
        first = next(block.children())

        def note(module, args, block=block):
            seen.setdefault(block, []).append(threading.current_thread().name)

        handles.append(first.register_forward_pre_hook(note))
    return seen, handles


@pytest.mark.parametrize("policy", ["blocks;overlap", "blocks;selective;overlap"])
def test_overlap_recomputes_ahead_on_a_side_stream_with_bit_exact_gradients(policy):
    """Blocks recomputed in the worker thread on a side stream, dropout and all, give the
    plain model's gradients bit for bit, step after step."""
    plain, config = small_gpt(layers=6)
    model = ckptwrap.wrap_model(copy.deepcopy(plain), policy)
    seen, handles = _worker_threads(model)
    batch = _batch(config)
    for seed in (1, 2, 3):
        expected = gpt_step(plain, batch, seed=seed)
        assert_same(gpt_step(model, batch, seed=seed), expected, f"{policy} vs plain, seed {seed}")
    for handle in handles:
        handle.remove()
    ahead = [block for block, threads in seen.items() if "ckptwrap-recompute-ahead" in threads]
    assert len(ahead) >= len(model.blocks) - 1, f"recomputed ahead: {len(ahead)} of {len(model.blocks)} blocks"


def test_overlap_matches_torch_checkpoint_under_bf16_autocast():
    plain, config = small_gpt(layers=4)
    ours = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks;overlap")
    theirs = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks")
    batch = _batch(config)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = gpt_step(theirs, batch)
        got = gpt_step(ours, batch)
    assert_same(got, expected, "overlap vs blocks under bf16 autocast")

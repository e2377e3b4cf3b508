"""Budget plans, measured plans and the selective and offload tiers, end to end.

References are computed in each test: the plain model, brute force over the measured
costs, and operator counts during recomputation.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckptwrap
from ckptwrap import plan, unwrap_model, wrap_model
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.planner import step_items
from ckptwrap.measure import region_bytes, step_device
from ckptwrap.wrap import profile_modules
from ckptwrap.planner import predicted_peak
from ckptwrap.planner._solver import smallest_reachable_peak

from ._models import (
    TinyGPT,
    assert_same,
    gpt_batch,
    gpt_loss,
    grads,
    make,
    marked,
    markings,
    recompute_counts,
    step,
    structure,
)


def _example():
    ids, _ = gpt_batch()
    return (ids,)


def _model(layers: int = 6) -> torch.nn.Module:
    return make(lambda: TinyGPT(layers=layers)).train()


def _every_plan(items):
    """Every plan over ``items``: each candidate plain, checkpointed alone, or starting a
    segment over the candidates after it that may join it (``joins`` set)."""

    def from_position(i):
        if i == len(items):
            yield []
            return
        yield from from_position(i + 1)
        for end in range(i + 1, len(items) + 1):
            if end > i + 1 and items[end - 1].joins is None:
                break
            for rest in from_position(end):
                yield [tuple(range(i, end))] + rest

    return list(from_position(0))


def _regions(result, names):
    """The plan's regions as groups of candidate indices, segments included."""
    groups = []
    for entry in result.selected:
        index = names.index(entry.name)
        if entry.joins is None:
            groups.append((index,))
        else:
            assert groups and names[groups[-1][-1]] == entry.joins == names[index - 1]
            groups[-1] += (index,)
    return groups


def reachable_share(model: torch.nn.Module, inputs, names=None) -> float:
    """The smallest step peak any budget plan over ``names`` (default: the blocks) can
    reach, as a share of the un-checkpointed step's peak, as the planner predicts both.

    Gradients and parameter gradients count in the peak, so a small model cannot reach
    small percentages: a budget between this share and 100% is in reach and still forces
    checkpointing. Byte costs are deterministic, so a fresh profile gives the planner's.
    """
    names = plan(model, "blocks").names if names is None else names
    profile = profile_modules(model, names, inputs, repeats=0, step=True)
    ordered, _, tail = step_items(
        profile, names, segments=True, levels=True, region_bytes=region_bytes(step_device(model, inputs, {}))
    )
    items = [item for _, item in ordered]
    lowest = smallest_reachable_peak(items, base=profile.base_bytes, tail=tail)
    return lowest / predicted_peak(items, (), base=profile.base_bytes, tail=tail)


def _reachable_percents(model: torch.nn.Module, count: int) -> list:
    """``count`` whole percentages from 90% down to just above :func:`reachable_share`,
    evenly spaced: each in reach, each below the un-checkpointed peak."""
    lowest = math.ceil(100 * reachable_share(model, _example())) + 1
    assert lowest < 90, f"the model reaches only {lowest}%: too few blocks to plan"
    return sorted({round(90 - i * (90 - lowest) / (count - 1)) for i in range(count)}, reverse=True)


def _in_reach(model: torch.nn.Module) -> str:
    """A ``budget:NN%`` policy halfway between the smallest reachable peak and 90%: in
    reach, yet it forces checkpointing."""
    return f"budget:{_reachable_percents(model, 3)[1]}%"


def _step_items(model, names, repeats=1):
    """The planner's whole-block items for ``names`` with their step terms, the base and
    the tail: byte costs are deterministic, so a fresh profile gives the planner's own."""
    profile = profile_modules(model, names, _example(), repeats=repeats, step=True)
    ordered, _, tail = step_items(
        profile, names, segments=True, region_bytes=region_bytes(step_device(model, _example(), {}))
    )
    return ordered, profile.base_bytes, tail


@pytest.mark.parametrize("place", [0, 1, 2])
def test_budget_plan_fits_and_is_optimal_for_the_measured_costs(place):
    model = _model()
    percent = _reachable_percents(model, 3)[place]
    # Whole blocks only, so that every plan can be enumerated below.
    result = plan(model, f"budget:{percent}%;recompute", example_inputs=_example())
    assert result.budget is not None and result.predicted_peak <= result.budget
    assert result.budget == int(percent / 100 * result.plain_peak)
    names = [f"h.{i}" for i in range(6)]
    assert set(result.names) <= set(names)
    # In forward order, each block joining the one before (segments are allowed).
    ordered, base, tail = _step_items(model, names)
    assert [name for name, _ in ordered] == names
    items = [item for _, item in ordered]
    assert predicted_peak(items, (), base=base, tail=tail) == result.plain_peak
    groups = _regions(result, names)
    assert predicted_peak(items, groups, base=base, tail=tail) == result.predicted_peak
    # The blocks are alike, so the planner weighs their noisy times as one (pooled)
    # time: then least time means fewest members, and among those the least peak.
    assert len({(item.kept, item.inputs, item.rebuilt) for item in items}) == 1
    fitting = [
        (sum(map(len, plan_)), predicted_peak(items, plan_, base=base, tail=tail))
        for plan_ in _every_plan(items)
    ]
    best = min(key for key in fitting if key[1] <= result.budget)
    assert (len(result.names), result.predicted_peak) == best


def test_budget_plans_of_equal_blocks_do_not_depend_on_timing_noise():
    # Whole blocks only: alike blocks then tie exactly, whatever their measured times. A
    # choice between a selective level and a whole recomputation weighs the measured times
    # themselves, so it may change with them.
    model = _model()
    policy = _in_reach(model) + ";recompute"
    plans = {
        (tuple(r.names), tuple(e.joins for e in r.selected), tuple(e.option for e in r.selected))
        for r in (plan(model, policy, example_inputs=_example()) for _ in range(10))
    }
    assert len(plans) == 1, plans
    assert plans.pop()[0], f"{policy} checkpoints nothing"


def test_a_percent_budget_below_reach_states_the_reachable_peak_in_percent():
    model = _model()
    names = [f"h.{i}" for i in range(6)]
    ordered, base, tail = _step_items(model, names, repeats=0)
    items = [item for _, item in ordered]
    lowest = smallest_reachable_peak(items, base=base, tail=tail)
    total = predicted_peak(items, (), base=base, tail=tail)
    share = rf"{100 * lowest / total:.2f}".replace(".", r"\.")
    match = (
        rf"at inputs of batch 2, length 8: budget 1% of the un-checkpointed step's peak at the "
        rf"largest shape planned so far \(.* \({total} bytes\)\), that is .*, is below the "
        rf"smallest reachable peak .* \({lowest} bytes\), {share}% of the un-checkpointed "
        rf"step's peak at the largest shape planned so far, .*raise the budget to at least "
        rf"budget:[0-9.]+%"
    )
    with pytest.raises(CheckpointConfigError, match=match):
        wrap_model(model, "budget:1%;recompute", example_inputs=_example())
    assert marked(model) == []


def test_smaller_budgets_never_predict_a_higher_peak():
    model = _model()
    percents = _reachable_percents(model, 4)
    assert len(percents) == 4, percents
    peaks = [
        plan(model, f"budget:{p}%", example_inputs=_example()).predicted_peak for p in percents
    ]
    assert peaks == sorted(peaks, reverse=True)


def test_plan_measures_without_changing_the_model():
    model = _model()
    policy = _in_reach(model)
    before = structure(model), copy.deepcopy(model.state_dict()), torch.get_rng_state()
    plan(model, policy, example_inputs=_example())
    assert structure(model) == before[0]
    assert_same(model.state_dict(), before[1], "state dict")
    assert torch.equal(torch.get_rng_state(), before[2])
    assert marked(model) == []


def test_budget_below_the_reachable_peak_names_it_and_changes_nothing():
    model = _model()
    with pytest.raises(CheckpointConfigError, match=r"below the smallest reachable peak"):
        wrap_model(model, "budget:1%", example_inputs=_example())
    assert marked(model) == [] and "ckptwrap_plan" not in model.__dict__


def test_budget_plan_needs_example_inputs():
    with pytest.raises(CheckpointConfigError, match="example_inputs"):
        plan(_model(), "budget:50%")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_budget_wrapped_model_has_the_plain_gradients(use_reentrant):
    plain = _model()
    policy = _in_reach(plain)
    model = wrap_model(copy.deepcopy(plain), policy, example_inputs=_example(), use_reentrant=use_reentrant)
    assert marked(model) == model.ckptwrap_plan.names and marked(model)
    assert_same({"loss": step(model, gpt_loss, gpt_batch())}, {"loss": step(plain, gpt_loss, gpt_batch())})
    assert_same(grads(model), grads(plain), "gradients")


def test_without_example_inputs_the_first_training_step_measures_then_plans(caplog):
    plain = _model()
    model = wrap_model(copy.deepcopy(plain), _in_reach(plain))
    assert model.ckptwrap_plan.pending and marked(model) == []
    with torch.no_grad():
        model(gpt_batch()[0])  # inference does not trigger planning
    assert model.ckptwrap_plan.pending
    with caplog.at_level(logging.INFO, logger="ckptwrap"):
        loss = step(model, gpt_loss, gpt_batch())
    assert [r.getMessage() for r in caplog.records if "measures this training step" in r.getMessage()], caplog.text
    # The step that measured ran under the plan of least memory, and trained correctly.
    measured_step = model.ckptwrap_plan
    assert not measured_step.pending and measured_step.budget is not None
    assert marked(model) == measured_step.names == [f"h.{i}" for i in range(6)]
    assert_same({"loss": loss}, {"loss": step(plain, gpt_loss, gpt_batch())})
    assert_same(grads(model), grads(plain), "gradients")
    # The next step at that shape runs under the plan solved from what it measured.
    with caplog.at_level(logging.INFO, logger="ckptwrap"):
        loss = step(model, gpt_loss, gpt_batch())
    assert [r.getMessage() for r in caplog.records if "measured a training step" in r.getMessage()], caplog.text
    assert [r.getMessage() for r in caplog.records if "applied" in r.getMessage()], caplog.text
    applied = model.ckptwrap_plan
    assert applied.predicted_peak <= applied.budget
    assert marked(model) == applied.names and applied.names
    assert_same({"loss": loss}, {"loss": step(plain, gpt_loss, gpt_batch())})
    assert_same(grads(model), grads(plain), "gradients")
    caplog.clear()
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="ckptwrap"):
        warnings.simplefilter("error")  # nothing to act on, and routine notes only when the plan changes
        step(model, gpt_loss, gpt_batch())
    assert not caplog.records, caplog.text


def test_a_budget_out_of_reach_in_training_is_said_at_the_callers_line_once_per_shape():
    model = _model()
    wrap_model(model, "budget:1%")
    # Measured, under the plan of least memory, above the budget: said at its end.
    with pytest.warns(UserWarning, match="peaked at .* under the plan of least memory .* above budget:1%"):
        step(model, gpt_loss, gpt_batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once while the shape stays
        model(gpt_batch()[0]).sum().backward()
        step(model, gpt_loss, gpt_batch())
    lowest = model.ckptwrap_plan
    assert lowest.names and lowest.predicted_peak > lowest.budget
    short = (gpt_batch()[0][:, :5], gpt_batch()[1][:, :5])
    with pytest.warns(UserWarning, match="length 5 peaked at .* above budget:1%"):
        step(model, gpt_loss, short)  # measured: said at its end
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, gpt_loss, short)  # solved, the same shape: not said again
    with pytest.warns(UserWarning, match="no plan fits budget:1%.*length 8") as record:
        model(gpt_batch()[0]).sum().backward()  # met again after another shape: said again
    # Not a line of torch's Module.__call__, which runs the hook, nor one of ckptwrap's.
    assert [w.filename for w in record] == [__file__]


def test_pending_plans_pickle_and_unwrap():
    model = wrap_model(_model(), "budget:50%")
    copied = pickle.loads(pickle.dumps(model))
    assert copied.ckptwrap_plan.pending
    unwrap_model(model)
    assert "ckptwrap_plan" not in model.__dict__ and not model._forward_pre_hooks
    step(model, gpt_loss, gpt_batch())
    assert marked(model) == []


def _hooks(model: torch.nn.Module) -> list:
    """Every forward hook of ``model`` and its modules, with the dictionaries torch keeps
    beside them (with kwargs, always called)."""
    return [
        getattr(module, name)
        for module in model.modules()
        for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                     "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
        if getattr(module, name)
    ]


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
def test_unwrapping_a_copy_removes_the_copys_hooks_and_leaves_the_originals(copier):
    model = wrap_model(_model(), "budget:50%")
    step(model, gpt_loss, gpt_batch())
    copied = copier(model)
    hooked = _hooks(model)
    assert hooked and len(_hooks(copied)) == len(hooked)
    unwrap_model(copied)
    assert _hooks(copied) == [] and _hooks(model) == hooked
    step(model, gpt_loss, gpt_batch())  # the original still plans
    assert marked(model)
    unwrap_model(model)
    assert _hooks(model) == []


def test_measured_plan_without_budget_reports_predictions():
    model = _model()
    result = plan(model, "every:2", example_inputs=_example())
    assert result.names == ["h.0", "h.2", "h.4"]
    assert all(e.saved_bytes > 0 and e.recompute_time > 0 for e in result.selected)
    assert result.predicted_peak < result.plain_peak
    text = str(result)
    assert "saves MiB" in text
    assert f"{result.plain_peak / (1 << 20):.2f} MiB predicted without checkpointing" in text
    assert f"{result.predicted_peak / (1 << 20):.2f} MiB with this plan" in text
    assert result.to_dict()["selected"][0]["name"] == "h.0"


class _CountRecomputed(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if ckptwrap.is_recomputing():
            self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def test_selective_tier_saves_matmuls_and_recomputes_the_rest():
    plain = _model(layers=2)
    model = wrap_model(copy.deepcopy(plain), "blocks;selective:mm,addmm,bmm")
    assert model.ckptwrap_plan.tier == "selective"
    full = wrap_model(copy.deepcopy(plain), "blocks")
    with _CountRecomputed() as selective_ops:
        step(model, gpt_loss, gpt_batch())
    with _CountRecomputed() as full_ops:
        step(full, gpt_loss, gpt_batch())
    aten = torch.ops.aten
    products = {aten.mm, aten.addmm, aten.bmm}
    assert any(op in products for op in full_ops.ops)
    assert not any(op in products for op in selective_ops.ops)
    assert selective_ops.ops  # elementwise work is still recomputed
    step(plain, gpt_loss, gpt_batch())
    assert_same(grads(model), grads(plain), "gradients")


def test_selective_tier_refuses_the_reentrant_engine():
    with pytest.raises(CheckpointConfigError, match="selective.*non-re-entrant"):
        wrap_model(_model(), "blocks;selective", use_reentrant=True)


def test_offload_tier_recomputes_nothing_and_keeps_gradients():
    plain = _model(layers=2)
    model = wrap_model(copy.deepcopy(plain), "last:1;offload")
    assert model.ckptwrap_plan.tier == "offload" and marked(model) == ["h.1"]
    log = recompute_counts(model, gpt_loss, gpt_batch())
    assert sum(log.recomputed.values()) == 0
    step(plain, gpt_loss, gpt_batch())
    assert_same(grads(model), grads(plain), "gradients")
    assert pickle.loads(pickle.dumps(model)).ckptwrap_plan.tier == "offload"


def test_selective_tier_with_batchnorm_updates_statistics_once():
    from ._models import ConvNet, conv_batch, conv_loss

    plain = make(ConvNet).train()
    model = wrap_model(copy.deepcopy(plain), "blocks;selective:convolution")
    step(model, conv_loss, conv_batch())
    step(plain, conv_loss, conv_batch())
    assert_same(grads(model), grads(plain), "gradients")
    assert_same(dict(model.named_buffers()), dict(plain.named_buffers()), "running statistics")


def test_wrapping_twice_with_a_budget_is_a_no_op():
    model = _model()
    loose, policy, _ = (f"budget:{p}%" for p in _reachable_percents(model, 3))
    wrap_model(model, policy, example_inputs=_example())
    before = markings(model), dict(model._forward_pre_hooks)
    # Planned again, the budget would be read against the memory left after the first
    # wrap, and refused or met by other modules.
    wrap_model(model, policy, example_inputs=_example())
    wrap_model(model, policy)
    # No second hook, nothing re-planned.
    assert (markings(model), dict(model._forward_pre_hooks)) == before
    # A different budget is a different plan: unwrap first, as for other options.
    unwrap_model(model)
    wrap_model(model, loose, example_inputs=_example())
    assert model.ckptwrap_plan.policy == loose

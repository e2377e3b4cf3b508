"""Budget plans, measured plans and the selective and offload tiers, end to end.

References are computed in each test: the plain model, brute force over the measured
costs, and operator counts during recomputation.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckptwrap
from ckptwrap import plan, unwrap_model, wrap_model
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.measure import profile_modules
from ckptwrap.policy._solver import predicted_peak, smallest_reachable_peak
from ckptwrap.wrap._costs import forward_items

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


@pytest.mark.parametrize("percent", [35, 60, 90])
def test_budget_plan_fits_and_is_optimal_for_the_measured_costs(percent):
    model = _model()
    result = plan(model, f"budget:{percent}%", example_inputs=_example())
    assert result.budget is not None and result.predicted_peak <= result.budget
    assert result.budget == int(percent / 100 * result.activation_bytes)
    names = [f"h.{i}" for i in range(6)]
    assert set(result.names) <= set(names)
    # Byte costs are deterministic, so a fresh profile gives the planner's items: in
    # forward order, each block joining the one before (segments are allowed).
    profile = profile_modules(model, names, _example(), repeats=1)
    ordered = forward_items(profile, names, segments=True)
    assert [name for name, _ in ordered] == names
    items = [item for _, item in ordered]
    base = profile.base_bytes
    groups = _regions(result, names)
    assert predicted_peak(items, groups, base=base) == result.predicted_peak
    # The blocks are alike, so the planner weighs their noisy times as one (pooled)
    # time: then least time means fewest members, and among those the least peak.
    assert len({(item.kept, item.inputs, item.rebuilt) for item in items}) == 1
    fitting = [
        (sum(map(len, plan_)), predicted_peak(items, plan_, base=base))
        for plan_ in _every_plan(items)
    ]
    best = min(key for key in fitting if key[1] <= result.budget)
    assert (len(result.names), result.predicted_peak) == best


def test_budget_plans_of_equal_blocks_do_not_depend_on_timing_noise():
    model = _model()
    plans = {
        (tuple(r.names), tuple(e.joins for e in r.selected))
        for r in (plan(model, "budget:50%", example_inputs=_example()) for _ in range(10))
    }
    assert len(plans) == 1, plans


def test_a_percent_budget_below_reach_states_the_reachable_peak_in_percent():
    model = _model()
    names = [f"h.{i}" for i in range(6)]
    profile = profile_modules(model, names, _example(), repeats=0)
    items = [item for _, item in forward_items(profile, names, segments=True)]
    lowest = smallest_reachable_peak(items, base=profile.base_bytes)
    total = profile.total_activation_bytes
    share = rf"{100 * lowest / total:.2f}".replace(".", r"\.")
    match = (
        rf"budget 1% of the un-checkpointed activation memory \(.* \({total} bytes\)\), that is "
        rf".*, is below the smallest reachable peak .* \({lowest} bytes\), {share}% of the "
        rf"un-checkpointed activation memory, .*raise the budget to at least budget:[0-9.]+%"
    )
    with pytest.raises(CheckpointConfigError, match=match):
        wrap_model(model, "budget:1%", example_inputs=_example())
    assert marked(model) == []


def test_smaller_budgets_never_predict_a_higher_peak():
    model = _model()
    peaks = [
        plan(model, f"budget:{p}%", example_inputs=_example()).predicted_peak for p in (90, 70, 50, 35)
    ]
    assert peaks == sorted(peaks, reverse=True)


def test_plan_measures_without_changing_the_model():
    model = _model()
    before = structure(model), copy.deepcopy(model.state_dict()), torch.get_rng_state()
    plan(model, "budget:50%", example_inputs=_example())
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
    model = wrap_model(copy.deepcopy(plain), "budget:50%", example_inputs=_example(), use_reentrant=use_reentrant)
    assert marked(model) == model.ckptwrap_plan.names and marked(model)
    assert_same({"loss": step(model, gpt_loss, gpt_batch())}, {"loss": step(plain, gpt_loss, gpt_batch())})
    assert_same(grads(model), grads(plain), "gradients")


def test_without_example_inputs_the_first_training_forward_measures_and_applies():
    plain = _model()
    model = wrap_model(copy.deepcopy(plain), "budget:50%")
    assert model.ckptwrap_plan.pending and marked(model) == []
    with torch.no_grad():
        model(gpt_batch()[0])  # inference does not trigger planning
    assert model.ckptwrap_plan.pending
    with pytest.warns(UserWarning, match="first training forward"):
        loss = step(model, gpt_loss, gpt_batch())
    applied = model.ckptwrap_plan
    assert not applied.pending and applied.predicted_peak <= applied.budget
    assert marked(model) == applied.names and applied.names
    # The very step that measured already trained correctly.
    assert_same({"loss": loss}, {"loss": step(plain, gpt_loss, gpt_batch())})
    assert_same(grads(model), grads(plain), "gradients")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        step(model, gpt_loss, gpt_batch())


def test_the_first_forward_note_points_at_the_callers_line():
    model = wrap_model(_model(), "budget:50%")
    with pytest.warns(UserWarning, match="first training forward") as record:
        model(gpt_batch()[0])
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


def test_measured_plan_without_budget_reports_predictions():
    model = _model()
    result = plan(model, "every:2", example_inputs=_example())
    assert result.names == ["h.0", "h.2", "h.4"]
    assert all(e.saved_bytes > 0 and e.recompute_time > 0 for e in result.selected)
    assert result.predicted_peak < result.activation_bytes
    text = str(result)
    assert "saves MiB" in text and "predicted at the peak" in text
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
    wrap_model(model, "budget:50%", example_inputs=_example())
    before = markings(model), dict(model._forward_pre_hooks)
    # Planned again, the budget would be read against the memory left after the first
    # wrap, and refused or met by other modules.
    wrap_model(model, "budget:50%", example_inputs=_example())
    wrap_model(model, "budget:50%")
    # No second hook, nothing re-planned.
    assert (markings(model), dict(model._forward_pre_hooks)) == before
    # A different budget is a different plan: unwrap first, as for other options.
    unwrap_model(model)
    wrap_model(model, "budget:60%", example_inputs=_example())
    assert model.ckptwrap_plan.policy == "budget:60%"

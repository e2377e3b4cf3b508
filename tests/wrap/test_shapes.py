"""Budget plans follow the input shape: costs are measured once, at small shapes of the
first training forward's inputs, and every later shape is a solve on the fitted costs.

Every step is compared with the plain model on the same inputs and seed; the training
step's peak is measured with the allocator meter of ``_meter`` and compared with the
applied plan's own prediction; measuring is counted by wrapping the planner's profiler
and its step meter.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import pickle
import sys
import warnings
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.profiler.profiler as profiler_module

import ckptwrap.planner._measuring as planner_module
from ckptwrap.planner._fit import CostFit
import ckptwrap.wrap._model as wrap_module
from ckptwrap import plan, unwrap_model, wrap_model
from ckptwrap._errors import CheckpointConfigError

from ._meter import allocator_step_peak
from ._models import assert_same, grads, marked, markings
from .test_budget import reachable_share
from .test_prediction import TOLERANCE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

_VOCAB = 64


def _gpt(layers: int = 4, seq_len: int = 512) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=_VOCAB, width=32, heads=2, layers=layers, seq_len=seq_len)).train()


def _batch(length: int, batch: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(_VOCAB, (batch, length + 1), generator=torch.Generator().manual_seed(length))
    return ids[:, :-1], ids[:, 1:]


def _step(model: torch.nn.Module, length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(*_batch(length, batch))
    loss.backward()
    return loss.detach()


def _same_step(model: torch.nn.Module, plain: torch.nn.Module, length: int, batch: int = 1) -> None:
    """One step of each at ``length``; losses and gradients bit for bit equal."""
    assert_same(
        {"loss": _step(model, length, batch=batch)}, {"loss": _step(plain, length, batch=batch)},
        f"loss at {length}",
    )
    assert_same(grads(model), grads(plain), f"gradients at {length}")


def _peak(model: torch.nn.Module, length: int) -> int:
    """The peak of one training step, from fresh gradients, as the allocator saw it."""
    model.zero_grad(set_to_none=True)

    def step() -> None:
        torch.manual_seed(1)
        model(*_batch(length)).backward()

    peak = allocator_step_peak(step)
    model.zero_grad(set_to_none=True)
    return peak


@functools.lru_cache(maxsize=None)
def _percent() -> int:
    """A whole percentage halfway between 100% and the smallest step peak ``_gpt()`` can
    reach at any length these tests use: in reach at every shape, yet below the
    un-checkpointed peak, so every shape's plan checkpoints something."""
    lowest = max(reachable_share(_gpt(), _batch(length)) for length in (64, 128, 256))
    return math.ceil(50 + 50 * lowest)


@pytest.fixture
def measured(monkeypatch) -> List[Tuple[str, int]]:
    """What the planner ran the model on to measure it: ``("profile", length)`` for each
    profile, ``("step", length)`` for each step it measured alone."""
    found: List[Tuple[str, int]] = []
    profile, step = planner_module.profile_modules, planner_module.measure_training_step

    def profiling(model, names, args, kwargs, **options):
        found.append(("profile", args[0].shape[1]))
        return profile(model, names, args, kwargs, **options)

    def stepping(model, names, args, kwargs, **options):
        found.append(("step", args[0].shape[1]))
        return step(model, names, args, kwargs, **options)

    monkeypatch.setattr(planner_module, "profile_modules", profiling)
    monkeypatch.setattr(planner_module, "measure_training_step", stepping)
    return found


def _budget_at(model: torch.nn.Module, length: int, share: float) -> int:
    return int(share * plan(model, "blocks", example_inputs=_batch(length)).plain_peak)


def _measured_once_at(found: List[Tuple[str, int]], length: int) -> None:
    """Measured on the first forward alone: profiles at shorter lengths, then one step at
    its own length."""
    assert found[-1] == ("step", length), found
    assert all(kind == "profile" and size < length for kind, size in found[:-1]), found
    assert len(found) >= 4, found


def test_a_training_loop_over_lengths_stays_under_an_absolute_budget(measured):
    plain = _gpt(layers=8)
    budget = _budget_at(plain, 256, 0.65)  # checkpoints nothing at 64 and 128, most at 512
    measured.clear()
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B")
    applied = {}
    for length in (64, 256, 128, 512, 64, 300):
        _same_step(model, plain, length)
        current = model.ckptwrap_plan
        assert current.budget == budget and current.predicted_peak <= budget
        assert marked(model) == current.names
        applied.setdefault(length, current)
        peak = _peak(model, length)  # a step of the same shape: no measuring
        assert peak <= budget * (1 + TOLERANCE), (length, peak, budget)
        assert abs(current.predicted_peak - peak) <= TOLERANCE * peak, (length, current)
        _same_step(model, plain, length)  # the metered step left nothing behind
    _measured_once_at(measured, 64)  # every later shape was a solve
    assert applied[64].names == [] and applied[128].names == []
    assert len(applied[256].names) < len(applied[512].names)
    # The plan made at 64 checkpoints nothing: kept for 512 it would exceed the budget.
    assert applied[512].plain_peak > 2 * budget


def test_a_percent_budget_is_read_against_the_largest_shape_planned_so_far(measured):
    plain = _gpt()
    percent = _percent()
    model = wrap_model(copy.deepcopy(plain), f"budget:{percent}%")
    _same_step(model, plain, 256)
    longest = model.ckptwrap_plan
    assert longest.budget == int(percent / 100 * longest.plain_peak) and longest.names
    # A shorter batch keeps the bytes of the longest: its plain peak fits them.
    _same_step(model, plain, 64)
    short = model.ckptwrap_plan
    assert short.budget == longest.budget and short.names == []
    assert short.plain_peak < longest.budget
    # A longer one raises the budget to its own share.
    _same_step(model, plain, 384)
    longer = model.ckptwrap_plan
    assert longer.budget == int(percent / 100 * longer.plain_peak) > longest.budget
    _measured_once_at(measured, 256)


def test_max_shapes_set_the_percentage_from_the_first_plan(measured):
    plain = _gpt()
    percent = _percent()
    model = wrap_model(copy.deepcopy(plain), f"budget:{percent}%", max_shapes={0: (1, 384)})
    _same_step(model, plain, 64)
    declared = plan(copy.deepcopy(plain), "blocks", example_inputs=_batch(384))
    assert abs(model.ckptwrap_plan.budget - percent / 100 * declared.plain_peak) <= TOLERANCE * declared.plain_peak
    with pytest.raises(CheckpointConfigError, match=r"max_shapes names 'tokens', which is not one tensor argument.*0, 1"):
        wrap_model(copy.deepcopy(plain), "budget:90%", example_inputs=_batch(64), max_shapes={"tokens": (1, 9)})
    with pytest.raises(CheckpointConfigError, match=r"at the declared max_shapes \(length 4096\).*below the smallest reachable"):
        wrap_model(copy.deepcopy(plain), f"budget:{_budget_at(plain, 64, 1.0)}B", example_inputs=_batch(64), max_shapes={0: (1, 4096)})


def test_plans_are_noted_to_the_logger_when_they_change(caplog):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="ckptwrap"):
        warnings.simplefilter("error")  # routine: nothing to act on
        for length in (128, 128, 64, 256, 256):
            _same_step(model, plain, length)
    notes = [record.getMessage() for record in caplog.records]
    assert notes[0].startswith("ckptwrap applied") and "inputs of length 128" in notes[0]
    assert all("switched to" in note for note in notes[1:]) and len(notes) <= 3, notes


def test_a_backward_pending_across_a_switch_is_unaffected(measured):
    plain = _gpt()
    budget = _budget_at(plain, 256, 0.6)  # nothing to checkpoint at 64, some at 256
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    first_plan = model.ckptwrap_plan
    results = []
    for each in (model, plain):
        each.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        first = each(*_batch(64))
        second = each(*_batch(256))  # switches the plan while first's backward waits
        (first + second).backward()
        results.append(({"loss": (first + second).detach()}, grads(each)))
    assert first_plan.names == [] and model.ckptwrap_plan.names  # the switch took place
    assert_same(*[losses for losses, _ in results])
    assert_same(*[gradients for _, gradients in results], "gradients")


def test_example_inputs_measure_once_and_wrapping_again_changes_nothing(measured):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", example_inputs=_batch(256))
    before = markings(model), dict(model._forward_pre_hooks)
    wrap_model(model, f"budget:{_percent()}%", example_inputs=_batch(256))
    wrap_model(model, f"budget:{_percent()}%")
    assert (markings(model), dict(model._forward_pre_hooks)) == before
    for length in (256, 200, 64):
        _same_step(model, plain, length)
    _measured_once_at(measured, 256)


def test_batches_of_every_size_share_one_measurement(measured):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    _same_step(model, plain, 64, batch=4)  # measured at batches 2 and 3
    for length, batch in ((96, 6), (80, 1), (64, 1), (128, 2)):
        _same_step(model, plain, length, batch=batch)
        current = model.ckptwrap_plan
        assert current.predicted_peak <= current.budget
        if batch == 1:  # whole modules only: a batch of one runs other operators
            assert all(entry.option == "recompute" for entry in current.selected)
    steps = [size for kind, size in measured if kind == "step"]
    assert steps == [64], measured


def test_unwrap_removes_the_shape_hook_and_every_plan(measured):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", example_inputs=_batch(64))
    _same_step(model, plain, 128)
    assert marked(model) and model._forward_pre_hooks
    unwrap_model(model)
    assert marked(model) == [] and not model._forward_pre_hooks
    assert "ckptwrap_plan" not in model.__dict__
    measured.clear()
    _same_step(model, plain, 256)
    assert measured == [] and marked(model) == []


def test_fitted_costs_survive_pickling_and_deep_copying(measured):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    for length in (64, 256):
        _same_step(model, plain, length)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        measured.clear()
        for length in (64, 256, 160):
            _same_step(copied, plain, length)
            _same_step(model, plain, length)
            assert marked(copied) == copied.ckptwrap_plan.names == model.ckptwrap_plan.names
        assert measured == []


def test_a_shape_out_of_reach_runs_under_its_plan_of_least_memory(measured):
    plain = _gpt()
    budget = _budget_at(plain, 64, 0.9)  # far below what any plan reaches at 256
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    with pytest.warns(UserWarning, match=r"no plan fits budget:.* at inputs of length 256; .*plan of least memory"):
        _same_step(model, plain, 256)
    lowest = model.ckptwrap_plan
    assert lowest.names and lowest.predicted_peak > budget
    assert abs(_peak(model, 256) - lowest.predicted_peak) <= TOLERANCE * lowest.predicted_peak
    first = plan(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _same_step(model, plain, 320)
        _same_step(model, plain, 64)
    assert model.ckptwrap_plan.names == first.names


def test_follow_shapes_false_keeps_the_first_plan(measured):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", follow_shapes=False)
    _same_step(model, plain, 64)
    first = markings(model)
    _same_step(model, plain, 256)
    assert markings(model) == first and len(measured) >= 4


def test_follow_shapes_must_be_a_bool_or_none():
    model = _gpt()
    with pytest.raises(CheckpointConfigError, match=r"follow_shapes must be True, False or None.*got 'yes'"):
        wrap_model(model, "budget:80%", follow_shapes="yes")
    assert marked(model) == [] and not model._forward_pre_hooks


def test_in_a_process_group_the_ranks_agree_once_on_the_costs(monkeypatch, measured):
    agreed = []

    def agreement(model, unmeasured):
        def agree(costs):
            agreed.append(costs)
            return costs

        return agree

    monkeypatch.setattr(wrap_module, "agreement", agreement)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    # The profiler that measures the training step describes an initialized group by its
    # backend, which this stand-in lacks: it is asked for nothing then.
    monkeypatch.setattr(profiler_module._KinetoProfile, "_get_distributed_info", lambda self: None)
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    _same_step(model, plain, 64)
    # Where costs were measured: the shapes to measure at, the fit, whether it holds.
    assert [type(value) for value in agreed[:2]] == [tuple, CostFit] and len(agreed) == 3
    for length in (128, 256):
        _same_step(model, plain, length)
    # Every later shape is a solve on those costs, the same on every rank, with no
    # collective to meet.
    assert len(agreed) == 3 and len(model.ckptwrap_plan.names) > 0

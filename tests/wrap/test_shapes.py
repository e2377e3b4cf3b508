"""Budget plans learned from the training steps themselves: a shape whose costs are not
known runs under the plan of least memory and is measured as it runs; once the costs fitted
over the shapes measured have predicted a step they were not fitted on, every shape they
stand for is a solve.

Every step is compared with the plain model on the same inputs and seed; the training
step's peak is read with the allocator meter of ``_meter`` (``torch.profiler``'s memory
events, independent of ckptwrap's); which steps were measured is counted by watching the
recorder the planner measures with.
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

import ckptwrap.measure._metering as profile_module
from ckptwrap import plan, unwrap_model, wrap_model
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.measure._metering import StepRecorder

from ._meter import allocator_step_peak
from ._models import assert_same, grads, marked, markings
from .test_budget import reachable_share
from .test_prediction import TOLERANCE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

_VOCAB = 64
OVER = 0.03
"""A step may peak above the budget by this share of the plain peak at the largest shape."""


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


def _same_step(model: torch.nn.Module, plain: torch.nn.Module, length: int, batch: int = 1) -> int:
    """One step of each at ``length``; losses and gradients bit for bit equal. Returns the
    wrapped model's step peak, read at the allocator."""
    losses = {}
    model.zero_grad(set_to_none=True)  # freed outside the meter: it reads the step alone
    peak = allocator_step_peak(lambda: losses.setdefault("loss", _step(model, length, batch=batch)))
    assert_same({"loss": losses["loss"]}, {"loss": _step(plain, length, batch=batch)}, f"loss at {length}")
    assert_same(grads(model), grads(plain), f"gradients at {length}")
    return peak


def _plain_peak(plain: torch.nn.Module, length: int, batch: int = 1) -> int:
    peak = allocator_step_peak(lambda: _step(plain, length, batch=batch))
    plain.zero_grad(set_to_none=True)
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
    """The steps measured: ``("step", length, batch)`` for a training step measured as it
    ran, ``("inputs", length, batch)`` for a step run on given (example) inputs."""
    found: List[Tuple[str, int]] = []
    begin, on_inputs = StepRecorder.begin, profile_module.measure_inputs
    given = []  # set while a step on given inputs runs (it records with the same recorder)

    def beginning(self, args, kwargs):
        if not given:
            found.append(("step", args[0].shape[1], args[0].shape[0]))
        return begin(self, args, kwargs)

    def inputs(model, targets, args, kwargs, **options):
        found.append(("inputs", args[0].shape[1], args[0].shape[0]))
        given.append(True)
        try:
            return on_inputs(model, targets, args, kwargs, **options)
        finally:
            given.pop()

    monkeypatch.setattr(StepRecorder, "begin", beginning)
    monkeypatch.setattr(profile_module, "measure_inputs", inputs)
    import ckptwrap.planner._planner as planner_module

    monkeypatch.setattr(planner_module, "measure_inputs", inputs)
    import ckptwrap.wrap._planning as planning_module

    monkeypatch.setattr(planning_module, "measure_inputs", inputs)
    return found


@pytest.fixture
def unbounded(monkeypatch):
    """Shapes without trusted costs measured, as if no bound from the shapes measured
    could stand for them: what these tests follow is the fit over shapes and its trust
    (bounds, and the steps they save, are ``tests/planner/test_bounds.py``'s)."""
    from ckptwrap.planner._shapes import LayoutCosts

    monkeypatch.setattr(LayoutCosts, "_bounded_at", lambda self, sizes, above=None: None)


def _budget_at(model: torch.nn.Module, length: int, share: float) -> int:
    return int(share * plan(model, "blocks", example_inputs=_batch(length)).plain_peak)


def _trained(model, plain, lengths) -> None:
    for length in lengths:
        _same_step(model, plain, length)


def test_a_training_loop_over_lengths_stays_under_an_absolute_budget(measured, unbounded):
    plain = _gpt(layers=8)
    budget = _budget_at(plain, 256, 0.65)  # checkpoints nothing at 64 and 128, most at 512
    measured.clear()
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B")
    lengths = (64, 256, 128, 512, 64, 300, 200, 448, 96, 512, 160, 384, 256, 64)
    largest = max(_plain_peak(plain, length) for length in lengths)
    applied = {}
    for length in lengths:
        peak = _same_step(model, plain, length)
        current = model.ckptwrap_plan
        assert current.budget == budget
        assert marked(model) == current.names
        assert peak <= budget + OVER * largest, (length, peak, budget)  # measured steps too
        if measured[-1:] != [("step", length, 1)]:  # a solved plan: predicted, and honoured
            assert current.predicted_peak <= budget
            assert abs(current.predicted_peak - peak) <= TOLERANCE * peak, (length, current.predicted_peak, peak)
        measured_now = len(measured)
        peak = _same_step(model, plain, length)  # the same shape again: nothing measured
        assert len(measured) == measured_now
        applied[length] = current = model.ckptwrap_plan
        assert abs(current.predicted_peak - peak) <= TOLERANCE * peak, (length, current.predicted_peak, peak)
    assert len(measured) <= 8, measured  # then the fit stood for the rest
    assert applied[64].names == [] and applied[128].names == []
    assert len(applied[256].names) < len(applied[512].names)


def test_a_percent_budget_is_read_against_the_largest_shape_planned_so_far(measured, unbounded):
    plain = _gpt()
    percent = _percent()
    model = wrap_model(copy.deepcopy(plain), f"budget:{percent}%")
    _trained(model, plain, (256, 256))
    longest = model.ckptwrap_plan
    assert longest.budget == int(percent / 100 * longest.plain_peak) and longest.names
    # A shorter batch keeps the bytes of the longest: its plain peak fits them.
    _trained(model, plain, (64, 64))
    short = model.ckptwrap_plan
    assert short.budget == longest.budget and short.names == []
    assert short.plain_peak < longest.budget
    # A longer one raises the budget to its own share, from the step that measures it on.
    _trained(model, plain, (384,))
    assert measured[-1] == ("step", 384, 1)
    longer = model.ckptwrap_plan
    assert longer.budget == int(percent / 100 * longer.plain_peak) > longest.budget


def test_max_shapes_set_the_percentage_once_the_costs_are_trusted(measured, unbounded):
    plain = _gpt()
    percent = _percent()
    model = wrap_model(copy.deepcopy(plain), f"budget:{percent}%", max_shapes={0: (1, 384)})
    _trained(model, plain, (64, 128, 96, 160, 112))  # four measured, the fourth predicted
    declared = plan(copy.deepcopy(plain), "blocks", example_inputs=_batch(384))
    budget = model.ckptwrap_plan.budget
    assert abs(budget - percent / 100 * declared.plain_peak) <= TOLERANCE * declared.plain_peak
    with pytest.raises(CheckpointConfigError, match=r"max_shapes names 'tokens', which is not one tensor argument.*0, 1"):
        wrap_model(copy.deepcopy(plain), "budget:90%", example_inputs=_batch(64), max_shapes={"tokens": (1, 9)})


def test_plans_are_noted_to_the_logger_when_they_change(caplog, unbounded):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="ckptwrap"):
        warnings.simplefilter("error")  # routine: nothing to act on
        for length in (128, 128, 128, 64, 64, 128):
            _same_step(model, plain, length)
    notes = [record.getMessage() for record in caplog.records]
    assert notes[0].startswith("ckptwrap measures this training step") and "length 128" in notes[0]
    assert notes[1].startswith("ckptwrap measured a training step at inputs of length 128")
    assert notes[2].startswith("ckptwrap applied") and "inputs of length 128" in notes[2]
    assert sum("applied" in note for note in notes) == 3, notes  # 128, 64, then 128 again
    assert not any("applied" in note for note in notes[3:4]), notes  # the same plan at 128


def test_a_backward_pending_across_a_switch_is_unaffected(measured, unbounded):
    plain = _gpt()
    budget = _budget_at(plain, 256, 0.6)  # nothing to checkpoint at 64, some at 256
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    _trained(model, plain, (256, 256))  # 256 measured, then planned
    first_plan = plan(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    measured.clear()
    results = []
    for each in (model, plain):
        each.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        first = each(*_batch(64))
        second = each(*_batch(256))  # switches the plan while first's backward waits
        (first + second).backward()
        results.append(({"loss": (first + second).detach()}, grads(each)))
    assert first_plan.names == [] and model.ckptwrap_plan.names  # the switch took place
    assert measured == []
    assert_same(*[losses for losses, _ in results])
    assert_same(*[gradients for _, gradients in results], "gradients")
    # A shape never seen, met while another forward's backward is pending, is not
    # measured (that step would hold both forwards): it runs under the plan of least memory.
    results = []
    for each in (model, plain):
        each.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        first = each(*_batch(64))
        second = each(*_batch(200))
        (first + second).backward()
        results.append(({"loss": (first + second).detach()}, grads(each)))
    assert measured == [] and len(model.ckptwrap_plan.names) == 4
    assert_same(*[gradients for _, gradients in results], "gradients")


def test_example_inputs_measure_once_and_wrapping_again_changes_nothing(measured, noted_steps):
    plain, percent = _gpt(), _percent()
    measured.clear()
    model = wrap_model(copy.deepcopy(plain), f"budget:{percent}%", example_inputs=_batch(256))
    before = markings(model), dict(model._forward_pre_hooks), dict(model._forward_hooks)
    wrap_model(model, f"budget:{percent}%", example_inputs=_batch(256))
    wrap_model(model, f"budget:{percent}%")
    assert (markings(model), dict(model._forward_pre_hooks), dict(model._forward_hooks)) == before
    assert measured == [("inputs", 256, 1)]
    _same_step(model, plain, 256)  # a real step at the example's shape: a solve, checked
    assert measured == [("inputs", 256, 1)]
    assert not noted_steps.forward["measured"] and noted_steps.forward["checked"]
    assert len(noted_steps.of("checked")) == 1


def test_batches_of_other_sizes_are_measured_until_the_fit_stands_for_them(measured, unbounded):
    plain, percent = _gpt(), _percent()
    measured.clear()
    model = wrap_model(copy.deepcopy(plain), f"budget:{percent}%")
    shapes = [(64, 4), (96, 4), (80, 4), (72, 4), (64, 2), (96, 2), (80, 2), (72, 2), (88, 3), (72, 1), (72, 1)]
    for length, batch in shapes:
        _same_step(model, plain, length, batch=batch)
        current = model.ckptwrap_plan
        if measured[-1] != ("step", length, batch):
            assert current.predicted_peak <= current.budget
            if batch == 1:  # whole modules only: a batch of one runs other operators
                assert all(entry.option == "recompute" for entry in current.selected)
    # Each new batch is measured until its terms are told apart; then (88, 3), between
    # the batches and lengths measured, is a solve, and so is a batch of one (a line
    # through batches 2 and 4, half the smallest away).
    assert {entry[2] for entry in measured} == {4, 2}, str(measured)
    assert len(measured) <= 8, str(measured)


def test_unwrap_removes_the_hooks_and_every_plan_mid_step(measured):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", example_inputs=_batch(64))
    model(*_batch(128))  # a measuring step's forward, its backward never taken
    assert marked(model) and model._forward_pre_hooks and model._forward_hooks
    unwrap_model(model)
    assert marked(model) == [] and not model._forward_pre_hooks and not model._forward_hooks
    assert "ckptwrap_plan" not in model.__dict__
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert _get_current_dispatch_mode_stack() == []  # the measuring meter is gone too
    measured.clear()
    _same_step(model, plain, 256)
    assert measured == [] and marked(model) == []


def test_learned_costs_survive_pickling_and_deep_copying(measured):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    _trained(model, plain, (64, 256, 128, 192, 160))
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        measured.clear()
        for length in (64, 256, 176):
            _same_step(copied, plain, length)
            _same_step(model, plain, length)
            assert marked(copied) == copied.ckptwrap_plan.names == model.ckptwrap_plan.names
        assert measured == []


def test_a_shape_out_of_reach_runs_under_its_plan_of_least_memory(measured):
    plain = _gpt()
    budget = _budget_at(plain, 64, 0.9)  # far below what any plan reaches at 256
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    with pytest.warns(UserWarning, match=r"at inputs of length 256 peaked at .* under the plan of least memory"):
        _same_step(model, plain, 256)  # measured: the plan of least memory already, said at its end
    _same_step(model, plain, 64)
    with pytest.warns(UserWarning, match=r"no plan fits budget:.* at inputs of length 256; .*plan of least memory"):
        _same_step(model, plain, 256)  # solved, met again after another shape
    lowest = model.ckptwrap_plan
    assert lowest.names and lowest.predicted_peak > budget
    peak = _same_step(model, plain, 256)
    assert abs(peak - lowest.predicted_peak) <= TOLERANCE * lowest.predicted_peak
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once while the shape stays
        _same_step(model, plain, 256)
        _same_step(model, plain, 64)  # in reach again
    first = plan(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    assert model.ckptwrap_plan.names == first.names


def test_follow_shapes_false_keeps_the_first_plan_solved(measured):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", follow_shapes=False)
    _trained(model, plain, (64, 64))  # measured, then solved
    first = markings(model)
    _trained(model, plain, (256, 128))
    assert markings(model) == first and measured == [("step", 64, 1)]


def test_follow_shapes_must_be_a_bool_or_none():
    model = _gpt()
    with pytest.raises(CheckpointConfigError, match=r"follow_shapes must be True, False or None.*got 'yes'"):
        wrap_model(model, "budget:80%", follow_shapes="yes")
    assert marked(model) == [] and not model._forward_pre_hooks


def test_in_a_process_group_planning_needs_no_collective(monkeypatch, measured):
    """Each rank learns from its own steps: nothing is gathered, so ranks whose batches
    differ in shape or layout never wait on one another."""
    def refuse(*args, **kwargs):
        raise AssertionError("planning called a collective")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    # The test's own meter (torch.profiler) describes an initialized group by its backend,
    # which this stand-in lacks: it is asked for nothing then.
    monkeypatch.setattr(profiler_module._KinetoProfile, "_get_distributed_info", lambda self: None)
    for collective in ("all_gather_object", "all_gather", "all_reduce", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(dist, collective, refuse)
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    _trained(model, plain, (64, 128, 256, 128, 64, 256))
    assert len(model.ckptwrap_plan.names) > 0

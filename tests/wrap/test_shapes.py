"""Budget plans follow the input shape: a training forward whose inputs no plan made so
far serves is profiled and planned before it goes on, and plans are kept per shape bucket.

Every step is compared with the plain model on the same inputs and seed; the training
step's peak is measured with the allocator meter of ``_meter`` and compared with the
applied plan's own prediction; profiling is counted by wrapping the planner's ``profile_modules``.
"""

from __future__ import annotations

import copy
import functools
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

import ckptwrap.planner._costs as costs
import ckptwrap.wrap._model as wrap_module
from ckptwrap import plan, unwrap_model, wrap_model
from ckptwrap._errors import CheckpointConfigError

from ._models import assert_same, grads, marked, markings
from ._meter import allocator_step_peak
from .test_budget import reachable_share
from .test_prediction import TOLERANCE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

_VOCAB = 64


def _gpt(layers: int = 4, seq_len: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=_VOCAB, width=32, heads=2, layers=layers, seq_len=seq_len)).train()


def _batch(length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(_VOCAB, (1, length + 1), generator=torch.Generator().manual_seed(length))
    return ids[:, :-1], ids[:, 1:]


def _step(model: torch.nn.Module, length: int, seed: int = 1) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(*_batch(length))
    loss.backward()
    return loss.detach()


def _same_step(model: torch.nn.Module, plain: torch.nn.Module, length: int) -> None:
    """One step of each at ``length``; losses and gradients bit for bit equal."""
    assert_same({"loss": _step(model, length)}, {"loss": _step(plain, length)}, f"loss at {length}")
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
def profiled(monkeypatch) -> List[int]:
    """The sequence length of every profile the planner makes."""
    lengths: List[int] = []
    original = costs.profile_modules

    def counting(model, names, args, kwargs, **options):
        lengths.append(args[0].shape[1])
        return original(model, names, args, kwargs, **options)

    monkeypatch.setattr(costs, "profile_modules", counting)
    return lengths


def _budget_at(model: torch.nn.Module, length: int, share: float) -> int:
    return int(share * plan(model, "blocks", example_inputs=_batch(length)).plain_peak)


def test_a_training_loop_over_lengths_stays_under_an_absolute_budget(profiled):
    plain = _gpt(layers=8, seq_len=512)
    budget = _budget_at(plain, 256, 0.65)  # checkpoints nothing at 64 and 128, most at 512
    profiled.clear()
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B")
    applied = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notes that a plan was made
        for length in (64, 256, 128, 512, 64):
            _same_step(model, plain, length)
            current = model.ckptwrap_plan
            assert current.budget == budget and current.predicted_peak <= budget
            assert marked(model) == current.names
            applied.setdefault(length, current)
            measured = _peak(model, length)  # a step of the same shape: no profiling
            assert measured <= budget * (1 + TOLERANCE), (length, measured, budget)
            assert abs(current.predicted_peak - measured) <= TOLERANCE * measured, (length, current)
            _same_step(model, plain, length)  # the metered step left nothing behind
    assert profiled == [64, 256, 128, 512]  # each bucket once, the second 64 from the cache
    assert applied[64].names == [] and applied[128].names == []
    assert len(applied[256].names) < len(applied[512].names)
    # The plan made at 64 checkpoints nothing: kept for 512 it would exceed the budget.
    assert applied[512].plain_peak > 2 * budget


def test_a_percent_budget_is_read_against_each_shapes_own_memory(profiled):
    plain = _gpt()
    policy = f"budget:{_percent()}%"
    model = wrap_model(copy.deepcopy(plain), policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (64, 256):
            _same_step(model, plain, length)
            applied = model.ckptwrap_plan
            alone = plan(copy.deepcopy(plain), policy, example_inputs=_batch(length))
            assert (applied.plain_peak, applied.budget) == (alone.plain_peak, alone.budget)
            assert applied.budget == int(_percent() / 100 * alone.plain_peak)
    assert profiled == [64, 64, 256, 256]  # the model's plan, and plan() beside it


def test_each_new_bucket_is_announced_once_and_smaller_inputs_reuse_its_plan(profiled):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    with pytest.warns(UserWarning, match="first training forward"):
        _same_step(model, plain, 128)
    with pytest.warns(UserWarning, match=r"inputs of shapes \(1, 64\), \(1, 64\) \(a new shape bucket\)"):
        _same_step(model, plain, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for length in (128, 100, 64, 33, 128):  # 100 is served by 128's plan, 33 by 64's
            _same_step(model, plain, length)
    assert profiled == [128, 64]


def test_a_larger_input_in_a_bucket_is_planned_for_before_it_runs(profiled):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same_step(model, plain, 160)
    with pytest.warns(UserWarning, match="larger than its bucket's plans were measured at"):
        _same_step(model, plain, 256)  # the same bucket, but 160's plan was measured smaller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same_step(model, plain, 160)
        _same_step(model, plain, 200)
    assert profiled == [160, 256]


def test_a_backward_pending_across_a_switch_is_unaffected(profiled):
    plain = _gpt()
    budget = _budget_at(plain, 256, 0.6)  # nothing to checkpoint at 64, some at 256
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    first_plan = model.ckptwrap_plan
    results = []
    for each in (model, plain):
        each.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        first = each(*_batch(64))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            second = each(*_batch(256))  # switches the plan while first's backward waits
        (first + second).backward()
        results.append(({"loss": (first + second).detach()}, grads(each)))
    assert first_plan.names == [] and model.ckptwrap_plan.names  # the switch took place
    assert_same(*[losses for losses, _ in results])
    assert_same(*[gradients for _, gradients in results], "gradients")
    assert profiled == [256, 64, 256]


def test_example_inputs_plan_the_first_bucket_and_wrapping_again_changes_nothing(profiled):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", example_inputs=_batch(256))
    before = markings(model), dict(model._forward_pre_hooks)
    wrap_model(model, f"budget:{_percent()}%", example_inputs=_batch(256))
    wrap_model(model, f"budget:{_percent()}%")
    assert (markings(model), dict(model._forward_pre_hooks)) == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same_step(model, plain, 256)
        _same_step(model, plain, 200)
    with pytest.warns(UserWarning, match="a new shape bucket"):
        _same_step(model, plain, 64)
    assert profiled == [256, 64]


def test_unwrap_removes_the_shape_hook_and_every_plan(profiled):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", example_inputs=_batch(64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same_step(model, plain, 128)
    assert marked(model) and model._forward_pre_hooks
    unwrap_model(model)
    assert marked(model) == [] and not model._forward_pre_hooks
    assert "ckptwrap_plan" not in model.__dict__
    profiled.clear()
    _same_step(model, plain, 256)
    assert profiled == [] and marked(model) == []


def test_plans_kept_per_bucket_survive_pickling_and_deep_copying(profiled):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (64, 256):
            _same_step(model, plain, length)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        profiled.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for length in (64, 256):
                _same_step(copied, plain, length)
                assert marked(copied) == copied.ckptwrap_plan.names
        assert profiled == []
        assert markings(model)["<plan>"] == markings(copied)["<plan>"]


def test_switching_plans_leaves_modules_marked_by_other_wrappings(profiled):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), "name:blocks.3")
    budget = _budget_at(plain, 256, 0.6)
    wrap_model(model, f"budget:{budget}B", example_inputs=_batch(64))
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (64, 256, 64):
            _same_step(model, plain, length)
            recorded = model.ckptwrap_plan
            assert marked(model) == recorded.names and "blocks.3" in recorded.names
            assert recorded.policy == f"name:blocks.3 + budget:{budget}B"
            counts.append(len(recorded.names))
    assert counts[0] == counts[2] == 1 < counts[1] and profiled == [256, 64, 256]


def test_a_budget_out_of_reach_at_a_new_shape_keeps_the_previous_plan(profiled):
    plain = _gpt()
    budget = _budget_at(plain, 64, 0.9)  # far below what any plan reaches at 256
    profiled.clear()
    model = wrap_model(copy.deepcopy(plain), f"budget:{budget}B", example_inputs=_batch(64))
    before = markings(model)
    with pytest.raises(
        CheckpointConfigError,
        match=r"inputs of shapes \(1, 256\), \(1, 256\), which no plan .* failed; the previous "
        r"plan is still applied\. .*below the smallest reachable peak",
    ):
        _step(model, 256)
    assert markings(model) == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same_step(model, plain, 64)
    assert profiled == [64, 256]


def test_follow_shapes_false_keeps_the_first_plan(profiled):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", follow_shapes=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same_step(model, plain, 64)
    first = markings(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same_step(model, plain, 256)
    assert markings(model) == first and profiled == [64]


def test_follow_shapes_must_be_a_bool_or_none():
    model = _gpt()
    with pytest.raises(CheckpointConfigError, match=r"follow_shapes must be True, False or None.*got 'yes'"):
        wrap_model(model, "budget:80%", follow_shapes="yes")
    assert marked(model) == [] and not model._forward_pre_hooks


def _in_a_group_of_two(monkeypatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    # The profiler that measures the training step describes an initialized group by its
    # backend, which this stand-in lacks: it is asked for nothing then.
    monkeypatch.setattr(profiler_module._KinetoProfile, "_get_distributed_info", lambda self: None)


def test_in_a_process_group_new_shapes_are_noted_not_planned_by_default(monkeypatch, profiled):
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", example_inputs=_batch(64))
    first = markings(model)
    _in_a_group_of_two(monkeypatch)
    with pytest.warns(UserWarning, match=r"process group of 2 ranks .* follow_shapes=True"):
        _same_step(model, plain, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per bucket
        _same_step(model, plain, 256)
    assert markings(model) == first and profiled == [64]


def test_planning_again_goes_through_the_agreement_of_ranks(monkeypatch, profiled):
    agreed = []

    def agreeing(model, made):
        agreed.append(made)
        return made

    monkeypatch.setattr(wrap_module, "agreed_plan", agreeing)
    plain = _gpt()
    model = wrap_model(copy.deepcopy(plain), f"budget:{_percent()}%", example_inputs=_batch(64), follow_shapes=True)
    _in_a_group_of_two(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same_step(model, plain, 256)
    assert len(agreed) == 2 and model.ckptwrap_plan.names == agreed[1].names
    assert profiled == [64, 256]


def test_shape_buckets_round_every_dimension_up_to_a_power_of_two():
    from ckptwrap.planner._shapes import bucket_of, input_shapes

    def bucket(*args, **kwargs):
        return bucket_of(input_shapes(args, kwargs))

    assert bucket(torch.zeros(3, 65)) == bucket(torch.zeros(4, 128)) != bucket(torch.zeros(4, 129))
    assert bucket(torch.zeros(1, 1)) != bucket(torch.zeros(1, 2))
    assert bucket(torch.zeros(2, 8)) != bucket(torch.zeros(2, 8, dtype=torch.float64))
    assert bucket(x=torch.zeros(2), y=None) == bucket(y=None, x=torch.zeros(2))
    assert bucket(torch.zeros(2)) != bucket(torch.zeros(2), None)

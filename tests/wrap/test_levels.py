"""Selective levels in budget plans: derived from measured operators, applied per module,
shown in the plan, and kept through pickling, deep copies, unwrapping and wrapping again.

Where the test needs the solver to pick a level regardless of its own trade-offs, the
planner's ``solve_budget`` is replaced by one that checkpoints every candidate at its
most saving level; gradients are always compared with the plain model's.
"""

from __future__ import annotations

import collections
import copy
import json
import pickle
import types
from typing import Any, Dict, Iterator, List

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckptwrap
from ckptwrap import CheckpointConfigError
import ckptwrap.measure._metering as calls
import ckptwrap.planner._planner as choosing
import ckptwrap.planner._peak_model as costs
from ckptwrap import plan, unwrap_model, wrap_model
from ckptwrap.planner import ShapePlanner
from ckptwrap.wrap import profile_modules
from ckptwrap.planner._peak_model import CostItem, predicted_peak
from ckptwrap.planner._peak_model import MAX_LEVELS, selective_levels
from ckptwrap.measure._costs import OpCost
from ckptwrap.wrap._marks import apply_plan
from ckptwrap.wrap._planning import plan_and_profile
from ckptwrap.wrap._selective import SavedInstances

from ._models import TinyGPT, assert_same, gpt_batch, gpt_loss, grads, make, marked, markings, step

BLOCKS = [f"h.{i}" for i in range(4)]


@pytest.fixture(autouse=True)
def _no_selective_overhead(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about carrying levels out, so the blocks must have some: on a block
    this small the measured dispatch overhead of selective checkpointing can exceed
    every time a level saves, and the planner then rightly offers none. The overhead's own
    effect is tested on made-up costs below."""
    monkeypatch.setattr(calls, "selective_cost", lambda: 0.0)


@pytest.fixture
def deepest(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The planner's solver checkpoints every candidate at its last (most saving) level."""

    def solve(items, budget, *, base, **_: Any):
        selected = tuple(range(len(items)))
        options = tuple(len(item.options) for item in items)
        return types.SimpleNamespace(
            selected=selected, options=options, segments=(), predicted_peak=int(budget)
        )

    monkeypatch.setattr(choosing, "solve_budget", solve)
    yield


def _example() -> torch.Tensor:
    return gpt_batch()[0]


def _levelled(policy: str = "budget:50%") -> torch.nn.Module:
    return wrap_model(make(TinyGPT), policy, example_inputs=(_example(),))


# --------------------------------------------------------------------------- deriving levels


def _op(name: str, index: int, nbytes: int, saved: bool = True, time: float = 1.0, mutated: bool = False) -> OpCost:
    return OpCost(name, index, nbytes, saved, 0, time, mutated)


def _cost(ops: List[OpCost], kept: int, peak: int = 0) -> Any:
    return types.SimpleNamespace(ops=tuple(ops), kept_bytes=kept, forward_peak_bytes=peak)


def test_levels_take_saved_new_outputs_by_time_per_byte():
    ops = [
        _op("mm", 0, 100, time=4.0),  # 0.04 s/B
        _op("view", 0, 0, saved=False),
        _op("relu", 0, 100, time=1.0),  # 0.01 s/B
        _op("mm", 1, 50, saved=False, time=9.0),  # not saved by autograd: never a candidate
        _op("empty_like", 0, 100, time=3.0, mutated=True),  # written in place later
        _op("mm", 2, 100, time=2.0),  # 0.02 s/B
    ]
    item = CostItem("b", kept=300, inputs=10, time=20.0)
    levels = selective_levels(_cost(ops, kept=300, peak=400), item)
    assert [level.instances for level in levels] == [
        (("mm", 0),),
        (("mm", 0), ("mm", 2)),
    ], "the third prefix holds all 300 kept bytes (+ inputs): no less than keeping"
    first, second = (level.option for level in levels)
    assert (first.inputs, first.time, first.rebuilt) == (110, 16.0, 300)
    assert (second.inputs, second.time, second.rebuilt) == (210, 14.0, 200)
    assert second.label == "save mm x2"


def test_levels_are_pareto_capped_and_spread():
    ops = [_op("mm", i, 10, time=1.0 + 0.01 * i) for i in range(20)] + [_op("relu", 0, 10, time=0.0)]
    item = CostItem("b", kept=10_000, inputs=0, time=30.0)
    levels = selective_levels(_cost(ops, kept=10_000), item)
    assert len(levels) == MAX_LEVELS
    held = [level.option.inputs for level in levels]
    assert held[0] == 10 and held[-1] == 200 and held == sorted(held)
    times = [level.option.time for level in levels]
    assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
    assert all(("relu", 0) not in level.instances for level in levels), "saves no time"


def test_operator_times_adding_up_to_more_than_the_block_are_scaled_down():
    ops = [_op("mm", 0, 10, time=3.0), _op("gelu", 0, 10, time=1.0)]
    item = CostItem("b", kept=1000, inputs=0, time=2.0)
    levels = selective_levels(_cost(ops, kept=1000), item)
    assert [level.option.time for level in levels] == [0.5, 0.0]


def test_the_selective_overhead_is_charged_twice_and_drops_levels_it_outweighs():
    ops = [_op("mm", 0, 100, time=4.0), _op("relu", 0, 100, time=1.0), _op("mm", 1, 100, time=2.0)]
    item = CostItem("b", kept=400, inputs=10, time=20.0)
    free = selective_levels(_cost(ops, kept=400, peak=400), item)
    assert [level.option.time for level in free] == [16.0, 14.0, 13.0]
    costly = _cost(ops, kept=400, peak=400)
    costly.selective_overhead = 1.75  # forward and recomputation: 3.5 s per level
    charged = selective_levels(costly, item)
    assert [level.option.time for level in charged] == [19.5, 17.5, 16.5]
    # An overhead above half of what any level saves leaves none.
    costly.selective_overhead = 3.6
    assert selective_levels(costly, item) == ()
    assert selective_levels(_cost(ops, kept=400, peak=400), item, overhead=3.6) == ()


# --------------------------------------------------------------------------- applying levels


class _Count(TorchDispatchMode):
    """Counts operator calls that really run while a region is recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.recomputed: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if ckptwrap.is_recomputing():
            self.recomputed[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _recomputed(model: torch.nn.Module) -> collections.Counter:
    counter = _Count()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = gpt_loss(model, gpt_batch())
    with counter, ckptwrap.set_checkpoint_early_stop(False):
        loss.backward()
    return counter.recomputed


def test_a_level_trains_like_the_plain_model_and_skips_its_saved_operators(deepest):
    plain = make(TinyGPT)
    model = _levelled()
    entries = model.ckptwrap_plan.selected
    assert [e.name for e in entries] == BLOCKS
    assert all(e.saved_ops and e.option.startswith("save ") for e in entries)
    for _ in range(2):
        assert_same({"loss": step(model, gpt_loss, gpt_batch())}, {"loss": step(plain, gpt_loss, gpt_batch())})
        assert_same(grads(model), grads(plain), "gradients with selective levels")

    whole = _levelled("budget:50%;recompute")
    assert all(e.option == "recompute" and not e.saved_ops for e in whole.ckptwrap_plan.selected)
    full, levelled = _recomputed(whole), _recomputed(model)
    saved = collections.Counter(name for e in entries for name, _ in e.saved_ops)
    for name in set(full) | set(levelled):
        assert full[name] - levelled[name] == saved[name], f"{name}: saved calls still recomputed"
    assert sum(saved.values()) > 0


class _Drawing(torch.nn.Module):
    """A block that draws twice: a dropout of its gate (a few bytes, so a level saving
    by time per byte takes it first) and one of its output, fused as a GPU runs
    ``F.dropout`` (one operator that returns new storages, output and mask)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.ones(width))
        self.a = torch.nn.Linear(width, 4 * width)
        self.b = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.native_dropout(self.gate, 0.5, True)[0]
        hidden = self.a(x * gate).relu()
        return x + torch.native_dropout(self.b(hidden), 0.5, True)[0]


def _drawing_stack() -> torch.nn.Module:
    return torch.nn.Sequential(*[_Drawing() for _ in range(4)])


def test_a_level_never_saves_an_operator_that_drew_random_numbers(deepest):
    """Saved, a dropout would be skipped by the recomputation, and every draw after it in
    the block would give other numbers than the forward's: no level saves one, and every
    block at its most saving level trains like the plain model, bit for bit."""
    batch = torch.randn(8, 12, 16, generator=torch.Generator().manual_seed(5))

    def loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    plain = make(_drawing_stack)
    model = wrap_model(make(_drawing_stack), "budget:50%", example_inputs=(batch,))
    entries = model.ckptwrap_plan.selected
    assert len(entries) == 4 and all(e.saved_ops for e in entries)  # levels are still offered
    assert not [op for e in entries for op in e.saved_ops if op[0] == "native_dropout"]
    for _ in range(2):
        assert_same({"loss": step(model, loss, batch)}, {"loss": step(plain, loss, batch)})
        assert_same(grads(model), grads(plain), "gradients with drawing blocks at selective levels")


def test_a_budget_between_a_level_and_keeping_chooses_the_level():
    model = make(TinyGPT)
    # The planner's own profile: with the measured training step, whose terms it adds.
    profile = profile_modules(model, ["h.1"], (_example(),), step=True)
    [(_, item)], _, tail = costs.step_items(profile, ["h.1"], levels=True)
    assert item.options, "the block has levels to choose from"
    keep = predicted_peak([item], [], base=profile.base_bytes, tail=tail)
    peaks = [
        predicted_peak([item], [0], base=profile.base_bytes, tail=tail, options={0: k})
        for k in range(1, len(item.options) + 1)
    ]
    budget = min(peaks)
    assert budget < keep
    # Planned from the same profile: the levels are those priced above.
    made, _ = plan_and_profile(
        model, f"name:h.1;budget:{budget}B", example_inputs=(_example(),), profile=profile
    )
    [entry] = made.selected
    assert entry.saved_ops and entry.option != "recompute"
    assert made.predicted_peak <= budget
    apply_plan(model, made)
    assert _contexts(model) == {"h.1": SavedInstances(entry.saved_ops)}
    plain = make(TinyGPT)
    assert_same({"loss": step(model, gpt_loss, gpt_batch())}, {"loss": step(plain, gpt_loss, gpt_batch())})
    assert_same(grads(model), grads(plain), "gradients with the chosen level")


# --------------------------------------------------------------------------- showing levels


def test_the_plan_table_and_json_show_each_option(deepest):
    made = plan(make(TinyGPT), "budget:50%", example_inputs=(_example(),))
    text = str(made)
    header = next(line for line in text.splitlines() if line.strip().startswith("module"))
    assert header.split()[-1] == "option"
    for entry in made.selected:
        assert entry.option in text
    data = json.loads(json.dumps(made.to_dict()))
    for shown, entry in zip(data["selected"], made.selected):
        assert shown["option"] == entry.option
        assert [tuple(op) for op in shown["saved_ops"]] == list(entry.saved_ops)

    whole = plan(make(TinyGPT), "budget:50%;recompute", example_inputs=(_example(),))
    assert all(entry["option"] == "recompute" for entry in whole.to_dict()["selected"])
    assert "option" not in str(plan(make(TinyGPT), "blocks"))


# --------------------------------------------------------------------------- keeping levels


def _contexts(model: torch.nn.Module) -> Dict[str, Any]:
    modules = dict(model.named_modules())
    return {name: modules[name].__dict__["forward"].options.context_fn for name in marked(model)}


def test_levels_survive_pickling_and_deep_copying(deepest):
    model = _levelled()
    expected = {e.name: SavedInstances(e.saved_ops) for e in model.ckptwrap_plan.selected}
    assert _contexts(model) == expected
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert _contexts(copied) == expected
        assert copied.ckptwrap_plan == model.ckptwrap_plan
        assert_same({"loss": step(copied, gpt_loss, gpt_batch())}, {"loss": step(model, gpt_loss, gpt_batch())})
        assert_same(grads(copied), grads(model), "gradients of the copy")


def test_wrapping_again_and_unwrapping_with_levels(deepest):
    model = _levelled()
    before = markings(model)
    wrap_model(model, "budget:50%", example_inputs=(_example(),))
    assert markings(model) == before, "wrapping twice is a no-op"
    again = plan(model, "budget:50%", example_inputs=(_example(),))  # no "different options"
    assert again.names == []
    with pytest.raises(CheckpointConfigError, match="already wrapped with 'budget:50%'"):
        wrap_model(model, "blocks")  # another policy over a budget: refused, nothing changed
    assert markings(model)["h.0"] is before["h.0"]
    unwrap_model(model)
    assert marked(model) == [] and "ckptwrap_plan" not in model.__dict__


def test_switching_shape_plans_switches_each_modules_level(monkeypatch):
    plans = iter([len, lambda options: 1])  # the first shape's deepest level, then the first

    def solve(items, budget, *, base, **_: Any):
        pick = next(plans)
        return types.SimpleNamespace(
            selected=tuple(range(len(items))),
            options=tuple(pick(item.options) for item in items),
            segments=(),
            predicted_peak=int(budget),
        )

    monkeypatch.setattr(choosing, "solve_budget", solve)
    monkeypatch.setattr("ckptwrap.planner._planner.LEARN_SHARE", 0.0)  # two solves, no more
    # The made-up solutions' predictions are no plan's: checks against them would miss.
    monkeypatch.setattr(ShapePlanner, "_step_checked", lambda *args, **kwargs: None)
    model = wrap_model(make(TinyGPT), "budget:50%")
    short = (gpt_batch()[0][:, :4], gpt_batch()[1][:, :4])
    full = gpt_batch()
    step(model, gpt_loss, full)  # each shape's first step is measured
    step(model, gpt_loss, short)
    step(model, gpt_loss, full)
    first = dict(_contexts(model))
    step(model, gpt_loss, short)
    second = dict(_contexts(model))
    assert first != second, "the two shapes' levels name different operator calls"
    step(model, gpt_loss, full)
    assert _contexts(model) == first
    assert _contexts(model) == {e.name: SavedInstances(e.saved_ops) for e in model.ckptwrap_plan.selected}
    plain = make(TinyGPT)
    for batch in (full, short):
        assert_same({"loss": step(model, gpt_loss, batch)}, {"loss": step(plain, gpt_loss, batch)})
        assert_same(grads(model), grads(plain), "gradients after switching")

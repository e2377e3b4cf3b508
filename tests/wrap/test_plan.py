"""What ``wrap_model`` selects and leaves out: plans, wrapping twice, nesting, errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import CheckpointWrapper, checkpointed, plan, unwrap_model, wrap_model
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.engine import CheckpointOptions

from ._models import (
    Block,
    ConvNet,
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
)
from .test_budget import reachable_share

VARIANTS = pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])


# --------------------------------------------------------------------------- double wrapping


@VARIANTS
def test_wrapping_twice_is_a_no_op(use_reentrant):
    model = wrap_model(make(TinyGPT), "blocks", use_reentrant=use_reentrant)
    first = markings(model)
    second_plan = plan(model, "blocks", use_reentrant=use_reentrant)
    assert second_plan.names == []
    assert [name for name, _ in second_plan.dropped] == [f"h.{i}" for i in range(4)]
    assert all("already checkpointed" in reason for _, reason in second_plan.dropped)

    first_plan = model.ckptwrap_plan
    wrap_model(model, "blocks", use_reentrant=use_reentrant)
    again = markings(model)
    assert {k: v for k, v in again.items() if k != "<plan>"} == {k: v for k, v in first.items() if k != "<plan>"}
    # The kept plan still says what is checkpointed, not "0 modules, all already checkpointed".
    assert model.ckptwrap_plan == first_plan
    assert model.ckptwrap_plan.names == marked(model) == [f"h.{i}" for i in range(4)]

    log = recompute_counts(model, gpt_loss, gpt_batch())
    assert log.recomputed["h.0.attn.qkv"] == 1, "the block is recomputed more than once: nested checkpoint"
    assert log.recomputed["h.0.mlp.fc"] == 1

    unwrap_model(model)
    assert marked(model) == []


def test_wrapping_more_on_top_records_everything_checkpointed():
    model = wrap_model(make(TinyGPT), "every:2")
    wrap_model(model, "blocks")
    recorded = model.ckptwrap_plan
    assert recorded.names == marked(model) == [f"h.{i}" for i in range(4)]
    assert recorded.policy == "every:2 + blocks"
    assert not any("already checkpointed" in reason for _, reason in recorded.dropped)
    assert "4 module(s)" in str(recorded)


@VARIANTS
def test_selecting_inside_checkpointed_blocks_later_nests_nothing(use_reentrant):
    model = wrap_model(make(TinyGPT), "blocks", use_reentrant=use_reentrant)
    wrap_model(model, "type:MLP", use_reentrant=use_reentrant)
    assert marked(model) == [f"h.{i}" for i in range(4)]
    assert all("inside checkpointed" in reason for _, reason in model.ckptwrap_plan.dropped)
    log = recompute_counts(model, gpt_loss, gpt_batch())
    assert log.recomputed["h.0.mlp.fc"] == 1


@VARIANTS
def test_selecting_around_checkpointed_modules_later_nests_nothing(use_reentrant):
    """Blocks selected after their MLPs were wrapped: without nested=True no checkpointed
    region may end up inside another (each region recomputed once per backward)."""
    plain = make(TinyGPT)
    model = wrap_model(copy.deepcopy(plain), "type:MLP", use_reentrant=use_reentrant)
    wrap_model(model, "blocks", use_reentrant=use_reentrant)
    assert marked(model) == [f"h.{i}.mlp" for i in range(4)]
    assert [name for name, _ in model.ckptwrap_plan.dropped] == [f"h.{i}" for i in range(4)]
    log = recompute_counts(model, gpt_loss, gpt_batch())
    assert log.recomputed["h.0.mlp.fc"] <= 1, (
        f"h.0.mlp.fc recomputed {log.recomputed['h.0.mlp.fc']} times in one backward: "
        f"wrap_model nested a checkpoint without nested=True"
    )
    step(plain, gpt_loss, gpt_batch())
    assert_same(grads(model), grads(plain), "gradients")


def test_wrapping_again_with_different_options_is_an_error_and_changes_nothing():
    model = wrap_model(make(TinyGPT), "every:2")
    before = markings(model)
    with pytest.raises(CheckpointConfigError, match=r"h\.0 \(Block\) is already checkpointed by wrap_model.*unwrap_model"):
        wrap_model(model, "blocks", use_reentrant=True)
    assert markings(model) == before
    assert model.ckptwrap_plan is before["<plan>"]


def test_modules_checkpointed_by_the_model_itself_are_respected():
    class Decorated(Block):
        forward = checkpointed(Block.forward)

    model = make(TinyGPT)
    model.h[0] = CheckpointWrapper(model.h[0])
    model.h[1] = make(Decorated)
    result = plan(model, "type:Block,Decorated,CheckpointWrapper")
    assert result.names == ["h.2", "h.3"]
    reasons = dict(result.dropped)
    assert "already checkpointed by CheckpointWrapper" in reasons["h.0"]
    assert "already checkpointed by @checkpointed" in reasons["h.1"]
    assert "inside checkpointed h.1" in plan(model, "type:MLP").dropped[1][1]

    with pytest.raises(CheckpointConfigError, match=r"h\.0 \(CheckpointWrapper\) is already checkpointed by CheckpointWrapper"):
        wrap_model(model, "name:h.0", use_reentrant=True)
    with pytest.raises(CheckpointConfigError, match=r"h\.1 \(Decorated\) is already checkpointed by @checkpointed"):
        wrap_model(model, "name:h.1", preserve_rng_state=False)
    assert marked(model) == []


# --------------------------------------------------------------------------- nesting


def test_a_child_of_a_selected_parent_is_left_out_with_a_reason():
    model = make(TinyGPT)
    result = plan(model, "type:Block,MLP")
    assert result.names == [f"h.{i}" for i in range(4)]
    assert result.dropped == tuple(
        (f"h.{i}.mlp", f"inside checkpointed h.{i} (pass nested=True to nest)") for i in range(4)
    )
    text = str(result)
    assert "h.2.mlp" in text and "inside checkpointed h.2" in text

    wrap_model(model, "type:Block,MLP")
    assert marked(model) == result.names
    assert model.ckptwrap_plan == result


@VARIANTS
def test_nested_true_keeps_both_and_gradients_still_match(use_reentrant):
    plain = make(TinyGPT)
    model = wrap_model(copy.deepcopy(plain), "type:Block,MLP", nested=True, use_reentrant=use_reentrant)
    expected = [name for i in range(4) for name in (f"h.{i}", f"h.{i}.mlp")]
    assert model.ckptwrap_plan.names == expected
    assert marked(model) == expected
    assert model.ckptwrap_plan.dropped == ()

    log = recompute_counts(model, gpt_loss, gpt_batch())
    assert log.recomputed["h.0.attn.qkv"] == 1
    assert log.recomputed["h.0.mlp.fc"] >= 1
    step(plain, gpt_loss, gpt_batch())
    assert_same(grads(model), grads(plain), "gradients with nested checkpoints")


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "policy, options, match",
    [
        ("blokcs", {}, "unknown term 'blokcs'.*did you mean 'blocks'"),
        ("type:Blok", {}, "type:Blok matches no module"),
        ("name:encoder.*", {}, "name:encoder.* matches no qualified name"),
        ("every:0", {}, "every"),
        (["blocks"], {}, "tuple of classes, not a list"),
        ("blocks", {"reentrant": True}, "'reentrant'.*allowed"),
        ("blocks", {"determinism_check": "exact"}, "determinism_check"),
        ("blocks", {"nested": "yes"}, "nested must be True or False"),
    ],
)
def test_an_error_leaves_the_model_unchanged(policy, options, match):
    model = make(TinyGPT)
    fresh = markings(model)
    with pytest.raises(CheckpointConfigError, match=match):
        wrap_model(model, policy, **options)
    assert markings(model) == fresh

    wrap_model(model, "every:2")
    wrapped = markings(model)
    with pytest.raises(CheckpointConfigError, match=match):
        wrap_model(model, policy, **options)
    assert markings(model) == wrapped


def test_non_modules_are_rejected():
    with pytest.raises(CheckpointConfigError, match="got str"):
        wrap_model("model", "blocks")
    with pytest.raises(CheckpointConfigError, match="got list"):
        unwrap_model([nn.Linear(2, 2)])
    with pytest.raises(CheckpointConfigError, match="got int"):
        plan(3, "blocks")


# --------------------------------------------------------------------------- plan


def test_plan_does_not_change_the_model():
    model = make(TinyGPT)
    before = markings(model)
    result = plan(model, "every:2", use_reentrant=True)
    assert result.names == ["h.0", "h.2"]
    assert markings(model) == before
    assert "ckptwrap_plan" not in model.__dict__

    wrap_model(model, "last:1")
    wrapped = markings(model)
    plan(model, "blocks")
    plan(model, "type:Block,MLP", nested=True)
    assert markings(model) == wrapped


def test_plan_prints_as_a_table_with_the_names(capsys):
    model = make(TinyGPT)
    result = plan(model, "type:Block;every:2", use_reentrant=True)
    print(result)
    out = capsys.readouterr().out
    assert "type:Block;every:2" in out
    assert "use_reentrant=True" in out
    for name in result.names:
        assert name in out
    rows = [line.split() for line in out.splitlines()]
    assert ["module", "class"] in rows
    assert ["h.0", "Block"] in rows and ["h.2", "Block"] in rows
    assert ["h.1", "Block"] not in rows
    assert list(result) == result.names and len(result) == 2
    assert result.options == CheckpointOptions(use_reentrant=True)


def test_the_plan_is_recorded_and_removed_by_unwrap():
    model = make(ConvNet)
    result = plan(model, "blocks", early_stop=False)
    wrap_model(model, "blocks", early_stop=False)
    assert model.ckptwrap_plan == result
    assert model.ckptwrap_plan.names == ["blocks.0", "blocks.1", "blocks.2"]
    assert model.ckptwrap_plan.options == CheckpointOptions(early_stop=False)
    assert "ckptwrap_plan" not in dict(model.named_modules())  # not a submodule
    unwrap_model(model)
    assert not hasattr(model, "ckptwrap_plan")


def test_none_marks_nothing():
    model = make(TinyGPT)
    wrap_model(model, "none")
    assert marked(model) == []
    assert model.ckptwrap_plan.names == []


# --------------------------------------------------------------------------- containers


class _Items(nn.Module):
    """Runs the modules of an ``nn.ModuleList`` in turn."""

    def __init__(self, items) -> None:
        super().__init__()
        self.items = nn.ModuleList(items)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for item in self.items:
            x = item(x)
        return x


def test_containers_that_are_never_called_are_replaced_by_their_items():
    model = make(TinyGPT)
    result = plan(model, "all")
    assert result.names == ["wte", "wpe", "h.0", "h.1", "h.2", "h.3", "ln_f", "head"]
    assert dict(result.dropped)["h"].startswith("ModuleList is never called")
    wrap_model(model, "all")
    assert marked(model) == result.names


def test_the_plan_lists_expanded_containers_in_model_order():
    model = nn.Sequential(_Items([_Items([nn.Linear(2, 2)]), nn.Linear(2, 2)]))
    in_model_order = ["0.items.0", "0.items.0.items.0", "0.items.1"]
    assert plan(model, "type:ModuleList", nested=True).names == in_model_order
    wrap_model(model, "type:ModuleList", nested=True)
    assert marked(model) == model.ckptwrap_plan.names


# --------------------------------------------------------------------------- TorchScript and inference mode


_TORCHSCRIPT = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


@_TORCHSCRIPT
@pytest.mark.parametrize("how", ["script", "trace"])
def test_torchscript_models_are_refused_by_name(how):
    eager = make(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    compiled = torch.jit.script(eager) if how == "script" else torch.jit.trace(eager, torch.randn(2, 4))
    forward = compiled.__dict__.get("forward")
    with pytest.raises(CheckpointConfigError, match=r"cannot checkpoint the model \(Sequential, a TorchScript module"):
        wrap_model(compiled, "all")
    with pytest.raises(CheckpointConfigError, match=r"CheckpointWrapper cannot checkpoint .*TorchScript"):
        CheckpointWrapper(compiled)
    assert compiled.__dict__.get("forward") is forward and "ckptwrap_plan" not in compiled.__dict__


@_TORCHSCRIPT
def test_a_scripted_submodule_is_refused_by_its_name_and_nothing_is_applied():
    model = make(TinyGPT)
    model.h[2] = torch.jit.script(model.h[2].mlp)  # now an item of the block list too
    before = markings(model)
    with pytest.raises(CheckpointConfigError, match=r"wrap_model cannot checkpoint h\.2 \(MLP, a TorchScript module"):
        wrap_model(model, "name:h.*")
    assert markings(model) == before


@pytest.mark.parametrize("policy", ["blocks", "budget:80%"])
def test_plans_with_example_inputs_refuse_no_grad_naming_it(policy):
    """Under torch.no_grad() a plan made from example inputs would give a training step's
    peak (the measured step turns autograd on) for a forward that trains nothing: refused,
    naming no_grad and what reads an inference forward's peak; nothing is applied."""
    model = make(TinyGPT).train()
    batch = gpt_batch()
    with torch.no_grad():
        with pytest.raises(CheckpointConfigError, match=r"autograd is off here \(torch\.no_grad\(\)\).*measure_peak"):
            plan(model, policy, example_inputs=batch[:1])
        with pytest.raises(CheckpointConfigError, match=r"torch\.no_grad\(\)"):
            wrap_model(model, policy, example_inputs=batch[:1])
        assert plan(model, "blocks").names  # without example inputs nothing is measured: a selection
    assert marked(model) == [] and "ckptwrap_plan" not in model.__dict__


def test_budget_plans_refuse_inference_mode():
    model = make(TinyGPT).train()
    batch = gpt_batch()
    # Halfway between the smallest reachable step peak and the plain one: in reach.
    percent = math.ceil(50 + 50 * reachable_share(model, batch[:1]))
    policy = f"budget:{percent}%"
    with torch.inference_mode():
        with pytest.raises(CheckpointConfigError, match=rf"budget:{percent}%.*torch\.inference_mode\(\) is on"):
            plan(model, policy, example_inputs=batch[:1])
        with pytest.raises(CheckpointConfigError, match=r"torch\.inference_mode\(\) is on"):
            wrap_model(model, policy, example_inputs=batch[:1])
        inference_batch = batch[0].clone()
    assert marked(model) == [] and "ckptwrap_plan" not in model.__dict__
    with pytest.raises(CheckpointConfigError, match=r"example input \(shape \(\d+, \d+\)\) was created under torch\.inference_mode"):
        plan(model, policy, example_inputs=(inference_batch,))
    # The same inputs made outside inference mode plan as usual.
    assert plan(model, policy, example_inputs=(batch[0],)).names

"""Segments: consecutive modules checkpointed as one region, as checkpoint_sequential does.

The budget planner forms them when a module's only input is the previous candidate's
output; ``wrap_model`` runs the first module's region over the whole chain and hands
each later module the output the segment computed for it. Every test compares with the
same model run plainly from the same seeds.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import List, Tuple

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import plan, unwrap_model, wrap_model
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.planner import step_items
from ckptwrap.measure import region_bytes, step_device
from ckptwrap.wrap import profile_modules
from ckptwrap.planner import predicted_peak
from ckptwrap.planner._solver import solve_budget
from ckptwrap.planner import _peak_model
from ckptwrap.wrap._marks import apply_plan as _apply
from ckptwrap.engine._options import CheckpointOptions
from ckptwrap.planner._plan import Plan, PlanEntry

from ._models import (
    CallLog,
    ConvNet,
    TinyGPT,
    assert_same,
    conv_batch,
    conv_loss,
    gpt_batch,
    gpt_loss,
    grads,
    make,
    step,
    structure,
)


def _gpt(layers: int = 6) -> nn.Module:
    return make(lambda: TinyGPT(layers=layers, width=32)).train()


def _segment_plan(names: List[Tuple[str, ...]], kind: str = "Block") -> Plan:
    """A plan that checkpoints each tuple of names as one segment."""
    entries = []
    for group in names:
        entries.append(PlanEntry(group[0], kind))
        entries += [PlanEntry(name, kind, joins=before) for before, name in zip(group, group[1:])]
    return Plan(policy="segments (test)", options=CheckpointOptions(), selected=tuple(entries))


def _plain_reference(model: nn.Module, loss, batch):
    reference = copy.deepcopy(model)
    loss_value = step(reference, loss, batch)
    return reference, loss_value


def _recomputed(log: CallLog, names: List[str], child: str) -> List[int]:
    """How often each named block's ``child`` ran inside a recomputation."""
    return [log.recomputed[f"{name}.{child}"] for name in names]


# ------------------------------------------------------------------------ running segments


def test_a_segment_recomputes_each_member_once_with_equal_gradients():
    model = _gpt()
    reference, expected_loss = _plain_reference(model, gpt_loss, gpt_batch())
    _apply(model, _segment_plan([("h.0", "h.1", "h.2"), ("h.3", "h.4")]))
    log = CallLog()
    with log.watching(model):
        loss = step(model, gpt_loss, gpt_batch())
    assert torch.equal(loss, expected_loss)
    assert_same(grads(model), grads(reference), "segments")
    blocks = [f"h.{i}" for i in range(6)]
    assert _recomputed(log, blocks, "attn") == [1, 1, 1, 1, 1, 0]
    # The model's forward still called every block once, members included.
    assert [log.forward[name] for name in blocks] == [1] * 6


def test_a_segment_keeps_only_its_first_input():
    """Inside one region, the members' inputs are rebuilt, not kept: fewer tensors stay
    alive after the forward than with one region per block."""

    def live_after_forward(wrapped: nn.Module) -> int:
        saved = []

        def pack(tensor):
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = gpt_loss(wrapped, gpt_batch())
        del loss
        return len(saved)

    blocks = [f"h.{i}" for i in range(6)]
    per_block, segment = _gpt(), _gpt()
    wrap_model(per_block, lambda module, name: name in blocks)
    _apply(segment, _segment_plan([tuple(blocks)]))
    # The model's own saved tensors are the same; what the regions keep differs by the
    # inputs of the five later blocks.
    assert live_after_forward(segment) < live_after_forward(per_block)


def test_batchnorm_statistics_and_gradients_match_the_plain_step_in_a_segment():
    model = make(lambda: ConvNet(blocks=3)).train()
    reference, _ = _plain_reference(model, conv_loss, conv_batch())
    _apply(model, _segment_plan([("blocks.0", "blocks.1", "blocks.2")], kind="ConvBlock"))
    step(model, conv_loss, conv_batch())
    assert_same(grads(model), grads(reference), "conv segment")
    assert_same(dict(model.named_buffers()), dict(reference.named_buffers()), "running statistics")


def test_a_broken_chain_runs_the_member_alone_and_says_so():
    class Detour(TinyGPT):
        """Between blocks 1 and 2 the forward makes a new tensor: no longer a chain."""

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1])))
            for index, block in enumerate(self.h):
                x = block(x * 1.0 if index == 2 else x)
            return self.head(self.ln_f(x))

    model = make(lambda: Detour(layers=4, width=32)).train()
    reference, _ = _plain_reference(model, gpt_loss, gpt_batch())
    _apply(model, _segment_plan([("h.0", "h.1", "h.2")]))
    log = CallLog()
    with pytest.warns(UserWarning, match=r"Block was planned to run in one checkpointed segment"):
        with log.watching(model):
            step(model, gpt_loss, gpt_batch())
    assert_same(grads(model), grads(reference), "broken chain")
    # h.2 ran as its own region; h.0 and h.1 in the segment.
    assert _recomputed(log, ["h.0", "h.1", "h.2", "h.3"], "attn") == [1, 1, 1, 0]


def test_disabled_and_no_grad_run_segments_plainly():
    model = _gpt(4)
    reference, _ = _plain_reference(model, gpt_loss, gpt_batch())
    _apply(model, _segment_plan([("h.0", "h.1", "h.2", "h.3")]))
    log = CallLog()
    with ckptwrap.disabled(), log.watching(model):
        step(model, gpt_loss, gpt_batch())
    assert sum(log.recomputed.values()) == 0
    assert_same(grads(model), grads(reference), "disabled")
    with torch.no_grad():
        ids, _ = gpt_batch()
        torch.manual_seed(1)
        out = model(ids)
        torch.manual_seed(1)
        assert torch.equal(out, reference(ids))


def test_a_forward_pre_hook_on_a_member_makes_each_module_its_own_region():
    model = _gpt(4)
    reference, _ = _plain_reference(model, gpt_loss, gpt_batch())
    _apply(model, _segment_plan([("h.0", "h.1", "h.2")]))
    seen = []
    # Like FSDP2's parameter gathering: it must run before the module computes.
    model.h[1].register_forward_pre_hook(lambda module, args: seen.append(ckptwrap.is_recomputing()))
    log = CallLog()
    with log.watching(model):
        step(model, gpt_loss, gpt_batch())
    assert_same(grads(model), grads(reference), "hooked member")
    assert seen == [False]  # called once, by the model's forward, before h.1 ran
    assert _recomputed(log, ["h.0", "h.1", "h.2", "h.3"], "attn") == [1, 1, 1, 0]


def test_wrapped_segments_copy_pickle_and_unwrap():
    model = _gpt(4)
    before = structure(model)
    reference, _ = _plain_reference(model, gpt_loss, gpt_batch())
    _apply(model, _segment_plan([("h.0", "h.1", "h.2")]))
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        log = CallLog()
        with log.watching(copied):
            step(copied, gpt_loss, gpt_batch())
        assert_same(grads(copied), grads(reference), "copied segments")
        assert _recomputed(log, ["h.0", "h.1", "h.2", "h.3"], "attn") == [1, 1, 1, 0]
    assert list(model.state_dict()) == before["state_dict"]
    unwrap_model(model)
    assert structure(model) == before
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_the_plan_table_marks_segment_members():
    shown = str(_segment_plan([("h.0", "h.1")]))
    assert "+ h.1" in shown and "one region with the module above it" in shown
    assert "+ h.0" not in shown


# ------------------------------------------------------------------ the planner's segments


def _constant_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate takes the same time, so plans depend on bytes alone."""
    cost_item = _peak_model.cost_item

    def item(*args, **kwargs):
        return dataclasses.replace(cost_item(*args, **kwargs), time=1e-3)

    monkeypatch.setattr(_peak_model, "cost_item", item)


def _step_items(model: nn.Module, example: Tuple[torch.Tensor, ...], *, segments: bool):
    """The planner's whole-block items over the blocks, with the training step's terms,
    and the base and tail of its peak model."""
    names = [f"h.{i}" for i in range(len(model.h))]
    profile = profile_modules(model, names, example, repeats=0, step=True)
    ordered, _, tail = step_items(
        profile, names, segments=segments, region_bytes=region_bytes(step_device(model, example, {}))
    )
    return [item for _, item in ordered], profile.base_bytes, tail


class _Link(nn.Module):
    """Two products with a nonlinearity between: it saves one tensor of its input's size
    inside, as much as the input it hands on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width, bias=False)
        self.fc2 = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class _Chain(nn.Module):
    """Eight links in a row. Checkpointed alone, a link saves only its inside; a segment
    also drops the boundaries between its links. Many rows and few parameters make
    activations, not parameter gradients, the training step's peak."""

    def __init__(self, links: int = 8, width: int = 32) -> None:
        super().__init__()
        self.h = nn.ModuleList(_Link(width) for _ in range(links))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for link in self.h:
            x = link(x)
        return x


def _chain_batch() -> Tuple[torch.Tensor]:
    return (torch.randn(4096, 32, generator=torch.Generator().manual_seed(5)),)


def _chain_loss(model: nn.Module, batch: Tuple[torch.Tensor]) -> torch.Tensor:
    return model(*batch).square().mean()


def _sequential_budget(model: nn.Module, example: Tuple[torch.Tensor, ...]) -> Tuple[int, int]:
    """The predicted step peak of checkpoint_sequential's plan over the blocks (segments
    of two, the last left plain), and how many blocks it recomputes."""
    items, base, tail = _step_items(model, example, segments=True)
    groups = [tuple(range(i, i + 2)) for i in range(0, len(items) - 2, 2)]
    return predicted_peak(items, groups, base=base, tail=tail), 2 * len(groups)


def test_the_planner_forms_segments_at_checkpoint_sequential_s_peak(monkeypatch):
    _constant_times(monkeypatch)
    model = make(_Chain).train()
    example = _chain_batch()
    budget, recomputed = _sequential_budget(model, example)
    # Whole blocks only, as checkpoint_sequential recomputes them.
    policy = f"budget:{budget}B;recompute"
    result = plan(model, policy, example_inputs=example)
    assert result.predicted_peak <= budget
    assert len(result) <= recomputed
    assert any(entry.joins for entry in result.selected)
    # Without segments, no plan reaches that peak.
    single, base, tail = _step_items(model, example, segments=False)
    with pytest.raises(CheckpointConfigError, match="below the smallest reachable peak"):
        solve_budget(single, budget, base=base, tail=tail)
    # Applied, the segments train exactly like the plain model.
    reference, _ = _plain_reference(model, _chain_loss, example)
    wrap_model(model, policy, example_inputs=example)
    assert model.ckptwrap_plan.selected == result.selected
    step(model, _chain_loss, example)
    assert_same(grads(model), grads(reference), "planned segments")


@pytest.mark.parametrize(
    ("policy", "options"),
    [("blocks;budget:{}B;selective", {}), ("blocks;budget:{}B", {"use_reentrant": True})],
)
def test_no_segments_for_the_selective_tier_or_the_reentrant_engine(monkeypatch, policy, options):
    _constant_times(monkeypatch)
    model = make(_Chain).train()
    example = _chain_batch()
    budget, _ = _sequential_budget(model, example)
    try:
        result = plan(model, policy.format(budget), example_inputs=example, **options)
    except ckptwrap.CheckpointError as error:  # the selective tier may not reach it
        assert "smallest reachable peak" in str(error)
        return
    assert not any(entry.joins for entry in result.selected)

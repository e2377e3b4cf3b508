"""``wrap_model`` under ``torch.compile``: the whole model, and blocks compiled one by one.

Under compilation a marked region becomes torch's checkpoint operator (the only one the
compiler understands); eager runs stay on ckptwrap's engine. The tests use the
``aot_eager`` backend, which traces, partitions and recomputes like the default one but
skips code generation, which would take most of CI's time budget.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

import ckptwrap
from _compiling import Recorder, fresh_compiler  # noqa: F401 (an autouse fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, Block, GPTConfig, synthetic_batch  # noqa: E402

# No dropout: compiled code draws its random numbers differently from eager code.
_CONFIG = GPTConfig(vocab=64, width=32, heads=2, layers=2, seq_len=16, dropout=0.0)
_STEPS = 2


def _train_and_compare(reference: GPT, model: GPT, run) -> None:
    """Train both for a few steps; every gradient of ``run`` must match the reference's."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(_STEPS):
        tokens, targets = synthetic_batch(_CONFIG, 2, seed=step)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        reference(tokens, targets).backward()
        run(tokens, targets).backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected.grad, rtol=1e-4, atol=1e-6, msg=name)
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize(
    "policy, use_reentrant", [("blocks", False), ("every:2", True)], ids=["blocks", "every:2-reentrant"]
)
def test_compiled_wrapped_model_trains_like_eager(policy, use_reentrant):
    torch.manual_seed(0)
    reference = GPT(_CONFIG)
    model = ckptwrap.wrap_model(copy.deepcopy(reference), policy, use_reentrant=use_reentrant)
    backend = Recorder()
    # fullgraph: the marking layer must not break the graph anywhere.
    _train_and_compare(reference, model, torch.compile(model, backend=backend, fullgraph=True))
    assert len(backend.graphs) == 1, "the second step recompiled"
    assert backend.checkpoints() == len(model.ckptwrap_plan) > 0


def test_wrap_model_on_blocks_compiled_one_by_one():
    torch.manual_seed(0)
    reference = GPT(_CONFIG)
    model = copy.deepcopy(reference)
    backend = Recorder()
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
    names = [name for name, _ in model.named_parameters()]
    ckptwrap.wrap_model(model, "blocks")
    assert [entry.name for entry in model.ckptwrap_plan.selected] == ["blocks.0", "blocks.1"]
    assert [name for name, _ in model.named_parameters()] == names
    _train_and_compare(reference, model, model)
    assert backend.checkpoints() == len(backend.graphs) > 0  # one checkpoint in each block's graph


class _DecoratedBlock(Block):
    @ckptwrap.checkpointed
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _decorated(block: Block) -> Block:
    decorated = _DecoratedBlock(_CONFIG)
    decorated.load_state_dict(block.state_dict())
    return decorated


@pytest.mark.parametrize(
    "mark", [ckptwrap.CheckpointWrapper, _decorated], ids=["CheckpointWrapper", "checkpointed"]
)
def test_compiled_model_with_marked_blocks_trains_like_eager(mark):
    torch.manual_seed(0)
    reference = GPT(_CONFIG)
    model = copy.deepcopy(reference)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = mark(block)
    backend = Recorder()
    _train_and_compare(reference, model, torch.compile(model, backend=backend, fullgraph=True))
    assert backend.checkpoints() == _CONFIG.layers


def test_eager_runs_stay_on_ckptwrap_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an eager run reached torch.utils.checkpoint")

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", refuse)
    torch.manual_seed(0)
    model = ckptwrap.wrap_model(GPT(_CONFIG), "blocks")
    tokens, targets = synthetic_batch(_CONFIG, 2)
    model(tokens, targets).backward()


def test_compiled_selective_tier_trains_like_eager():
    torch.manual_seed(0)
    reference = GPT(_CONFIG)
    model = ckptwrap.wrap_model(copy.deepcopy(reference), "blocks;selective")
    backend = Recorder()
    _train_and_compare(reference, model, torch.compile(model, backend=backend, fullgraph=True))
    assert backend.checkpoints() == len(model.ckptwrap_plan) > 0


@pytest.mark.parametrize("order", ["wrap-then-compile", "compile-then-wrap"])
def test_a_lazy_budget_plans_eagerly_under_compile_in_either_order(order):
    torch.manual_seed(0)
    reference = GPT(_CONFIG)
    model = copy.deepcopy(reference)
    # The tiny model's least memory is about 92% of its plain step's peak.
    if order == "wrap-then-compile":
        compiled = torch.compile(ckptwrap.wrap_model(model, "budget:95%"), backend="aot_eager")
    else:
        compiled = ckptwrap.wrap_model(torch.compile(model, backend="aot_eager"), "budget:95%")
    assert model.ckptwrap_plan.pending
    _train_and_compare(reference, model, compiled)
    applied = model.ckptwrap_plan
    assert not applied.pending and applied.predicted_peak <= applied.budget
    assert len(applied) > 0, "the budget is below the plain step's peak"
    assert compiled.ckptwrap_plan is applied  # read through the compiled module too
    assert [name for name, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]


def test_a_lazy_budget_under_fullgraph_names_example_inputs():
    model = ckptwrap.wrap_model(GPT(_CONFIG), "budget:50%")
    tokens, targets = synthetic_batch(_CONFIG, 2, seed=0)
    with pytest.raises(Exception, match="example_inputs") as info:
        torch.compile(model, backend="aot_eager", fullgraph=True)(tokens, targets)
    assert "ckptwrap plans a budget" in str(info.value)


def test_a_budget_planned_with_example_inputs_compiles_without_breaks():
    torch.manual_seed(0)
    reference = GPT(_CONFIG)
    tokens, targets = synthetic_batch(_CONFIG, 2, seed=0)
    model = ckptwrap.wrap_model(copy.deepcopy(reference), "budget:95%", example_inputs=(tokens, targets))
    backend = Recorder()
    _train_and_compare(reference, model, torch.compile(model, backend=backend, fullgraph=True))
    assert backend.checkpoints() == len(model.ckptwrap_plan) > 0


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks", "fullgraph"])
def test_the_offload_tier_is_refused_under_compile(fullgraph):
    model = ckptwrap.wrap_model(GPT(_CONFIG), "blocks;offload")
    tokens, targets = synthetic_batch(_CONFIG, 2, seed=0)
    expected = ckptwrap.CheckpointConfigError if not fullgraph else Exception
    with pytest.raises(expected, match=r"(?s)offload tier cannot run under torch\.compile.*without ';offload'"):
        torch.compile(model, backend="aot_eager", fullgraph=fullgraph)(tokens, targets)
    model(tokens, targets).backward()  # eagerly the tier runs as before

"""A model on the meta device or made of fake tensors allocates nothing and runs other
kernels than the device it trains on: a step measured there would predict wrong peaks
(before this, silently: a Llama's plain step predicted 29% high and ``blocks`` 67% low).
Planning from example inputs there is refused, naming why and what to do; a policy that
measures nothing still applies; a lazy budget trained there runs the plan of least memory
unplanned, says so once, and plans from the first steps once the model is materialised.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import CheckpointConfigError

transformers = pytest.importorskip("transformers")


def _llama(device: str) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("policy", ["blocks", "budget:50%"])
def test_planning_from_example_inputs_on_the_meta_device_is_refused(policy):
    model = _llama("meta")
    ids = torch.randint(0, 128, (2, 32), device="meta")
    with pytest.raises(CheckpointConfigError, match="meta device.*would be wrong.*to_empty"):
        ckptwrap.plan(model, policy, example_kwargs={"input_ids": ids})
    with pytest.raises(CheckpointConfigError, match="meta device"):
        ckptwrap.wrap_model(model, policy, example_kwargs={"input_ids": ids})
    assert "ckptwrap_plan" not in model.__dict__, "nothing is left half-applied"


def test_real_inputs_to_a_meta_model_are_refused_too():
    with pytest.raises(CheckpointConfigError, match="meta device"):
        ckptwrap.plan(_llama("meta"), "blocks", example_kwargs={"input_ids": torch.randint(0, 128, (2, 32))})


def test_fake_tensors_are_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = _llama("cpu")
        ids = torch.randint(0, 128, (2, 32))
        with pytest.raises(CheckpointConfigError, match="fake tensors"):
            ckptwrap.plan(model, "blocks", example_kwargs={"input_ids": ids})


def test_a_selection_without_measuring_applies_on_the_meta_device():
    model = ckptwrap.wrap_model(_llama("meta"), "blocks")
    assert list(model.ckptwrap_plan) == ["model.layers.0", "model.layers.1"]


def test_a_lazy_budget_on_the_meta_device_plans_once_the_model_is_real():
    model = ckptwrap.wrap_model(_llama("meta"), "budget:50%").train()
    meta_ids = torch.randint(0, 128, (2, 32), device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(input_ids=meta_ids, labels=meta_ids).loss.backward()
    said = [str(w.message) for w in caught if "meta device" in str(w.message)]
    assert len(said) == 1 and "plan of least memory" in said[0], said
    assert list(model.ckptwrap_plan) == ["model.layers.0", "model.layers.1"]

    # Materialised as FSDP2 and big-model loading do it, then trained: planned from real steps.
    reference = _llama("cpu")
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    for name, buffer in reference.named_buffers():
        model.get_buffer(name).copy_(buffer)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
    plan = model.ckptwrap_plan
    assert not plan.pending and plan.predicted_peak is not None and plan.predicted_peak > 0
    reference.train()
    reference(input_ids=ids, labels=ids).loss.backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad), name

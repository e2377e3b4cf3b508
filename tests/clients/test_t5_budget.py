"""``budget:`` on a Hugging Face encoder-decoder, T5, with its default KV cache.

T5's decoder builds a KV cache in training too (``config.use_cache`` is True) and hands it
to every decoder layer, which writes its keys and values into it. Under a budget no
candidate layer writes it in training (a checkpointed layer's recomputation could not
write it again, and which layers are checkpointed changes with the shape). The model is built tiny from a config
(no download) and every result is compared with the un-wrapped model on the same batch.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from ckptwrap import plan, wrap_model

VOCAB = 100
# The peak of a training step counts gradients and parameter gradients too, which no plan
# lowers: this tiny T5 reaches about 55% of its un-checkpointed step's peak at best, and
# around 80% the plan checkpoints the decoder, whose layers write the cache.
BUDGET = "budget:80%"
PATHS = pytest.mark.parametrize("path", ["example-inputs", "first-forward"])
DROPOUTS = pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _t5(tf: Any, dropout: float) -> nn.Module:
    config = tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(config).train()


def _batch() -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # some padding, so the attention masks matter
    # Targets longer than the inputs make the decoder's activations the step's peak.
    labels = torch.randint(2, VOCAB, (2, 32), generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _step(model: nn.Module, seed: int, *, cache: bool = True) -> torch.Tensor:
    """One forward and backward from ``seed``, with the config's default cache (on) or,
    with ``cache=False``, with ``use_cache=False``."""
    model.zero_grad(set_to_none=True)
    batch = _batch()
    if not cache:
        batch["use_cache"] = False
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        # transformers warns of its own cache handling; not what is tested here.
        warnings.simplefilter("ignore")
        output = model(**batch)
    output.loss.backward()
    return output.loss.detach()


def _grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_grads(actual: nn.Module, expected: nn.Module) -> None:
    got, want = _grads(actual), _grads(expected)
    assert list(got) == list(want)
    differ = [
        name for name, value in want.items()
        if (value is None) != (got[name] is None)
        or (value is not None and not torch.equal(got[name], value))
    ]
    assert not differ, f"{len(differ)} of {len(want)} gradients differ, e.g. {differ[:4]}"


def _blocks(model: nn.Module) -> List[str]:
    stacks = (model.encoder.block, model.decoder.block)
    qualified = {id(module): name for name, module in model.named_modules()}
    return [qualified[id(layer)] for stack in stacks for layer in stack]


def _wrap(model: nn.Module, path: str) -> nn.Module:
    if path == "example-inputs":
        return wrap_model(model, BUDGET, example_kwargs=_batch())
    return wrap_model(model, BUDGET)


def test_plan_with_example_inputs_profiles_the_decoder_layers(transformers):
    model = _t5(transformers, 0.1)
    assert model.config.use_cache
    before = {name: value.clone() for name, value in model.state_dict().items()}
    planned = plan(model, BUDGET, example_kwargs=_batch())
    assert planned.names and set(planned.names) <= set(_blocks(model))
    assert planned.predicted_peak is not None and planned.predicted_peak <= planned.budget
    # Planning changed nothing: the model still trains as before.
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def _checkpointed_by_transformers(model: nn.Module, names: List[str]) -> nn.Module:
    """``model`` with transformers' own gradient checkpointing (torch.utils.checkpoint,
    non-re-entrant) on the named layers only."""
    modules = dict(model.named_modules())
    for name in names:
        modules[name].gradient_checkpointing = True
        modules[name]._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False
        )
    return model


@DROPOUTS
@PATHS
def test_a_step_with_the_cache_equals_transformers_own_checkpointing(transformers, path, dropout):
    """With the cache on, the candidate layers run without writing it under a budget,
    whichever the plan checkpoints (so a step's gradients never depend on the plan), as
    transformers' own gradient checkpointing turns the cache off in training; T5 rounds
    differently without the cache, so the reference is that checkpointing, of the same
    layers, without the cache. On the first-forward path this step plans."""
    plain = _t5(transformers, dropout)
    wrapped = _wrap(copy.deepcopy(plain), path)
    loss = _step(wrapped, 1)
    applied = wrapped.ckptwrap_plan
    assert not applied.pending
    assert applied.names and set(applied.names) <= set(_blocks(wrapped))
    assert any(name.startswith("decoder.") for name in applied.names)
    marked = [name for name, module in wrapped.named_modules() if "forward" in module.__dict__]
    assert marked == list(applied.names)
    reference = _checkpointed_by_transformers(copy.deepcopy(plain), list(applied.names))
    assert torch.equal(loss, _step(reference, 1, cache=False))
    _assert_same_grads(wrapped, reference)


@DROPOUTS
@PATHS
def test_budget_wrapped_t5_trains_with_the_gradients_of_the_plain_model(
    transformers, path, dropout
):
    plain = _t5(transformers, dropout)
    wrapped = _wrap(copy.deepcopy(plain), path)
    _step(wrapped, 1)  # plans on the first-forward path, with the default cache
    for seed in (2, 3):
        loss_plain = _step(plain, seed, cache=False)
        loss_wrapped = _step(wrapped, seed, cache=False)
        assert torch.equal(loss_wrapped, loss_plain)
        _assert_same_grads(wrapped, plain)


@PATHS
def test_both_paths_choose_the_same_layers(transformers, path):
    eager = _wrap(_t5(transformers, 0.0), "example-inputs")
    other = _wrap(_t5(transformers, 0.0), path)
    _step(other, 1)  # the first training step measures where no example inputs were given
    _step(other, 1)  # and the next one at its shape runs the plan solved from it
    assert other.ckptwrap_plan.names == eager.ckptwrap_plan.names

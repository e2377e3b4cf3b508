"""transformers' own gradient checkpointing beside ckptwrap's, and the KV-cache note.

A layer checkpointed by both would run its forward three times per step; the Trainer
switches transformers' checkpointing on inside ``train()``, after the script wrapped the
model, so both orders are tried. Forwards are counted at the layer class's ``forward``,
which the model's call, ckptwrap's recomputation and transformers' all go through.
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

import ckptwrap

VOCAB = 100


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("transformers")


def _gpt2(tf: Any) -> nn.Module:
    torch.manual_seed(0)
    config = tf.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )
    return tf.GPT2LMHeadModel(config).train()


def _batch(seed: int = 0) -> Dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture
def forwards(tf, monkeypatch) -> List[int]:
    """Every run of a GPT2Block's forward, by anyone."""
    runs: List[int] = []
    original = tf.models.gpt2.modeling_gpt2.GPT2Block.forward

    @functools.wraps(original)  # the same signature, which ckptwrap reads for the KV cache
    def counted(self, *args, **kwargs):
        runs.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tf.models.gpt2.modeling_gpt2.GPT2Block, "forward", counted)
    return runs


def _step(model: nn.Module, seed: int) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**_batch(seed)).loss
    loss.backward()
    return loss.detach()


def _grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["hf-non-reentrant", "hf-reentrant"])
@pytest.mark.parametrize("order", ["hf-first", "hf-after-wrap"])
@pytest.mark.parametrize("policy", ["blocks", "budget:60%"])
def test_transformers_checkpointing_is_switched_off_once_and_said(tf, forwards, use_reentrant, order, policy):
    plain = _gpt2(tf)
    model = copy.deepcopy(plain)
    enable = lambda: model.gradient_checkpointing_enable(  # noqa: E731
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if order == "hf-first":
            enable()
        ckptwrap.wrap_model(model, policy)
        if order == "hf-after-wrap":
            enable()  # as the Trainer does inside train()
        losses, counts = [], []
        for seed in range(3):
            forwards.clear()
            losses.append(_step(model, seed))
            counts.append(len(forwards))
    said = [w for w in caught if "gradient checkpointing was on" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "gradient_checkpointing_enable" in str(said[0].message)
    assert "TrainingArguments(gradient_checkpointing=False)" in str(said[0].message)
    assert not model.is_gradient_checkpointing
    checkpointed = len(model.ckptwrap_plan)
    assert checkpointed > 0
    # Steps after the one that plans: each layer runs once, and once more if ckptwrap
    # checkpoints it; never a third time.
    assert counts[1:] == [3 + checkpointed] * 2, counts
    for seed, loss in enumerate(losses):
        assert torch.equal(_step(plain, seed), loss)
    _step(model, 0), _step(plain, 0)
    assert _grads(model).keys() == _grads(plain).keys()
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(_grads(model)[name], grad, rtol=0, atol=0, msg=name)
    ckptwrap.unwrap_model(model)
    assert model.is_gradient_checkpointing, "unwrap_model puts back what wrap_model switched off"


def test_transformers_checkpointing_stays_on_when_ckptwrap_checkpoints_nothing(tf):
    model = _gpt2(tf)
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckptwrap.wrap_model(model, "none")  # the flag's default: transformers' switch decides
        _step(model, 0)
    assert model.is_gradient_checkpointing


def test_a_failed_wrap_leaves_transformers_checkpointing_as_it_was(tf):
    model = _gpt2(tf)
    model.gradient_checkpointing_enable()
    ids = _batch()["input_ids"]
    with pytest.raises(ckptwrap.CheckpointConfigError, match="budget"):
        ckptwrap.wrap_model(model, "budget:1%", example_kwargs={"input_ids": ids, "labels": ids})
    assert model.is_gradient_checkpointing
    assert "ckptwrap_plan" not in model.__dict__


def test_the_kv_cache_note_is_logged_not_warned(tf, caplog, monkeypatch):
    monkeypatch.setattr(ckptwrap.wrap._clients, "_noted", set())  # said once per class
    model = ckptwrap.wrap_model(_gpt2(tf), "blocks")
    ids = _batch()["input_ids"]
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="ckptwrap"):
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids, use_cache=True).loss.backward()
    assert not [w for w in caught if "KV cache" in str(w.message)]
    assert any("KV cache" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)

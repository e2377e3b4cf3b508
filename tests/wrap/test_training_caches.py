"""Caches in training: what a checkpointed region is given that holds state.

Models whose configuration defaults to ``use_cache=True`` build their cache in training
too and hand it to every layer: GPT-2 and Llama a KV cache; Jamba, Zamba2, Bamba and the
other hybrids one cache holding keys and values for their attention layers and conv and
recurrent states for their Mamba, linear-attention or convolution layers. A layer's
forward writes into it, and a recomputation must neither write again nor read what the
forward wrote, nor run without it: those Mamba layers take other code without a cache,
and their gradients then differ in the last bits from the model's own.

Every text-generating model of the catalogue (``benchmarks/_architectures.py``) is
trained with its configuration's cache beside the plain model on the same batches, in
loops as people write them (a tiny first batch, right-padded masks, the output held
through the backward, an optimizer step between), with whole blocks checkpointed, with
only the submodules given the cache checkpointed (a Mamba mixer alone, an attention
alone) and under a lazy ``budget:``: every loss and gradient must equal the plain
model's bit for bit.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import pytest
import torch
from torch import nn

import ckptwrap

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _architectures import ARCHITECTURES, available  # noqa: E402
from _budget_loops import _forward, _same_grads, _same_model  # noqa: E402

Cache = transformers.cache_utils.Cache

_FAMILIES = ("causal", "encoder-decoder", "state-space", "hybrid")
CACHED = [name for name in available() if ARCHITECTURES[name].family in _FAMILIES or name == "whisper"]
"""The models that take ``use_cache`` (their configuration's default, on)."""
HYBRIDS = [name for name in CACHED if ARCHITECTURES[name].family == "hybrid"]
BUDGETED = HYBRIDS + [name for name in ("gpt2", "llama", "t5", "whisper") if name in CACHED]

Step = Tuple[int, int, bool, bool]
"""(rows, length, output held through the backward, right-padded)."""


def _steps(arch: Any, more: bool = False) -> List[Step]:
    low, high = arch.lengths
    high = min(high, 64)
    steps = [(1, low, True, True), (3, high, False, True), (2, (low + high) // 2, True, False)]
    if more:  # shapes met again, which a budget solves rather than measures
        steps += [(3, high, True, True), (1, low, False, False)]
    return steps


def _train(model: nn.Module, plain: nn.Module, arch: Any, steps: List[Step]) -> None:
    """Train ``model`` and ``plain`` side by side; every loss and gradient equal."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, plain)]
    for index, (rows, length, held, padded) in enumerate(steps):
        batch = arch.batch(rows, length, index, padded)  # no use_cache: the configuration's
        losses = []
        for each, optimizer in zip((model, plain), optimizers):
            optimizer.zero_grad(set_to_none=True)
            losses.append(_forward(each, arch, (rows, length, index, padded), held, batch=batch))
        assert torch.equal(losses[0], losses[1]), f"{arch.name}: the loss differs at step {index}"
        differ = [n for (n, a), b in zip(model.named_parameters(), plain.parameters()) if not _equal(a.grad, b.grad)]
        assert not differ, f"{arch.name}: {len(differ)} gradients differ at step {index}, e.g. {differ[:3]}"
        for optimizer in optimizers:
            optimizer.step()
    assert _same_grads(model, plain)


def _equal(a: Any, b: Any) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _given_a_cache(model: nn.Module, arch: Any) -> Dict[str, nn.Module]:
    """The modules a training forward hands a transformers cache to, by name."""
    names = {id(m): n for n, m in model.named_modules()}
    found: Dict[str, nn.Module] = {}

    def seen(module: nn.Module, args: Any, kwargs: Any) -> None:
        if any(isinstance(v, Cache) for v in (*args, *kwargs.values())):
            found[names[id(module)]] = module

    handles = [m.register_forward_pre_hook(seen, with_kwargs=True) for m in model.modules()]
    try:
        model(**arch.batch(2, arch.lengths[0], 0, True))
    finally:
        for handle in handles:
            handle.remove()
    return found


def _innermost(names: Set[str]) -> Set[str]:
    return {n for n in names if not any(other.startswith(n + ".") for other in names)}


def _recomputations(model: nn.Module) -> Tuple[List[str], List[Any]]:
    seen: List[str] = []
    hooks = [
        m.register_forward_pre_hook(lambda m, a, name=n: seen.append(name) if ckptwrap.is_recomputing() else None)
        for n, m in model.named_modules()
    ]
    return seen, hooks


@pytest.mark.parametrize("name", CACHED)
def test_blocks_train_bit_exact_with_the_cache_the_model_builds(name):
    arch = ARCHITECTURES[name]
    plain = arch.build()
    assert getattr(plain.config, "use_cache", True) is not False
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks")
    _train(model, plain, arch, _steps(arch))
    assert model.config.use_cache == plain.config.use_cache, "the configuration was changed"
    ckptwrap.unwrap_model(model)
    assert _same_model(model, plain)


@pytest.mark.parametrize("name", CACHED)
def test_the_submodules_given_the_cache_train_bit_exact_checkpointed_alone(name):
    """A Mamba mixer, an attention, a linear attention alone: the modules inside a block
    that the cache is handed to, checkpointed and nothing else."""
    arch = ARCHITECTURES[name]
    plain = arch.build()
    blocks = ckptwrap.plan(copy.deepcopy(plain), "blocks").names
    inside = {n for n in _given_a_cache(plain, arch) if any(n.startswith(block + ".") for block in blocks)}
    if not inside:
        pytest.skip(f"{name} hands no module inside a block a cache in training")
    chosen = _innermost(inside)
    model = ckptwrap.wrap_model(copy.deepcopy(plain), lambda module, qualified: qualified in chosen)
    assert set(model.ckptwrap_plan.names) == chosen
    seen, hooks = _recomputations(model)
    _train(model, plain, arch, _steps(arch))
    assert seen, f"{name}: nothing was recomputed"
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize("name", BUDGETED)
def test_a_lazy_budget_trains_bit_exact_with_the_cache(name, noted_steps):
    """Planned from the loop's own steps (no example inputs): the steps it measures and
    those it solves, at shapes met once and again."""
    arch = ARCHITECTURES[name]
    plain = arch.build()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "budget:70%")
    seen, hooks = _recomputations(model)
    _train(model, plain, arch, _steps(arch, more=True))
    assert seen, f"{name}: the budget checkpointed nothing"
    assert noted_steps.measured >= 1
    for hook in hooks:
        hook.remove()
    assert model.config.use_cache == plain.config.use_cache
    ckptwrap.unwrap_model(model)
    assert _same_model(model, plain)


def _jamba() -> Tuple[nn.Module, Any]:
    if "jamba" not in CACHED:
        pytest.skip("Jamba does not build here")
    arch = ARCHITECTURES["jamba"]
    return arch.build(), arch


def test_a_mixer_alone_is_recomputed_from_the_cache_as_its_forward_found_it():
    """The issue's case: the recomputation of a Jamba mixer that had written its conv
    state convolved 68 positions where the forward convolved 64 (a CheckpointError)."""
    plain, arch = _jamba()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "name:model.layers.0.mamba")
    _train(model, plain, arch, [(4, 64, True, False), (2, 16, False, True)])


def test_the_re_entrant_variant_is_exact_with_the_cache_too():
    plain, arch = _jamba()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks", use_reentrant=True)
    _train(model, plain, arch, _steps(arch))


def test_the_cache_a_training_forward_returns_keeps_nothing_a_checkpointed_layer_writes():
    plain, arch = _jamba()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "name:model.layers.0.mamba")
    batch = arch.batch(2, 16, 0, False)
    theirs, ours = plain(**batch).past_key_values, model(**batch).past_key_values
    assert theirs.has_previous_state(0) and theirs.get_seq_length() == 16
    assert not ours.has_previous_state(0), "the checkpointed mixer wrote its states into the cache"
    assert ours.get_seq_length() == 16, "the plain attention layers write the cache as they do un-checkpointed"


def _continued(plain: nn.Module, arch: Any, policy: str, steps: int = 1) -> None:
    """Train ``steps`` steps that continue a sequence from a cache the caller made (the
    first part's keys, values and states, changed in place before) under ``policy``,
    beside the plain model on a copy of it: equal losses and gradients each step, and the
    caller's cache keeps what it held."""
    model = ckptwrap.wrap_model(copy.deepcopy(plain), policy)
    ids = arch.batch(2, 24, 0, False)["input_ids"]
    with torch.no_grad():
        cache = plain(input_ids=ids[:, :16], use_cache=True).past_key_values
    before = [t.clone() for layer in cache.layers for t in _tensors(layer)]
    assert before
    for _ in range(steps):
        losses = []
        for each in (model, plain):
            each.zero_grad(set_to_none=True)
            given = cache if each is model else copy.deepcopy(cache)
            torch.manual_seed(0)
            out = each(input_ids=ids[:, 16:], labels=ids[:, 16:], past_key_values=given, use_cache=True)
            out.loss.backward()
            losses.append(out.loss.detach())
        assert torch.equal(losses[0], losses[1])
        assert _same_grads(model, plain)
        after = [t for layer in cache.layers for t in _tensors(layer)]
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def test_a_cache_the_caller_passes_is_read_as_given_and_left_as_it_was():
    """A training step that continues a sequence: each run of a checkpointed layer reads
    the cache as given, and the caller's cache keeps what it held."""
    _continued(*_jamba(), "blocks")


CONTINUED = [
    (name, policy)
    for name in ("jamba", "zamba", "zamba2", "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "lfm2", "llama")
    if name in CACHED
    for policy in (("budget:100%", "budget:70%") if name == "jamba" else ("budget:70%",))
]
"""Models whose plain step continues a sequence from a cache (qwen3_next's, olmo_hybrid's
and kimi_linear's raise in autograd there, checkpointed or not), under budgets that keep
every layer plain and some."""


@pytest.mark.parametrize("name,policy", CONTINUED, ids=[f"{n}-{p}" for n, p in CONTINUED])
def test_a_cache_the_caller_passes_is_left_as_it_was_by_layers_a_budget_keeps_plain(name, policy):
    """As above, under a budget, over steps that are measured and then solved: a layer the
    plan leaves un-checkpointed runs on a copy of the cache too, the states changed in
    place before cloned for it; a layer it checkpoints is left to its region's copies
    (Jamba's budget raised here, where ``blocks`` trained exactly)."""
    arch = ARCHITECTURES[name]
    _continued(arch.build(), arch, policy, steps=3)


def _tensors(layer: Any) -> List[torch.Tensor]:
    found = []
    for value in vars(layer).values():
        values = value.values() if isinstance(value, dict) else [value]
        found += [v for v in values if isinstance(v, torch.Tensor)]
    return found


def test_outside_training_the_forward_writes_the_cache_and_the_recomputation_reads_a_copy():
    """With autograd on and the model in eval mode (dropout off), the cache is written
    as without checkpointing: it is the model's output, as in decoding with gradients."""
    plain, arch = _jamba()
    plain.eval()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks")
    batch = arch.batch(2, 16, 0, True)
    outs = []
    for each in (model, plain):
        out = each(**batch)
        out.loss.backward()
        outs.append(out)
    assert torch.equal(outs[0].loss, outs[1].loss)
    assert _same_grads(model, plain)
    ours, theirs = outs[0].past_key_values, outs[1].past_key_values
    assert ours.get_seq_length() == theirs.get_seq_length() == 16
    for a, b in zip(ours.layers, theirs.layers):
        assert all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b)))


class _Record:
    """What a layer leaves for the layers after it within the same forward."""

    def __init__(self) -> None:
        self.seen: List[torch.Tensor] = []


def test_an_object_a_region_leaves_state_in_is_written_once_by_its_forward():
    @ckptwrap.checkpointed
    def block(x: torch.Tensor, weight: torch.Tensor, record: _Record) -> torch.Tensor:
        h = torch.tanh(x @ weight)
        record.seen.append(h)
        return h * h

    def plain_block(x: torch.Tensor, weight: torch.Tensor, record: _Record) -> torch.Tensor:
        h = torch.tanh(x @ weight)
        record.seen.append(h)
        return h * h

    grads = []
    for fn in (block, plain_block):
        torch.manual_seed(0)
        x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        record = _Record()
        y = fn(fn(x, weight, record), weight, record)
        loss = y.sum() + sum(h.sum() for h in record.seen)  # a later layer reads what it left
        loss.backward()
        assert len(record.seen) == 2, "the recomputation wrote into the record again"
        grads.append((x.grad, weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_the_log_says_what_each_layer_does_with_its_cache(caplog, monkeypatch):
    monkeypatch.setattr(ckptwrap.wrap._clients, "_noted", set())
    plain, arch = _jamba()
    model = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks")
    mixer = ckptwrap.wrap_model(copy.deepcopy(plain), "name:model.layers.0.mamba")
    batch = arch.batch(2, 16, 0, False)
    with caplog.at_level(logging.INFO, logger="ckptwrap"):
        model(**batch).loss.backward()
        mixer(**batch).loss.backward()
    said = [r.getMessage() for r in caplog.records if r.name == "ckptwrap" and "cache" in r.getMessage()]
    for layer in ("JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"):
        assert any(m.startswith(layer) and "(past_key_values: DynamicCache)" in m for m in said), said
    assert any(m.startswith("JambaMambaMixer") and "(cache_params: DynamicCache)" in m for m in said), said
    assert all("keeps nothing it writes" in m for m in said), said
    assert not any("use_cache=False" in m or "without writing" in m for m in said), said

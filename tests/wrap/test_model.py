"""``wrap_model`` and ``unwrap_model`` on a GPT-like model and a conv net with BatchNorm:
names, numerics, BatchNorm statistics and copies."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Callable, Dict

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckptwrap
from ckptwrap import plan, unwrap_model, wrap_model

from ._models import (
    Block,
    CallLog,
    ConvBlock,
    ConvNet,
    TinyGPT,
    assert_same,
    conv_batch,
    conv_loss,
    gpt_batch,
    gpt_loss,
    grads,
    make,
    marked,
    recompute_counts,
    step,
    structure,
)

VARIANTS = pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])

# (factory, loss, batch) for each model kind.
KINDS: Dict[str, Any] = {
    "gpt": (TinyGPT, gpt_loss, gpt_batch),
    "convnet": (ConvNet, conv_loss, conv_batch),
}
KIND = pytest.mark.parametrize("kind", list(KINDS))


def _is_attention(module: nn.Module, name: str) -> bool:
    return name.endswith(".attn")


POLICIES = {
    "gpt": ["blocks", "every:2", "type:Block;last:1", "name:h.*.mlp", "type:Linear", "all", Block, _is_attention],
    "convnet": ["blocks", "first:2", "type:BatchNorm2d", "name:stem", "all", (ConvBlock, nn.Linear)],
}


def _policy_cases():
    for kind, policies in POLICIES.items():
        for policy in policies:
            label = policy if isinstance(policy, str) else getattr(policy, "__name__", "classes")
            yield pytest.param(kind, policy, id=f"{kind}-{label}")


# --------------------------------------------------------------------------- names stay


@KIND
def test_names_types_and_state_dict_are_unchanged_by_wrap_and_unwrap(kind):
    factory, loss_fn, batch = KINDS[kind]
    model = make(factory)
    before = structure(model)
    values = {k: v.clone() for k, v in model.state_dict().items()}

    assert wrap_model(model, "blocks") is model
    assert marked(model), "nothing was marked"
    assert structure(model) == before
    assert [type(m) for _, m in model.named_modules()] == [cls for _, cls, _ in before["modules"]]
    step(model, loss_fn, batch())
    assert structure(model) == before

    assert unwrap_model(model) is model
    assert marked(model) == []
    assert structure(model) == before
    # a step without an optimizer changes no parameter
    parameters = dict(model.named_parameters())
    assert_same({k: v for k, v in model.state_dict().items() if k in parameters},
                {k: v for k, v in values.items() if k in parameters}, "parameter values")


@KIND
def test_optimizer_state_is_the_same_before_after_wrapping_and_after_unwrapping(kind):
    factory, loss_fn, batch = KINDS[kind]
    model = make(factory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, loss_fn, batch())
    optimizer.step()
    before = copy.deepcopy(optimizer.state_dict())

    wrap_model(model, "blocks")
    _assert_same_optimizer_state(optimizer.state_dict(), before)
    rebuilt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rebuilt.load_state_dict(before)
    _assert_same_optimizer_state(rebuilt.state_dict(), before)

    unwrap_model(model)
    _assert_same_optimizer_state(optimizer.state_dict(), before)


def test_optimizer_steps_on_a_wrapped_model_equal_the_plain_model():
    plain = make(TinyGPT)
    wrapped = wrap_model(copy.deepcopy(plain), "blocks")
    for model in (plain, wrapped):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        for seed in (1, 2):
            step(model, gpt_loss, gpt_batch(), seed=seed)
            optimizer.step()
        model.optimizer_state = optimizer.state_dict()
    assert_same(dict(wrapped.state_dict()), dict(plain.state_dict()), "parameters after two steps")
    _assert_same_optimizer_state(wrapped.optimizer_state, plain.optimizer_state)


def _assert_same_optimizer_state(actual: Dict[str, Any], expected: Dict[str, Any]) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert_same(actual["state"][index], state, f"optimizer state of parameter {index}")


# --------------------------------------------------------------------------- numerics


@VARIANTS
@pytest.mark.parametrize("kind, policy", list(_policy_cases()))
def test_outputs_and_gradients_equal_the_unwrapped_model(kind, policy, use_reentrant):
    factory, loss_fn, batch = KINDS[kind]
    plain = make(factory)
    wrapped = wrap_model(copy.deepcopy(plain), policy, use_reentrant=use_reentrant)
    assert marked(wrapped) == plan(plain, policy).names

    for seed in (1, 2):
        loss_plain = step(plain, loss_fn, batch(), seed=seed)
        loss_wrapped = step(wrapped, loss_fn, batch(), seed=seed)
        assert torch.equal(loss_wrapped, loss_plain)
        assert_same(grads(wrapped), grads(plain), f"gradients with {policy}")
        assert_same(dict(wrapped.named_buffers()), dict(plain.named_buffers()), "buffers")


@VARIANTS
def test_input_gradients_equal_the_unwrapped_model(use_reentrant):
    plain = make(ConvNet)
    wrapped = wrap_model(copy.deepcopy(plain), "blocks", use_reentrant=use_reentrant)
    images, labels = conv_batch()
    input_grads = []
    for model in (plain, wrapped):
        x = images.clone().requires_grad_()
        torch.manual_seed(1)
        nn.functional.cross_entropy(model(x), labels).backward()
        input_grads.append(x.grad)
    assert torch.equal(input_grads[1], input_grads[0])


def test_blocks_are_recomputed_once_per_backward():
    model = wrap_model(make(TinyGPT), "blocks")
    for _ in range(2):
        log = recompute_counts(model, gpt_loss, gpt_batch())
        for i in range(len(model.h)):
            assert log.forward[f"h.{i}.attn.qkv"] == 1
            assert log.recomputed[f"h.{i}.attn.qkv"] == 1
        assert log.recomputed["wte"] == 0 and log.recomputed["head"] == 0

    log = CallLog()
    with log.watching(model), torch.no_grad():
        model(gpt_batch()[0])
    assert sum(log.recomputed.values()) == 0


def test_nothing_is_recomputed_inside_disabled():
    plain = make(TinyGPT)
    model = wrap_model(copy.deepcopy(plain), "blocks")
    log = CallLog()
    with log.watching(model), ckptwrap.disabled():
        step(model, gpt_loss, gpt_batch())
    assert sum(log.recomputed.values()) == 0
    step(plain, gpt_loss, gpt_batch())
    assert_same(grads(model), grads(plain), "gradients inside disabled()")


# --------------------------------------------------------------------------- BatchNorm


OPTION_SETS = pytest.mark.parametrize(
    "options",
    [{"use_reentrant": False}, {"use_reentrant": False, "early_stop": False}, {"use_reentrant": True}],
    ids=["non-reentrant", "non-reentrant-no-early-stop", "reentrant"],
)


@OPTION_SETS
@pytest.mark.parametrize("policy", ["blocks", "all"])
def test_batchnorm_statistics_equal_the_unwrapped_run(policy, options):
    plain = make(ConvNet)
    wrapped = wrap_model(copy.deepcopy(plain), policy, **options)
    for seed in (1, 2):
        step(plain, conv_loss, conv_batch(), seed=seed)
        step(wrapped, conv_loss, conv_batch(), seed=seed)
        assert_same(dict(wrapped.named_buffers()), dict(plain.named_buffers()), "BatchNorm statistics")
        assert_same(grads(wrapped), grads(plain), "gradients")
    assert plain.blocks[0].bn.num_batches_tracked.item() == 2


@VARIANTS
def test_torch_utils_checkpoint_alone_updates_batchnorm_statistics_twice(use_reentrant):
    """The contrast: the same blocks through torch.utils.checkpoint do update them twice."""
    plain = make(ConvNet)
    through_torch = copy.deepcopy(plain)
    images, labels = conv_batch()

    torch.manual_seed(1)
    nn.functional.cross_entropy(plain(images), labels).backward()
    torch.manual_seed(1)
    out = through_torch.forward_with(
        images.clone().requires_grad_(),
        lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=use_reentrant),
    )
    nn.functional.cross_entropy(out, labels).backward()

    # gradients agree, statistics do not
    assert_same(grads(through_torch), grads(plain), "gradients")
    block_plain, block_torch = plain.blocks[0].bn, through_torch.blocks[0].bn
    assert block_torch.num_batches_tracked.item() == 2 * block_plain.num_batches_tracked.item()
    assert not torch.equal(block_torch.running_mean, block_plain.running_mean)
    assert not torch.equal(block_torch.running_var, block_plain.running_var)


def test_eval_mode_batchnorm_is_untouched():
    plain = make(ConvNet)
    wrapped = wrap_model(copy.deepcopy(plain), "blocks")
    for model in (plain, wrapped):
        model.eval()
        step(model, conv_loss, conv_batch())
    assert_same(dict(wrapped.named_buffers()), dict(plain.named_buffers()), "statistics in eval mode")
    assert_same(grads(wrapped), grads(plain), "gradients in eval mode")


# --------------------------------------------------------------------------- copies


def _pickle(model: nn.Module) -> nn.Module:
    return pickle.loads(pickle.dumps(model))


def _torch_save(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@VARIANTS
@KIND
@pytest.mark.parametrize("copier", [_pickle, copy.deepcopy, _torch_save], ids=["pickle", "deepcopy", "torch.save"])
def test_a_copy_of_a_wrapped_model_is_still_checkpointed(copier: Callable[[nn.Module], nn.Module], kind, use_reentrant):
    factory, loss_fn, batch = KINDS[kind]
    model = wrap_model(make(factory), "blocks", use_reentrant=use_reentrant)
    copied = copier(model)

    assert marked(copied) == marked(model)
    assert copied.ckptwrap_plan == model.ckptwrap_plan
    assert structure(copied)["state_dict"] == structure(model)["state_dict"]

    first_block = model.ckptwrap_plan.names[0]
    leaf = {"gpt": "attn.qkv", "convnet": "conv"}[kind]
    log = recompute_counts(copied, loss_fn, batch())
    assert log.recomputed[f"{first_block}.{leaf}"] == 1
    # The copy computes with its own parameters: the original received no gradient.
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in copied.parameters())

    loss_copy = step(copied, loss_fn, batch(), seed=3)
    loss_model = step(model, loss_fn, batch(), seed=3)
    assert torch.equal(loss_copy, loss_model)
    assert_same(grads(copied), grads(model), "gradients of the copy")

    unwrap_model(copied)
    assert marked(copied) == [] and marked(model) == model.ckptwrap_plan.names


# --------------------------------------------------------------------------- instance forwards


class _Scaled:
    """A picklable instance-level forward someone else set before wrapping."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return type(self.module).forward(self.module, x) * 0.5


def test_an_existing_instance_forward_is_kept_inside_and_restored():
    plain = make(TinyGPT)
    plain.h[1].forward = _Scaled(plain.h[1])
    model = copy.deepcopy(plain)
    own_forward = model.h[1].__dict__["forward"]

    wrap_model(model, "blocks")
    assert model.h[1].__dict__["forward"] is not own_forward
    log = recompute_counts(model, gpt_loss, gpt_batch())
    assert log.recomputed["h.1.attn.qkv"] == 1
    step(plain, gpt_loss, gpt_batch())
    assert_same(grads(model), grads(plain), "gradients through the instance forward")

    unwrap_model(model)
    assert model.h[1].__dict__["forward"] is own_forward
    assert marked(model) == ["h.1"]

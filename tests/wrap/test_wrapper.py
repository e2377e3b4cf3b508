"""``CheckpointWrapper``: the same names as the wrapped module, and checkpointed calls."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import ckptwrap
from ckptwrap import CheckpointWrapper
from ckptwrap._errors import CheckpointConfigError

from ._models import Block, CallLog, ConvBlock, assert_same, grads, make

VARIANTS = pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])


def _stack() -> nn.Sequential:
    return nn.Sequential(Block(), nn.Dropout(0.3), Block())


def _input() -> torch.Tensor:
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)


def _run(module: nn.Module, seed: int = 1):
    x = _input()
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(x)
    out.pow(2).sum().backward()
    return out.detach(), x.grad


def test_state_dict_keys_equal_the_wrapped_modules():
    module = make(_stack)
    wrapper = CheckpointWrapper(module)
    assert list(wrapper.state_dict()) == list(module.state_dict())
    assert [n for n, _ in wrapper.named_parameters()] == [n for n, _ in module.named_parameters()]
    assert [n for n, _ in wrapper.named_buffers()] == [n for n, _ in module.named_buffers()]
    assert all(a is b for (_, a), (_, b) in zip(wrapper.named_parameters(), module.named_parameters()))

    parent = nn.Sequential(nn.Linear(16, 16), CheckpointWrapper(make(Block)))
    plain_parent = nn.Sequential(nn.Linear(16, 16), make(Block))
    assert list(parent.state_dict()) == list(plain_parent.state_dict())


def test_state_dict_keys_of_a_module_with_buffers():
    module = make(lambda: ConvBlock(4))
    wrapper = CheckpointWrapper(module)
    assert list(wrapper.state_dict()) == list(module.state_dict())
    assert "bn.num_batches_tracked" in wrapper.state_dict()
    batchnorm = nn.BatchNorm1d(3)
    assert list(CheckpointWrapper(batchnorm).state_dict()) == list(batchnorm.state_dict())


def test_loads_a_bare_module_state_dict():
    wrapper = CheckpointWrapper(make(_stack, 0))
    source = make(_stack, 5)
    wrapper.load_state_dict(source.state_dict())
    assert_same(dict(wrapper.state_dict()), dict(source.state_dict()), "loaded state")


def test_its_state_dict_loads_into_a_bare_module_and_into_a_wrapper():
    wrapper = CheckpointWrapper(make(_stack, 5))
    bare = make(_stack, 0)
    bare.load_state_dict(wrapper.state_dict())
    assert_same(dict(bare.state_dict()), dict(wrapper.state_dict()), "bare module")
    other = CheckpointWrapper(make(_stack, 0))
    other.load_state_dict(wrapper.state_dict())
    assert_same(dict(other.state_dict()), dict(wrapper.state_dict()), "wrapper")


def _raw_state(module: nn.Module) -> dict:
    """Parameters and buffers under the names of the module tree, bypassing torch's
    checkpoint_wrapper overrides that strip its prefix."""
    return {
        **dict(nn.Module.named_parameters(module, remove_duplicate=False)),
        **dict(nn.Module.named_buffers(module, remove_duplicate=False)),
    }


def test_loads_the_state_dicts_of_torchs_checkpoint_wrapper():
    torch_wrapped = checkpoint_wrapper(make(lambda: ConvBlock(4), 5))
    # What torch's state_dict() gives (its hook strips the prefix) ...
    stripped = torch_wrapped.state_dict()
    # ... and the raw, prefixed names its submodule tree gives (as in checkpoints saved
    # without its hooks, e.g. by older versions or by code that walks the module tree).
    prefixed = _raw_state(torch_wrapped)
    assert all(key.startswith("_checkpoint_wrapped_module.") for key in prefixed)

    for source in (stripped, prefixed):
        wrapper = CheckpointWrapper(make(lambda: ConvBlock(4), 0))
        wrapper.load_state_dict(source)
        assert_same(dict(wrapper.state_dict()), dict(stripped), "loaded from torch's wrapper")

    # Inside a parent, the prefix sits in the middle of each key.
    torch_parent = nn.Sequential(nn.Linear(4, 4), checkpoint_wrapper(make(lambda: ConvBlock(4), 5)))
    raw = _raw_state(torch_parent)
    parent = nn.Sequential(nn.Linear(4, 4), CheckpointWrapper(make(lambda: ConvBlock(4), 0)))
    parent.load_state_dict(raw)
    assert_same(dict(parent.state_dict()), dict(torch_parent.state_dict()), "inside a parent")


def test_strict_loading_still_reports_wrong_keys():
    wrapper = CheckpointWrapper(make(Block))
    state = dict(make(Block).state_dict())
    state["mlp.extra"] = torch.zeros(1)
    del state["ln1.weight"]
    with pytest.raises(RuntimeError, match=r"(?s)Missing key.*ln1\.weight.*Unexpected key.*mlp\.extra"):
        wrapper.load_state_dict(state)


def test_attribute_access_indexing_len_and_iteration_reach_the_wrapped_module():
    module = make(_stack)
    module.note = "hello"
    wrapper = CheckpointWrapper(module)
    assert wrapper.wrapped_module is module
    assert wrapper[0] is module[0] and wrapper[-1] is module[2]
    assert len(wrapper) == 3
    assert list(wrapper) == list(module)
    assert wrapper.note == "hello"

    block = make(Block)
    wrapped_block = CheckpointWrapper(block)
    assert wrapped_block.ln1 is block.ln1
    assert wrapped_block.mlp.fc.weight is block.mlp.fc.weight
    assert "ln1" in dir(wrapped_block)
    with pytest.raises(AttributeError, match="no_such_attribute"):
        wrapped_block.no_such_attribute


def test_repr_contains_the_wrapped_repr():
    block = make(Block)
    assert repr(block) in repr(CheckpointWrapper(block)).replace("\n  ", "\n")
    assert "use_reentrant=True" in repr(CheckpointWrapper(block, use_reentrant=True))


@VARIANTS
def test_gradients_equal_the_plain_module(use_reentrant):
    plain = make(_stack)
    wrapper = CheckpointWrapper(copy.deepcopy(plain), use_reentrant=use_reentrant)
    out_p, x_grad_p = _run(plain)
    out_w, x_grad_w = _run(wrapper)
    assert torch.equal(out_w, out_p)
    assert torch.equal(x_grad_w, x_grad_p)
    assert_same(grads(wrapper), grads(plain), "parameter gradients")


@VARIANTS
def test_gradients_equal_torch_utils_checkpoint(use_reentrant):
    reference = make(_stack)
    wrapper = CheckpointWrapper(copy.deepcopy(reference), use_reentrant=use_reentrant)
    x = _input()
    torch.manual_seed(1)
    torch_checkpoint.checkpoint(reference, x, use_reentrant=use_reentrant).pow(2).sum().backward()
    _, x_grad = _run(wrapper)
    assert torch.equal(x_grad, x.grad)
    assert_same(grads(wrapper), grads(reference), "parameter gradients")


def test_the_wrapped_module_is_recomputed_in_backward():
    wrapper = CheckpointWrapper(make(Block))
    log = CallLog()
    with log.watching(wrapper):
        _run(wrapper)
    assert log.forward["attn.qkv"] == 1
    assert log.recomputed["attn.qkv"] == 1

    with log.watching(wrapper), torch.no_grad():
        wrapper(_input())
    assert log.forward["attn.qkv"] == 2
    assert log.recomputed["attn.qkv"] == 1


@VARIANTS
@pytest.mark.parametrize("factory", [lambda: ConvBlock(4), lambda: nn.BatchNorm2d(4)], ids=["ConvBlock", "BatchNorm2d"])
def test_batchnorm_statistics_and_gradients_equal_the_plain_module(factory, use_reentrant):
    plain = make(factory)
    wrapper = CheckpointWrapper(copy.deepcopy(plain), use_reentrant=use_reentrant)
    input_grads = []
    for module in (plain, wrapper):
        x = torch.randn(4, 4, 5, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
        torch.manual_seed(1)
        (module(x) * torch.arange(5.0)).sum().backward()
        input_grads.append(x.grad)
    assert_same(dict(wrapper.state_dict()), dict(plain.state_dict()), "statistics")
    assert torch.equal(input_grads[1], input_grads[0])
    assert_same(grads(wrapper), grads(plain), "gradients")


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_pickle_and_deepcopy(how):
    wrapper = CheckpointWrapper(make(_stack), use_reentrant=True)
    if how == "pickle":
        copied = pickle.loads(pickle.dumps(wrapper))
    elif how == "deepcopy":
        copied = copy.deepcopy(wrapper)
    else:
        buffer = io.BytesIO()
        torch.save(wrapper, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)

    assert isinstance(copied, CheckpointWrapper)
    assert copied.checkpoint_options == wrapper.checkpoint_options
    assert list(copied.state_dict()) == list(wrapper.state_dict())
    # The copy still shares its names with its own wrapped module, not with the original.
    assert copied[0].ln1.weight is copied.wrapped_module[0].ln1.weight
    assert copied[0].ln1.weight is not wrapper[0].ln1.weight
    assert all(a is b for a, b in zip(copied.parameters(), copied.wrapped_module.parameters()))

    log = CallLog()
    with log.watching(copied):
        out_c, x_grad_c = _run(copied)
    assert log.recomputed["0.attn.qkv"] == 1
    out_w, x_grad_w = _run(wrapper)
    assert torch.equal(out_c, out_w)
    assert torch.equal(x_grad_c, x_grad_w)
    assert_same(grads(copied), grads(wrapper), "gradients of the copy")


def test_train_and_eval_propagate():
    module = make(_stack)
    wrapper = CheckpointWrapper(module)
    parent = nn.Sequential(wrapper)
    parent.eval()
    assert not wrapper.training and not module.training
    assert not any(m.training for m in module.modules())
    wrapper.train()
    assert wrapper.training and module.training
    assert all(m.training for m in module.modules())

    torch.manual_seed(1)
    with torch.no_grad():
        evaluated = wrapper.eval()(_input())
    assert torch.equal(evaluated, module.eval()(_input()).detach())


def test_a_module_is_required_and_options_are_checked():
    with pytest.raises(CheckpointConfigError, match="got function"):
        CheckpointWrapper(lambda x: x)
    with pytest.raises(CheckpointConfigError, match="'reentrant'.*allowed"):
        CheckpointWrapper(nn.Linear(2, 2), reentrant=True)
    with pytest.raises(ckptwrap.CheckpointError, match="preserve_rng_state must be True or False"):
        CheckpointWrapper(nn.Linear(2, 2), preserve_rng_state=None)

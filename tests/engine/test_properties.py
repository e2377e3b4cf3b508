"""Property: for random layer stacks, nesting depths (0-3) and variants, gradients equal the
plain run; around a re-entrant region that shares its input with the outside (a residual),
they equal torch's re-entrant variant bit for bit and the plain run to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptwrap
from _models import assert_close_to_rounding, assert_same, grads_of, weighted_loss

_layer = st.one_of(
    st.tuples(st.just("linear"), st.integers(2, 12)),
    st.tuples(st.just("relu"), st.none()),
    st.tuples(st.just("tanh"), st.none()),
    st.tuples(st.just("dropout"), st.sampled_from([0.0, 0.1, 0.5, 0.9])),
    st.tuples(st.just("layernorm"), st.none()),
)

# Options of one nesting level: either variant, and for the non-re-entrant one every
# early-stop choice; levels are drawn independently, so variants mix across depths. A
# residual level adds the region's input to its first layer's output inside the region and
# to the region's output outside it, so that input gets gradient from both sides.
_level_options = st.tuples(
    st.one_of(
        st.fixed_dictionaries({"use_reentrant": st.just(True)}),
        st.fixed_dictionaries(
            {"use_reentrant": st.just(False), "early_stop": st.sampled_from([None, True, False])}
        ),
    ),
    st.booleans(),
)


def _build(spec, in_width):
    layers, width = [], in_width
    for kind, arg in spec:
        if kind == "linear":
            layers.append(nn.Linear(width, arg))
            width = arg
        elif kind == "relu":
            layers.append(nn.ReLU())
        elif kind == "tanh":
            layers.append(nn.Tanh())
        elif kind == "dropout":
            layers.append(nn.Dropout(arg))
        else:
            layers.append(nn.LayerNorm(width))
    return nn.Sequential(*layers).train()


def _nested(layers, levels, x, checkpoint):
    """Run ``layers`` with one level per entry of ``levels`` (its options, whether it is a
    residual): each level runs its first layer itself and checkpoints the rest, so three
    levels put a checkpoint inside a checkpoint inside a checkpoint. ``checkpoint`` is
    ckptwrap's, torch's, or None for the plain run."""
    if not levels or not layers:
        for layer in layers:
            x = layer(x)
        return x
    options, residual = levels[0]

    def region(h):
        first = layers[0](h)
        first = first + h if residual and first.shape == h.shape else first
        return _nested(layers[1:], levels[1:], first, checkpoint)

    out = checkpoint(region, x, **options) if checkpoint is not None else region(x)
    return x + out if residual and out.shape == x.shape else out


def _torch_checkpoint(fn, *args, use_reentrant, early_stop=None):
    early_stop = True if early_stop is None else early_stop
    if use_reentrant:
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=True)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, early_stop=early_stop)


def _run(spec, in_width, levels, input_grad, checkpoint):
    torch.manual_seed(0)
    model = _build(spec, in_width)
    x = torch.randn(3, in_width, requires_grad=input_grad)
    torch.manual_seed(1)
    out = _nested(list(model), levels, x, checkpoint)
    if out.requires_grad:  # not when there are no parameters and the input needs no grad
        weighted_loss(out).backward()
    named = {f"param:{k}": p for k, p in model.named_parameters()} | {"input:x": x}
    return grads_of(named) | {"output": out.detach()}


# torch's re-entrant variant warns when a region's inputs need no grad (a nested region
# under the outer's no_grad, or a stack without parameters); ckptwrap's is compared with it.
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # max_examples: tests/conftest.py
@given(
    spec=st.lists(_layer, min_size=1, max_size=7),
    in_width=st.integers(2, 10),
    levels=st.lists(_level_options, min_size=0, max_size=3),
    input_grad=st.booleans(),
)
def test_gradients_equal_plain_run(spec, in_width, levels, input_grad):
    plain = _run(spec, in_width, levels, input_grad, None)
    ours = _run(spec, in_width, levels, input_grad, ckptwrap.checkpoint)
    # Where a re-entrant region's input also feeds the residual sum outside it, the input's
    # gradient parts are summed in another order (the region's backward is its own pass).
    shared = any(options["use_reentrant"] and residual for options, residual in levels)
    if not shared:
        assert_same(ours, plain)
        return
    assert_close_to_rounding(ours, plain, "vs plain")
    if input_grad:  # else torch's re-entrant variant drops the parameters' gradients
        assert_same(ours, _run(spec, in_width, levels, input_grad, _torch_checkpoint), "vs torch")

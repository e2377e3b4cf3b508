"""Property: for random layer stacks, nesting depths (0-3) and variants, gradients equal the plain run."""

from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptwrap
from _models import assert_same, grads_of, weighted_loss

_layer = st.one_of(
    st.tuples(st.just("linear"), st.integers(2, 12)),
    st.tuples(st.just("relu"), st.none()),
    st.tuples(st.just("tanh"), st.none()),
    st.tuples(st.just("dropout"), st.sampled_from([0.0, 0.1, 0.5, 0.9])),
    st.tuples(st.just("layernorm"), st.none()),
)

# Options of one nesting level: either variant, and for the non-re-entrant one every
# early-stop choice; levels are drawn independently, so variants mix across depths.
_level_options = st.one_of(
    st.fixed_dictionaries({"use_reentrant": st.just(True)}),
    st.fixed_dictionaries({"use_reentrant": st.just(False), "early_stop": st.sampled_from([None, True, False])}),
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


def _nested(layers, levels, x):
    """Checkpoint ``layers`` with one level per entry of ``levels`` (its options): each level
    runs its first layer itself and checkpoints the rest, so three levels put a checkpoint
    inside a checkpoint inside a checkpoint."""
    if not levels or not layers:
        for layer in layers:
            x = layer(x)
        return x

    def region(h):
        h = layers[0](h)
        return _nested(layers[1:], levels[1:], h)

    return ckptwrap.checkpoint(region, x, **levels[0])


def _run(spec, in_width, levels, input_grad):
    torch.manual_seed(0)
    model = _build(spec, in_width)
    x = torch.randn(3, in_width, requires_grad=input_grad)
    torch.manual_seed(1)
    layers = list(model)
    out = _nested(layers, levels, x) if levels is not None else model(x)
    if out.requires_grad:  # not when there are no parameters and the input needs no grad
        weighted_loss(out).backward()
    named = {f"param:{k}": p for k, p in model.named_parameters()} | {"input:x": x}
    return grads_of(named) | {"output": out.detach()}


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # max_examples: tests/conftest.py
@given(
    spec=st.lists(_layer, min_size=1, max_size=7),
    in_width=st.integers(2, 10),
    levels=st.lists(_level_options, min_size=0, max_size=3),
    input_grad=st.booleans(),
)
def test_gradients_equal_plain_run(spec, in_width, levels, input_grad):
    plain = _run(spec, in_width, None, input_grad)
    ours = _run(spec, in_width, levels, input_grad)
    assert_same(ours, plain)

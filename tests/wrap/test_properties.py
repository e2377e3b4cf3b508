"""Properties of ``wrap_model`` over randomly built nested models and random valid policies."""

from __future__ import annotations

import copy
import functools
from typing import Any, List, Tuple

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from torch import nn

from ckptwrap import plan, unwrap_model, wrap_model
from ckptwrap.policy import find_blocks

from ._models import assert_close_to_rounding, assert_same, grads, marked

WIDTH = 6

# A model is described by a tree: a leaf kind, or (container kind, [children]), or
# ("repeat", child, n) for n separately built copies of one child in an nn.Sequential.
LEAVES = ("linear", "dropout", "layernorm", "gelu")
CONTAINERS = ("seq", "list", "dict", "residual")


class Residual(nn.Module):
    def __init__(self, body: List[nn.Module]) -> None:
        super().__init__()
        self.body = nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ListBlock(nn.Module):
    def __init__(self, items: List[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleList(items)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for item in self.items:
            x = item(x)
        return x


class DictBlock(nn.Module):
    def __init__(self, items: List[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleDict({f"k{i}": item for i, item in enumerate(items)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for key in sorted(self.items):
            x = self.items[key](x)
        return x


def _build(spec: Any) -> nn.Module:
    if isinstance(spec, str):
        return {
            "linear": lambda: nn.Linear(WIDTH, WIDTH),
            "dropout": lambda: nn.Dropout(0.3),
            "layernorm": lambda: nn.LayerNorm(WIDTH),
            "gelu": nn.GELU,
        }[spec]()
    if spec[0] == "repeat":
        _, child, n = spec
        return nn.Sequential(*(_build(child) for _ in range(n)))
    kind, children = spec
    built = [_build(child) for child in children]
    if kind == "seq":
        return nn.Sequential(*built)
    return {"list": ListBlock, "dict": DictBlock, "residual": Residual}[kind](built)


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.sampled_from(CONTAINERS), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("repeat"), children, st.integers(2, 3)),
    )


SPECS = st.recursive(st.sampled_from(LEAVES), _extend, max_leaves=8).map(
    lambda spec: ("seq", [spec, "linear"])  # a container at the root, a parameter at the end
)


@st.composite
def model_and_policy(draw: st.DrawFn) -> Tuple[Any, Any, nn.Module]:
    spec = draw(SPECS)
    torch.manual_seed(draw(st.integers(0, 3)))
    model = _build(spec)
    named = list(model.named_modules())[1:]
    names = [name for name, _ in named]

    set_terms = ["none", "type:" + draw(st.sampled_from(sorted({type(m).__name__ for _, m in named})))]
    set_terms.append("name:" + draw(st.sampled_from(names)))
    parents = [name for name, m in named if next(m.children(), None) is not None]
    if parents:
        set_terms.append("name:" + draw(st.sampled_from(parents)) + ".*")
    if find_blocks(model):
        set_terms.append("blocks")
    if any(next(m.parameters(), None) is not None or next(m.children(), None) is not None for m in model.children()):
        set_terms.append("all")
    policy = draw(st.sampled_from(set_terms))
    picker = draw(
        st.one_of(
            st.none(),
            st.integers(1, 3).map(lambda n: f"every:{n}"),
            st.integers(1, 3).map(lambda k: f"first:{k}"),
            st.integers(1, 3).map(lambda k: f"last:{k}"),
            st.sampled_from(["fraction:0.5", "fraction:1"]),
        )
    )
    if picker is not None:
        policy = f"{policy};{picker}"

    python_forms = [
        policy,
        type(draw(st.sampled_from([m for _, m in named]))),
        (nn.Linear, Residual),
        _AtDepth(draw(st.integers(0, 2))),
    ]
    chosen = draw(st.sampled_from(python_forms))
    if isinstance(chosen, tuple) and not any(isinstance(m, chosen) for _, m in named):
        chosen = policy
    if isinstance(chosen, _AtDepth) and not any(chosen(m, n) for n, m in named):
        chosen = policy
    return spec, chosen, model


class _AtDepth:
    """A predicate policy: modules at one nesting depth."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __call__(self, module: nn.Module, name: str) -> bool:
        return name.count(".") == self.depth

    def __repr__(self) -> str:
        return f"_AtDepth({self.depth})"


OPTIONS = st.fixed_dictionaries({"use_reentrant": st.booleans(), "nested": st.booleans()})


def _input() -> torch.Tensor:
    return torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(5), requires_grad=True)


def _run(model: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    x = _input()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    out = model(x)
    (out * torch.linspace(-1, 2, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad


def _snapshot(model: nn.Module) -> dict:
    return {
        "modules": [(name, type(m), id(m)) for name, m in model.named_modules()],
        "parameters": [(name, id(p)) for name, p in model.named_parameters()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


@settings(deadline=None)  # example count from the profile in tests/conftest.py
@given(case=model_and_policy(), options=OPTIONS)
def test_wrap_then_unwrap_leaves_everything_as_it_was(case, options):
    spec, policy, model = case
    before = _snapshot(model)
    torch.manual_seed(11)
    with torch.no_grad():
        out_before = model(_input())

    wrap_model(model, policy, **options)
    unwrap_model(model)

    after = _snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["parameters"] == before["parameters"]
    assert_same(after["state"], before["state"], "state dict")
    assert marked(model) == [] and not hasattr(model, "ckptwrap_plan")
    torch.manual_seed(11)
    with torch.no_grad():
        assert torch.equal(model(_input()), out_before)


def _residual_inside_and_outside() -> Tuple[Any, Any, nn.Module]:
    """The region is a residual's body that holds a residual of its own, so the region's
    input gets gradient from outside (the outer sum) and twice from inside."""
    spec = ("seq", [("residual", [("residual", ["dropout"]), "gelu", "gelu"]), "linear"])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return spec, "name:0.body", _build(spec)


# torch's re-entrant variant warns when a nested region's forward runs under the outer's no_grad.
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@settings(deadline=None)  # example count from the profile in tests/conftest.py
@given(case=model_and_policy(), options=OPTIONS)
@example(case=_residual_inside_and_outside(), options={"use_reentrant": True, "nested": False})
@example(case=_residual_inside_and_outside(), options={"use_reentrant": False, "nested": False})
def test_gradients_of_the_wrapped_model_equal_the_unwrapped_one(case, options):
    spec, policy, plain = case
    wrapped = copy.deepcopy(plain)
    wrap_model(wrapped, policy, **options)

    applied = wrapped.ckptwrap_plan
    event(f"{len(applied.names)} module(s) checkpointed")
    assert marked(wrapped) == applied.names == plan(plain, policy, **options).names
    if not options["nested"]:
        assert not [(a, b) for a in applied.names for b in applied.names if b.startswith(a + ".")]
    assert [n for n, _ in wrapped.state_dict().items()] == [n for n, _ in plain.state_dict().items()]

    out_plain, x_grad_plain = _run(plain)
    out_wrapped, x_grad_wrapped = _run(wrapped)
    assert torch.equal(out_wrapped, out_plain)
    ours = {"input": x_grad_wrapped} | grads(wrapped)
    expected = {"input": x_grad_plain} | grads(plain)
    what = f"gradients with policy {policy!r}"
    if not options["use_reentrant"]:
        assert_same(ours, expected, what)
        return
    # Each re-entrant region's backward is a pass of its own, so a tensor that gets
    # gradient from inside and outside a region (a residual input) has its parts summed
    # in another order: bit for bit as torch's re-entrant variant, to rounding as plain.
    reference = _with_torch_reentrant(copy.deepcopy(plain), applied.names)
    out_reference, x_grad_reference = _run(reference)
    assert torch.equal(out_wrapped, out_reference)
    assert_same(ours, {"input": x_grad_reference} | grads(reference), f"{what}, vs torch")
    assert_close_to_rounding(ours, expected, f"{what}, vs plain")


def _with_torch_reentrant(model: nn.Module, names: List[str]) -> nn.Module:
    """``model`` with the modules ``names`` run through torch's re-entrant checkpoint."""
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        forward = functools.partial(type(module).forward, module)
        module.forward = functools.partial(torch_checkpoint.checkpoint, forward, use_reentrant=True)
    return model

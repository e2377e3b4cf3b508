"""Model corpus and helpers shared by the engine tests.

Every helper runs a model three ways (plain, torch.utils.checkpoint, ckptwrap) from the
same seeds, so tests compare results computed in the same process, never stored numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import ckptwrap

MODEL_SEED = 0
RUN_SEED = 1


# ---------------------------------------------------------------------------------------
# Generic helpers
# ---------------------------------------------------------------------------------------


def tensor_leaves(obj: Any) -> List[torch.Tensor]:
    """Tensors inside ``obj`` (tuples, lists, dicts, dataclasses), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensor_leaves(item)]
    if isinstance(obj, dict):
        return [t for key in sorted(obj) for t in tensor_leaves(obj[key])]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensor_leaves(getattr(obj, f.name))]
    return []


def structure(obj: Any) -> Any:
    """The shape of a nested output: container types and keys, tensor dtypes and shapes."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, tuple(obj.shape), obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, [structure(item) for item in obj])
    if isinstance(obj, dict):
        return ("dict", [(key, structure(value)) for key, value in obj.items()])
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, [(f.name, structure(getattr(obj, f.name))) for f in dataclasses.fields(obj)])
    return ("value", obj)


def weighted_loss(out: Any) -> torch.Tensor:
    """A scalar that depends on every element of every tensor in ``out`` with distinct weights.

    Distinct weights make each output element's gradient different, so a gradient that
    is routed to the wrong place or dropped changes the result.
    """
    total = None
    for index, leaf in enumerate(tensor_leaves(out)):
        if not leaf.requires_grad:
            continue
        weights = torch.linspace(-1.0, 1.0 + index, leaf.numel(), dtype=torch.float32)
        term = (leaf.float() * weights.reshape(leaf.shape)).sum()
        total = term if total is None else total + term
    if total is None:
        raise AssertionError("no output requires grad")
    return total


def assert_same(actual: Dict[str, Any], expected: Dict[str, Any], what: str = "") -> None:
    """Bit-for-bit equality of two name -> tensor (or None) maps."""
    assert actual.keys() == expected.keys(), f"{what}: keys differ {actual.keys()} vs {expected.keys()}"
    for name in expected:
        a, e = actual[name], expected[name]
        if e is None or a is None:
            assert a is None and e is None, f"{what}: {name} is {a!r}, expected {e!r}"
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: {name} {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        assert torch.equal(a, e), f"{what}: {name} differs, max abs diff {(a.double() - e.double()).abs().max().item()}"


def assert_close_to_rounding(actual: Dict[str, Any], expected: Dict[str, Any], what: str = "") -> None:
    """Same keys, and float32 tensors equal up to the rounding of summing a few gradient
    parts in another order: a few units in the last place, relative to each tensor's size."""
    assert actual.keys() == expected.keys(), f"{what}: keys differ {actual.keys()} vs {expected.keys()}"
    for name in expected:
        a, e = actual[name], expected[name]
        if e is None or a is None:
            assert a is None and e is None, f"{what}: {name} is {a!r}, expected {e!r}"
            continue
        scale = max(e.abs().max().item(), 1.0)
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7 * scale, msg=lambda m: f"{what}: {name}: {m}")


def grads_of(named: Dict[str, torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
    return {name: (t.grad.clone() if t.grad is not None else None) for name, t in named.items()}


class OpLog(TorchDispatchMode):
    """Records every aten operator, split by whether ``ckptwrap.is_recomputing()`` was True."""

    def __init__(self) -> None:
        super().__init__()
        self.forward: List[str] = []
        self.recompute: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.recompute if ckptwrap.is_recomputing() else self.forward).append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

    def recompute_count(self, name: str) -> int:
        return sum(1 for op in self.recompute if op == name)


# ---------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------


@dataclass
class Built:
    """One freshly built instance of a case: what to call and what has gradients."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: Dict[str, Any] = field(default_factory=dict)
    module: Optional[nn.Module] = None
    inputs: Dict[str, torch.Tensor] = field(default_factory=dict)

    def leaves_with_grad(self) -> Dict[str, torch.Tensor]:
        named = {f"input:{k}": v for k, v in self.inputs.items()}
        if self.module is not None:
            named.update({f"param:{k}": p for k, p in self.module.named_parameters()})
        return named


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Built]
    reentrant: bool = True
    """ckptwrap's re-entrant variant supports this case."""
    torch_reentrant: bool = True
    """torch's re-entrant variant supports it too (so the two can be compared)."""
    running_stats: bool = False


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_()


def _mlp() -> Built:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x = _leaf(5, 8)
    return Built(model, (x,), module=model, inputs={"x": x})


def _conv_bn() -> Built:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).train()
    x = _leaf(2, 3, 6, 6)
    return Built(model, (x,), module=model, inputs={"x": x})


def _transformer() -> Built:
    model = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.25, batch_first=True).train()
    x = _leaf(2, 5, 16)
    return Built(model, (x,), module=model, inputs={"x": x})


def _lstm_cell() -> Built:
    cell = nn.LSTMCell(6, 8)
    x, h, c = _leaf(3, 6), _leaf(3, 8), _leaf(3, 8)

    def step(x, hc):
        return cell(x, hc)

    return Built(step, (x, (h, c)), module=cell, inputs={"x": x, "h": h, "c": c})


def _keywords_and_non_tensors() -> Built:
    linear = nn.Linear(6, 6)
    x, gate = _leaf(4, 6), _leaf(6)

    def fn(x, scale, mode, *, gate, bias=None, activation="tanh"):
        h = linear(x) * scale
        if bias is not None:
            h = h + bias
        h = torch.tanh(h) if activation == "tanh" else torch.relu(h)
        h = h * torch.sigmoid(gate)
        return h.sum(dim=1) if mode == "sum" else h.mean(dim=1)

    return Built(
        fn,
        (x, 2.5, "sum"),
        {"gate": gate, "bias": None, "activation": "tanh"},
        module=linear,
        inputs={"x": x, "gate": gate},
    )


def _dict_output() -> Built:
    linear = nn.Linear(5, 5)
    x, y = _leaf(3, 5), _leaf(3, 5)

    def fn(x, y):
        h = linear(x)
        return {"sum": h + y, "prod": torch.sin(h * y), "extra": [torch.exp(x).mean(dim=0)]}

    return Built(fn, (x, y), module=linear, inputs={"x": x, "y": y})


CORPUS = [
    Case("mlp", _mlp),
    Case("conv_bn", _conv_bn, running_stats=True),
    Case("transformer_dropout", _transformer),
    Case("lstm_cell", _lstm_cell),
    Case("kwargs_non_tensor", _keywords_and_non_tensors, reentrant=False, torch_reentrant=False),
    Case("dict_output", _dict_output, torch_reentrant=False),
]


@dataclass
class Result:
    outputs: Dict[str, torch.Tensor]
    structure: Any
    grads: Dict[str, Optional[torch.Tensor]]
    buffers: Dict[str, torch.Tensor]


def run_case(case: Case, how: str, use_reentrant: bool = False, **options: Any) -> Result:
    """Build ``case`` afresh, run forward (plain, "torch" or "ours") and backward."""
    torch.manual_seed(MODEL_SEED)
    built = case.build()
    torch.manual_seed(RUN_SEED)
    out = call(how, built.fn, *built.args, use_reentrant=use_reentrant, **options, **built.kwargs)
    shape = structure(out)
    weighted_loss(out).backward()
    buffers = {}
    if built.module is not None:
        buffers = {k: b.clone() for k, b in built.module.named_buffers()}
    outputs = {str(i): t.detach().clone() for i, t in enumerate(tensor_leaves(out))}
    return Result(outputs, shape, grads_of(built.leaves_with_grad()), buffers)


def call(how: str, fn: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:
    """Run ``fn`` plainly, through torch's checkpoint or through ckptwrap's."""
    if how == "plain":
        return fn(*args, **kwargs)
    if how == "torch":
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=use_reentrant, **kwargs)
    if how == "ours":
        return ckptwrap.checkpoint(fn, *args, use_reentrant=use_reentrant, **kwargs)
    raise AssertionError(how)

"""Every private torch name ckptwrap uses has a fallback for a torch without it
(``ckptwrap._torch_private``): each lookup falls back when torch lacks the name, and the
engine with each fallback in place gives the plain run's outputs and gradients bit for bit
(or the degraded behaviour its comment documents)."""

from __future__ import annotations

import collections
import contextlib
import importlib
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import _torch_private
from _models import CORPUS, assert_same, run_case

VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]
CASES = [pytest.param(case, id=case.name) for case in CORPUS]
_Point = collections.namedtuple("_Point", "x y")


@contextlib.contextmanager
def _torch_without(owner: Any, name: str) -> Iterator[Any]:
    """``_torch_private`` looked up afresh while ``owner.name`` is missing; put back after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(owner, name)
        try:
            yield importlib.reload(_torch_private)
        finally:
            patch.undo()
            importlib.reload(_torch_private)


def _module(name: str) -> Any:
    return importlib.import_module(name)


# (where torch keeps it, its name, what ckptwrap's lookup must then hold)
LOOKUPS = [
    ("torch._C", "_get_graph_exec_group", lambda tp: tp.graph_exec_group() is None),
    ("torch._C", "_current_graph_task_id", lambda tp: tp.graph_task_id() == -1),
    ("torch._C._autograd", "_make_saved_tensor", lambda tp: tp.make_saved_tensor is None),
    ("torch.autograd", "_is_checkpoint_valid", lambda tp: tp.is_checkpoint_valid() is True),
    ("torch._C", "_get_privateuse1_backend_name", lambda tp: tp.privateuse1_backend_name() == "privateuseone"),
    ("torch.overrides", "_get_current_function_mode_stack", lambda tp: tp.function_mode_stack() == []),
    ("torch.utils._device", "DeviceContext", lambda tp: tp.device_context_class is None),
    (
        "torch.utils._pytree",
        "_get_node_type",
        lambda tp: tp.pytree_node_type(_Point(1, 2)) is collections.namedtuple and tp.pytree_node_type([]) is list,
    ),
    ("torch.utils._pytree", "SUPPORTED_NODES", lambda tp: set(tp.pytree_nodes) >= {tuple, list, dict}),
    ("torch.utils._python_dispatch", "_disable_current_modes", lambda tp: tp.disable_current_modes is contextlib.nullcontext),
    ("torch.nn.modules.batchnorm", "_NormBase", lambda tp: nn.BatchNorm2d in tp.norm_classes),
    ("torch.nn.modules.module", "_global_forward_pre_hooks", lambda tp: tp.global_forward_pre_hooks is None),
    ("torch.utils.checkpoint", "_CachedTorchDispatchMode", lambda tp: tp.sac_modes is None),
    ("torch._C._autograd", "_profiler_enabled", lambda tp: tp.profiler_enabled() is True),
    ("torch._C._autograd", "_saved_tensors_hooks_is_enabled", lambda tp: not tp.saved_tensors_hooks_enabled()),
    ("torch._C._autograd", "_top_saved_tensors_default_hooks", lambda tp: tp.top_saved_tensors_hooks() is None),
    ("torch.nn.modules.dropout", "_DropoutNd", lambda tp: nn.Dropout in tp.dropout_classes),
    ("torch._subclasses.fake_tensor", "FakeTensor", lambda tp: tp.fake_tensor is None),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily", lambda tp: tp.fake_tensor is None),
]


@pytest.mark.parametrize("owner, name, holds", [pytest.param(*entry, id=entry[1]) for entry in LOOKUPS])
def test_lookup_falls_back_where_torch_lacks_the_name(owner: str, name: str, holds: Callable[[Any], bool]):
    if not hasattr(_module(owner), name):
        pytest.skip(f"this torch ({torch.__version__}) has no {owner}.{name}: its fallback is in use already")
    with _torch_without(_module(owner), name) as looked_up:
        assert holds(looked_up), f"without {owner}.{name}"
        assert f"{owner}.{name}" in looked_up.fallbacks_in_use()
    assert _torch_private.graph_task_id is torch._C._current_graph_task_id  # put back


def test_without_the_end_of_backward_callback_no_task_is_used():
    with _torch_without(torch.autograd.Variable, "_execution_engine") as looked_up:
        assert looked_up.queue_callback is None
        assert looked_up.graph_task_id() == -1


_BEFORE_2_12 = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 12)


def test_every_name_resolves_on_this_torch():
    """On the torch the suite runs (2.13), no fallback is in use; on torch 2.11, only the
    one for ``_make_saved_tensor`` (added in 2.12)."""
    expected = ["torch._C._autograd._make_saved_tensor"] if _BEFORE_2_12 else []
    assert _torch_private.fallbacks_in_use() == expected
    assert (_torch_private.make_saved_tensor is None) == _BEFORE_2_12
    assert _torch_private.graph_exec_group is torch._C._get_graph_exec_group
    assert _torch_private.sac_modes is not None
    assert _torch_private.pytree_nodes is torch.utils._pytree.SUPPORTED_NODES


def _views_by_base(tensor: torch.Tensor) -> bool:
    return getattr(tensor, "_base", None) is not None


# Each fallback as the engine meets it (the values a torch without the name leaves).
FALLBACKS = {
    "graph_exec_group": lambda: None,
    "graph_task_id": lambda: -1,
    "make_saved_tensor": None,
    "is_checkpoint_valid": lambda: True,
    "tensor_is_view": _views_by_base,
    "privateuse1_backend_name": lambda: "privateuseone",
    "function_mode_stack": lambda: [],
    "device_context_class": None,
    "pytree_node_type": _torch_private._namedtuple_node_type,
    "pytree_nodes": _torch_private._BUILTIN_NODES,
}
SETS = [pytest.param([name], id=name) for name in FALLBACKS] + [pytest.param(list(FALLBACKS), id="all")]


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> Callable[[list], None]:
    def put(names: list) -> None:
        ckptwrap.engine._device._autocast_types.cache_clear()
        for name in names:
            monkeypatch.setattr(_torch_private, name, FALLBACKS[name])

    yield put
    ckptwrap.engine._device._autocast_types.cache_clear()


@pytest.mark.parametrize("names", SETS)
@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_the_plain_run_with_the_fallback(case, use_reentrant, names, fallbacks):
    if use_reentrant and not case.reentrant:
        pytest.skip("keyword arguments are not supported by the re-entrant variant")
    plain = run_case(case, "plain")
    fallbacks(names)
    ours = run_case(case, "ours", use_reentrant=use_reentrant)
    assert ours.structure == plain.structure
    assert_same(ours.outputs, plain.outputs, "outputs")
    assert_same(ours.grads, plain.grads, "gradients")


class _Counted(nn.Module):
    """Three layers whose forward calls are counted, so recomputations can be."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.layers(x)


def _counted_step(retain: bool = False):
    torch.manual_seed(0)
    block = _Counted()
    x = torch.randn(4, 6, requires_grad=True)
    out = ckptwrap.checkpoint(block, x, use_reentrant=False)
    out.sum().backward(retain_graph=retain)
    if retain:
        out.sum().backward()
    return block, x


def test_without_a_graph_task_each_unpack_recomputes_for_itself(fallbacks):
    """The documented cost of the graph-task fallback: same gradients, more recomputation
    (once per saved tensor unpacked instead of once per backward)."""
    keyed, x_keyed = _counted_step()
    fallbacks(["graph_task_id"])
    alone, x_alone = _counted_step()
    assert torch.equal(x_alone.grad, x_keyed.grad)
    assert keyed.calls == 2  # forward, then one recomputation
    assert alone.calls > 2


def test_without_a_graph_task_retain_graph_still_matches(fallbacks):
    keyed, x_keyed = _counted_step(retain=True)
    fallbacks(["graph_task_id"])
    alone, x_alone = _counted_step(retain=True)
    assert torch.equal(x_alone.grad, x_keyed.grad)


def test_without_the_validity_query_reentrant_grad_is_not_refused(fallbacks):
    """The documented cost of the is_checkpoint_valid fallback: torch.autograd.grad through
    a re-entrant region is not refused; it returns the input's gradient and, as torch's
    own re-entrant variant does, also accumulates the region's parameter gradients."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ckptwrap.CheckpointError, match="torch.autograd.grad"):
        torch.autograd.grad(ckptwrap.checkpoint(layer, x, use_reentrant=True).sum(), x)
    layer.zero_grad(set_to_none=True)
    fallbacks(["is_checkpoint_valid"])
    (got,) = torch.autograd.grad(ckptwrap.checkpoint(layer, x, use_reentrant=True).sum(), x)
    (expected,) = torch.autograd.grad(layer(x).sum(), x)
    assert torch.equal(got, expected)
    assert layer.weight.grad is not None


def test_default_device_context_is_replayed_only_where_it_can_be_found(fallbacks):
    """With the mode stack readable, a ``with torch.device(...)`` around the forward is
    replayed in the recomputation; without it, the recomputation allocates on the device in
    force at backward (here the same), and gradients still match."""
    def region(x: torch.Tensor) -> torch.Tensor:
        return x * torch.ones(x.shape)  # a factory call without a device

    for names in ([], ["function_mode_stack", "device_context_class"]):
        fallbacks(names)
        with torch.device("cpu"):
            x = torch.randn(3, requires_grad=True)
            ckptwrap.checkpoint(region, x, use_reentrant=False).sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x))

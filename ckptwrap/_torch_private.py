"""Every private torch name ckptwrap calls, looked up once at import, each with a fallback.

Private names come and go between torch releases; one missing would otherwise fail deep
in a training step. Each entry says which releases have it and what ckptwrap does
without it (docs/gpu.md has the same list). Callers read these through this module
(``_torch_private.graph_task_id()``), so a test can put a fallback in place.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import os
import sys
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = [
    "checkpoint_debug_switch",
    "device_context_class",
    "disable_current_modes",
    "dispatch_modes_active",
    "dispatch_stack",
    "dropout_classes",
    "fake_tensor",
    "fake_process_group_store",
    "fallbacks_in_use",
    "fsdp2_params",
    "fsdp2_units",
    "keep_cpu_allocation_table",
    "function_mode_stack",
    "global_forward_pre_hooks",
    "graph_exec_group",
    "graph_task_id",
    "is_checkpoint_valid",
    "legacy_memory_profiler",
    "let_cpu_allocation_table_go",
    "make_saved_tensor",
    "norm_classes",
    "privateuse1_backend_name",
    "profiler_enabled",
    "pytree_node_type",
    "pytree_nodes",
    "queue_callback",
    "sac_modes",
    "saved_tensors_hooks_enabled",
    "tensor_is_view",
    "top_saved_tensors_hooks",
]


_FELL_BACK: List[str] = []


def _lookup(owner: Any, name: str, fallback: Any) -> Any:
    """``owner.name``, or ``fallback`` where ``owner`` or its attribute is missing."""
    value = getattr(owner, name, None) if owner is not None else None
    if value is None:
        _FELL_BACK.append(name if owner is None else f"{getattr(owner, '__name__', owner)}.{name}")
        return fallback
    return value


def fallbacks_in_use() -> List[str]:
    """The private names this torch lacks (so their fallbacks are in use), for reports."""
    return list(_FELL_BACK)


def _import(module: str) -> Any:
    """The module named ``module``, or None where this torch has no such module."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# --- the non-re-entrant engine, on every unpack --------------------------------------

# Added with torch.utils.checkpoint.GraphExecGroup (pytorch#166536, November 2025: torch
# 2.10 and later). Without it no GraphExecGroup can exist, so "no group" is exact.
graph_exec_group: Callable[[], Any] = _lookup(torch._C, "_get_graph_exec_group", lambda: None)


def _outside_backward() -> int:
    return -1


# The autograd engine's end-of-backward callback: every torch 1.x and 2.x.
queue_callback: Optional[Callable[[Callable[[], None]], None]] = _lookup(
    _lookup(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None
)
# The running backward's graph task: torch 2.0 and later (torch's own non-re-entrant
# checkpoint keys on it). Without it, or without the callback that drops what a partial
# backward left over, every unpack counts as outside a backward: the region is
# recomputed for each saved tensor it hands out, with the same gradients at more cost.
graph_task_id: Callable[[], int] = (
    _lookup(torch._C, "_current_graph_task_id", _outside_backward)
    if queue_callback is not None
    else _outside_backward
)

# SavedTensor made directly (pytorch#174333, February 2026: torch 2.12 and later). None:
# the engine saves a region's inputs through a no-op autograd Function instead, with the
# same hooks and the same gradients.
make_saved_tensor: Optional[Callable[..., Any]] = _lookup(
    _import("torch._C._autograd"), "_make_saved_tensor", None
)

# The number of Python dispatch modes in force on the calling thread: torch 2.0 and later.
# Fallback: assume one is, so no region is recomputed ahead in another thread (a mode
# such as FlopCounterMode would not see it there): the recomputation runs in backward.
_dispatch_mode_count: Callable[[], int] = _lookup(torch._C, "_len_torch_dispatch_stack", lambda: 1)


# --- following a training step (measure._span) -----------------------------------------


class _DispatchStack(NamedTuple):
    """The calling thread's dispatch mode stack, one mode at a time (inside a backward,
    the copy of the thread-local state that autograd's engine puts back after each node)."""

    push: Callable[[Any], None]
    pop: Callable[[], Any]
    length: Callable[[], int]
    at: Callable[[int], Any]


def _dispatch_stack() -> Optional[_DispatchStack]:
    found = [
        _lookup(torch._C, name, None)
        for name in (
            "_push_on_torch_dispatch_stack", "_pop_torch_dispatch_stack",
            "_len_torch_dispatch_stack", "_get_dispatch_stack_at",
        )
    ]
    if None in found:
        return None
    push, pop, length, at = found
    return _DispatchStack(push, lambda: pop(None), length, at)


# torch 2.0 and later. Fallback None: a meter's counter is never put on a stack by hand,
# so a metered step's forward and recomputations count nothing by operators: what the
# backward's nodes are handed (and, on the CPU, the allocator's events around them) is
# what such a step measures.
dispatch_stack: Optional[_DispatchStack] = _dispatch_stack()


def dispatch_modes_active() -> bool:
    """Whether a Python dispatch mode is in force on the calling thread."""
    return _dispatch_mode_count() > 0


def checkpoint_debug_switch() -> Optional[bool]:
    """``torch.utils.checkpoint.set_checkpoint_debug_enabled``'s setting, read at each
    checkpoint (the context manager rebinds a module global): True or False inside it,
    None outside it or on a torch without the switch, where ``debug=`` decides."""
    value = getattr(torch.utils.checkpoint, "_checkpoint_debug_enabled", None)
    return value if isinstance(value, bool) else None


# --- the re-entrant engine ------------------------------------------------------------

# torch 1.x and later. Fallback: always valid, so misuse through torch.autograd.grad() is
# not reported with ckptwrap's message (torch's own error, if any, is what remains).
is_checkpoint_valid: Callable[[], bool] = _lookup(
    torch.autograd, "_is_checkpoint_valid", lambda: True
)


# Tensor._is_view: torch 1.x and later. Fallback: a view is a tensor with a base.
tensor_is_view: Callable[[torch.Tensor], bool] = _lookup(
    torch.Tensor, "_is_view", lambda tensor: getattr(tensor, "_base", None) is not None
)

# --- device state captured at every region's forward -----------------------------------

# torch 2.1 and later (renamable third backend). Fallback: the backend's default name, so
# a renamed backend's autocast state is replayed only where its tensors are inputs.
privateuse1_backend_name: Callable[[], str] = _lookup(
    torch._C, "_get_privateuse1_backend_name", lambda: "privateuseone"
)

# ``with torch.device(...)`` as a mode: torch 2.0 and later. Fallback: no default-device
# context is replayed, so factory calls without a device in a recomputation allocate on
# the default device in force at backward (the same one, in a usual training loop).
function_mode_stack: Callable[[], List[Any]] = _lookup(
    torch.overrides, "_get_current_function_mode_stack", lambda: []
)
device_context_class: Optional[type] = _lookup(_import("torch.utils._device"), "DeviceContext", None)

# --- pytree: tensors nested in a region's arguments and outputs -------------------------


class _Node(NamedTuple):
    """What torch's pytree registry holds per container type (its NodeDef's two fns)."""

    flatten_fn: Callable[[Any], Tuple[List[Any], Any]]
    unflatten_fn: Callable[[List[Any], Any], Any]


def _namedtuple_node_type(obj: Any) -> Any:
    kind = type(obj)
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):
        return collections.namedtuple
    return kind


def _dict_items(d: Dict[Any, Any]) -> Tuple[List[Any], Any]:
    return list(d.values()), (type(d), list(d.keys()))


def _dict_rebuild(values: List[Any], context: Any) -> Any:
    kind, keys = context
    return kind(zip(keys, values))


_BUILTIN_NODES: Dict[Any, _Node] = {
    tuple: _Node(lambda t: (list(t), None), lambda values, _: tuple(values)),
    list: _Node(lambda t: (list(t), None), lambda values, _: list(values)),
    dict: _Node(_dict_items, _dict_rebuild),
    collections.OrderedDict: _Node(_dict_items, _dict_rebuild),
    collections.namedtuple: _Node(lambda t: (list(t), type(t)), lambda values, kind: kind(*values)),
}

_pytree = _import("torch.utils._pytree")
# torch 1.x and later (namedtuples folded into one node type). Fallback: the same rule.
pytree_node_type: Callable[[Any], Any] = _lookup(_pytree, "_get_node_type", _namedtuple_node_type)
# The registry (torch 1.x and later). Fallback: tuples, lists, dicts and namedtuples only;
# a type another library registered (Hugging Face ModelOutput) is then a leaf.
pytree_nodes: Dict[Any, Any] = _lookup(_pytree, "SUPPORTED_NODES", _BUILTIN_NODES)

# --- the marking layer, on every wrapped forward ----------------------------------------

# torch 2.0 and later. Fallback: nothing suspended, so BatchNorm's running statistics are
# snapshotted inside the recomputation's dispatch modes: plain regions are unaffected, a
# selective region holding BatchNorm fails in backward (torch's replay mode refuses the
# snapshot's copies), never with statistics updated twice.
disable_current_modes: Callable[[], Any] = _lookup(
    _import("torch.utils._python_dispatch"), "_disable_current_modes", contextlib.nullcontext
)

# The base of torch's BatchNorm and InstanceNorm classes: torch 1.x and later. Fallback:
# those classes by name, missing only third-party subclasses of the private base.
norm_classes: Any = _lookup(
    torch.nn.modules.batchnorm,
    "_NormBase",
    (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
     nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
)

# Hooks registered by nn.modules.module.register_module_forward_pre_hook: torch 1.x and
# later. Fallback None: callers assume such a hook may be present (see _forwards).
global_forward_pre_hooks: Optional[Dict[Any, Any]] = _lookup(
    torch.nn.modules.module, "_global_forward_pre_hooks", None
)

# torch's selective-checkpoint modes (torch 2.4 and later), extended to name the module
# and operator when a saved output was changed in place. None: torch's own contexts,
# with torch's own bare error.
sac_modes: Optional[Tuple[type, type]] = (
    _lookup(torch.utils.checkpoint, "_CachingTorchDispatchMode", None),
    _lookup(torch.utils.checkpoint, "_CachedTorchDispatchMode", None),
)
if None in sac_modes:
    sac_modes = None

# --- planning and diagnostics (not on the training step's path) -------------------------

# torch 1.x and later. Fallback: assume a profiler may be running, so that none is started
# beside it (a CPU convolution's own allocations are then bounded, not read).
profiler_enabled: Callable[[], bool] = _lookup(
    _import("torch._C._autograd"), "_profiler_enabled", lambda: True
)

# The base of torch's dropout modules: torch 1.x and later. Fallback: those classes.
dropout_classes: Any = _lookup(
    torch.nn.modules.dropout,
    "_DropoutNd",
    (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout),
)


def _legacy_memory_profiler() -> Optional[Tuple[Callable[..., None], Callable[[], Any], Callable[[], Any]]]:
    """(enable, disable, config): torch's legacy autograd profiler set to report the CPU
    allocator's events on the calling thread, with no profiler library behind it; None
    where any part of it is missing."""
    autograd = _import("torch._C._autograd")
    profiler = _import("torch._C._profiler")
    enable = getattr(autograd, "_enable_profiler_legacy", None)
    disable = getattr(autograd, "_disable_profiler_legacy", None)
    config_class = getattr(torch.autograd, "ProfilerConfig", None)
    state = getattr(getattr(torch.autograd, "ProfilerState", None), "CPU", None)
    experimental = getattr(profiler, "_ExperimentalConfig", None)
    if None in (enable, disable, config_class, state, experimental):
        _FELL_BACK.append("legacy_memory_profiler")
        return None

    def config() -> Any:
        # state, shapes, memory, stack, flops, modules, experimental
        return config_class(state, False, True, False, False, False, experimental())

    return enable, disable, config


# The legacy profiler, for reading a CPU operator's own allocations (``measure._workspace``).
legacy_memory_profiler = _legacy_memory_profiler()


def _cpu_allocation_switch() -> Optional[Any]:
    """The CPU allocator's switch (libc10's ``FLAGS_caffe2_report_cpu_memory_usage``) that
    keeps its table of block sizes for every allocation, not only for those made while a
    profiler reports memory; None where the library or the flag cannot be found."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(os.path.join(lib_dir, name)), "FLAGS_caffe2_report_cpu_memory_usage")
        except (OSError, ValueError):
            continue
    _FELL_BACK.append("c10 FLAGS_caffe2_report_cpu_memory_usage")
    return None


# Any torch whose CPU allocator reports to the profiler (1.x and later). Fallback: the
# table is kept only while a reading is open, so a reading misses the frees of blocks
# allocated outside every reading, and may read a free at the size of a block that
# stood at the same address before (the table is not cleared when a reading ends).
_cpu_allocation_flag = _cpu_allocation_switch()
_cpu_table_lock = threading.Lock()
_cpu_table_keepers = 0
_cpu_table_found = False  # the switch as the first keeper found it


def keep_cpu_allocation_table() -> bool:
    """Have the CPU allocator enter every block it allocates and frees in the table the
    legacy profiler reads sizes from (see :func:`legacy_memory_profiler`), until
    :func:`let_cpu_allocation_table_go`: a reading then reports the free of every block
    allocated since, at its own size. It costs about 3 us per CPU allocation (the
    allocator logs each at INFO, shown only with ``TORCH_CPP_LOG_LEVEL=INFO``). False
    where it cannot be done (nothing to let go then)."""
    global _cpu_table_keepers, _cpu_table_found
    if _cpu_allocation_flag is None:
        return False
    with _cpu_table_lock:
        if not _cpu_table_keepers:
            _cpu_table_found = bool(_cpu_allocation_flag.value)
        _cpu_table_keepers += 1
        _cpu_allocation_flag.value = True
    return True


def let_cpu_allocation_table_go() -> None:
    """End one :func:`keep_cpu_allocation_table`; the last one puts the switch back as it
    was found."""
    global _cpu_table_keepers
    with _cpu_table_lock:
        if _cpu_allocation_flag is None or not _cpu_table_keepers:
            return
        _cpu_table_keepers -= 1
        if not _cpu_table_keepers:
            _cpu_allocation_flag.value = _cpu_table_found


def _saved_tensors_hooks_readers() -> Tuple[Callable[[], bool], Callable[[], Any]]:
    """(enabled, top): whether saved-tensor hooks may run on the calling thread, and the
    innermost pair in force there (None if none)."""
    autograd = _import("torch._C._autograd")
    enabled = _lookup(autograd, "_saved_tensors_hooks_is_enabled", None)
    top = _lookup(autograd, "_top_saved_tensors_default_hooks", None)
    if enabled is None or top is None:
        return (lambda: False), (lambda: None)
    return enabled, (lambda: top(False))


# torch 2.0 and later (``_top_saved_tensors_default_hooks``). Fallback: taken as disabled,
# so the planner's recorder does not follow what the forward saves outside the
# candidates (a candidate's inputs, saved by the model's own code beside it, are then
# counted as kept by the model, not the candidate: predictions from the same measured
# step, a little less tight).
saved_tensors_hooks_enabled, top_saved_tensors_hooks = _saved_tensors_hooks_readers()


def fsdp2_params(model: nn.Module) -> List[Any]:
    """FSDP2's record of each parameter it shards in ``model`` (its ``FSDPParam``: the
    sharded parameter the model registers between steps in ``sharded_param``, the gathered
    one its forward and backward compute with in ``_unsharded_param``, once gathered, and
    an unreduced gradient it accumulates without syncing in ``unsharded_accumulated_grad``),
    each once; none for a model ``fully_shard`` was not applied to.

    Read through ``FSDPModule._get_fsdp_state()``, its state's ``_fsdp_param_group`` and
    the group's ``fsdp_params`` (torch 2.6 and later, where ``fully_shard`` is public).
    Only an FSDP module already imported is consulted: a model cannot hold an FSDP2 unit
    unless it was. Fallback, where any of these is missing (named in ``fallbacks_in_use``
    once met): none found, so a measured step
    of an FSDP2 model computes its gradients as any other model's (``profile_modules``), without
    FSDP2's reduce-scatter of them."""
    found: Dict[int, Any] = {}
    for module in fsdp2_units(model):
        state = getattr(module, "_get_fsdp_state", None)
        state = state() if callable(state) else None
        if not hasattr(state, "_fsdp_param_group"):
            return _fsdp2_fell_back("FSDPModule._get_fsdp_state()._fsdp_param_group")
        group = state._fsdp_param_group  # None for a unit with no parameters of its own
        for fsdp_param in getattr(group, "fsdp_params", None) or ():
            if not hasattr(fsdp_param, "sharded_param"):
                return _fsdp2_fell_back("FSDPParam.sharded_param")
            found.setdefault(id(fsdp_param), fsdp_param)
    return list(found.values())


def fsdp2_units(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` made units (each gathers its
    parameters as it is called, through the public ``FSDPModule``); none where FSDP2 was
    never imported, since a model cannot hold a unit unless it was."""
    unit = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if not isinstance(unit, type):
        return []
    return [module for module in model.modules() if isinstance(module, unit)]


def _fsdp2_fell_back(name: str) -> List[Any]:
    if name not in _FELL_BACK:
        _FELL_BACK.append(name)
    return []


def fake_process_group_store() -> Any:
    """A store for torch's fake process group (``init_process_group("fake", ...)``: every
    collective returns at once, nothing is sent), which importing its module registers:
    ``torch.testing._internal.distributed.fake_pg.FakeStore``, as torch's own memory
    estimators use it. Fallback, where this torch lacks it: None (``--ranks`` is refused,
    saying so)."""
    module = _import("torch.testing._internal.distributed.fake_pg")
    store = _lookup(module, "FakeStore", None)
    return store() if callable(store) else None


class _FakeTensors(NamedTuple):
    tensor_class: type
    """torch's ``FakeTensor``."""
    mode_class: type
    """torch's ``FakeTensorMode``."""
    outside: Callable[[], Any]
    """A context manager in which no fake mode is active (the planner's own arithmetic)."""
    data_dependent: Tuple[type, ...]
    """The errors a fake tensor raises where an operator needs the values it lacks."""


def _fake_tensor() -> Optional[_FakeTensors]:
    module = _import("torch._subclasses.fake_tensor")
    found = [_lookup(module, name, None) for name in ("FakeTensor", "FakeTensorMode", "unset_fake_temporarily")]
    if None in found:
        return None
    errors = (
        _lookup(module, name, None)
        for name in ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
    )
    return _FakeTensors(found[0], found[1], found[2], tuple(e for e in errors if isinstance(e, type)))


# torch's fake tensors: torch 2.1 and later. Fallback None: a model on the meta device or
# made of fake tensors is refused where a step would be measured, as nothing can run it.
fake_tensor: Optional[_FakeTensors] = _fake_tensor()

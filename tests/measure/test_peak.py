"""Tests of the peak memory meter, against byte counts derived from shapes and dtypes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ckptwrap import _torch_private
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.measure import PeakMemory, StorageCounter, measure_peak

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.int8, torch.int64]


def _nbytes(shape, dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


# An action is ("alloc", numel, dtype index) or ("free", index into the live tensors).
_actions = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 5000), st.integers(0, len(_DTYPES) - 1)),
        st.tuples(st.just("free"), st.integers(0, 20)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(_actions)
def test_peak_is_max_of_running_sum_of_allocations(actions):
    live, running, expected = [], 0, 0
    with measure_peak("cpu") as peak:
        for action in actions:
            if action[0] == "alloc":
                _, numel, dtype_index = action
                dtype = _DTYPES[dtype_index]
                live.append(torch.empty(numel, dtype=dtype))
                running += _nbytes((numel,), dtype)
                expected = max(expected, running)
            elif live:
                tensor = live.pop(action[1] % len(live))
                running -= _nbytes(tensor.shape, tensor.dtype)
                del tensor
    assert peak.peak_bytes == expected


def test_views_are_not_double_counted():
    shape = (64, 32)
    with measure_peak("cpu") as peak:
        base = torch.empty(shape)
        views = [base.view(-1), base[::2], base.t(), base[3], base.unsqueeze(0), base.detach()]
        del base  # the views keep the storage alive
        other = torch.empty(shape)
    assert peak.peak_bytes == 2 * _nbytes(shape, torch.float32)
    del views, other


def test_memory_alive_before_entry_is_not_counted():
    before = torch.ones(1000, dtype=torch.float64)
    with measure_peak("cpu") as peak:
        before.add_(1)
        before.view(10, 100).mul_(2)
        alias = before.detach()[10:]
        product = before * 2
    assert peak.peak_bytes == _nbytes(product.shape, product.dtype)
    del alias


def test_adopting_a_storage_from_before_entry_is_not_counted():
    before = torch.ones(1000)
    with measure_peak("cpu") as peak:
        adopter = torch.empty(0)
        adopter.set_(before.untyped_storage())
    assert peak.peak_bytes == 0
    assert adopter.untyped_storage().nbytes() == _nbytes(before.shape, before.dtype)


@pytest.mark.parametrize("start", [0, 10])
def test_growing_a_storage_in_place_counts_the_growth(start):
    inputs = torch.randn(1000)
    with measure_peak("cpu") as peak:
        grown = torch.empty(start)
        grown.resize_(500)
        out = torch.empty(0)  # out= grows only empty outputs without a warning
        torch.mul(inputs, 2, out=out)
    assert peak.peak_bytes == _nbytes((500,), torch.float32) + _nbytes(inputs.shape, inputs.dtype)


def test_other_devices_are_not_counted():
    with measure_peak("cpu") as peak:
        torch.empty(1000, device="meta")
        kept = torch.empty(7, dtype=torch.int64)
    assert peak.peak_bytes == _nbytes(kept.shape, kept.dtype)


def test_backward_allocations_are_counted():
    leaf = torch.randn(4096, requires_grad=True)
    loss = (leaf * 2).sum()
    with measure_peak("cpu") as peak:
        loss.backward()
    grad_bytes = _nbytes(leaf.shape, leaf.dtype)
    # The gradient plus a scalar seed; nothing else of that size is alive at once.
    assert grad_bytes <= peak.peak_bytes < 2 * grad_bytes


def test_storage_finalizer_fires_when_the_memory_is_freed():
    # The meter relies on torch keeping a storage's Python object for as long as the
    # storage lives, so that dropping that object does not fire its finalizer early.
    fired = []
    tensor = torch.empty(1000)
    weakref.finalize(tensor.untyped_storage(), fired.append, True)
    gc.collect()
    view = tensor[10:]
    del tensor
    gc.collect()
    assert not fired
    del view
    assert fired == [True]


def test_counting_does_not_keep_storages_alive():
    with measure_peak("cpu"):
        tensor = torch.empty(1000)
        storage_ref = weakref.ref(tensor.untyped_storage())
        del tensor
        gc.collect()
        assert storage_ref() is None


def test_storages_freed_after_exit_touch_nothing():
    with measure_peak("cpu") as peak:
        counter_ref = weakref.ref(_get_current_dispatch_mode())
        survivor = torch.empty(256)
    measured = peak.peak_bytes
    gc.collect()
    # The survivor's finalizer must be gone, or it would keep the counter alive.
    assert counter_ref() is None
    del survivor
    gc.collect()
    assert peak.peak_bytes == measured == _nbytes((256,), torch.float32)


def test_nested_meters_each_count_their_own_block():
    size = _nbytes((500,), torch.float32)
    with measure_peak("cpu") as outer:
        first = torch.empty(500)
        with measure_peak("cpu") as inner:
            second = torch.empty(500)
            third = torch.empty(500)
        del second, third
    assert inner.peak_bytes == 2 * size
    assert outer.peak_bytes == 3 * size
    del first


def test_result_is_filled_when_the_block_raises():
    with pytest.raises(KeyError, match="boom"):
        with measure_peak("cpu") as peak:
            kept = torch.empty(100)
            raise KeyError("boom")
    assert peak.peak_bytes == _nbytes(kept.shape, kept.dtype)
    assert _get_current_dispatch_mode() is None


def _mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.Tanh())
            for _ in range(depth)
        ]
    )


def _training_step_peak(model: nn.Sequential, inputs: torch.Tensor, checkpointed: bool) -> int:
    model.zero_grad(set_to_none=True)
    with measure_peak("cpu") as peak:
        hidden = inputs
        for layer in model:
            if checkpointed:
                hidden = torch_checkpoint.checkpoint(layer, hidden, use_reentrant=False)
            else:
                hidden = layer(hidden)
        hidden.square().mean().backward()
        del hidden
    return peak.peak_bytes


def test_checkpointing_every_layer_lowers_the_peak_of_a_training_step():
    width, depth, batch = 64, 6, 256
    model = _mlp(width, depth)
    inputs = torch.randn(batch, width)
    plain = _training_step_peak(model, inputs, checkpointed=False)
    checkpointed = _training_step_peak(model, inputs, checkpointed=True)
    activation = _nbytes((batch, width), torch.float32)
    # Un-checkpointed, every layer keeps several activations of this size for backward.
    assert plain > depth * 2 * activation
    assert checkpointed < plain
    # Both steps end holding every parameter gradient.
    grad_bytes = sum(_nbytes(p.shape, p.dtype) for p in model.parameters())
    assert checkpointed >= grad_bytes


def test_default_device_without_accelerator_is_cpu():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present, so it is the default")
    with measure_peak() as peak:
        kept = torch.empty(3)
    assert peak.device == torch.device("cpu")
    assert peak.peak_bytes == _nbytes(kept.shape, kept.dtype)


def test_cuda_reads_the_allocator_peak_above_entry(monkeypatch):
    calls = []
    state = {"allocated": 1000, "max": 1000}

    def reset(device):
        calls.append(("reset", device))
        state["max"] = state["allocated"]

    def allocated(device):
        calls.append(("allocated", device))
        return state["allocated"]

    def max_allocated(device):
        calls.append(("max", device))
        return state["max"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_allocated)
    device = torch.device("cuda", 0)
    with measure_peak(device) as peak:
        state["max"] = 1000 + 4096  # the block's allocations, seen by the allocator
    assert peak.peak_bytes == 4096
    assert peak.device == device
    assert [name for name, _ in calls] == ["reset", "allocated", "max"]
    assert all(where == device for _, where in calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_covers_a_known_allocation():
    shape = (1024, 1024)
    with measure_peak("cuda") as peak:
        tensor = torch.empty(shape, device="cuda")
        del tensor
    assert peak.peak_bytes >= _nbytes(shape, torch.float32)


def test_device_without_statistics_is_rejected():
    with pytest.raises(CheckpointConfigError, match="'meta'.*Supported: 'cpu', 'cuda'"):
        with measure_peak("meta"):
            pass


def test_result_reports_mebibytes():
    result = PeakMemory(device=torch.device("cpu"), peak_bytes=3 * 1024 * 1024)
    assert result.peak_mib == 3.0


def test_storages_resized_in_place_count_as_fsdp2_frees_and_regathers_them():
    """FSDP2 frees a layer's all-gathered parameters with ``untyped_storage().resize_(0)``
    and allocates them again with ``resize_(size)``, which no dispatch mode sees."""
    # A counter an earlier test left open (a lazy budget's measured forward whose backward
    # never came, which the model's next forward would close) lives until it is collected.
    gc.collect()
    made_before = torch.empty(1024)  # a gathered parameter between steps: kept, empty
    made_before.untyped_storage().resize_(0)
    with measure_peak("cpu") as peak:
        made_inside = torch.empty(512)  # 2 KiB
        made_inside.untyped_storage().resize_(0)  # freed: the count goes down
        made_before.untyped_storage().resize_(4096)  # re-gathered: 4 KiB from now
        made_before.untyped_storage().resize_(0)
        made_inside.untyped_storage().resize_(2048)  # 2 KiB again
        made_before.untyped_storage().resize_(4096)  # both alive: 6 KiB
        made_before.untyped_storage().resize_(0)
        made_inside.untyped_storage().resize_(0)
    assert peak.peak_bytes == 6144
    assert torch.UntypedStorage.resize_ is _PLAIN_RESIZE  # put back once no counter is open


_PLAIN_RESIZE = torch.UntypedStorage.resize_


@pytest.mark.skipif(_torch_private._cpu_allocation_flag is None, reason="this torch's allocator switch was not found")
def test_a_cpu_counter_keeps_the_allocator_table_while_it_counts_and_puts_the_switch_back():
    """While a CPU counter counts, the allocator keeps every block's size (so a reading
    reports the free of any block allocated since, at its own size); closed, the switch
    is as it was found, off or on, however many counters overlapped."""
    switch = _torch_private._cpu_allocation_flag
    for found in (False, True):
        switch.value = found
        try:
            first, second = StorageCounter("cpu"), StorageCounter("cpu")
            assert switch.value
            first.close()
            assert switch.value
            second.close()
            second.close()  # closing twice lets go once
            assert switch.value is found
        finally:
            switch.value = False


def _profiled(monkeypatch=None):
    from ckptwrap.wrap import profile_modules

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(3)])
    profile = profile_modules(model, ["0", "1", "2", "1.2"], (torch.randn(4, 16, 32),), step=True).to_dict()
    for cost in profile["modules"]:
        cost.update(forward_time=0.0, recompute_time=None, selective_overhead=0.0, ops=[])
    profile["step"].pop("seconds")
    return profile


def test_without_the_allocator_switch_a_step_is_measured_as_with_it(monkeypatch):
    """The fallback where the switch is missing: readings keep the profiler's own table,
    and a step whose blocks' frees it reports alike measures the same bytes."""
    _profiled()  # a process's first measured step reads 32 bytes more in one recomputation (made once)
    kept = _profiled()
    monkeypatch.setattr(_torch_private, "_cpu_allocation_flag", None)
    assert not _torch_private.keep_cpu_allocation_table()
    assert _profiled() == kept

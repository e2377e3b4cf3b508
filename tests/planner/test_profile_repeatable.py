"""The profiler gives the same bytes on every run of the same model and input.

Storages are told apart by the address of their C++ object. When a block's output is
freed and a later storage is allocated at the same address, the profiler must not take
the new storage for the old one; whether that happens depends on the allocator, so each
model is profiled many times and every run must agree with a count made here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

from ckptwrap.wrap import profile_modules

RUNS = 12


class _ReluBlock(nn.Module):
    """Linear then ReLU: the ReLU saves its output, so the block keeps it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _Tail(nn.Module):
    """Blocks, each followed by plain operators. ``saving`` says which of them are
    followed by an operator that saves the block's output (``sin``); the others by a
    product with a constant, which saves nothing, then two ``sin``, which save only
    storages created after the block's output may have been freed."""

    def __init__(self, depth: int, saving: Tuple[int, ...] = ()) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ReluBlock(16) for _ in range(depth)])
        self.saving = saving

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index in self.saving:
                x = torch.sin(x)
            else:
                x = x * 2
                x = torch.sin(x)
                x = torch.sin(x)
        return x


def _by_hand(
    model: nn.Module, names: List[str], args: Tuple[Any, ...]
) -> Tuple[Dict[str, int], int]:
    """Per block, the bytes of its outputs that it saves itself and that the forward saves
    again after the block returns; and the bytes a plain forward saves in all (other than
    parameters and inputs). Every storage seen is held until the count ends, so no address
    is reused while counting."""
    modules = dict(model.named_modules())
    excluded = {t.untyped_storage()._cdata for t in [*model.parameters(), *args]}
    held: List[torch.UntypedStorage] = []
    outputs: Dict[str, set] = {name: set() for name in names}
    inside: Dict[str, set] = {name: set() for name in names}
    after: Dict[str, set] = {name: set() for name in names}
    saved: Dict[int, int] = {}
    running: List[str] = []
    finished: List[str] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        held.append(storage)
        if storage._cdata not in excluded:
            saved[storage._cdata] = storage.nbytes()
        for name in running:
            inside[name].add(storage._cdata)
        for name in finished:
            after[name].add(storage._cdata)
        return tensor

    def pre(name: str):
        return lambda module, inputs: running.append(name)

    def post(name: str):
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            running.remove(name)
            finished.append(name)
            held.append(output.untyped_storage())
            outputs[name].add(output.untyped_storage()._cdata)

        return hook

    handles = []
    for name in names:
        handles.append(modules[name].register_forward_pre_hook(pre(name)))
        handles.append(modules[name].register_forward_hook(post(name)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model(*args)
        del output
    finally:
        for handle in handles:
            handle.remove()
    handed = {
        name: sum(saved.get(key, 0) for key in outputs[name] & inside[name] & after[name])
        for name in names
    }
    return handed, sum(saved.values())


def _figures(profile: Any) -> Tuple[Any, ...]:
    per_module = tuple(
        (c.kept_bytes, c.handed_over_bytes, c.self_saved_input_bytes, c.base_before_bytes,
         c.joins_previous)
        for c in profile.modules
    )
    return per_module, profile.base_bytes, profile.total_activation_bytes


@pytest.mark.parametrize(
    "saving", [(), (1, 4, 6)], ids=["nothing-saves-the-outputs", "some-outputs-saved-again"]
)
def test_bytes_are_the_same_on_every_run_and_right(saving):
    torch.manual_seed(0)
    model = _Tail(8, saving)
    x = torch.randn(8, 16)
    names = [f"blocks.{i}" for i in range(8)]
    handed, total = _by_hand(model, names, (x,))
    assert [handed[name] > 0 for name in names] == [i in saving for i in range(8)]
    runs = [profile_modules(model, names, (x,), repeats=0) for _ in range(RUNS)]
    for profile in runs:
        assert {c.name: c.handed_over_bytes for c in profile.modules} == handed
        assert profile.total_activation_bytes == total
        assert _figures(profile) == _figures(runs[0])


def test_a_join_is_not_broken_by_a_storage_at_a_freed_address():
    """The chain check watches the storage a block saves of its input; a later storage at
    the same address, saved after the block, must not count as that input saved again."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_ReluBlock(16) for _ in range(6)])
    x = torch.randn(8, 16)
    names = [str(i) for i in range(6)]
    runs = [profile_modules(model, names, (x,), repeats=0) for _ in range(RUNS)]
    # Each block takes the one before's output alone, and only it saves that input.
    assert [c.joins_previous for c in runs[0].modules] == [False] + [True] * 5
    assert all(_figures(profile) == _figures(runs[0]) for profile in runs)

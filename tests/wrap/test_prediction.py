"""The plan's predicted peak against the activation peak measured in one training step.

The meter here counts, from the operator that creates it until it is freed, every
storage the forward or a recomputation creates; storages backward itself creates
(gradients, temporaries) are not counted: that is what the planner predicts.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ckptwrap
from ckptwrap import plan, wrap_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from factories import ConvPyramid  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

TOLERANCE = 0.10


class _ActivationMeter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.in_backward = False
        self.peak = 0
        self._live = 0
        self._sizes: Dict[int, int] = {}
        self._freed: List[int] = []
        self._finalizers: List[weakref.finalize] = []
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_backward and not ckptwrap.is_recomputing():
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                key = storage._cdata
                with self._lock:
                    if key in inputs or key in self._sizes:
                        continue
                    self._sizes[key] = storage.nbytes()
                    self._finalizers.append(weakref.finalize(storage, self._release, key))
                    while self._freed:
                        self._live -= self._freed.pop()
                    self._live += storage.nbytes()
                    self.peak = max(self.peak, self._live)
        return out

    def _release(self, key: int) -> None:
        # Forget the address at once: a new storage may take it before the next count.
        self._freed.append(self._sizes.pop(key, 0))

    def __exit__(self, *exc):
        for finalizer in self._finalizers:
            finalizer.detach()
        return super().__exit__(*exc)


def _gpt():
    config = GPTConfig(vocab=128, width=64, heads=4, layers=6, seq_len=64)
    torch.manual_seed(0)
    return GPT(config).train(), synthetic_batch(config, 4, seed=0), (lambda loss: loss)


def _pyramid():
    torch.manual_seed(0)
    model = ConvPyramid(in_channels=3, widths=(8, 24, 72), blocks_per_stage=2, classes=10).train()
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(10, (4,), generator=torch.Generator().manual_seed(1))
    return model, (images,), (lambda logits: torch.nn.functional.cross_entropy(logits, labels))


def _measured_peak(model, inputs, loss_of) -> int:
    torch.manual_seed(1)
    with _ActivationMeter() as meter:
        loss = loss_of(model(*inputs))
        meter.in_backward = True
        loss.backward()
    return meter.peak


@pytest.mark.parametrize(
    ("build", "policy"),
    [
        (_gpt, "none"),
        (_gpt, "blocks"),
        (_gpt, "every:2"),
        (_gpt, "last:2"),
        (_gpt, "budget:50%"),
        (_gpt, "budget:30%"),
        (_gpt, "blocks;selective"),
        (_pyramid, "none"),
        (_pyramid, "blocks"),
        (_pyramid, "every:2"),
        (_pyramid, "budget:70%"),
    ],
)
def test_the_predicted_peak_is_within_ten_percent_of_the_measured_one(build, policy):
    model, inputs, loss_of = build()
    wrapped = copy.deepcopy(model)
    if policy == "none":
        predicted = plan(model, "blocks", example_inputs=inputs).activation_bytes
    else:
        wrap_model(wrapped, policy, example_inputs=inputs)
        predicted = wrapped.ckptwrap_plan.predicted_peak
    measured = _measured_peak(wrapped, inputs, loss_of)
    assert abs(predicted / measured - 1) <= TOLERANCE, (
        f"{policy}: predicted {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB"
    )

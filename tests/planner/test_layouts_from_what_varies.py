"""Shape variables found from what varies between steps, not only from one forward's
inputs (``planner._shapes``: ``InputLayout.widened``): an axis read as fixed that another
step gives another size (the patches of images at another resolution, flattened into one
axis), and one variable's dimensions given two sizes (an image's height and width),
become variables of the same layout, so what was measured keeps standing and a fit
covers every size; and a fit is trusted only where the measured shapes determine it.

Counted through the ``ckptwrap`` logger, as a user reads it: each measured step says
"ckptwrap measured a training step".
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch

import ckptwrap
from ckptwrap.planner._shapes import read_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _architectures as catalogue  # noqa: E402
from _architectures import ARCHITECTURES, available  # noqa: E402


def _qwen_like(rows: int, side: int, patches: int):
    """Inputs shaped as Qwen2-VL's processor gives them: the patches of every image of the
    batch in one axis of a 2-D float tensor, their grid per image."""
    return {
        "input_ids": torch.randint(100, (rows, 20)),
        "pixel_values": torch.randn(patches, 96),
        "image_grid_thw": torch.tensor([[1, side, side]] * rows),
    }


def test_an_axis_read_as_fixed_that_another_step_changes_becomes_a_variable():
    layout = read_layout((), _qwen_like(2, 4, 32))
    assert layout.sizes_of((), _qwen_like(2, 4, 48)) is None  # as read, 32 patches are fixed
    wider = layout.widened((), _qwen_like(2, 4, 48))
    assert wider is not None and "pixel_values.shape[0]" in wider.names
    sizes = dict(zip(wider.names, wider.sizes_of((), _qwen_like(2, 4, 48))))
    assert sizes["pixel_values.shape[0]"] == 48
    # Any later number of patches fits the widened layout, and steps measured before it
    # widened keep their place at the size they had.
    assert wider.sizes_of((), _qwen_like(2, 4, 200)) is not None
    before = layout.sizes_of((), _qwen_like(2, 4, 32))
    assert dict(zip(wider.names, wider.extended(before)))["pixel_values.shape[0]"] == 32
    # Nothing to widen where the inputs fit, or differ in structure or dtype.
    assert layout.widened((), _qwen_like(2, 4, 32)) is None
    other = _qwen_like(2, 4, 48)
    other["pixel_values"] = other["pixel_values"].half()
    assert layout.widened((), other) is None
    assert layout.widened((), {**_qwen_like(2, 4, 48), "labels": torch.zeros(2, 20)}) is None


def test_one_variable_whose_dimensions_take_two_sizes_splits():
    def images(rows, high, wide):
        return {"pixel_values": torch.randn(rows, 3, high, wide)}

    layout = read_layout((), images(2, 32, 32))
    assert layout.sizes_of((), images(2, 32, 48)) is None  # a square side is one length
    wider = layout.widened((), images(2, 32, 48))
    assert wider is not None and len(wider.names) == len(layout.names) + 1
    assert sorted(wider.sizes_of((), images(3, 40, 24))) == sorted([3, 40, 24])
    # The side split off had the square's size at the shapes measured before.
    assert sorted(wider.extended(layout.sizes_of((), images(2, 16, 16)))) == [2, 16, 16]


def _measured_steps(caplog) -> int:
    return sum("ckptwrap measured a training step" in record.getMessage() for record in caplog.records)


def _train(name: str, batches, caplog, budget: str = "budget:50%"):
    """A lazy budget and the plain model trained side by side on ``batches``: the
    measured steps, and whether every loss and gradient was the same."""
    arch = ARCHITECTURES[name]
    torch.manual_seed(0)
    plain = arch.build()
    model = copy.deepcopy(plain)
    ckptwrap.wrap_model(model, budget)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, plain)]
    exact = True
    with caplog.at_level(logging.INFO, logger="ckptwrap"):
        for step, batch in enumerate(batches):
            losses = []
            for each, optimizer in zip((model, plain), optimizers):
                torch.manual_seed(step)  # the same dropout masks in both
                out = each(**batch)
                out.loss.backward()
                losses.append(out.loss.detach())
                del out
            exact &= torch.equal(*losses) and all(
                (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
                for a, b in zip(model.parameters(), plain.parameters())
            )
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return _measured_steps(caplog), exact


@pytest.mark.skipif("qwen2_vl" not in available(), reason="transformers lacks Qwen2-VL")
def test_a_vision_language_model_at_ten_resolutions_is_measured_at_few(caplog):
    """Qwen2-VL fed as its processor feeds it: each batch's images at resolutions of
    their own, so the patch axis of ``pixel_values`` takes a new size at every step."""
    sides = [4, 6, 8, 10, 12, 14, 16, 6, 10, 14]
    batches = [
        catalogue.dynamic_resolution_batch(2, side, 100 * round_ + seed, True)
        for round_ in range(3) for seed, side in enumerate(sides)
    ]
    assert len({batch["pixel_values"].shape[0] for batch in batches}) >= 10
    measured, exact = _train("qwen2_vl", batches, caplog)
    assert exact
    assert 1 <= measured <= 12, f"{measured} of {len(batches)} steps measured"


@pytest.mark.skipif("clip" not in available(), reason="transformers lacks CLIP")
def test_a_two_tower_model_with_batch_and_length_varying_apart_is_trusted_after_few_steps(caplog):
    """CLIP's batch (both towers) and caption length vary independently over 11 shapes,
    each met twice. A fit is trusted once it predicts a step it was not fitted on, and
    only where the shapes measured determine it: two caption lengths tell a line, not a
    parabola, so a third length is measured once."""
    shapes = [(2, 8), (4, 8), (2, 16), (4, 16), (3, 12), (2, 12), (4, 12), (3, 8), (3, 16), (4, 10), (2, 10)]
    batches = [catalogue.contrastive_batch(rows, length, i, True) for i, (rows, length) in enumerate(shapes * 2)]
    measured, exact = _train("clip", batches, caplog)
    assert exact
    assert 1 <= measured <= 5, f"{measured} of {len(batches)} steps measured"

"""The shape variables read from one forward's inputs (``planner._shapes``), on the
layouts real loops feed: padded batches from a collator, packed sequences with their
offsets, speech features, images, flat token streams, and inputs that do not fit."""

from __future__ import annotations

import pytest
import torch

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.planner._shapes import read_layout


def _ids(rows: int, length: int) -> torch.Tensor:
    return torch.randint(100, (rows, length))


def _padded(rows: int, length: int):
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1:, length // 2:] = 0
    return {"input_ids": _ids(rows, length), "attention_mask": mask, "labels": _ids(rows, length)}


def _packed(lengths):
    total = sum(lengths)
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {
        "input_ids": _ids(1, total), "position_ids": positions, "labels": _ids(1, total),
        "cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }


def test_a_padded_batch_has_a_batch_and_a_length_and_reads_every_later_batch():
    layout = read_layout((), _padded(4, 37))
    assert layout.names == ("batch", "length") and layout.sizes == (4, 37)
    assert layout.sizes_of((), _padded(3, 50)) == (3, 50)
    assert layout.sizes_of((), _padded(2, 2)) == (2, 2)
    assert layout.describe() == "batch 4, length 37"


def test_packed_sequences_have_no_batch_and_their_offsets_are_free():
    layout = read_layout((), _packed([100, 90, 60]))
    assert layout.names == ("length",) and layout.sizes == (250,)  # never "batch 4"
    assert layout.sizes_of((), _packed([30] * 10)) == (300,)
    assert layout.sizes_of((), _packed([7])) == (7,)


def test_speech_features_keep_their_frames_fixed_and_the_text_length_varies():
    def batch(rows, text, frames=3000):
        return {"input_features": torch.randn(rows, 80, frames), "decoder_input_ids": _ids(rows, text), "labels": _ids(rows, text)}

    layout = read_layout((), batch(2, 12))
    assert layout.sizes_of((), batch(3, 20)) is not None
    changed = dict(zip(layout.names, layout.sizes_of((), batch(3, 20))))
    assert changed["batch"] == 3 and 20 in changed.values() and 80 in changed.values()
    assert layout.sizes_of((), batch(2, 12, frames=1500)) is None  # another layout: measured, never resized


def test_an_image_side_is_one_length_and_channels_are_fixed():
    layout = read_layout((torch.randn(4, 3, 32, 32),), {})
    assert layout.names == ("batch", "length") and layout.sizes == (4, 32)
    assert layout.sizes_of((torch.randn(2, 3, 64, 64),), {}) == (2, 64)
    assert layout.sizes_of((torch.randn(2, 4, 64, 64),), {}) is None
    assert layout.sizes_of((torch.randn(2, 3, 64, 48),), {}) is None  # one variable, two sizes


def test_a_float_mask_follows_the_length():
    layout = read_layout((_ids(2, 16),), {"mask": torch.zeros(2, 1, 16, 16)})
    assert layout.names == ("batch", "length")
    assert layout.sizes_of((_ids(3, 24),), {"mask": torch.zeros(3, 1, 24, 24)}) == (3, 24)


def test_a_flat_token_stream_is_a_length():
    layout = read_layout((torch.arange(64),), {})
    assert layout.names == ("length",)
    assert layout.sizes_of((torch.arange(80),), {}) == (80,)


def test_one_row_is_no_batch_and_sizes_below_two_are_fixed():
    layout = read_layout((_ids(1, 1),), {})
    assert layout.names == ()
    assert layout.sizes_of((_ids(1, 1),), {}) == ()
    assert layout.sizes_of((_ids(2, 1),), {}) is None


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda b: {**b, "input_ids": b["input_ids"].int()}, id="another dtype"),
        pytest.param(lambda b: {k: v for k, v in b.items() if k != "labels"}, id="an argument less"),
        pytest.param(lambda b: {**b, "labels": None}, id="a tensor made None"),
        pytest.param(lambda b: {**b, "input_ids": b["input_ids"][None]}, id="another rank"),
    ],
)
def test_inputs_of_another_structure_do_not_fit(other):
    layout = read_layout((), _padded(4, 37))
    assert layout.sizes_of((), other(_padded(4, 37))) is None


def test_declared_shapes_raise_the_variables_they_carry():
    layout = read_layout((), _padded(4, 37))
    assert layout.declared({"input_ids": (8, 512)}) == (8, 512)
    assert layout.declared({"labels": (2, 16)}) == (4, 37)  # never below what was seen
    with pytest.raises(CheckpointConfigError, match="'input_idz'.*attention_mask, input_ids, labels"):
        layout.declared({"input_idz": (8, 512)})
    with pytest.raises(CheckpointConfigError, match=r"\(8,\), of 1 dimensions; its tensor has 2"):
        layout.declared({"input_ids": (8,)})

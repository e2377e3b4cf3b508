"""The non-re-entrant engine on a torch without ``_make_saved_tensor`` (before 2.12).

There a region's inputs are saved through a no-op autograd Function instead. The tests of
nesting, early stop and the differential comparison with torch's checkpoint run again here
with that path forced, so both ways of saving are held to the same results.
"""

from __future__ import annotations

import pytest
import torch

import ckptwrap
from ckptwrap import _torch_private
from ckptwrap.engine import _nonreentrant

from test_differential import *  # noqa: F401,F403  (collected again under the fixture below)
from test_early_stop import *  # noqa: F401,F403
from test_nesting import *  # noqa: F401,F403


@pytest.fixture(autouse=True)
def _inputs_saved_through_a_function(monkeypatch):
    monkeypatch.setattr(_torch_private, "make_saved_tensor", None)


def test_the_function_path_is_the_one_taken(monkeypatch):
    calls = []
    original = _nonreentrant._save_through_function
    monkeypatch.setattr(
        _nonreentrant, "_save_through_function", lambda tensors: calls.append(len(tensors)) or original(tensors)
    )
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    ckptwrap.checkpoint(lambda a, b, scale=1.0: torch.sin(a @ b) * scale, x, w, scale=2.0).sum().backward()
    assert calls == [2]
    expected_x, expected_w = torch.autograd.grad((torch.sin(x @ w) * 2.0).sum(), (x, w))
    assert torch.equal(x.grad, expected_x) and torch.equal(w.grad, expected_w)


def test_an_input_changed_in_place_before_backward_is_reported():
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 1.0
    out = ckptwrap.checkpoint(torch.sin, h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_what_is_kept_holds_the_node_alive():
    """On torch before 2.12 a Function's node lives only while a tensor or a graph edge
    holds it (its Python object does not), and its saved tensors cannot be read once it
    died: what a region keeps must be a tensor whose ``grad_fn`` is the node, so that the
    node lives as long as the region. (On this torch the node's Python object would keep
    it alive too; the test pins the holding, which the CUDA run on torch 2.11 needed.)"""
    x = torch.randn(3, 4, requires_grad=True)
    kept = _nonreentrant._SavedInputs((x, 2.0), {})
    held = kept._saved
    assert isinstance(held, torch.Tensor) and held.numel() == 0
    assert type(held.grad_fn).__name__.startswith("_SaveInputs")
    args, kwargs = kept.restore()
    assert args[0] is x and args[1] == 2.0 and kwargs == {}

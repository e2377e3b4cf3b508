"""The non-re-entrant engine on a torch without ``_make_saved_tensor`` (before 2.12).

There a region's inputs are saved through a no-op autograd Function instead. The tests of
nesting, early stop and the differential comparison with torch's checkpoint run again here
with that path forced, so both ways of saving are held to the same results.
"""

from __future__ import annotations

import pytest
import torch

import ckptwrap
from ckptwrap.engine import _nonreentrant

from test_differential import *  # noqa: F401,F403  (collected again under the fixture below)
from test_early_stop import *  # noqa: F401,F403
from test_nesting import *  # noqa: F401,F403


@pytest.fixture(autouse=True)
def _inputs_saved_through_a_function(monkeypatch):
    monkeypatch.setattr(_nonreentrant, "_make_saved_tensor", None)


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

"""Every engine test must leave autograd as it found it: no recomputation flag left set and
no saved-tensor hook left on the stack (a leaked hook would swallow the next plain forward)."""

import pytest
import torch

import ckptwrap


@pytest.fixture(autouse=True)
def _engine_state_is_clean():
    yield
    assert ckptwrap.is_recomputing() is False, "is_recomputing() left True after the test"
    x = torch.randn(2, requires_grad=True)
    saved = x.sin().grad_fn._saved_self
    assert isinstance(saved, torch.Tensor) and torch.equal(saved, x), "a saved-tensor hook leaked"

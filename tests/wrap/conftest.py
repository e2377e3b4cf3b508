"""Every marking-layer test must leave autograd as it found it: no recomputation flag left
set, no saved-tensor hook left on the stack, and checkpointing switched back on."""

import pytest
import torch

import ckptwrap
from ckptwrap.wrap import _switch


@pytest.fixture(autouse=True)
def _one_thread():
    # The models here are tiny: intra-op threads only add synchronisation, which costs
    # seconds per step when the machine's cores are busy with other work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _state_is_clean(_one_thread):
    yield
    assert ckptwrap.is_recomputing() is False, "is_recomputing() left True after the test"
    assert _switch.is_disabled() is False, "ckptwrap.wrap.disabled() left on after the test"
    x = torch.randn(2, requires_grad=True)
    saved = x.sin().grad_fn._saved_self
    assert isinstance(saved, torch.Tensor) and torch.equal(saved, x), "a saved-tensor hook leaked"

"""Client tests run real third-party models, kept tiny so the suite stays fast."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models gain nothing from intra-op threads, and on a busy machine their
    # synchronisation costs seconds per step.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

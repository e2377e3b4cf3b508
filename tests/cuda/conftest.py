"""Configuration of the CUDA tests: deterministic kernels, so that two plain runs agree
bit for bit and any difference a test finds is ckptwrap's.

The cuBLAS workspace setting must be in the environment before cuBLAS starts, which is
why it is set here, at collection, and not in a fixture.
"""

import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _deterministic():
    if not torch.cuda.is_available():
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)

"""pytest plugin: run a CPU test selection with every tensor made on another device.

Loaded by ``scripts/gpu_check.py`` as ``-p pytest_on_device`` with ``scripts/`` on
``PYTHONPATH``. ``CKPTWRAP_TEST_DEVICE`` (``cuda``, ``cuda:1``...) becomes torch's default
device before any test runs, so tensors and modules the tests build without naming a
device live there, and the tests compare ckptwrap with the plain run and with
``torch.utils.checkpoint`` on that device. On CUDA, kernels are deterministic (with
``CUBLAS_WORKSPACE_CONFIG``, which the caller sets before the process starts), so
bit-for-bit comparisons stay meaningful.
"""

from __future__ import annotations

import os

import torch


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook signature
    device = os.environ.get("CKPTWRAP_TEST_DEVICE")
    if not device:
        return
    torch.set_default_device(device)
    if torch.device(device).type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_report_header(config) -> str:  # noqa: ANN001
    device = os.environ.get("CKPTWRAP_TEST_DEVICE")
    return f"ckptwrap: tensors made on {device} (torch.set_default_device)" if device else ""

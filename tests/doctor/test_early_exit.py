"""The doctor says what it saw of regions the step did not call: the layers an early-exit
model skipped on the example inputs were not reached (nothing inside them ran, their
parameters got no gradient), which is not a parent using their submodules directly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ckptwrap
from ckptwrap import doctor


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


class _EarlyExit(nn.Module):
    """Stops calling its layers once the hidden state is confident enough (here: always
    after the first), as early-exit models do, depending on the data."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(depth))
        self.exit = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if torch.sigmoid(self.exit(x)).mean() > -1.0:  # a decision read from the data
                break
        return self.exit(x).sum()


class _UsesTheWeight(nn.Module):
    """Uses a leaf module's parameters without calling it (a tied projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.projection = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.linear(x, self.projection.weight).sum()


def _inputs() -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def _not_called(report):
    return [f for f in report.findings if f.check == "not-called"]


def test_layers_an_early_exit_skipped_are_said_not_reached():
    report = doctor(ckptwrap.wrap_model(_EarlyExit(), "blocks"), _inputs())
    [finding] = _not_called(report)
    assert finding.modules == ("layers.1", "layers.2", "layers.3")
    assert "not called in the step" in finding.message and "data-dependent" in finding.message
    assert "uses its submodules" not in finding.message
    assert finding.severity == "info" and report.ok
    assert all("its parameters got no gradient" in detail for detail in finding.details)
    # The layer it did reach is checked as any other.
    assert "layers.0" not in str(finding.modules)


def test_a_module_whose_parameters_are_used_directly_is_still_a_warning():
    report = doctor(ckptwrap.wrap_model(_UsesTheWeight(), "name:projection"), _inputs())
    [finding] = _not_called(report)
    assert finding.severity == "warning" and not report.ok
    assert "uses its submodules or parameters directly" in finding.message
    assert finding.details == ("projection (Linear); its parameters projection.weight get gradients",)

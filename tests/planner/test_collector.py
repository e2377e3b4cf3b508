"""Python's cyclic collector is held off while a plan measures a step on example inputs,
and is as the caller had it afterwards (also where the caller had switched it off). A
lazy budget's measured step leaves it as it is: that step spans the caller's code, and
one never finished would hold it off for good."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import ckptwrap


class _Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom")
        return torch.relu(self.linear(x))


def _model(seen):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)], _Last())
    model[0].register_forward_hook(lambda *args: seen.append(gc.isenabled()))
    return model


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_a_plan_on_example_inputs_holds_it_off_while_it_measures():
    seen = []
    ckptwrap.plan(_model(seen), "blocks", example_inputs=(torch.randn(4, 8),))
    assert seen == [False]  # the one forward, measured
    assert gc.isenabled()


def test_a_lazy_budget_leaves_it_as_it_is_in_every_step():
    seen = []
    model = ckptwrap.wrap_model(_model(seen), "budget:60%")
    for rows in (4, 4, 6):
        model(torch.randn(rows, 8)).sum().backward()
    assert seen == [True, True, True]
    model[3].fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(7, 8))  # a new shape: measured, and it raises halfway
    assert gc.isenabled()


def test_a_plan_that_raises_puts_it_back():
    seen = []
    model = _model(seen)
    model[3].fail = True
    with pytest.raises(Exception, match="boom"):
        ckptwrap.plan(model, "blocks", example_inputs=(torch.randn(4, 8),))
    assert seen == [False] and gc.isenabled()


def test_where_the_caller_switched_it_off_it_stays_off():
    seen = []
    gc.disable()
    ckptwrap.plan(_model(seen), "blocks", example_inputs=(torch.randn(4, 8),))
    assert seen == [False] and not gc.isenabled()

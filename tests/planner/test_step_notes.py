"""What a lazy budget says of each training step on the ``ckptwrap`` logger (docs/budget.md,
"What the planner says of each step"): each forward's decision at DEBUG, the steps
measured and the checks, each with its fields, agreeing with the plan the step ran."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from torch import nn

import ckptwrap

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

_VOCAB = 64
_FORWARD = {"event", "model", "inputs", "sizes", "measured", "learning", "checked", "source", "checkpointed",
            "predicted_peak", "budget"}


def _model(policy: str = "budget:50%") -> nn.Module:
    torch.manual_seed(0)
    return ckptwrap.wrap_model(GPT(GPTConfig(vocab=_VOCAB, width=32, heads=2, layers=3, seq_len=128)).train(), policy)


def _step(model: nn.Module, length: int, rows: int = 2) -> None:
    ids = torch.randint(_VOCAB, (rows, length + 1), generator=torch.Generator().manual_seed(length))
    model.zero_grad(set_to_none=True)
    model(ids[:, :-1], ids[:, 1:]).backward()


def test_each_forward_is_noted_with_what_it_ran_under(noted_steps):
    model = _model()
    lengths = [64, 96, 64, 48, 96, 80]
    applied = []
    for length in lengths:
        _step(model, length)
        applied.append(model.ckptwrap_plan)
    forwards = noted_steps.of("forward")
    assert len(forwards) == len(lengths)
    assert all(set(forward) - {"thread"} == _FORWARD for forward in forwards)  # (thread: the handler's)
    assert [forward["sizes"] for forward in forwards] == [(2, length) for length in lengths]
    assert forwards[0]["measured"] and forwards[0]["source"] is None and forwards[0]["predicted_peak"] is None
    outermost = tuple(f"blocks.{i}" for i in range(3))
    for forward, plan in zip(forwards, applied):
        assert forward["model"] == "GPT" and forward["inputs"] == f"batch 2, length {forward['sizes'][1]}"
        # What the note says the step ran under is the plan the model was marked by.
        assert forward["checkpointed"] == tuple(plan.names), (forward, plan.names)
        if forward["measured"]:
            assert forward["checkpointed"] == outermost  # the plan of least memory
            continue
        assert forward["predicted_peak"] == plan.predicted_peak and forward["budget"] == plan.budget
        assert forward["source"] in ("measured", "fitted", "bounded", "scaled")
    # Each measured forward whose step was taken in is said once, with the peak it read.
    measured = noted_steps.of("measured")
    assert 1 <= len(measured) <= noted_steps.measured
    assert all(step["peak"] > 0 for step in measured)
    assert [step["sizes"] for step in measured] == [f["sizes"] for f in forwards if f["measured"]][: len(measured)]


def test_a_checked_step_says_how_it_peaked_against_its_prediction(noted_steps):
    model = _model("budget:200MiB")
    for length in (96, 64, 80, 48, 64, 72, 56, 64):
        _step(model, length)
    checked = noted_steps.of("checked")
    forwards = [f for f in noted_steps.of("forward") if f["checked"]]
    assert checked, "no step was checked"
    # A check is said at the end of the backward of a forward noted as checked.
    assert [step["sizes"] for step in checked] == [f["sizes"] for f in forwards][: len(checked)]
    for step, forward in zip(checked, forwards):
        assert step["predicted_peak"] == forward["predicted_peak"] and step["peak"] > 0
        if step["peak"] <= step["predicted_peak"]:
            assert step["missed"] is False, step  # at or below its prediction: never a miss


def test_nothing_is_noted_below_the_loggers_level():
    seen = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logger = logging.getLogger("ckptwrap")
    handler, level = Handler(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = _model()
        for length in (64, 96, 64):
            _step(model, length)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen and all(record.levelno >= logging.INFO for record in seen)
    assert not [r for r in seen if getattr(r, "ckptwrap_step", {}).get("event") == "forward"]

"""One training step of a model under a ``budget:`` policy, followed from its forward's
pre-hook to the end of its backward: the end is found by a hook on the outputs that
queues a callback on autograd's engine, and the step's timing, measurement or check is
handed to the planner there.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Any, Optional

import torch
from torch import nn

from .. import _torch_private
from .._warn import note
from ..measure import SpanPeak, tensors
from ..planner import Decision, Plan, ShapePlanner, StepRecorder
from ._marks import PLAN_ATTRIBUTE, record_plan

__all__ = ["FollowedStep"]


class FollowedStep:
    """One training step followed from its forward's pre-hook to the end of its backward."""

    def __init__(
        self,
        model: nn.Module,
        planner: ShapePlanner,
        decision: Decision,
        recorder: Optional[StepRecorder] = None,
        meter: Optional[SpanPeak] = None,
    ) -> None:
        self.model = weakref.ref(model)
        self.planner, self.decision = planner, decision
        self.recorder, self.meter = recorder, meter
        self.forward_done_ = False
        self.started = time.perf_counter()
        self.queued = False
        self.ended = False
        self.learned: Optional[Any] = None  # the profile a measured step gave

    def end(self) -> None:
        """The backward has ended (called by autograd's engine): hand the planner what
        was measured. Never raises into the backward."""
        if self.ended:
            return
        self.ended = True
        try:
            self.planner.timed(self.decision, time.perf_counter() - self.started)
            if self.recorder is not None:
                self.learned = self.recorder.finish()
                self.planner.learned(self.decision, self.learned, self.recorder.failed)
                self._record_measured()
                model = self.model()
                if model is not None:
                    self.planner.say_measured(self.decision, self.learned, model)
            elif self.meter is not None:
                peak = self.meter.stop()
                self.planner.checked(self.decision, peak, self.meter.exact)
        except Exception as error:  # noqa: BLE001 - the caller's backward must go on
            note(f"ckptwrap could not take in a step it followed: {type(error).__name__}: {error}")

    def _record_measured(self) -> None:
        """Give the model's plan record what the measured step showed at its shape."""
        model, profile = self.model(), self.learned
        record = None if model is None else model.__dict__.get(PLAN_ATTRIBUTE)
        if profile is None or not isinstance(record, Plan) or record.pending:
            return
        budget, plain = self.planner.measured_plan(self.decision, profile)
        record_plan(model, dataclasses.replace(
            record, budget=budget, plain_peak=plain, activation_bytes=profile.total_activation_bytes,
            predicted_peak=profile.step.total if profile.step is not None else None,
        ))

    def abandon(self, why: str) -> None:
        """The step ends without a backward (none came before the next training forward,
        or the forward raised): nothing is learned from it."""
        if self.ended:
            return
        self.ended = True
        if self.recorder is not None:
            self.recorder.abandon(why)
            self.planner.abandoned(self.decision)
        elif self.meter is not None:
            self.meter.stop()

    def forward_done(self, output: Any) -> bool:
        """The forward returned: carry the meter into the backward from the output.
        False if the output holds nothing to follow the backward from."""
        self.forward_done_ = True
        roots = [t for t in tensors(output) if t.requires_grad]
        if self.recorder is not None:
            self.recorder.forward_done(output)
        elif self.meter is not None:
            self.meter.leave(roots)
        if not roots or _torch_private.queue_callback is None:
            self.abandon("the forward gave nothing to backpropagate")
            return False
        reached = functools.partial(_reached, weakref.ref(self))
        for tensor in roots:
            tensor.register_hook(functools.partial(reached, tensor.numel() == 1))
        return True

    def reached(self, scalar: bool, grad: Any) -> None:
        """The backward reached an output of the step: have it tell the step when it
        ends. Reached first at an output other than a scalar, the loss was made outside
        the model, where no meter counted it: the meter takes it in from here."""
        if self.queued or self.ended:
            return
        self.queued = True
        if not scalar and isinstance(grad, torch.Tensor):
            if self.recorder is not None:
                self.recorder.phases.loss_outside(grad)
            elif self.meter is not None and self.meter.span is not None:
                self.meter.span.loss_outside(grad)
        _torch_private.queue_callback(self.end)  # type: ignore[misc]


def _reached(step_ref: "weakref.ref[FollowedStep]", scalar: bool, grad: Any) -> None:
    step = step_ref()
    if step is not None:
        step.reached(scalar, grad)
    return None

"""The forward pre-hook of a model wrapped with a ``budget:`` policy, which plans each
training forward's shape before it goes on (measuring on the first, a solve after)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._compiling import outside_graph
from .._warn import note
from ..planner import Plan, ShapePlanner, is_measuring
from ._marks import PLAN_ATTRIBUTE, apply_plan, mark, named, unmark
from ._planning import measured

__all__ = ["PlanPerShape", "remove_pending"]


class PlanPerShape:
    """Forward pre-hook of a model wrapped with a ``budget:`` policy: before each training
    forward goes on, it asks the planner for the plan of that forward's inputs (measuring
    costs on the first, a solve from then on) and switches the marks if the plan differs
    from the one applied.

    Switching only between forwards is safe for a backward still pending: each forward
    captured the function and options it ran with, and its recomputation uses those.
    """

    def __init__(self, planner: ShapePlanner, unmeasured: Plan, follow_shapes: Optional[bool]) -> None:
        self.planner = planner
        self.unmeasured = unmeasured  # the selection the planner chooses among
        self.follow_shapes = follow_shapes
        self.applied: Optional[Plan] = None  # the plan whose modules this hook marked

    def __call__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if not torch.is_grad_enabled() or not model.training:
            return None  # not a training forward
        if torch.compiler.is_compiling():  # (the planner measures eagerly, never traced)
            if self.applied is None:
                # Traced for the first time: measure and plan eagerly, then trace on with
                # the plan's marks. Compiled code keeps the plan it was traced with.
                _plan_outside_graph(self, model, args, kwargs)
            return None
        if is_measuring():
            return None  # the planner's own run of the model
        if self.applied is not None and self.follow_shapes is False:
            return None
        self.plan(model, args, kwargs)
        return None

    def plan(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Choose the plan for these inputs and switch the marks to it."""
        record = model.__dict__.get(PLAN_ATTRIBUTE)
        previous = self.applied
        choice = self.planner.choose(
            model, args, kwargs, strict=False, around=functools.partial(_unmarked, model, previous)
        )
        new = measured(self.unmeasured, choice)
        if previous is not None and _same_marks(previous, new):
            self.applied = new
            if isinstance(record, Plan) and not record.pending:
                setattr(model, PLAN_ATTRIBUTE, dataclasses.replace(record, **_predictions(new)))
            return None
        if previous is None:
            apply_plan(model, new)
            self.applied = new
        else:
            unmark(named(model, previous))
            self._mark_recorded(model, new, record)
        shapes = self.planner.layout_of(args, kwargs) or "these inputs"
        verb = "applied" if previous is None else "switched to"
        note(
            f"ckptwrap {verb} {new.policy!r} for {type(model).__name__}'s inputs of {shapes}: "
            f"{len(new)} module(s) checkpointed, {(new.predicted_peak or 0) / 2**20:.1f} MiB "
            f"predicted at the training step's peak (model.ckptwrap_plan has the details)."
        )
        return None

    def _mark_recorded(self, model: nn.Module, new: Plan, record: Any) -> None:
        """Mark ``new``'s modules (this hook's old ones are unmarked) and record it as the
        model's plan. No other wrapping marks this model (``wrap_model`` refuses a budget
        beside another), so the plan is this hook's, under the policy recorded."""
        mark(model, new)
        self.applied = new
        if isinstance(record, Plan) and not record.pending:
            new = dataclasses.replace(new, policy=record.policy)
        setattr(model, PLAN_ATTRIBUTE, new)


def _plan_eagerly(hook: PlanPerShape, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    hook.plan(model, args, kwargs)


_COMPILE_NOTE = (
    "ckptwrap plans a budget: policy given no example inputs on the model's first training "
    "forward, eagerly, outside the compiled graph; under torch.compile(fullgraph=True) that "
    "is a graph break. Plan before compiling instead: wrap_model(model, policy, "
    "example_inputs=..., example_kwargs=...)."
)
_plan_outside_graph = outside_graph(_plan_eagerly, _COMPILE_NOTE)


@contextlib.contextmanager
def _unmarked(model: nn.Module, applied: Optional[Plan]) -> Iterator[None]:
    """While the planner measures the model from inside its training forward: without the
    marks of ``applied`` (costs are measured as the model runs unmarked), put back after.

    An FSDP2 model's own parameters are gathered again afterwards: FSDP2 gathered them
    before this hook ran, and the measured step's backward sharded them once more, so the
    forward that goes on would meet sharded ones."""
    marks = [(module, module.__dict__.get("forward")) for module in named(model, applied)]
    unmark(module for module, _ in marks)
    try:
        yield
    finally:
        for module, forward in marks:
            if forward is not None:
                module.forward = forward
        fsdp = getattr(dist, "fsdp", None) if dist.is_available() else None
        module_class = getattr(fsdp, "FSDPModule", None)
        if module_class is not None and isinstance(model, module_class):
            model.unshard()


def _same_marks(old: Plan, new: Plan) -> bool:
    """Whether two plans mark the same modules the same way (predictions aside)."""
    def marks(plan: Plan) -> List[Tuple[Any, ...]]:
        return [(e.name, e.joins, e.saved_ops, e.option) for e in plan.selected]

    return marks(old) == marks(new)


def _predictions(plan: Plan) -> Dict[str, Any]:
    return {
        "budget": plan.budget,
        "activation_bytes": plan.activation_bytes,
        "predicted_peak": plan.predicted_peak,
        "plain_peak": plan.plain_peak,
    }


def remove_pending(model: nn.Module) -> None:
    """Remove the hook that plans a ``budget:`` policy, with the costs and plans it keeps
    (the modules it marked stay marked)."""
    for key, hook in list(model._forward_pre_hooks.items()):
        if isinstance(hook, PlanPerShape):
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)

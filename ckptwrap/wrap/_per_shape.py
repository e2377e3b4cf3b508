"""The marking side of a ``budget:`` policy: the hooks of a wrapped model that plan each
training forward and follow its step to the end of its backward.

Before each training forward the pre-hook asks the planner what to run
(``ShapePlanner.begin``: the plan solved for that shape, or the plan of least memory
with the step measured), switches the marks by the answer (a ``planner.PlannedStep``),
and starts the step; the forward hook hands it the output, whose tensors it watches for
the backward to reach them; the end of the backward is queued on autograd's engine, and
the step hands the planner what it measured there. The step's meter (a dispatch mode) is
on the caller's mode stack during the forward alone and goes through the backward node
by node (``measure``'s step span): nothing of ckptwrap's stays on any stack between steps.

Switching marks only between forwards is safe for a backward still pending: each
forward captured the function and options it ran with, and its recomputation uses those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._compiling import outside_graph
from .._errors import CheckpointConfigError
from .._warn import debugging, note, note_step, warn
from ..planner import Decision, Plan, PlanEntry, PlannedStep, ShapePlanner
from ..measure import is_measuring, step_device, unreal
from ._clients import cache_writes_on
from ._marks import PLAN_ATTRIBUTE, apply_plan, mark, named, record_plan, unmark
from ._max_shapes import unreceived
from ._planning import measured

__all__ = [
    "PlanPerShape",
    "StepEnd",
    "remove_pending",
]


class PlanPerShape:
    """Forward pre-hook of a model wrapped with a ``budget:`` policy (see the module)."""

    def __init__(
        self,
        planner: ShapePlanner,
        unmeasured: Plan,
        follow_shapes: Optional[bool],
        max_shapes: Optional[Mapping[Any, Sequence[int]]] = None,
    ) -> None:
        self.planner = planner
        # Checked against the first training forward's inputs, then dropped.
        self.max_shapes = dict(max_shapes) if max_shapes else None
        self.unmeasured = unmeasured  # the selection the planner chooses among
        self.follow_shapes = follow_shapes
        self.applied: Optional[Plan] = None  # the plan whose modules this hook marked
        self._observed = False  # whether the marks applied tell a recorder what they do
        self.current: Optional[PlannedStep] = None  # the step followed now
        self._failed = False
        self.solved = False  # whether a plan solved from costs was applied
        self._overlapping = False  # a forward began while another's backward was pending
        self.handle: Any = None  # its registration on the model (a RemovableHandle)
        self.unfollowed = False  # whether a step's output was found to hold nothing to follow
        self._said_unreal = False  # whether a step with nothing to measure was said

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["current"] = None
        return state

    def __call__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        training = torch.is_grad_enabled() and model.training
        self._settle(training)
        if not training:
            return None
        if torch.compiler.is_compiling():  # (the planner measures eagerly, never traced)
            if self.applied is None:
                # Traced for the first time: measure on these inputs and plan eagerly, then
                # trace on with the plan's marks. Compiled code keeps the plan it was traced with.
                _plan_outside_graph(self, model, args, kwargs)
            return None
        if is_measuring():
            return None  # the planner's own run of the model
        self.check_inputs(model, args, kwargs)
        if self.follow_shapes is False and self.applied is not None and self.solved:
            return None
        try:
            self.step(model, args, kwargs)
        except CheckpointConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - a training forward never fails for want of a plan
            self._fall_back(model, error)
        return None

    def check_inputs(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """At the first training forward: say which ``max_shapes`` keys its inputs do not
        take (a forward with ``**kwargs`` lets any name through at wrap time), which would
        otherwise be ignored at every forward without a word."""
        declared, self.max_shapes = self.__dict__.get("max_shapes"), None
        if declared:
            message = unreceived(model, declared, args, kwargs)
            if message is not None:
                warn(message)

    # ------------------------------------------------------------------ each step

    def step(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Decide this training forward's plan, mark it, and start following the step."""
        why = unreal(model, args, kwargs, first_only=True)
        if why is not None:  # nothing to measure: least memory, unplanned, said once
            self._unmeasurable(model, why)
            return
        step = self.planner.begin(
            model, args, kwargs, device=step_device(model, args, kwargs), fresh=functools.partial(_fresh, model),
            overlapping=self._overlapping, on_measured=functools.partial(_record_measured, weakref.ref(model)),
        )
        decision = step.decision
        if step.recorder is not None:
            self._apply(model, self._least_memory(), decision, observer=step.recorder)
        elif decision.choice is None:  # a layout no longer measured: least memory, unmeasured
            self._apply(model, self._least_memory(), decision)
        else:
            self._apply(model, measured(self.unmeasured, decision.choice, decision.source), decision)
            self.solved = True
        step.start(args, kwargs)
        if debugging():
            assert self.applied is not None  # marked just above
            _note_forward(model, step, self.applied)
        # Followed to the end even unmetered: a forward that comes before its backward
        # must know this one's graph is still alive.
        self.current = step

    def _unmeasurable(self, model: nn.Module, why: str) -> None:
        """A training forward where nothing can be measured (the meta device, fake
        tensors): the plan of least memory, unplanned, and the user told once."""
        plan = self._least_memory()
        if self.applied is None or self.applied.selected != plan.selected or self._observed:
            self._remark(model, plan)
        if not self._said_unreal:
            self._said_unreal = True
            warn(
                f"{type(model).__name__}: a training forward ran where {why}: nothing is "
                f"allocated there to measure, so this step runs under the plan of least memory, "
                f"unplanned; the budget plans from the first training steps on the device the "
                f"model trains on (or now, from a step on fake tensors, if wrap_model is given "
                f"example inputs)."
            )

    def _settle(self, training: bool) -> None:
        """Before a forward: take ended steps' meters off the stack; before a training
        forward, a step whose backward never came is given up."""
        step = self.current
        self._overlapping = False
        if step is not None and (step.ended or training):
            if not step.ended:
                # Its graph may still be alive (two forwards, then one backward): this
                # forward's step would hold that one's activations too, so it is not measured.
                self._overlapping = step.forwarded
                step.abandon("no backward came before the next training forward")
            self.current = None

    def _least_memory(self) -> Plan:
        """Every outermost candidate checkpointed whole on the non-re-entrant engine: the
        plan that holds the least between forward and backward, whose steps measure."""
        kinds = dict(self.planner.settings.candidates)
        entries = tuple(
            PlanEntry(name, kinds[name], option="recompute" if self.unmeasured.tier == "recompute" else None)
            for name in self.planner.settings.outermost
        )
        options = dataclasses.replace(self.unmeasured.options, use_reentrant=False)
        return dataclasses.replace(
            self.unmeasured, selected=entries, options=options, tier="recompute", pending=False,
        )

    def _apply(self, model: nn.Module, new: Plan, decision: Decision, observer: Any = None) -> None:
        """Switch the marks to ``new`` (told to ``observer``), record it as the model's plan
        and note a change."""
        record = model.__dict__.get(PLAN_ATTRIBUTE)
        previous = self.applied
        if isinstance(record, Plan) and not record.pending:
            new = dataclasses.replace(new, policy=record.policy)
        same = (
            previous is not None and observer is None and not self._observed
            and _same_marks(previous, new) and previous.options == new.options
        )
        if same:
            record_plan(model, new)
        elif previous is None and observer is None and not isinstance(record, Plan):
            apply_plan(model, new)
        else:
            self._remark(model, new, observer)
        self.applied, self._observed = new, observer is not None
        if same:
            return
        shapes = decision.describe()
        if observer is not None:
            note(
                f"ckptwrap measures this training step of {type(model).__name__} at inputs of "
                f"{shapes} under the plan of least memory ({len(new)} module(s) checkpointed)."
            )
            return
        bound = " at most" if new.from_bound else ""
        note(
            f"ckptwrap applied {new.policy!r} for {type(model).__name__}'s inputs of {shapes}: "
            f"{len(new)} module(s) checkpointed,{bound} {(new.predicted_peak or 0) / 2**20:.1f} MiB "
            f"predicted at the training step's peak (model.ckptwrap_plan has the details)."
        )

    def _fall_back(self, model: nn.Module, error: Exception) -> None:
        """Planning failed where it never should: this forward, and every later one, runs
        under the plan of least memory, and the user is told once."""
        if not self._failed:
            self._failed = True
            warn(
                f"ckptwrap could not plan {self.unmeasured.policy!r} for {type(model).__name__} "
                f"({type(error).__name__}: {error}); training goes on under the plan of least "
                f"memory. Please report this."
            )
        self.follow_shapes = False
        self._remark(model, self._least_memory())
        self.current = None

    def _remark(self, model: nn.Module, plan: Plan, observer: Any = None) -> None:
        """Switch the marks from the plan applied to ``plan`` (told to ``observer``) and
        record it as the model's plan."""
        unmark(named(model, self.applied))
        mark(model, plan, observer)
        record_plan(model, plan)
        self.applied, self._observed = plan, observer is not None

    def plan(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Plan on these inputs directly (measuring one step on them if their shape's costs
        are not known) and switch the marks to it: how a compiled model plans, once it has
        checked them as the first training forward's inputs."""
        self.check_inputs(model, args, kwargs)
        previous = self.applied
        choice = self.planner.choose(
            model, args, kwargs, strict=False, around=functools.partial(_unmarked, model, previous)
        )
        new = measured(self.unmeasured, choice)
        decision = Decision(None, (), measure=False, choice=choice)
        self._apply(model, new, decision)
        self.solved = True


class StepEnd:
    """Forward hook (always called) of a model wrapped with a ``budget:`` policy: once the
    forward of a followed step returns, watch its outputs for the backward to reach them,
    and then for the backward to end."""

    def __init__(self, hook: PlanPerShape) -> None:
        self.hook = hook
        self.handle: Any = None  # its registration on the model (a RemovableHandle)

    def __call__(self, model: nn.Module, args: Any, output: Any) -> None:
        step = self.hook.current
        if step is None or step.forwarded or step.ended:
            return None
        if not step.forward_done(output) and not self.hook.unfollowed:
            self.hook.unfollowed = True
            warn(
                f"ckptwrap cannot follow the backward of {type(model).__name__}'s training "
                f"steps: no tensor that requires grad was found in its output (a "
                f"{type(output).__name__}; tensors are found in tuples, lists, dicts, "
                f"dataclasses and classes registered with torch.utils._pytree). Its "
                f"'budget:' plan learns nothing from these steps, which run under the plan "
                f"of least memory."
            )
        return None


def _note_forward(model: nn.Module, step: PlannedStep, applied: Plan) -> None:
    """What a training forward runs under, noted at DEBUG (docs/budget.md, "What the
    planner says of each step")."""
    decision, measured = step.decision, step.recorder is not None
    choice = None if measured else decision.choice
    names = tuple(applied.names)
    if measured:
        how = "measured under the plan of least memory" + (", to learn" if decision.learn else "")
    elif choice is None:
        how = "the plan of least memory, unmeasured"
    else:
        how = (
            f"{len(names)} checkpointed, {choice.predicted_peak / 2**20:.1f} MiB predicted"
            + (f" for a budget of {choice.budget / 2**20:.1f} MiB" if choice.budget is not None else "")
            + (f" ({decision.source} costs)" if decision.source else "")
            + ("" if choice.reachable else ", out of reach") + (", checked" if step.meter is not None else "")
        )
    note_step(
        f"ckptwrap: a training forward of {type(model).__name__} at inputs of {decision.describe()}: {how}",
        event="forward", model=type(model).__name__, inputs=decision.describe(), sizes=tuple(decision.sizes),
        measured=measured, learning=measured and decision.learn, checked=step.meter is not None,
        source=decision.source or None, checkpointed=names,
        predicted_peak=None if choice is None else choice.predicted_peak,
        budget=None if choice is None else choice.budget,
    )


def _fresh(model: nn.Module) -> bool:
    """Whether no parameter that trains holds a gradient (a step from fresh gradients)."""
    return all(p.grad is None for p in model.parameters() if p.requires_grad)


def _record_measured(model_ref: "weakref.ref[nn.Module]", profile: Any, budget: Optional[int], plain: int) -> None:
    """Give the model's plan record what a measured step showed at its shape (the budget
    in bytes and the un-checkpointed peak there)."""
    model = model_ref()
    record = None if model is None else model.__dict__.get(PLAN_ATTRIBUTE)
    if not isinstance(record, Plan) or record.pending:
        return
    record_plan(model, dataclasses.replace(
        record, budget=budget, plain_peak=plain, activation_bytes=profile.total_activation_bytes,
        predicted_peak=profile.step.total if profile.step is not None else None,
    ))


_COMPILE_NOTE = (
    "ckptwrap plans a budget: policy given no example inputs on the model's first training "
    "forward, eagerly, outside the compiled graph; under torch.compile(fullgraph=True) that "
    "is a graph break. Plan before compiling instead: wrap_model(model, policy, "
    "example_inputs=..., example_kwargs=...)."
)
_plan_outside_graph = outside_graph(PlanPerShape.plan, _COMPILE_NOTE)


@contextlib.contextmanager
def _unmarked(model: nn.Module, applied: Optional[Plan]) -> Iterator[None]:
    """While the planner measures the model on given inputs from inside its forward:
    without the marks of ``applied`` (the step measured marks its own), put back after.

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


def remove_pending(model: nn.Module) -> None:
    """Remove the hooks that plan a ``budget:`` policy, with the costs and plans they keep
    (the modules marked stay marked)."""
    hooks = [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
    for hook in hooks:
        if isinstance(hook, PlanPerShape):
            hook.handle.remove()
            step = hook.current
            if step is not None:
                step.abandon("unwrapped")
                hook.current = None
        elif isinstance(hook, StepEnd):
            hook.handle.remove()
    cache_writes_on(model.modules())

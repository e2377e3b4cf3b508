"""The ``forward`` attributes that ``wrap_model`` gives the instances it marks: one that
runs the class's forward as a checkpointed region (alone or at the head of a segment), and
one for a module that runs inside the segment of the module before it.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _torch_private
from .._errors import CheckpointConfigError
from .._warn import warn
from ._decorator import decorator_options
from ..engine import CheckpointOptions
from ._region import RngSnapshot, region_switched_off, run_offloaded, run_region, run_segment
from ._selective import SavedInstances
from ._wrapper import CheckpointWrapper

__all__ = [
    "CheckpointedForward",
    "entry_options",
    "marking",
    "markings_of",
    "SegmentMember",
]


class CheckpointedForward:
    """The ``forward`` attribute ``wrap_model`` gives a module instance.

    Holds the module weakly so marking creates no reference cycle; pickling and deep
    copying rebuild it around the copied module.
    """

    __slots__ = ("_module", "options", "previous", "offload", "chain", "observer", "qualified_name", "__weakref__")

    def __init__(
        self,
        module: nn.Module,
        options: CheckpointOptions,
        previous: Optional[Callable[..., Any]],
        offload: bool = False,
        chain: Tuple["SegmentMember", ...] = (),
        observer: Any = None,
        qualified_name: str = "",
    ) -> None:
        self._module = weakref.ref(module)
        self.qualified_name = qualified_name  # the module's name in the wrapped model, for errors
        self.options = options
        self.previous = previous  # an instance-level forward someone else had set, if any
        self.offload = offload
        self.chain = chain  # the modules that run in this module's region after it
        # The planner's step recorder (``StepRecorder``), told of each call on a step measured.
        self.observer = observer

    @property
    def copies_caches(self) -> bool:
        """Whether the region runs on copies of the caches it is given (``on_cache_copies``):
        every checkpointed one; an offloaded one runs its forward once, as it is."""
        return not self.offload

    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise CheckpointConfigError(
                "This forward belongs to a module that no longer exists; call the module itself."
            )
        return module

    def call(self) -> Callable[..., Any]:
        """The module's own forward, without the checkpoint."""
        if self.previous is not None:
            return self.previous
        module = self.module()
        return functools.partial(type(module).forward, module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, call = self.module(), self.call()
        if self.offload:
            return run_offloaded(module, call, args, kwargs)
        if self.chain and _segment_runs(args, kwargs) and not self._members_hooked():
            return self._run_segment(module, call, args[0])
        if self.observer is not None:
            options = self.options
            return self.observer.region(
                module, call, args, kwargs, lambda watched: run_region(module, watched, args, kwargs, options)
            )
        return run_region(module, call, args, kwargs, self.options)

    def _members_hooked(self) -> bool:
        """Whether something watches the later modules' calls before they run (FSDP2
        gathers their parameters there): inside a segment they would run before it. Where
        torch's registry of global hooks cannot be read, assume one."""
        hooks = _torch_private.global_forward_pre_hooks
        return hooks is None or bool(hooks) or any(
            member.module()._forward_pre_hooks for member in self.chain
        )

    def _run_segment(self, module: nn.Module, call: Callable[..., Any], value: torch.Tensor) -> Any:
        """Run this module and the chain after it as one region; hand each later module the
        output it is to return when the model's forward calls it on the one before's."""
        members = [member.module() for member in self.chain]
        calls = [call, *(member.call() for member in self.chain)]
        outputs, states = run_segment([module, *members], calls, value, self.options)
        for index, member in enumerate(self.chain):
            member.expect(outputs[index], outputs[index + 1], states[index], states[index + 1])
        return outputs[0]

    def __reduce__(self) -> Tuple[Any, ...]:
        return (
            CheckpointedForward,
            (self._module(), self.options, self.previous, self.offload, self.chain, None, self.qualified_name),
        )

    def __repr__(self) -> str:
        module = self._module()
        kind = type(module).__name__ if module is not None else "<dead module>"
        return f"<checkpointed forward of {kind}>"


class SegmentMember:
    """The ``forward`` of a module that runs inside the region of a module before it.

    Called by the model's forward on the output it expects (the one before's), it returns
    the output the segment computed. Called on anything else, or when the segment did not
    run as one (autograd or ckptwrap off, under ``torch.compile``, other arguments), it
    runs as a region of its own.
    """

    __slots__ = ("_module", "options", "previous", "_expected", "__weakref__")
    # The segment ran this module ahead of the model's forward: it returns the output only
    # if that forward calls it on the output before it, with the random generators where
    # the segment left them then, and moves them on as the module did.

    def __init__(
        self, module: nn.Module, options: CheckpointOptions, previous: Optional[Callable[..., Any]]
    ) -> None:
        self._module = weakref.ref(module)
        self.options = options
        self.previous = previous
        self._expected: Optional[Tuple[Any, Any, RngSnapshot, RngSnapshot]] = None

    module = CheckpointedForward.module
    call = CheckpointedForward.call

    def expect(self, given: Any, output: Any, before: RngSnapshot, after: RngSnapshot) -> None:
        """The segment's output for this module, when it is called on ``given`` with the
        generators in state ``before``; ``after`` is where the module left them."""
        self._expected = (given, output, before, after)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        expected, self._expected = self._expected, None
        if (
            expected is not None
            and not kwargs
            and len(args) == 1
            and args[0] is expected[0]
            and expected[2].is_current()
        ):
            expected[3].restore()
            return expected[1]
        if expected is not None:
            _warn_broken_segment(self.module())
        return run_region(self.module(), self.call(), args, kwargs, self.options)

    def __reduce__(self) -> Tuple[Any, ...]:
        # Built empty, then filled: the module's own dict refers back to this object, and
        # copying must meet the same copy there (the head's chain holds it too).
        return (SegmentMember.__new__, (SegmentMember,), (self._module(), self.options, self.previous))

    def __setstate__(self, state: Tuple[Any, ...]) -> None:
        module, options, previous = state
        self.__init__(module, options, previous)  # type: ignore[misc]

    def __repr__(self) -> str:
        module = self._module()
        kind = type(module).__name__ if module is not None else "<dead module>"
        return f"<forward of {kind}, checkpointed in a segment>"


def _segment_runs(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether a segment can run as one region now: on one tensor, eagerly, with regions on."""
    return (
        len(args) == 1
        and not kwargs
        and isinstance(args[0], torch.Tensor)
        and not torch.compiler.is_compiling()
        and not region_switched_off()
    )


_warned_segments: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _warn_broken_segment(module: nn.Module) -> None:
    if module in _warned_segments:
        return
    _warned_segments.add(module)
    warn(
        f"{type(module).__name__} was planned to run in one checkpointed segment with the "
        f"module before it, but the model's forward did not call it on that module's output "
        f"alone (or drew random numbers in between); it now runs as a region of its own, and "
        f"the segment's work for it was wasted. Plan again on inputs that take this path "
        f"(wrap_model(..., example_inputs=...)).",
    )


def entry_options(options: CheckpointOptions, saved_ops: Tuple[Tuple[str, int], ...]) -> CheckpointOptions:
    """The options a plan's module runs with: the plan's, and for a selective level a
    ``context_fn`` that saves its operator calls."""
    if not saved_ops:
        return options
    return dataclasses.replace(options, context_fn=SavedInstances(saved_ops))


def marking(module: nn.Module) -> Optional[Tuple[str, CheckpointOptions]]:
    """How ``module`` is already checkpointed, if it is: (what marks it, its options).

    For a module ``wrap_model`` marks, these are the options of its plan: the selective
    level a budget plan chose for it is the plan's choice, not an option given.
    """
    forward = module.__dict__.get("forward")
    if isinstance(forward, (CheckpointedForward, SegmentMember)):
        options = forward.options
        if isinstance(options.context_fn, SavedInstances):
            options = dataclasses.replace(options, context_fn=None)
        return "wrap_model", options
    found = markings_of(module)
    return found[0] if found else None


def markings_of(module: nn.Module) -> List[Tuple[str, CheckpointOptions]]:
    """Every marking that makes calls of ``module`` checkpointed, outermost first.

    Offloading (``wrap_model(..., "offload")``) recomputes nothing and is not a marking.
    """
    found: List[Tuple[str, CheckpointOptions]] = []
    forward = module.__dict__.get("forward")
    if isinstance(forward, CheckpointedForward) and not forward.offload:
        found.append(("wrap_model", forward.options))
    elif isinstance(forward, SegmentMember):  # runs in the region of the module before it
        found.append(("wrap_model", forward.options))
    if isinstance(module, CheckpointWrapper):
        found.append(("CheckpointWrapper", module.checkpoint_options))
        # The wrapper calls its module, so whatever marks that module applies as well.
        return found + markings_of(module.wrapped_module)
    options = decorator_options(type(module))
    if options is not None:
        found.append(("@checkpointed", options))
    return found

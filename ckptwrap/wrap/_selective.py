"""Selective checkpointing: save chosen operators' outputs, recompute everything else.
An operator call that drew random numbers (dropout, attention with dropout) is always
recomputed, named or not: the recomputation replays the forward's generator state, and
draws what the forward drew only if it runs every such call again, in order.

``SelectiveContexts`` (the ``selective`` tier) saves every call of the named operators;
``SavedInstances`` (a budget plan's selective level) saves chosen calls, named by operator
and occurrence. Both build the contexts torch's ``create_selective_checkpoint_contexts``
builds and are handed to the engine as ``context_fn``; small classes rather than closures,
so wrapped models still pickle. A saved output changed in place before backward fails as
a ``CheckpointError`` naming the module, the operator and the fix.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from types import TracebackType
from typing import Any, ContextManager, Dict, Iterable, Optional, Tuple, Type

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import _torch_private
from .._errors import CheckpointError
from ..measure import packet_name
from ..policy import draws_random, resolve_ops

__all__ = ["SavedInstances", "SelectiveContexts"]

# torch's recomputation mode (create_selective_checkpoint_contexts pairs it with its caching one);
# extended to name what its bare error leaves out. Private: a torch
# without them gets its own contexts, and its own bare error (see _torch_private).
_CachedTorchDispatchMode = (_torch_private.sac_modes or (None, None))[1]


class _ByValue(functools.partial):
    """A ``context_fn`` in the form ``torch.compile`` accepts (a ``functools.partial``) that
    compares, hashes and pickles by ``value``, the one argument its class is built from,
    so equal options stay equal and wrapped models still pickle."""

    @property
    def value(self) -> Any:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.value)

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(self), (self.value,))


class SelectiveContexts(_ByValue):
    """``context_fn`` that saves the outputs of ``ops`` and recomputes the rest."""

    def __new__(cls, ops: Tuple[str, ...]) -> "SelectiveContexts":
        return super().__new__(cls, _contexts, _SavePolicy(tuple(ops)))

    @property
    def ops(self) -> Tuple[str, ...]:
        return self.args[0].ops

    value = ops

    def __repr__(self) -> str:
        return f"selective({', '.join(self.ops)})"


class _SavePolicy:
    """Saves the outputs of the named operators; holds names so that it pickles."""

    __slots__ = ("ops", "_packets")

    def __init__(self, ops: Tuple[str, ...]) -> None:
        self.ops = ops
        self._packets = resolve_ops(ops)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(op, "overloadpacket", op) in self._packets and not draws_random(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE  # never a call that drew, even if named (see the module)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fix_for(self, op: Any) -> str:
        """What to change when the saved output of ``op`` (None: not known) was mutated."""
        whole = "checkpoint the module whole (the same policy without its selective term)"
        packet = getattr(op, "overloadpacket", op)
        named = [name for name in self.ops if packet in resolve_ops((name,))]
        rest = [name for name in self.ops if name not in named]
        if not named:
            return f"leave that operator out of selective:OP,..., or {whole}."
        if not rest:
            return whole[0].upper() + whole[1:] + "."
        return (
            f"leave {','.join(named)} out of the saved operators (selective:{','.join(rest)}), "
            f"or {whole}."
        )

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_SavePolicy, (self.ops,))


Instance = Tuple[str, int]


class SavedInstances(_ByValue):
    """``context_fn`` that saves the outputs of chosen operator calls, named as
    ``(packet, occurrence)``: ``("mm", 2)`` is the third ``aten.mm`` call of the region.

    Occurrences count per packet within one region's forward, afresh for every call of
    ``context_fn`` (each checkpointed call gets its own), exactly as the profiler numbered
    them (``measure._ops``).

    Example:
        >>> checkpoint(block, x, use_reentrant=False,
        ...            context_fn=SavedInstances((("addmm", 0), ("mm", 1))))  # doctest: +SKIP
    """

    def __new__(cls, instances: Iterable[Instance]) -> "SavedInstances":
        normal = tuple(sorted((str(name), int(index)) for name, index in instances))
        return super().__new__(cls, _instance_contexts, normal)

    @property
    def instances(self) -> Tuple[Instance, ...]:
        return self.args[0]

    value = instances

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}#{index}" for name, index in self.instances)
        return f"saved_instances({shown})"


def _instance_contexts(instances: Tuple[Instance, ...]) -> Tuple[ContextManager, ContextManager]:
    return _contexts(_InstancePolicy(instances))


class _InstancePolicy:
    """Numbers the calls of each packet and saves the listed ones.

    Forward and recomputation keep separate counts: torch versions that consult the
    policy during recomputation too must see the same numbering there.
    """

    __slots__ = ("_wanted", "_counts")

    def __init__(self, instances: Tuple[Instance, ...]) -> None:
        self._wanted = frozenset(instances)
        self._counts: Dict[bool, Dict[str, int]] = {False: defaultdict(int), True: defaultdict(int)}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = packet_name(op)
        counts = self._counts[bool(getattr(ctx, "is_recompute", False))]
        index = counts[name]
        counts[name] += 1
        if (name, index) in self._wanted and not draws_random(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE  # never a call that drew (see the module)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fix_for(self, op: Any) -> str:
        """What to change when the saved output of ``op`` was mutated."""
        return (
            "a budget plan chose to save this output: add the recompute term to the policy "
            "(budget:...;recompute) so that the plan checkpoints modules whole."
        )


_MUTATED = "Tensor cached during selective activation checkpoint has been mutated"
"""The start of torch's message when a saved output was changed in place before backward."""


def _contexts(policy: Any) -> Tuple[ContextManager, ContextManager]:
    """The forward's and the recomputation's context of selective checkpointing under
    ``policy``: torch's own (``create_selective_checkpoint_contexts(policy)``, so that
    their storage and arguments are those of the installed torch, which changed between
    releases), the recomputation's turned into ours, which names the module and operator
    when a saved output was changed in place."""
    forward, recompute = create_selective_checkpoint_contexts(policy)
    if _CachedTorchDispatchMode is not None and type(recompute) is _CachedTorchDispatchMode:
        recompute.__class__ = _Recomputation
        recompute._policy = policy
    return forward, recompute


class _Recomputation(_CachedTorchDispatchMode or object):  # type: ignore[misc]
    """torch's recomputation mode, whose bare error for a saved output that was changed in
    place becomes a ``CheckpointError`` naming the module, the operator and the fix.

    Never constructed: torch makes the mode and :func:`_contexts` gives it this class (and
    the policy, ``_policy``), so that its state is whatever the installed torch keeps. The
    error is converted as it leaves the mode, from its traceback, so operators that run
    normally pay nothing for it.
    """

    _policy: Any

    def __exit__(
        self,
        kind: Optional[Type[BaseException]],
        error: Optional[BaseException],
        trace: Optional[TracebackType],
    ) -> Any:
        suppressed = super().__exit__(kind, error, trace)
        if (
            isinstance(error, RuntimeError)
            and not isinstance(error, CheckpointError)
            and str(error).startswith(_MUTATED)
        ):
            module, op = self._culprits(trace)
            raise _mutation_error(module, op, self._policy.fix_for(op)) from error
        return suppressed

    def _culprits(self, trace: Optional[TracebackType]) -> Tuple[Optional[nn.Module], Any]:
        """The region's module (the outermost module whose forward the traceback passes
        through) and the operator this mode was serving when the error was raised."""
        module, op = None, None
        while trace is not None:
            local = trace.tb_frame.f_locals
            owner = local.get("self")
            if module is None and isinstance(owner, nn.Module):
                module = owner
            if owner is self and op is None:
                op = local.get("func")
            trace = trace.tb_next
        return module, op


def _mutation_error(module: Optional[nn.Module], op: Any, fix: str) -> CheckpointError:
    where = type(module).__name__ if module is not None else "A checkpointed function"
    # A module wrap_model marked knows its name in the model (its checkpointed forward does).
    name = getattr(module.__dict__.get("forward"), "qualified_name", "") if module is not None else ""
    if name:
        where = f"{where} {name!r}"
    saved = f"the output of {op}" if op is not None else "an operator's output"
    error = CheckpointError(
        f"{where} is checkpointed at a selective level, which keeps {saved} from its "
        f"forward for the backward, and that output was then changed in place (by the "
        f"forward itself or by code after it), so the recomputation cannot use it. "
        f"Fix: {fix}"
    )
    error.module = module
    error.fix = fix
    return error

"""What a profile is: the costs of each candidate module in one forward of the model
(:class:`ModuleCost`), and of all of them with the training step (:class:`ModelProfile`).
``profile_modules`` measures them; the shape fit (``_fit``) evaluates them at any shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

from ._ops import OpCost
from ._step import StepPeaks

__all__ = ["ModelProfile", "ModuleCost"]


@dataclasses.dataclass(frozen=True)
class ModuleCost:
    """What one candidate module costs in one forward of the model.

    A module that runs several times in one forward (a shared layer, a recurrent cell
    stepped over time) gets the sum over its calls in every figure but those named per
    call, and ``calls`` says how many there were.
    """

    name: str
    """Qualified name, as in ``model.named_modules()``."""
    kind: str
    """Class name of the module."""
    kept_bytes: int
    """Bytes of the distinct storages its forward saves for backward, other than the model's
    parameters and buffers, the model's inputs and the module's own inputs."""
    input_bytes: int
    """Bytes of the distinct storages of its tensor inputs (args and kwargs, nested), other
    than parameters, buffers and the model's own inputs (those were there before the
    step); a checkpoint of the module keeps these. An input that the calls of other
    candidates take too (a mask or position embeddings every layer takes) is alive through
    the forward whatever is checkpointed: it is counted in the base instead, once."""
    output_bytes: int
    """Bytes of the distinct storages of its tensor outputs, other than parameters and buffers."""
    forward_time: float
    """Seconds for its forward with autograd on: the median over the repeats."""
    flops: int
    """Floating-point operations of its forward, as ``FlopCounterMode`` counts them."""
    self_saved_input_bytes: int = 0
    """The part of ``input_bytes`` its own forward saves for backward (counted in the
    profile's base bytes): a checkpoint of it keeps these at no extra cost."""
    called: bool = True
    """False if the model's forward never called it; every figure is then zero."""
    calls: int = 1
    """How many times the model's forward called it (recursive calls of itself not counted)."""
    forward_peak_bytes: int = 0
    """The most bytes that storages created by one call of its forward held at one time:
    saved tensors, temporaries and outputs; what a recomputation of it needs at its
    highest."""
    forward_moments: Tuple[int, ...] = ()
    """The bytes its forward's own storages held after each operator that created one
    (the highest of its calls' where their operators line up): the points at which
    ``forward_peak_bytes`` can be reached, which the cost model follows across input
    shapes."""
    call_kept_bytes: int = 0
    """The most one call's forward saves for backward (``kept_bytes`` for one call)."""
    call_input_bytes: int = 0
    """The most bytes of one call's inputs (``input_bytes`` for one call)."""
    created_bytes: int = 0
    """Bytes of every storage its forward created, freed or not: the memory traffic its
    time grows with, beside ``flops``."""
    forward_ops: int = 0
    """Operator calls its forward ran, over all its calls (those selective checkpointing
    numbers): each costs a dispatch beside its work. 0: not counted (as many as ``ops``
    per call is taken)."""
    handed_over_bytes: int = 0
    """The part of ``kept_bytes`` (its own saved outputs) that the forward after it saves
    as well, the next block's first layer for one: counted in the profile's base bytes,
    since a checkpoint of this module does not free it."""
    joins_previous: bool = False
    """Whether its only input was the output of the candidate called just before it, and
    nothing after it saves that input again: the two can run as one checkpointed segment,
    which frees the input (``self_saved_input_bytes``). Both must be called once."""
    base_before_bytes: Optional[int] = None
    """The part of the profile's base bytes saved before its (last) call began, its own
    saved inputs included: what of the base is still alive when backward reaches it. None
    if it was never called outside another candidate."""
    position: int = -1
    """Where its (last) call comes among the candidates' calls that are not nested in
    another candidate's, from 0; -1 if there is none."""
    first_position: int = -1
    """Where its first such call comes; ``position - first_position + 1 == calls`` when
    its calls follow each other with no other candidate's between them."""
    policy_saved_bytes: int = 0
    """With a save policy: bytes of the outputs of the operators it saves, which a selective
    checkpoint of the module keeps until backward."""
    policy_saved_kept_bytes: int = 0
    """The part of ``policy_saved_bytes`` that the plain forward saves for backward too
    (in ``kept_bytes``): a selective recomputation need not rebuild it."""
    selective_overhead: float = 0.0
    """Seconds torch's selective checkpointing adds to one forward of it: the dispatch mode
    it runs over every operator (the forward measured under it, saving nothing, less the
    plain forward)."""
    recompute_time: Optional[float] = None
    """With a save policy: seconds its forward takes when the saved outputs are replayed,
    what a selective recomputation costs; None without one (``forward_time`` then)."""
    ops: Tuple[OpCost, ...] = ()
    """Its forward's operators in call order, as selective checkpointing numbers them
    (summed over its calls); empty if its calls ran different operators or it was not
    called. The planner derives selective levels from them."""

    def __post_init__(self) -> None:
        # From JSON (``to_dict``), the operators and moments come back as lists of dicts.
        ops = tuple(op if isinstance(op, OpCost) else OpCost(**op) for op in self.ops)
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "forward_moments", tuple(int(m) for m in self.forward_moments))

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """The costs of the candidate modules of one model on one example input.

    ``total_activation_bytes == base_bytes + sum of (kept_bytes - handed_over_bytes)`` over
    the candidates whose calls are not nested inside another candidate's call.
    """

    modules: Tuple[ModuleCost, ...]
    """One cost per candidate, in the order of ``model.named_modules()``."""
    total_activation_bytes: int
    """Bytes of the distinct storages a plain forward with autograd on saves for backward,
    other than parameters, buffers and the model's inputs."""
    base_bytes: int
    """The part of the total that no checkpoint frees: storages saved outside the candidates,
    candidate inputs that the candidates save (a checkpoint would keep those as well), and
    candidate outputs that the forward after them saves again."""
    step: Optional[StepPeaks] = None
    """With ``step=True``: the memory of one whole training step with every outermost
    candidate checkpointed, phase by phase; what the step peak is predicted from."""
    priced_at: Optional[str] = None
    """For a step run on fake tensors, the rates its times were priced at (a device's
    name); None where they were measured."""
    step_time: Optional[float] = None
    """For a step run on fake tensors, the priced seconds of one training step with
    nothing checkpointed (forward, loss, backward); None elsewhere."""
    _index: Dict[str, ModuleCost] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "_index", {cost.name: cost for cost in self.modules})

    def __getitem__(self, name: str) -> ModuleCost:
        try:
            return self._index[name]
        except KeyError:
            shown = ", ".join(repr(cost.name) for cost in self.modules[:5])
            more = ", ..." if len(self.modules) > 5 else ""
            raise KeyError(f"{name!r} was not profiled; profiled modules: {shown}{more}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-friendly dict that :meth:`from_dict` turns back into an equal profile."""
        return {
            "modules": [cost.to_dict() for cost in self.modules],
            "total_activation_bytes": self.total_activation_bytes,
            "base_bytes": self.base_bytes,
            "step": None if self.step is None else self.step.to_dict(),
            "priced_at": self.priced_at,
            "step_time": self.step_time,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """Rebuild a profile from :meth:`to_dict` output (for example, loaded from JSON)."""
        return cls(
            modules=tuple(ModuleCost(**cost) for cost in data["modules"]),
            total_activation_bytes=int(data["total_activation_bytes"]),
            base_bytes=int(data["base_bytes"]),
            step=None if data.get("step") is None else StepPeaks(**data["step"]),
            priced_at=data.get("priced_at"),
            step_time=data.get("step_time"),
        )

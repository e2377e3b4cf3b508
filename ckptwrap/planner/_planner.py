"""The planner of one model and policy: the costs of its candidates over its inputs'
shapes, and the plan for each training forward's shape.

Costs are measured once per input layout (``_inputs``): at a few small shapes (a slice of
the batch, shorter lengths), fitted over the shape variables (``_fit``), then checked on
the shape planned for by one training step with every candidate checkpointed, which also
sets the time model's rates. From then on, a plan for any shape of that layout is a solve
(milliseconds, no profiling). Where the small shapes cannot be taken or fitted (no
variable to shrink, a model that does other things at other shapes), the shape is
profiled directly; where the check finds the fit off, each new shape of that layout gets
its own measured step, and the planner says so.

A budget in bytes is the same at every shape. ``budget:NN%`` is NN% of the predicted
un-checkpointed step peak at the largest shape planned or declared so far (largest by
that peak), turned into bytes: shorter batches get the same bytes, so they need less
checkpointing, and the budget grows only when a longer batch comes. A shape that no plan
fits gets its plan of least memory (``strict`` raises instead: at wrap time with example
inputs).
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from .._warn import warn
from ..policy import Budget
from ._choose import Choice, choose, plain_peak, step_items
from ._module_costs import ModelProfile
from ._inputs import read_layout
from ._measuring import LayoutCosts, Measurer, PlanSettings, region_bytes
from ._solver import PercentBudget, smallest_reachable_peak

__all__ = ["ShapePlanner", "resolve_budget"]

Sizes = Tuple[int, ...]

_CACHED = 64
"""Plans kept per planner, the most recently used."""


class ShapePlanner:
    """Plans for one model and policy at any shape of its inputs (see the module).

    Plain data between calls (the fitted costs, no model), so it pickles and deep-copies
    with a wrapped model.

    Args:
        settings: The candidates, the budget and how plans may checkpoint them.
        max_shapes: The largest shapes the model's inputs will take, as a mapping from an
            input's name (a keyword argument) or position (an int) to its shape; a
            percentage budget is then read against the plain peak at those shapes from
            the first plan on.
        agree: Called with the fitted costs of the first layout measured, returns those
            every rank of a process group uses (the identity outside one).
    """

    def __init__(
        self,
        settings: PlanSettings,
        *,
        max_shapes: Optional[Dict[Any, Sequence[int]]] = None,
        agree: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        self.settings = settings
        self.max_shapes = max_shapes
        self.reference = 0
        """The largest un-checkpointed peak planned for or declared so far."""
        self._measurer = Measurer(settings, agree)
        self._layouts: List[LayoutCosts] = []
        self._plans: "collections.OrderedDict[Tuple[int, Sizes, Optional[int]], Choice]" = (
            collections.OrderedDict()
        )
        self._said: set = set()

    @property
    def measurements(self) -> int:
        """How many times the model ran to be measured (every layout, every shape)."""
        return self._measurer.measurements

    def __getstate__(self) -> Dict[str, Any]:
        # A loss function or an agreement closure often cannot pickle: left out, the
        # plans made after unpickling use the default loss and agree with no other rank.
        state = dict(self.__dict__)
        state["_plans"] = collections.OrderedDict()
        settings = self.settings
        try:
            pickle.dumps(settings.loss_fn)
        except Exception:  # noqa: BLE001 - whatever stops it pickling, leave it out
            settings = dataclasses.replace(settings, loss_fn=None)
        state["settings"] = settings
        state["_measurer"] = Measurer(settings)
        return state

    # ------------------------------------------------------------------ planning

    def choose(
        self,
        model: nn.Module,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        *,
        strict: bool,
        around: Optional[Callable[[], ContextManager[Any]]] = None,
    ) -> Choice:
        """The plan for a training forward on these inputs, measuring first if no costs of
        their layout are known; each time the model runs to be measured, it runs inside
        ``around()`` (the caller takes its own marks off the model there, say).

        Raises:
            CheckpointConfigError: With ``strict``, when no plan fits the budget at these
                shapes (or at the declared largest ones).
        """
        self._measurer.around = around
        try:
            index, sizes = self._find(args, kwargs)
            if index is None:
                index, sizes = self._measure(model, args, kwargs, strict=strict)
            costs = self._layouts[index]
            profile = costs.profile_at(sizes)
            if profile is None:
                profile = self._measurer.shape(model, costs, sizes, args, kwargs)
        finally:
            self._measurer.around = None
        region = region_bytes(model, args, kwargs, self.settings.preserve_rng_state)
        plain = plain_peak(profile, self.settings.names, region_bytes=region)
        budget = self._budget(plain)
        key = (index, sizes, None if budget is None else int(budget))
        found = self._plans.get(key)
        if found is not None:
            self._plans.move_to_end(key)
            return found
        settings = self.settings
        # A batch of one names its operators otherwise than the samples did: whole modules.
        levels = settings.levels and not costs.layout.single(sizes)
        try:
            choice = choose(
                profile, settings.candidates, budget,
                describe=settings.budget.describe() if settings.budget is not None else "the budget",
                segments=settings.segments, levels=levels, recompute=settings.recompute,
                region_bytes=region, strict=strict,
            )
        except CheckpointConfigError as error:
            raise CheckpointConfigError(
                f"at inputs of {costs.layout.describe(sizes)}: {error}"
            ) from None
        if not choice.reachable and "unreachable" not in self._said:
            self._said.add("unreachable")
            warn(
                f"{type(model).__name__}: no plan fits {settings.budget.describe()} "  # type: ignore[union-attr]
                f"({_mib(int(budget or 0))}) at inputs of {costs.layout.describe(sizes)}; this "
                f"forward runs under the plan of least memory ({_mib(choice.predicted_peak)} "
                f"predicted), as will any other such shape (said once)."
            )
        self._plans[key] = choice
        while len(self._plans) > _CACHED:
            self._plans.popitem(last=False)
        return choice

    def seed(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], profile: ModelProfile) -> None:
        """Take ``profile``, measured directly on these inputs (with a step), as their
        costs instead of measuring them."""
        layout = read_layout(args, kwargs)
        costs = LayoutCosts(layout)
        costs.profiles[layout.sizes] = profile
        self._layouts.append(costs)

    def layout_of(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
        """How the shape variables of these inputs read, if their layout is known."""
        index, sizes = self._find(args, kwargs)
        return None if index is None else self._layouts[index].layout.describe(sizes)

    def _find(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Optional[int], Sizes]:
        """The measured layout these inputs fit, and their sizes in it. A keyword argument
        holding a 0-dim tensor that the measured inputs lacked (the Trainer's
        ``num_items_in_batch``, a loss scale) is looked past: it moves no activation."""
        scalars = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
        tries = [kwargs, {k: v for k, v in kwargs.items() if k not in scalars}] if scalars else [kwargs]
        for given in tries:
            for index, costs in enumerate(self._layouts):
                sizes = costs.layout.sizes_of(args, given)
                if sizes is not None:
                    return index, sizes
        return None, ()

    def _budget(self, plain: int, *, planned: bool = True) -> Optional[int]:
        """The budget in bytes at a shape whose plain peak is ``plain``; ``planned``: that
        shape is planned for (or declared), and counts for the largest so far."""
        budget = self.settings.budget
        if budget is None:
            return None
        reference = max(self.reference, plain)
        if planned:
            self.reference = reference
        return resolve_budget(budget, reference)

    # ------------------------------------------------------------------ measuring

    def _measure(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], *, strict: bool) -> Tuple[int, Sizes]:
        """Measure the costs of a new layout; its index and these inputs' sizes."""
        region = region_bytes(model, args, kwargs, self.settings.preserve_rng_state)
        costs = self._measurer.layout(model, args, kwargs, lambda fitted: self._bound(fitted, region))
        self._layouts.append(costs)
        if len(self._layouts) == 1 and self.max_shapes:
            self._declare(model, costs, region, strict=strict)
        return len(self._layouts) - 1, costs.layout.sizes

    def _bound(self, fitted: ModelProfile, region: int) -> Optional[int]:
        """The most a measurement at these costs' shape may hold: the budget there, or the
        least any plan reaches when that is more; None without a budget."""
        if self.settings.budget is None:
            return None
        names = self.settings.names
        budget = self._budget(plain_peak(fitted, names, region_bytes=region), planned=False)
        ordered, _, tail = step_items(fitted, names, segments=self.settings.segments, region_bytes=region)
        lowest = smallest_reachable_peak([item for _, item in ordered], base=fitted.base_bytes, tail=tail)
        return max(int(budget), lowest)  # type: ignore[arg-type]

    def _declare(self, model: nn.Module, costs: LayoutCosts, region: int, *, strict: bool) -> None:
        """Read the declared largest shapes as sizes of the first layout and plan there
        (without measuring), so that a percentage is read against them from the start
        and, with ``strict``, a budget they cannot reach is an error now."""
        declared = costs.layout.declared(self.max_shapes or {})
        if declared == costs.layout.sizes:
            return
        profile = costs.profile_at(declared) if costs.fit is not None else None
        if profile is None:
            warn(
                f"max_shapes were left aside: {type(model).__name__}'s costs could not be "
                f"fitted over its input shapes, so shapes not measured cannot be planned for."
            )
            return
        budget = self._budget(plain_peak(profile, self.settings.names, region_bytes=region))
        if not strict or budget is None:
            return
        settings = self.settings
        try:
            choose(
                profile, settings.candidates, budget, segments=settings.segments,
                levels=settings.levels, region_bytes=region, strict=True,
            )
        except CheckpointConfigError as error:
            raise CheckpointConfigError(
                f"at the declared max_shapes ({costs.layout.describe(declared)}): {error}"
            ) from None


def resolve_budget(budget: Budget, reference: int) -> int:
    """``budget`` in bytes: its amount, or its share of ``reference`` (the predicted
    un-checkpointed step peak it is read against) as a :class:`PercentBudget`, an int that
    remembers its percentage, so that a budget below reach is reported in percent too."""
    fraction, amount = budget.parsed()
    if fraction is None:
        return int(amount)  # type: ignore[arg-type]
    return PercentBudget(
        fraction, reference,
        of="the un-checkpointed step's peak at the largest shape planned so far",
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

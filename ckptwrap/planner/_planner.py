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
import contextlib
import math
import contextvars
import dataclasses
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from .._warn import note, warn
from ..measure import tensors
from ..policy import Budget
from ._choose import Choice, choose, plain_peak
from ._fit import CostFit, ShapesDiffer
from ._inputs import InputLayout, read_layout
from ._profile import ModelProfile, measure_training_step, profile_modules
from ._solver import PercentBudget, smallest_reachable_peak
from ._step import StepPeaks
from ._items import forward_items
from ._step_terms import with_step_terms

__all__ = ["PlanSettings", "ShapePlanner", "is_measuring", "region_bytes", "resolve_budget"]

_MEASURING: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptwrap_measuring", default=False)


def is_measuring() -> bool:
    """Whether the model runs to be measured for a plan: a forward hook that plans must
    then leave it alone (the forward is not a training forward of the caller's)."""
    return _MEASURING.get()


Sizes = Tuple[int, ...]

_CACHED = 64
"""Plans kept per planner, the most recently used."""
_CHECK_TOLERANCE = 0.03
"""How far (a share of the step's peak) a fitted phase peak may lie from the measured one
on the shape planned for before the fit is no longer trusted at shapes not measured."""


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What a measured plan is made of, besides the model and its inputs."""

    candidates: Tuple[Tuple[str, str], ...]
    """``(qualified name, class name)`` of each candidate, in model order."""
    budget: Optional[Budget] = None
    """The budget term; None predicts the plan that checkpoints every candidate."""
    save_policy: Optional[Callable[..., Any]] = None
    """The selective tier's policy, if candidates are checkpointed selectively."""
    segments: bool = False
    """Whether consecutive candidates may share one region."""
    levels: bool = False
    """Whether a candidate may be checkpointed at a selective level."""
    recompute: bool = True
    """Whether the candidates are recomputed (the plain tier), for the entries' labels."""
    preserve_rng_state: bool = True
    """The engine option: on the CPU each region keeps the generator's state."""
    loss_fn: Optional[Callable[[Any], Any]] = None
    """How a training step turns the output into the loss (see ``plan``)."""

    @property
    def names(self) -> List[str]:
        return [name for name, _ in self.candidates]


class _LayoutCosts:
    """What the planner knows of one input layout's costs."""

    def __init__(self, layout: InputLayout) -> None:
        self.layout = layout
        self.fit: Optional[CostFit] = None
        self.profiles: Dict[Sizes, ModelProfile] = {}  # profiled directly at these sizes
        self.steps: Dict[Sizes, StepPeaks] = {}  # steps measured at these sizes
        self.follows = False  # whether the fit stands for sizes not measured

    def profile_at(self, sizes: Sizes) -> Optional[ModelProfile]:
        """The profile at ``sizes`` if known without measuring."""
        known = self.profiles.get(sizes)
        if known is not None:
            return known
        if self.fit is None or not (self.follows or sizes in self.steps):
            return None
        return self.fit.profile_at(sizes, self.steps.get(sizes))


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
        self.agree = agree
        self.reference = 0
        """The largest un-checkpointed peak planned for or declared so far."""
        self._layouts: List[_LayoutCosts] = []
        self._plans: "collections.OrderedDict[Tuple[int, Sizes, Optional[int]], Choice]" = (
            collections.OrderedDict()
        )
        self._said: set = set()
        self.measurements = 0
        """How many times the model ran to be measured (every layout, every shape)."""
        self._around: Optional[Callable[[], ContextManager[Any]]] = None
        self._region: Optional[int] = None

    def __getstate__(self) -> Dict[str, Any]:
        # A loss function or an agreement closure often cannot pickle: left out, the
        # plans made after unpickling use the default loss and agree with no other rank.
        state = dict(self.__dict__)
        state["agree"] = state["_around"] = None
        state["_plans"] = collections.OrderedDict()
        try:
            import pickle

            pickle.dumps(self.settings.loss_fn)
        except Exception:  # noqa: BLE001 - whatever stops it pickling, leave it out
            state["settings"] = dataclasses.replace(self.settings, loss_fn=None)
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
        self._around = around
        try:
            index, sizes = self._find(args, kwargs)
            if index is None:
                index, sizes = self._measure(model, args, kwargs, strict=strict)
            costs = self._layouts[index]
            profile = costs.profile_at(sizes)
            if profile is None:
                profile = self._measure_shape(model, costs, sizes, args, kwargs)
        finally:
            self._around = None
        region = region_bytes(model, args, kwargs, self.settings.preserve_rng_state)
        plain = plain_peak(profile, self.settings.names, region_bytes=region)
        budget = self._budget(plain)
        key = (index, sizes, None if budget is None else int(budget))
        found = self._plans.get(key)
        if found is not None:
            self._plans.move_to_end(key)
            return found
        settings = self.settings
        try:
            choice = choose(
                profile, settings.candidates, budget,
                describe=settings.budget.describe() if settings.budget is not None else "the budget",
                segments=settings.segments, levels=settings.levels, recompute=settings.recompute,
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
        costs = _LayoutCosts(layout)
        costs.profiles[layout.sizes] = profile
        self._layouts.append(costs)

    def layout_of(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
        """How the shape variables of these inputs read, if their layout is known."""
        index, sizes = self._find(args, kwargs)
        return None if index is None else self._layouts[index].layout.describe(sizes)

    def _find(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Optional[int], Sizes]:
        for index, costs in enumerate(self._layouts):
            sizes = costs.layout.sizes_of(args, kwargs)
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
        """Measure the costs of a new layout; its index and these inputs' sizes.

        In a process group every rank measures at the same shapes (the lowest rank's, its
        own inputs cut or repeated to them) and takes each decision the lowest rank takes
        (whether the costs could be fitted, whether the fit holds), so that every rank runs
        the model as many times: an FSDP2 model's runs are collectives.
        """
        layout = read_layout(args, kwargs)
        costs = _LayoutCosts(layout)
        sizes = layout.sizes
        at = self._agreed(sizes)
        if len(at) == len(sizes) and at != sizes:
            args, kwargs = layout.resized(args, kwargs, at)
            sizes = at
        first = not self._layouts
        samples = layout.samples_at(sizes)
        why = None
        if samples is None:
            why = "its inputs have no batch or length to profile smaller"
        else:
            try:
                costs.fit = self._fit(model, layout, samples, args, kwargs)
            except ShapesDiffer as error:
                why = f"its costs do not follow its shapes ({error})"
            costs.fit = self._agreed(costs.fit)
        if costs.fit is None:
            costs.profiles[sizes] = self._profile(model, args, kwargs, repeats=1)
            note(
                f"ckptwrap profiled {type(model).__name__} at inputs of {layout.describe(sizes)} "
                f"directly: {why or 'so did the lowest rank'}; each new shape of these inputs is "
                f"profiled likewise."
            )
        else:
            self._check(model, costs, sizes, args, kwargs)
            # Every rank plans from the same costs (their times differ by noise).
            costs.fit, costs.follows = self._agreed((costs.fit, costs.follows))
        self._layouts.append(costs)
        self._region = region_bytes(model, args, kwargs, self.settings.preserve_rng_state)
        if first and self.max_shapes:
            self._declare(model, len(self._layouts) - 1, strict=strict)
        return len(self._layouts) - 1, layout.sizes

    def _agreed(self, value: Any) -> Any:
        """``value`` as the lowest rank of the process group has it (itself outside one)."""
        return value if self.agree is None else self.agree(value)

    def _fit(
        self, model: nn.Module, layout: InputLayout, samples: Sequence[Sizes], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> CostFit:
        profiles = []
        for number, sizes in enumerate(samples):
            small_args, small_kwargs = layout.resized(args, kwargs, sizes)
            try:
                profile = self._profile(
                    model, small_args, small_kwargs, repeats=1 if number == 0 else 0, tolerant=True
                )
            except (RuntimeError, ValueError, IndexError, TypeError) as error:
                raise ShapesDiffer(
                    f"its forward failed at {layout.describe(sizes)}: {type(error).__name__}"
                ) from error
            profiles.append((sizes, profile))
        return CostFit(layout.names, profiles)

    def _check(self, model: nn.Module, costs: _LayoutCosts, sizes: Sizes, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Check the fit on the shape planned for, with one step measured there (every
        candidate checkpointed), if that step is predicted to stay within the budget."""
        assert costs.fit is not None
        fitted = costs.fit.profile_at(sizes)
        assert fitted.step is not None
        region = region_bytes(model, args, kwargs, self.settings.preserve_rng_state)
        bound = self._bound(fitted, region)
        if bound is not None and fitted.step.total > bound:
            costs.follows = True
            note(
                f"ckptwrap fitted {type(model).__name__}'s costs over its input shapes without "
                f"checking them at {costs.layout.describe(sizes)}: the step that checks them "
                f"is predicted to exceed the budget there."
            )
            return
        with self._measuring():
            step = measure_training_step(
                model, self.settings.names, args, kwargs, loss_fn=self.settings.loss_fn,
                save_policy=self.settings.save_policy,
                preserve_rng_state=self.settings.preserve_rng_state,
            )
        costs.steps[sizes] = step
        costs.fit.calibrate(sizes, step)
        error = costs.fit.step_error(sizes, step)
        costs.follows = error <= _CHECK_TOLERANCE
        if not costs.follows:
            note(
                f"ckptwrap's fit of {type(model).__name__}'s costs missed the step measured "
                f"at {costs.layout.describe(sizes)} by {error:.1%} of its peak; every new shape "
                f"of these inputs gets a step of its own measured before it is planned."
            )

    def _bound(self, fitted: ModelProfile, region: int) -> Optional[int]:
        """The most a measurement at these costs' shape may hold: the budget there, or the
        least any plan reaches when that is more; None without a budget."""
        if self.settings.budget is None:
            return None
        budget = self._budget(plain_peak(fitted, self.settings.names, region_bytes=region), planned=False)
        assert budget is not None
        ordered, tail = with_step_terms(
            forward_items(fitted, self.settings.names, segments=self.settings.segments, region_bytes=region),
            fitted,
        )
        lowest = smallest_reachable_peak([item for _, item in ordered], base=fitted.base_bytes, tail=tail)
        return max(int(budget), lowest)

    def _measure_shape(
        self, model: nn.Module, costs: _LayoutCosts, sizes: Sizes, args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> ModelProfile:
        """The profile at sizes the layout's costs do not stand for: its step measured, on
        the fit's other terms, or, without a fit, a profile of its own.

        In a process group nothing is measured (ranks meet new shapes at other steps, and
        an FSDP2 model's runs are collectives): the fit stands for the shape, or, without
        one, the profile measured at the shape closest in size."""
        if self.agree is not None:
            if costs.fit is not None:
                return costs.fit.profile_at(sizes)
            nearest = min(costs.profiles, key=lambda known: abs(math.prod(known) - math.prod(sizes)))
            return costs.profiles[nearest]
        if costs.fit is None:
            profile = self._profile(model, args, kwargs, repeats=0)
            costs.profiles[sizes] = profile
            return profile
        with self._measuring():
            costs.steps[sizes] = measure_training_step(
                model, self.settings.names, args, kwargs, loss_fn=_tolerant(self.settings.loss_fn),
                save_policy=self.settings.save_policy,
                preserve_rng_state=self.settings.preserve_rng_state,
            )
        return costs.fit.profile_at(sizes, costs.steps[sizes])

    def _profile(
        self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], *, repeats: int,
        tolerant: bool = False,
    ) -> ModelProfile:
        """A direct profile; ``tolerant`` (a shape the caller did not give) backpropagates
        from the default loss if the given loss function fails on it."""
        settings = self.settings
        with torch.random.fork_rng(devices=[]), self._measuring():
            return profile_modules(
                model, settings.names, args, kwargs, repeats=repeats, progress=False,
                save_policy=settings.save_policy, step=True,
                loss_fn=_tolerant(settings.loss_fn) if tolerant else settings.loss_fn,
                preserve_rng_state=settings.preserve_rng_state,
            )

    @contextlib.contextmanager
    def _measuring(self) -> Iterator[None]:
        """While the model runs to be measured: hooks that plan leave it alone, and the
        caller's ``around`` context holds."""
        self.measurements += 1
        token = _MEASURING.set(True)
        try:
            with (self._around() if self._around is not None else contextlib.nullcontext()):
                yield
        finally:
            _MEASURING.reset(token)

    def _declare(self, model: nn.Module, index: int, *, strict: bool) -> None:
        """Read the declared largest shapes as sizes of the first layout and plan there
        (without measuring), so that a percentage is read against them from the start
        and, with ``strict``, a budget they cannot reach is an error now."""
        costs = self._layouts[index]
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
        region = self._region if self._region is not None else 0
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


def _tolerant(loss_fn: Optional[Callable[[Any], Any]]) -> Optional[Callable[[Any], Any]]:
    """``loss_fn``, falling back to the default loss (the output as it is) where it fails:
    a loss function made for the inputs the caller gave may not take other shapes."""
    if loss_fn is None:
        return None

    def loss(output: Any) -> Any:
        try:
            return loss_fn(output)
        except Exception:  # noqa: BLE001 - any failure of a loss made for other shapes
            return output

    return loss


def region_bytes(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], preserve_rng_state: bool = True) -> int:
    """What the engine keeps per checkpointed call besides its inputs, in the memory the
    budget caps: on the CPU, the generator state it replays (an accelerator's is kept in
    host memory)."""
    if not preserve_rng_state:
        return 0
    on_cpu = all(t.device.type == "cpu" for t in [*tensors((args, kwargs)), *model.parameters()])
    return torch.get_rng_state().untyped_storage().nbytes() if on_cpu else 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

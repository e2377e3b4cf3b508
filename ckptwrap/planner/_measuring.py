"""Measuring a model for the planner, one layout of its inputs at a time: profiles at a few
small shapes fitted over the shape variables (``_fit``) and checked with one training step
at the shape planned for, or, where that cannot be done, a profile of the shape itself.

While the model runs to be measured, :func:`is_measuring` is true, so that a hook that
plans leaves those forwards alone. In a process group every rank measures at the same
shapes and takes each decision the lowest rank takes, so that every rank runs the model
as many times: an FSDP2 model's runs are collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._warn import note
from ..measure import tensors
from ..policy import Budget
from ._module_costs import ModelProfile
from ._fit import CostFit, ShapesDiffer
from ._inputs import InputLayout, read_layout
from ._profile import measure_training_step, profile_modules
from ._step import StepPeaks

__all__ = ["LayoutCosts", "Measurer", "PlanSettings", "is_measuring", "region_bytes"]

Sizes = Tuple[int, ...]

_CHECK_TOLERANCE = 0.03
"""How far (a share of the step's peak) a fitted phase peak may lie from the measured one
on the shape planned for before the fit is no longer trusted at shapes not measured."""

_MEASURING: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptwrap_measuring", default=False)


def is_measuring() -> bool:
    """Whether the model runs to be measured for a plan: a forward hook that plans must
    then leave it alone (the forward is not a training forward of the caller's)."""
    return _MEASURING.get()


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


class LayoutCosts:
    """What is known of one input layout's costs."""

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


Bound = Callable[[ModelProfile], Optional[int]]
"""Given costs fitted at a shape, the most a measurement there may hold (None: no limit)."""


class Measurer:
    """Measures one model for one planner (see the module).

    Args:
        settings: What the plans are made of (candidates, loss, save policy...).
        agree: In a process group, returns for a value of this rank's the lowest rank's.
    """

    def __init__(self, settings: PlanSettings, agree: Optional[Callable[[Any], Any]] = None) -> None:
        self.settings = settings
        self.agree = agree
        self.measurements = 0
        """How many times the model ran to be measured."""
        self.around: Optional[Callable[[], ContextManager[Any]]] = None
        """Entered around each run of the model, if set (the caller's marks come off there)."""

    def layout(
        self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], bound: Bound
    ) -> LayoutCosts:
        """The costs of the layout of these inputs, measured (see the module)."""
        layout = read_layout(args, kwargs)
        costs = LayoutCosts(layout)
        sizes = layout.sizes
        at = self._agreed(sizes)
        resized = len(at) == len(sizes) and at != sizes
        if resized:
            args, kwargs = layout.resized(args, kwargs, at)
            sizes = at
        # Without a budget the plan is made at these shapes alone: no need to fit them.
        samples = layout.samples_at(sizes) if self.settings.budget is not None else None
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
            costs.profiles[sizes] = self.profile(model, args, kwargs, repeats=1, tolerant=resized)
            if self.settings.budget is None:
                return costs
            note(
                f"ckptwrap profiled {type(model).__name__} at inputs of {layout.describe(sizes)} "
                f"directly: {why or 'so did the lowest rank'}; each new shape of these inputs is "
                f"profiled likewise."
            )
            return costs
        self._check(model, costs, sizes, args, kwargs, bound, tolerant=resized)
        # Every rank plans from the same costs (their times differ by noise).
        costs.fit, costs.follows = self._agreed((costs.fit, costs.follows))
        return costs

    def shape(
        self, model: nn.Module, costs: LayoutCosts, sizes: Sizes, args: Tuple[Any, ...], kwargs: Dict[str, Any]
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
            profile = self.profile(model, args, kwargs, repeats=0)
            costs.profiles[sizes] = profile
            return profile
        costs.steps[sizes] = self._step(model, args, kwargs, tolerant=True)
        return costs.fit.profile_at(sizes, costs.steps[sizes])

    def profile(
        self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], *, repeats: int,
        tolerant: bool = False,
    ) -> ModelProfile:
        """A direct profile, with a step; ``tolerant`` (a shape the caller did not give)
        backpropagates from the default loss if the given loss function fails on it."""
        settings = self.settings
        with torch.random.fork_rng(devices=[]), self._measuring():
            return profile_modules(
                model, settings.names, args, kwargs, repeats=repeats, progress=False,
                save_policy=settings.save_policy, step=True,
                loss_fn=_tolerant(settings.loss_fn) if tolerant else settings.loss_fn,
                preserve_rng_state=settings.preserve_rng_state,
            )

    def _agreed(self, value: Any) -> Any:
        """``value`` as the lowest rank of the process group has it (itself outside one)."""
        return value if self.agree is None else self.agree(value)

    def _fit(
        self, model: nn.Module, layout: InputLayout, samples: Sequence[Sizes], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> CostFit:
        profiles = []
        # Selective levels weigh operators' times and the selective mode's cost against
        # each other, and the selective tier its replay's: the first profile times them.
        timed = self.settings.levels or self.settings.save_policy is not None
        for number, sizes in enumerate(samples):
            small_args, small_kwargs = layout.resized(args, kwargs, sizes)
            try:
                profile = self.profile(
                    model, small_args, small_kwargs, repeats=1 if number == 0 and timed else 0,
                    tolerant=True,
                )
            except (RuntimeError, ValueError, IndexError, TypeError) as error:
                raise ShapesDiffer(
                    f"its forward failed at {layout.describe(sizes)}: {type(error).__name__}"
                ) from error
            profiles.append((sizes, profile))
        return CostFit(layout.names, profiles)

    def _check(
        self, model: nn.Module, costs: LayoutCosts, sizes: Sizes, args: Tuple[Any, ...],
        kwargs: Dict[str, Any], bound: Bound, *, tolerant: bool,
    ) -> None:
        """Check the fit on the shape planned for, with one step measured there (every
        candidate checkpointed), if that step is predicted to stay within ``bound``."""
        assert costs.fit is not None
        fitted = costs.fit.profile_at(sizes)
        assert fitted.step is not None
        most = bound(fitted)
        if most is not None and fitted.step.total > most:
            costs.follows = True
            note(
                f"ckptwrap fitted {type(model).__name__}'s costs over its input shapes without "
                f"checking them at {costs.layout.describe(sizes)}: the step that checks them "
                f"is predicted to exceed the budget there."
            )
            return
        step = self._step(model, args, kwargs, tolerant=tolerant)
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

    def _step(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], *, tolerant: bool) -> StepPeaks:
        settings = self.settings
        with self._measuring():
            return measure_training_step(
                model, settings.names, args, kwargs,
                loss_fn=_tolerant(settings.loss_fn) if tolerant else settings.loss_fn,
                save_policy=settings.save_policy, preserve_rng_state=settings.preserve_rng_state,
            )

    @contextlib.contextmanager
    def _measuring(self) -> Iterator[None]:
        """While the model runs to be measured: hooks that plan leave it alone, and the
        caller's ``around`` context holds."""
        self.measurements += 1
        token = _MEASURING.set(True)
        try:
            with (self.around() if self.around is not None else contextlib.nullcontext()):
                yield
        finally:
            _MEASURING.reset(token)


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

"""What the planner knows of one layout of a model's inputs: the profiles of the steps
measured at its shapes, their fit over the shape variables (``_fit``), whether that fit
may stand for shapes not measured, and the margin the closed loop added.

A fit is trusted once it has predicted a measured step it was not fitted on, within
``_TRUST_UNDER`` (too low) and ``_TRUST_OVER`` (too high) of that step's peak; the fits
after it keep to its monomials (its *form*) while they predict the steps measured next,
and fit all the monomials the shapes tell apart again after one they miss. A trusted fit
stands only where the measured shapes determine it (a batch measured at one size says
nothing of another) and where no monomial it leaves out, fitted beside its own, would
move its peaks by more than those shares (``CostFit.leeway``), and up to a tenth past the
largest size of each variable measured. Elsewhere a bound from a measured shape stands
(``_bounded_at``): costs grow with the shape, so a larger measured shape bounds them, and
a smaller one scaled up by its growth. A checked step above its prediction adds that share of the
un-checkpointed peak as a margin; a large miss at a shape not measured has that shape
measured again.

A layout is widened where inputs differ from it in sizes only (``InputLayout.widened``):
the dimensions that changed become variables of it, what was measured keeps its place
(at the sizes those dimensions had), and no new layout is opened.

While the planner runs the model itself on given inputs (``plan``, example inputs),
:func:`is_measuring` is true, so that a hook that plans leaves those forwards alone.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from ..policy import Budget
from ._module_costs import ModelProfile
from ._fit import CostFit, Form, ShapesDiffer
from ._inputs import InputLayout, read_layout
from ._poly import basis

__all__ = ["LayoutCosts", "Layouts", "PlanSettings", "is_measuring", "measuring"]

Sizes = Tuple[int, ...]

_TRUST_UNDER = 0.02
"""How far below a measured step's peak (a share of it) a fit may predict a phase and
still be trusted."""
_TRUST_OVER = 0.10
"""How far above it."""
_EXTEND = 1.1
"""A fit that predicted one measured step stands for sizes up to this multiple of the
largest measured (any smaller size: costs there are smaller, and a miss is caught by the
checks)."""
_REACH = 2.0
"""The furthest a fit stands past the largest size measured, as a multiple of it: its
reach doubles its share past ``_EXTEND`` for each further step it predicted at sizes
beyond those it was fitted on."""
_KEPT = 12
"""Measured profiles kept per layout: the extremes of each variable and the most recent."""
_REMEASURE = 0.03
"""A checked step this far above its fitted prediction (a share of the un-checkpointed
peak) has its shape measured again."""
_MARGIN_SLACK = 0.005
"""Added to a miss when it becomes the margin."""
_GIVE_UP = 3
"""Failed measurements of one layout after which it is no longer measured."""
_LAYOUTS = 8
"""Layouts of inputs kept per planner, the most recently used."""
_EVALUATED = 64
"""Evaluations of a fit kept per layout, the most recent."""

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
    rates: Any = None
    """What a step run on fake tensors is priced at (``plan``'s ``device_rates``)."""
    fake: bool = False
    """Whether steps on given inputs run on fake tensors even for a real model."""
    optimizer: Any = None
    """The optimizer whose state and step count in a device's memory (an ``OptimizerSpec``)."""
    accumulation: int = 1
    """Micro-steps per optimizer step: past one, a plan from example inputs is for a
    micro-step that starts with the gradients held (``plan``'s ``accumulation``)."""

    @property
    def names(self) -> List[str]:
        return [name for name, _ in self.candidates]

    @property
    def outermost(self) -> List[str]:
        """The candidates no other candidate contains: those a measured step checkpoints."""
        names = self.names
        return [
            name for name in names
            if name and not any(name.startswith(other + ".") for other in names if other)
        ]


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """While the planner runs the model itself, on given inputs."""
    token = _MEASURING.set(True)
    try:
        yield
    finally:
        _MEASURING.reset(token)


_SCALE_STEP = 2 ** (1 / 16)
"""The grid a scaled bound's factor is rounded up to (steps of 4.4%)."""
_SCALE_REUSE = _SCALE_STEP ** 2 * (1 + 1e-9)
"""How much larger than its own a scaled bound already worked out may be and still be
taken (two steps of the grid, 9%): a new shape then costs no evaluation and no solve."""
_SCALED_PEAK = 0.999
"""A scaled bound's peak against its measured shape's times the scale (counts of calls do
not scale): what it is at least, for telling whether it may peak below a fit."""


class LayoutCosts:
    """What is known of one input layout's costs (see the module)."""

    def __init__(self, layout: InputLayout) -> None:
        self.layout = layout
        self.profiles: "collections.OrderedDict[Sizes, ModelProfile]" = collections.OrderedDict()
        self.fit: Optional[CostFit] = None
        self.trusted = False
        self.margin = 0.0
        """A share of the un-checkpointed peak kept free beyond the predictions."""
        self.failures = 0
        self.remeasure: Set[Sizes] = set()
        # The form of a fit that predicted a step it was not fitted on: later fits keep
        # to it (more samples, the same monomials) until it fails to predict one.
        self._form: Optional[Form] = None
        # The steps measured past the sizes it was fitted on that the form predicted, one
        # after another: how far past them it stands (``_reach``).
        self._confirmed = 0
        # Evaluations of the current fit, by sizes (a loop meets a shape many times).
        self._fitted: Dict[Sizes, ModelProfile] = {}
        self._covered: Dict[Sizes, bool] = {}
        self._known: Dict[Sizes, Optional[Tuple[str, ModelProfile]]] = {}
        self._single: Dict[Sizes, CostFit] = {}  # one measured profile, to scale
        self._scaled: Dict[Tuple[Sizes, float], ModelProfile] = {}

    @property
    def given_up(self) -> bool:
        return self.failures >= _GIVE_UP

    def source_at(self, sizes: Sizes) -> Optional[str]:
        """Where the costs at ``sizes`` come from if they are known without measuring
        (``measured``, ``fitted``, or a bound from a measured shape, ``bounded`` or
        ``scaled``; then :meth:`profile_at` gives them), else None."""
        if sizes in self.remeasure:
            return None
        if sizes in self.profiles:
            return "measured"
        known = self._known_at(sizes)
        return None if known is None else known[0]

    def fits(self, sizes: Sizes) -> bool:
        """Whether a trusted fit stands for ``sizes`` (measuring there teaches little)."""
        return self.fit is not None and self.trusted and self.covers(sizes)

    def profile_at(self, sizes: Sizes) -> ModelProfile:
        """The profile at ``sizes``: measured there, or else as :meth:`source_at` says,
        or else fitted."""
        known = self.profiles.get(sizes)
        if known is not None:
            return known
        found = self._known_at(sizes) if sizes not in self.remeasure else None
        return found[1] if found is not None else self._fitted_at(sizes)

    def _known_at(self, sizes: Sizes) -> Optional[Tuple[str, ModelProfile]]:
        """The costs at unmeasured ``sizes``: the trusted fit's, or a bound from a measured
        shape (:meth:`_bounded_at`), whichever peaks lower."""
        if sizes in self._known:
            return self._known[sizes]
        found = []
        if self.fits(sizes):
            found.append(("fitted", self._fitted_at(sizes)))
        # The bound's peak is its measured shape's, scaled: its profile is worked out only
        # where it may peak lower than the fit's (a loop meets a new shape at most steps).
        bound = self._bounded_at(sizes, above=_peak(found[0][1]) if found else None)
        if bound is not None:
            found.append(bound)
        known = min(found, key=lambda pair: _peak(pair[1])) if found else None
        self._known[sizes] = known
        while len(self._known) > _EVALUATED:
            del self._known[next(iter(self._known))]
        return known

    def _bounded_at(self, sizes: Sizes, above: Optional[int] = None) -> Optional[Tuple[str, ModelProfile]]:
        """Costs at ``sizes`` no lower than the real ones, from a measured shape: every
        term a sum of tensor sizes, of degree at most 1 in the batch and 2 in the lengths,
        none negative, so a shape at least as large in every variable bounds them as
        measured (``bounded``), and a smaller one once each term is scaled by the batch's
        growth and the square of the largest length's growth (``scaled``). The measured
        shape whose bound peaks lowest, said ``bounded`` wherever a measured shape at
        least as large stands (a smaller one scaled may peak lower: no larger shape
        needs measuring); None where there is none, or where that bound's peak would not
        be below ``above``."""
        names = self.layout.names
        scaled = [(_growth(names, point, sizes), point) for point in self.profiles if point not in self.remeasure]
        if not scaled:
            return None
        scale, point = min(scaled, key=lambda pair: pair[0] * _peak(self.profiles[pair[1]]))
        if above is not None and scale * _peak(self.profiles[point]) * _SCALED_PEAK >= above:
            return None
        if scale == 1.0:
            return "bounded", self.profiles[point]
        # Scaled up to the next step of a grid: still a bound, and the shapes between two
        # steps share one profile (and so one plan, solved once). A profile already
        # worked out a step or two higher is a bound too, and its plan is solved already.
        scale = _SCALE_STEP ** math.ceil(math.log(scale, _SCALE_STEP) - 1e-9)
        scale = min((s for p, s in self._scaled if p == point and scale <= s <= scale * _SCALE_REUSE), default=scale)
        found = self._scaled.get((point, scale))
        if found is None:
            single = self._single.get(point)
            if single is None:
                single = self._single[point] = CostFit(names, [(point, self.profiles[point])])
            found = self._scaled[(point, scale)] = single.profile_at(point, scale=scale)
            while len(self._scaled) > _EVALUATED:
                del self._scaled[next(iter(self._scaled))]
        return ("bounded" if any(growth == 1.0 for growth, _ in scaled) else "scaled"), found

    def _fitted_at(self, sizes: Sizes) -> ModelProfile:
        assert self.fit is not None
        found = self._fitted.get(sizes)
        if found is None:
            found = self._fitted[sizes] = self.fit.profile_at(sizes)
            while len(self._fitted) > _EVALUATED:
                del self._fitted[next(iter(self._fitted))]
        return found

    def covers(self, sizes: Sizes) -> bool:
        """Whether a trusted fit stands for ``sizes``."""
        fit = self.fit
        if fit is None:
            return False
        known = self._covered.get(sizes)
        if known is not None:
            return known
        reach = self._reach()
        covered = all(size <= largest * reach for size, largest in zip(sizes, _largest(fit.points)))
        if covered:
            leeway = fit.leeway(sizes)
            covered = leeway is not None and leeway[0] <= _TRUST_UNDER and leeway[1] <= _TRUST_OVER
        self._covered[sizes] = covered
        while len(self._covered) > _EVALUATED:
            del self._covered[next(iter(self._covered))]
        return covered

    def _reach(self) -> float:
        """How far past the largest measured sizes the trusted fit stands (see the module)."""
        return min(_REACH, 1 + (_EXTEND - 1) * 2 ** max(0, self._confirmed - 1))

    def widen(self, layout: InputLayout) -> None:
        """The layout, :meth:`InputLayout.widened` by inputs that gave some of its
        dimensions other sizes: what was measured stands, its shapes given their sizes
        in the new variables (those they had), and the fit is made over them again."""
        added = len(layout.variables) - len(self.layout.variables)
        self.layout = layout
        self.profiles = collections.OrderedDict(
            (layout.extended(sizes), profile) for sizes, profile in self.profiles.items()
        )
        self.remeasure = {layout.extended(sizes) for sizes in self.remeasure}
        if self._form is not None:
            self._form = tuple(powers + (0,) * added for powers in self._form)
        if self.profiles:
            trusted = self.trusted
            self._refit()
            # The measured shapes determine nothing where the new variables take other
            # sizes (``CostFit.leeway``): where the fit was trusted, it still is.
            self.trusted = trusted and self.trusted

    def learn(self, sizes: Sizes, profile: ModelProfile) -> str:
        """Take a step measured at ``sizes``: check the fit on it if it was not fitted on
        it, then fit again. Returns what happened, for the notes."""
        sizes = self.layout.extended(sizes)  # a step planned before the layout widened
        said = "measured"
        fit = self.fit
        if fit is not None and sizes not in self.profiles:
            under, over = misses(fit.profile_at(sizes), profile)
            was = self.trusted
            self.trusted = under <= _TRUST_UNDER and over <= _TRUST_OVER
            self._form = (self._richer(sizes, profile) or fit.powers) if self.trusted else None
            if not self.trusted:
                self._confirmed = 0
            elif not was or any(size > largest for size, largest in zip(sizes, _largest(fit.points))):
                self._confirmed += 1  # trusted now, or predicted further out than it was fitted
            said = (
                f"the fit predicted it within {max(under, over):.1%}"
                if self.trusted
                else f"the fit missed it by {max(under, over):.1%}{'; no longer trusted' if was else ''}"
            )
        known = self.profiles.pop(sizes, None)
        if known is not None and _peak(known) > _peak(profile):
            profile = known  # the same shape measured twice: its higher costs stand
        self.profiles[sizes] = profile
        self.remeasure.discard(sizes)
        self._bound()
        self._refit()
        return said

    def _richer(self, sizes: Sizes, profile: ModelProfile) -> Optional[Form]:
        """More monomials than the trusted fit's, where the measured shapes tell them
        apart and a fit of them all predicted the step at ``sizes`` as well, from the
        shapes measured before it: the monomials a form leaves out are those a loop
        that grows would otherwise measure for (``CostFit.leeway``)."""
        fit = self.fit
        assert fit is not None
        names, batched = self.layout.names, self.layout.batched
        if len(basis(names, list(self.profiles), batched)) <= len(fit.powers):
            return None  # the shapes tell no more apart
        try:
            fuller = CostFit(names, list(self.profiles.items()), batched=batched)
        except ShapesDiffer:
            return None
        under, over = misses(fuller.profile_at(sizes), profile)
        return fuller.powers if under <= _TRUST_UNDER and over <= _TRUST_OVER else None

    def missed(self, sizes: Sizes, share: float, source: str) -> None:
        """A checked step at ``sizes`` peaked ``share`` of the un-checkpointed peak above
        its prediction from ``source`` costs."""
        sizes = self.layout.extended(sizes)
        self.margin = max(self.margin, min(0.5, share + _MARGIN_SLACK))
        if source != "measured" and share > _REMEASURE:
            self.remeasure.add(sizes)
            # The form did not hold where it reached: it stands a tenth past what it was
            # fitted on again, until it predicts further steps.
            self._confirmed = 0
            self._known.clear()
            self._covered.clear()

    def _bound(self) -> None:
        """At most ``_KEPT`` profiles: the extremes of each variable stay, then the newest."""
        if len(self.profiles) <= _KEPT:
            return
        points = list(self.profiles)
        keep = set()
        for index in range(len(points[0])):
            keep.add(min(points, key=lambda p: p[index]))
            keep.add(max(points, key=lambda p: p[index]))
        for point in reversed(points):
            if len(keep) >= _KEPT:
                break
            keep.add(point)
        for point in points:
            if point not in keep:
                del self.profiles[point]

    def _refit(self) -> None:
        self._fitted.clear()
        self._covered.clear()
        self._known.clear()
        self._single.clear()
        self._scaled.clear()
        samples = list(self.profiles.items())
        names, batched = self.layout.names, self.layout.batched
        try:
            self.fit = CostFit(names, samples, batched=batched, form=self._form)
            return
        except ShapesDiffer:
            pass
        # The model did something else at some shapes: fit those like the newest.
        alike = []
        for sizes, profile in samples:
            try:
                CostFit(names, [(sizes, profile), samples[-1]], batched=batched)
                alike.append((sizes, profile))
            except ShapesDiffer:
                continue
        self.fit = CostFit(names, alike or [samples[-1]], batched=batched)
        self.trusted = False
        self._form = None
        self._confirmed = 0


class Layouts:
    """The layouts of a model's inputs met so far, with their costs: the most recently used
    ``_LAYOUTS``; ``forget`` is told of each one dropped, and of each one widened (the
    sizes its plans were solved at are no longer its)."""

    def __init__(self, forget: Callable[[LayoutCosts], None]) -> None:
        self._known: "collections.OrderedDict[Tuple[Any, ...], LayoutCosts]" = collections.OrderedDict()
        self._forget = forget

    def __len__(self) -> int:
        return len(self._known)

    def values(self) -> Any:
        return self._known.values()

    def of(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[LayoutCosts, Sizes]:
        """The costs of the layout these inputs fit, and their sizes: a known layout, as it
        is or widened by these inputs (``InputLayout.widened``: they differ from it in
        sizes only), else a new one."""
        found = self.find(args, kwargs) or self._widen(args, kwargs)
        if found is not None:
            return found
        layout = read_layout(args, kwargs)
        costs = LayoutCosts(layout)
        self._known[(layout.spec, layout.leaves)] = costs
        while len(self._known) > _LAYOUTS:
            self._forget(self._known.popitem(last=False)[1])
        return costs, layout.sizes

    def find(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[LayoutCosts, Sizes]]:
        """The known layout these inputs fit, and their sizes in it. A keyword argument
        holding a 0-dim tensor that the known inputs lacked (the Trainer's
        ``num_items_in_batch``, a loss scale) is looked past: it moves no activation."""
        for given in self._tries(kwargs):
            for key, costs in reversed(self._known.items()):
                sizes = costs.layout.sizes_of(args, given)
                if sizes is not None:
                    self._known.move_to_end(key)
                    return costs, sizes
        return None

    def _widen(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[LayoutCosts, Sizes]]:
        """The most recently used layout that these inputs differ from in sizes only,
        widened by them (its dimensions they give other sizes made variables), and
        their sizes in it; None if there is none."""
        for given in self._tries(kwargs):
            for key, costs in reversed(list(self._known.items())):
                wider = costs.layout.widened(args, given)
                if wider is None:
                    continue
                del self._known[key]
                costs.widen(wider)
                self._forget(costs)
                other = self._known.pop((wider.spec, wider.leaves), None)
                if other is not None:
                    self._forget(other)
                self._known[(wider.spec, wider.leaves)] = costs
                sizes = wider.sizes_of(args, given)
                assert sizes is not None
                return costs, sizes
        return None

    @staticmethod
    def _tries(kwargs: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The keyword arguments as given, then without those holding a 0-dim tensor."""
        scalars = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
        return [kwargs, {k: v for k, v in kwargs.items() if k not in scalars}] if scalars else [kwargs]


def misses(predicted: ModelProfile, measured: ModelProfile) -> Tuple[float, float]:
    """How far ``predicted`` lies below and above ``measured`` at its worst, as shares of
    the measured step's peak: every phase of the step, and the activations in all."""
    ours, theirs = predicted.step, measured.step
    pairs = [(predicted.total_activation_bytes, measured.total_activation_bytes)]
    if ours is not None and theirs is not None:
        pairs += [(ours.end, theirs.end), (ours.total, theirs.total)]
        for table in ("forward", "recompute", "backward"):
            mine, real = getattr(ours, table), getattr(theirs, table)
            pairs += [(mine.get(name, 0), value) for name, value in real.items()]
    scale = max(_peak(measured), 1)
    under = max(0, max(real - mine for mine, real in pairs)) / scale
    over = max(0, max(mine - real for mine, real in pairs)) / scale
    return under, over


def _largest(points: Sequence[Sizes]) -> Sizes:
    """The largest size of each shape variable among ``points``."""
    return tuple(max(sizes) for sizes in zip(*points))


def _growth(names: Tuple[str, ...], point: Sizes, sizes: Sizes) -> float:
    """How many times a term measured at ``point`` may grow at ``sizes`` (see
    ``LayoutCosts._bounded_at``): 1 where ``point`` is at least as large everywhere."""
    batch = length = 1.0
    for name, measured, size in zip(names, point, sizes):
        grown = max(1.0, size / max(measured, 1))
        if name == "batch":
            batch = grown
        else:
            length = max(length, grown)
    return batch * length**2


def _peak(profile: ModelProfile) -> int:
    return profile.step.total if profile.step is not None else profile.total_activation_bytes

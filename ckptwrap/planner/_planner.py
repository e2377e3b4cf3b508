"""The planner of one model and policy: what to do at each training forward, learned from
the training steps themselves.

Each training forward is a :class:`Decision`. Where the costs at its shape are known (a
step measured at that shape, a trusted fit that stands for it, or a bound from a shape
measured, ``_measuring``), it is a solve: the plan of least recompute time whose
predicted peak fits the budget, less the margin the closed loop added, and some of those
steps are checked against their prediction (:meth:`ShapePlanner.checked`). Where they
are not, or a bound puts every plan over the budget, or learning may spend the time
(``_schedule``), the step runs under the plan of least memory (every candidate
checkpointed) and is measured as it runs (:meth:`ShapePlanner.learned`). Example inputs
are real inputs too: :meth:`choose` measures one step on them at once.

A budget in bytes is the same at every shape. ``budget:NN%`` is NN% of the predicted
un-checkpointed step peak at the largest shape planned so far (largest by that peak),
turned into bytes. A shape that no plan fits gets its plan of least memory, said (a
``UserWarning`` naming the shape, the budget and the peak) at its first step after a step
at another shape, measured steps included (``strict`` raises instead: at wrap time with
example inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import pickle
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._errors import CheckpointConfigError
from .._warn import note, warn
from ._choose import Choice, choose, plain_peak
from ._decision import Decision
from ._plan_cache import PlanCache
from ._reading import BudgetReading
from ._measuring import LayoutCosts, Layouts, PlanSettings, measuring
from ._step import region_bytes
from ._module_costs import ModelProfile
from ._plan import BOUNDS
from ._profile import resolve_targets, measure_inputs
from ._schedule import CheckSchedule
from ._timing import dispatch_cost, selective_cost
from ._unreal import outside_fake, step_device

__all__ = ["Decision", "ShapePlanner"]

Sizes = Tuple[int, ...]

_MISS = 0.01
"""A checked step above its prediction by more than this share of the un-checkpointed
peak is a miss."""


class ShapePlanner:
    """Plans for one model and policy at any shape of its inputs (see the module).

    Plain data between calls (costs and fits, no model), so it pickles and deep-copies
    with a wrapped model.

    Args:
        settings: The candidates, the budget and how plans may checkpoint them.
        max_shapes: The largest shapes the model's inputs will take, as a mapping from an
            input's name (a keyword argument) or position (an int) to its shape; a
            percentage budget is read against the plain peak at those shapes once the
            costs over shapes are trusted.
    """

    def __init__(self, settings: PlanSettings, *, max_shapes: Optional[Dict[Any, Sequence[int]]] = None) -> None:
        # What a measuring dispatch mode costs per operator, read now, outside any step
        # (reading it inside one would count its own tensors).
        dispatch_cost()
        if settings.levels or settings.save_policy is not None:
            selective_cost()
        self.settings = settings
        self.reading = BudgetReading(settings, max_shapes)
        self._measured = 0
        self.checks = 0
        """How many steps were checked against their prediction."""
        self._layouts = Layouts(self._forget_plans)
        self._cache = PlanCache()
        self._schedule = CheckSchedule()
        self._reset = False
        self._previous: Optional[Tuple[int, Sizes]] = None
        """The layout and shape of the last training forward."""
        self._said: Optional[Tuple[int, Sizes]] = None
        """Where a budget out of reach was last said, until a step at another shape."""
        # Steps measured whose profiles are taken in at the next plan: fitting allocates,
        # and the end of a backward is inside the caller's step, often at its peak.
        self._learned: List[Tuple[Decision, Optional[ModelProfile], Optional[str]]] = []
        self.device = self.reading.device
        self.watch_base = True
        """Whether a measured step follows what the forward saves outside the candidates
        through saved-tensor hooks (off after a measured step whose backward never came:
        a graph dropped unused keeps what such hooks hold)."""

    @property
    def reference(self) -> int:
        """The largest un-checkpointed peak planned for so far."""
        return self.reading.reference

    @property
    def measurements(self) -> int:
        """How many steps were measured (training steps and example inputs)."""
        return self._measured + sum(profile is not None for _, profile, _ in self._learned)

    def __getstate__(self) -> Dict[str, Any]:
        # A loss function often cannot pickle: left out, the steps measured on example
        # inputs after unpickling use the default loss.
        self._take_in()
        state = dict(self.__dict__)
        state["_cache"] = PlanCache()  # keyed by the costs' identity, which a copy changes
        try:
            pickle.dumps(self.settings.loss_fn)
        except Exception:  # noqa: BLE001 - whatever stops it pickling, leave it out
            state["settings"] = dataclasses.replace(self.settings, loss_fn=None)
        return state

    # ------------------------------------------------------------------ training steps

    def decide(
        self,
        model: nn.Module,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        *,
        device: Optional[torch.device] = None,
        fresh: Callable[[], bool] = lambda: True,
    ) -> Decision:
        """What the training forward on these inputs runs under, on ``device`` (where the
        step allocates; read from the inputs and the model by default). ``fresh()``: the
        step starts from no parameter gradients (only such a step is checked). Metering
        a step on an accelerator costs nothing (its peak statistics): every one is checked
        there."""
        self._schedule.step()
        self._take_in()
        device = step_device(model, args, kwargs) if device is None else device
        self.device.before_step(model, device, fresh, args, kwargs)
        costs, sizes = self._layouts.of(args, kwargs)
        if self._previous != (id(costs), sizes):
            self._previous, self._said = (id(costs), sizes), None
        region = region_bytes(device, self.settings.preserve_rng_state)
        if costs.given_up:
            return Decision(costs, sizes, measure=False, region=region)
        cheap = device.type not in ("cpu", "meta")
        covered = self._cache.nothing.find(
            (id(costs), region), sizes, functools.partial(self.reading.now, costs), costs.margin
        )
        if covered is not None and sizes not in costs.remeasure and not costs.fits(sizes):
            # No plan needed: what bounds this shape's step fits with nothing checkpointed
            # (a shape a trusted fit stands for gets its own predictions instead).
            return self._solved(costs, sizes, covered, "bounded", region, cheap, fresh)
        source = costs.source_at(sizes)
        bounded = source in BOUNDS
        # A share of the plain peak at a shape larger than any measured: that peak is
        # known only by measuring it.
        if source is None or (source == "scaled" and self.reading.percent):
            return Decision(costs, sizes, measure=True, region=region)
        if bounded and not costs.fits(sizes) and self._schedule.may_learn(math.prod(sizes)):
            return Decision(costs, sizes, measure=True, region=region, learn=True)
        choice = self._choice(costs, sizes, region, strict=False, model=model, bounded=bounded)
        if choice is None:
            # Out of reach under a bound, perhaps not under the costs themselves: measured
            # (the plan of least memory is not solved for, whose arrays the budget does
            # not bound).
            return Decision(costs, sizes, measure=True, region=region)
        self._cache.nothing.add((id(costs), region), sizes, choice.budget, costs.margin, choice)
        return self._solved(costs, sizes, choice, source, region, cheap, fresh)

    def _solved(
        self, costs: LayoutCosts, sizes: Sizes, choice: Choice, source: str, region: int, cheap: bool,
        fresh: Callable[[], bool],
    ) -> Decision:
        """The decision to run ``choice``, checked against its prediction when due."""
        check = self._schedule.due(cheap=cheap, size=math.prod(sizes)) and fresh()
        reset, self._reset = self._reset and check, self._reset and not check
        return Decision(
            costs, sizes, measure=False, choice=choice, source=source, check=check, reset=reset,
            region=region, margin=costs.margin, metered=check and not cheap,
        )

    def learned(self, decision: Decision, profile: Optional[ModelProfile], failure: Optional[str] = None) -> None:
        """The step of a measuring ``decision`` has ended, with this profile (None: the
        recording failed, ``failure`` says why); taken in before the next plan."""
        self._learned.append((decision, profile, failure))

    def _take_in(self) -> None:
        learned, self._learned = self._learned, []
        for decision, profile, failure in learned:
            self._learn(decision, profile, failure)

    def _learn(self, decision: Decision, profile: Optional[ModelProfile], failure: Optional[str]) -> None:
        costs = decision.costs
        if costs is None:
            return
        if profile is None:
            costs.failures += 1
            if costs.given_up:
                warn(
                    f"ckptwrap could not measure a training step at inputs of {decision.describe()} "
                    f"{costs.failures} times ({failure}); inputs of this layout now run under the "
                    f"plan of least memory, unmeasured."
                )
            return
        said = costs.learn(decision.sizes, profile)
        self._measured += 1
        if decision.seconds:
            self._schedule.measured(decision.seconds, size=math.prod(decision.sizes), learning=decision.learn)
        self._forget_plans(costs)
        if not decision.learn:  # a step measured to learn was itself the fit's test
            self._schedule.soon()
        note(
            f"ckptwrap measured a training step at inputs of {decision.describe()} "
            f"({profile.step.total / 2**20 if profile.step else 0:.1f} MiB under the plan of least "
            f"memory): {said}."
        )

    def measured_plan(self, decision: Decision, profile: ModelProfile) -> Tuple[Optional[int], int]:
        """The budget and the un-checkpointed peak at the shape of a measured step."""
        costs = decision.costs
        assert costs is not None
        plain = plain_peak(profile, self.settings.names, region_bytes=decision.region)
        return self.reading.at(plain, costs), plain

    def say_measured(self, decision: Decision, profile: Optional[ModelProfile], model: nn.Module) -> None:
        """A measured step (under the plan of least memory) that peaked above the budget
        at its shape: said at its end, as a solved step out of reach is said."""
        costs = decision.costs
        if costs is None or profile is None or profile.step is None or self.settings.budget is None:
            return
        budget, _ = self.measured_plan(decision, profile)
        key = (id(costs), decision.sizes)
        if budget is None or profile.step.total <= budget or self._said == key:
            return
        self._said = key
        warn(
            f"{type(model).__name__}: a training step at inputs of {decision.describe()} peaked at "
            f"{_mib(profile.step.total)} under the plan of least memory (every candidate checkpointed, "
            f"measured), above {self.settings.budget.describe()} ({_mib(int(budget))}) there. "
            f"Said at the first step at a shape after a step at another.",
            repeat=True,
        )

    def timed(self, decision: Decision, seconds: float) -> None:
        """The step of ``decision`` took ``seconds``, forward to end of backward."""
        if decision.measure:
            decision.seconds = seconds  # told with the profile (its size), when taken in
        elif decision.choice is not None:
            self._schedule.timed(seconds, checked=decision.metered, size=math.prod(decision.sizes))

    def abandoned(self, decision: Decision) -> None:
        """A measuring step ended without a backward."""
        self.watch_base = False

    def checked(self, decision: Decision, peak: int, exact: bool = True) -> None:
        """The step of ``decision`` peaked at ``peak`` bytes (its meter's reading; an upper
        bound of it where not ``exact``)."""
        choice, costs = decision.choice, decision.costs
        if choice is None or costs is None:
            return
        # Above the prediction, beyond what the plan kept free for such misses, as a share
        # of the largest un-checkpointed peak planned for: a miss at a short batch, far
        # below the budget, is not taken as that share of every longer batch.
        plain = max(choice.plain_peak, self.reference, 1)
        share = (peak - choice.predicted_peak - decision.margin * choice.plain_peak) / plain
        if not exact and share > _MISS:
            # An accelerator's peak not raised by the step, and above the prediction: the
            # next check resets the statistics to tell.
            self._reset = True
            self._schedule.inconclusive()
            return
        self.checks += 1
        if share <= _MISS:
            self._schedule.hit()
            return
        costs.missed(decision.sizes, share + decision.margin * choice.plain_peak / plain, decision.source)
        self._forget_plans(costs)
        self._schedule.soon()
        note(
            f"ckptwrap's plan at inputs of {decision.describe()} peaked {share:.1%} of the "
            f"un-checkpointed peak above its prediction ({decision.source} costs); plans of these "
            f"inputs now keep {costs.margin:.1%} free."
        )

    # ------------------------------------------------------------------ given inputs

    def choose(
        self,
        model: nn.Module,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        *,
        strict: bool,
        around: Optional[Callable[[], ContextManager[Any]]] = None,
    ) -> Choice:
        """The plan for these inputs, measuring one step on them first if their shape's
        costs are not known; each time the model runs to be measured, it runs inside
        ``around()`` (the caller takes its own marks off the model there, say). The next
        training step is checked against the plan's prediction.

        Raises:
            CheckpointConfigError: With ``strict``, when no plan fits the budget at these
                shapes.
        """
        with outside_fake():  # the step runs in its own fake mode; the arithmetic outside
            self._take_in()
            costs, sizes = self._layouts.of(args, kwargs)
            if sizes not in costs.profiles:
                settings = self.settings
                with measuring(), (around() if around is not None else contextlib.nullcontext()):
                    profile = measure_inputs(
                        model, resolve_targets(model, settings.names), args, kwargs,
                        loss_fn=settings.loss_fn, save_policy=settings.save_policy,
                        preserve_rng_state=settings.preserve_rng_state, rates=settings.rates,
                        fake=settings.fake,
                    )
                costs.learn(sizes, profile)
                self._measured += 1
            device = step_device(model, args, kwargs)
            self.device.before_example(model, device, args, kwargs)
            region = region_bytes(device, self.settings.preserve_rng_state)
            choice = self._choice(costs, sizes, region, strict=strict, model=model)
            self._schedule.soon()
            return choice

    def seed(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], profile: ModelProfile) -> None:
        """Take ``profile``, measured on these inputs, as their costs."""
        costs, sizes = self._layouts.of(args, kwargs)
        costs.learn(sizes, profile)

    def layout_of(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
        """How the shape variables of these inputs read, if their layout is known."""
        found = self._layouts.find(args, kwargs)
        return None if found is None else found[0].layout.describe(found[1])

    # ------------------------------------------------------------------ internals

    def _choice(
        self,
        costs: LayoutCosts,
        sizes: Sizes,
        region: int,
        *,
        strict: bool,
        model: nn.Module,
        bounded: bool = False,
    ) -> Optional[Choice]:
        """The plan at ``sizes``, whose costs ``costs`` knows (solved once per shape,
        budget and margin; the profile is evaluated only to solve). ``strict``: a budget
        out of reach raises rather than giving the plan of least memory. ``bounded``: the
        costs are a bound (their plain peak is no reference for a share), and a budget out
        of reach under them gives None."""
        settings = self.settings
        profile = costs.profile_at(sizes)
        plain = self._cache.plain.get((id(costs), sizes, region))
        if plain is None and (self.reading.percent or costs.margin or self.reading.max_shapes):
            plain = plain_peak(profile, settings.names, region_bytes=region)
            self._cache.keep_plain((id(costs), sizes, region), plain)
        # Otherwise the solve gives the plain peak (the budget and the margin need none).
        budget = self.reading.at(plain or 0, costs, reference=not bounded)
        kept_free = int(costs.margin * (plain or 0))
        # A batch of one names its operators otherwise than other batches: whole modules.
        levels = settings.levels and not costs.layout.single(sizes)
        # Solved once per profile: the shapes a measured shape bounds (or one scaled bound)
        # share theirs, and with it their plan.
        key = (id(costs), id(profile), levels, region, bounded, None if budget is None else int(budget), kept_free)
        found = self._cache.plan(key, profile)
        if found is not None:
            self._solved_at(found, plain, costs, sizes, region, bounded)
            self._say_unreachable(found, costs, sizes, model)
            return found
        target = budget if budget is None or not kept_free else max(0, int(budget) - kept_free)
        try:
            choice = choose(
                profile, settings.candidates, target,
                describe=settings.budget.describe() if settings.budget is not None else "the budget",
                segments=settings.segments, levels=levels, recompute=settings.recompute,
                region_bytes=region, strict=strict, settle=not bounded,
            )
        except CheckpointConfigError as error:
            if bounded:
                # No plan under a bound: the caller measures. Returned from here, the
                # error goes at once, and with it the solver's arrays its frames hold
                # (raised on, a cycle would keep them to the next garbage collection:
                # inside the step).
                return None
            said = CheckpointConfigError(f"at inputs of {costs.layout.describe(sizes)}: {error}")
            said.needed, said.offered = error.needed, error.offered
            raise said from None
        choice = dataclasses.replace(choice, budget=budget, memory=self.device.memory)
        self._solved_at(choice, plain, costs, sizes, region, bounded)
        self.device.check_optimizer(model, strict=strict)
        self._say_unreachable(choice, costs, sizes, model)
        self._cache.keep(key, choice)
        return choice

    def _say_unreachable(self, choice: Choice, costs: LayoutCosts, sizes: Sizes, model: nn.Module) -> None:
        """A plan of least memory where no plan fits: said at the first step at a shape
        after a step at another (or at the example inputs)."""
        if choice.reachable or self._said == (id(costs), sizes):
            return
        self._said = (id(costs), sizes)
        warn(
            f"{type(model).__name__}: no plan fits {self.settings.budget.describe()} "  # type: ignore[union-attr]
            f"({_mib(int(choice.budget or 0))}) at inputs of {costs.layout.describe(sizes)}; this "
            f"forward runs under the plan of least memory ({_mib(choice.predicted_peak)} "
            f"predicted). Said at the first step at a shape after a step at another.",
            repeat=True,
        )

    def _solved_at(
        self, choice: Choice, plain: Optional[int], costs: LayoutCosts, sizes: Sizes, region: int, bounded: bool
    ) -> None:
        """``choice`` at ``sizes``: its plain peak kept as the shape's, and as a reference."""
        if plain is None:
            self._cache.keep_plain((id(costs), sizes, region), choice.plain_peak)
            if not bounded:
                self.reading.reference = max(self.reading.reference, choice.plain_peak)

    def _forget_plans(self, costs: LayoutCosts) -> None:
        self._cache.forget(id(costs))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

"""Costs over input shapes: every term of the profiles of real steps, measured at the
shapes the caller's inputs took, fitted as a polynomial in the inputs' shape variables,
so that the profile at another shape is a few dot products rather than a new measurement.

Bytes that storages hold are sums of tensor sizes, so each is a polynomial in the batch
``b`` and the lengths: the fit draws on the monomials of degree at most 1 in ``b`` and
at most 2 in the lengths together, those a tensor's size can be first (``1, b, b*s,
b*s^2``, then ``s, s^2``, for a length the inputs carry beside the batch; ``_poly``),
taking those the measured shapes can tell apart (a batch that never changed is no
variable; two lengths fit a line, three a parabola). Each term is then raised by its
largest miss on the measured shapes, so that the fit lies on or above every one of them
(a term that depends on content as well, such as attention with or without a padding
mask, is followed at its highest). A peak is not such a sum but the largest of its moments, and
which moment is largest changes with the shape (the feed-forward's hidden states at
short lengths, attention scores at long ones), so each moment is fitted, and a peak is
the largest fitted moment. What the allocator held beyond the meter's moments
(workspaces, on accelerators) is fitted as one more term.

Seconds are modelled per candidate as ``overhead + rate * work``, ``work`` being its
counted FLOPs plus its created bytes (both polynomials), fitted to the measured steps.

Whether a fit may stand for shapes not measured is decided by the planner, which trusts
it once it has predicted a measured step it was not fitted on (``_measuring``), and then
keeps to its monomials while they predict the steps measured after. Where such a fit has
more samples than monomials, :meth:`CostFit.leeway` says how far each monomial it leaves
out, fitted beside them, would move its peaks at another shape: it stands where none
would move them much, and where the samples determine the costs at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ._module_costs import ModelProfile, ModuleCost
from ._ops import OpCost
from ._poly import Poly, basis, fit_columns, least_squares, monomials, powers_of, rank_of
from ._step import END, StepPeaks

__all__ = ["CostFit", "Form", "ShapesDiffer"]

Sizes = Tuple[int, ...]
Form = Tuple[Tuple[int, ...], ...]
"""A fit's monomials, by their exponents."""

_BYTES_PER_FLOP = 8
"""How many FLOPs one byte created weighs in ``work``: memory traffic against arithmetic."""
_INT_FIELDS = (
    "kept_bytes", "input_bytes", "output_bytes", "flops", "self_saved_input_bytes",
    "forward_peak_bytes", "call_kept_bytes", "call_input_bytes", "created_bytes",
    "handed_over_bytes", "policy_saved_bytes", "policy_saved_kept_bytes",
)
_OVER_SLACK = 64
_OVER_SHARE = 0.001
"""How far a fit of what the allocator held beyond the moments may miss its samples
(bytes, and share of its largest) and still be followed to other shapes."""
_COUNT_FIELDS = ("calls", "position", "first_position")
_SHAPE_FIELDS = ("kind", "called", "joins_previous")
_SPAN_TOLERANCE = 1e-6
_OTHERS = ("total_activation_bytes", "base_bytes", "step")
"""The terms of a profile not a candidate's: kept by key for the step's tables."""


class ShapesDiffer(Exception):
    """The profiles cannot be fitted together: the model did something else at another
    shape (other candidates called, or called otherwise)."""


@dataclasses.dataclass
class _Timing:
    """``seconds = overhead + rate * work`` of one candidate's recomputation."""

    overhead: float
    rate: float

    def seconds(self, work: float) -> float:
        return max(0.0, self.overhead + self.rate * max(0.0, work))


class CostFit:
    """Profiles of one model measured at several sizes of its inputs' shape variables,
    fitted over them; :meth:`profile_at` gives the profile at any sizes.

    Args:
        names: The shape variables (``batch`` first if there is one), as the sizes give them.
        samples: ``(sizes, profile)`` pairs, each profile with its step; one is enough
            (it then stands for its own sizes alone). The last one's operators are the
            template where candidates' operators line up across them.
        batched: Per variable, whether the inputs carry it beside the batch
            (``InputLayout.batched``): what decides which monomials a fit takes up first.
        form: The monomials to fit (a fit's :attr:`powers`: a form that predicted a step
            it was not fitted on is kept while it does); by default, as many as the
            samples tell apart (``_poly.basis``).

    Raises:
        ShapesDiffer: If the profiles do not line up: other candidates called, or called
            otherwise.
    """

    def __init__(
        self, names: Sequence[str], samples: Sequence[Tuple[Sizes, ModelProfile]], *, batched: Sequence[bool] = (),
        form: Optional["Form"] = None,
    ) -> None:
        if not samples:
            raise ShapesDiffer("no profile to fit")
        self.names = tuple(names)
        points = [tuple(int(size) for size in sizes) for sizes, _ in samples]
        profiles = [profile for _, profile in samples]
        self.points = points
        self.powers: Form = form if form is not None else basis(self.names, points, batched)
        _check_alike(profiles)
        lined_up = _ops_lined_up(profiles)
        self.template = _without_ops(profiles[-1], lined_up)
        flat = [_flatten(profile, lined_up) for profile in profiles]
        self.keys = sorted(set.intersection(*(set(row[0]) for row in flat)))
        values = [[float(row[0][key]) for row in flat] for key in self.keys]
        self._ints, residual = fit_columns(self.powers, points, values)
        self.residual = dict(zip(self.keys, residual))
        # What the allocator held beyond a phase's counted moments is a difference of two
        # peaks: smooth where it is a workspace that grows with the shape, a step where
        # the allocator's peak falls elsewhere at some shapes. Where no polynomial follows
        # it, its largest seen.
        self._steady = {
            key: int(max(column))
            for key, column, miss in zip(self.keys, values, residual)
            if key.endswith("/over") and miss > max(_OVER_SLACK, _OVER_SHARE * abs(max(column)))
        }
        # Every run of moments that lines up across the profiles, fitted as columns of one
        # polynomial (one pass evaluates them all), with its columns' slice per key.
        self._slices: Dict[str, Tuple[int, int]] = {}
        columns: List[List[float]] = []
        for key in sorted(flat[-1][1]):
            traces = [row[1].get(key, ()) for row in flat]
            if len({len(trace) for trace in traces}) != 1 or not traces[0]:
                continue  # fitted through its peak alone
            self._slices[key] = (len(columns), len(columns) + len(traces[0]))
            columns.extend([float(trace[k]) for trace in traces] for k in range(len(traces[0])))
        self._moments = fit_columns(self.powers, points, columns)[0] if columns else None
        self._timings = self._time(samples)
        self._left_out(batched, values)
        # Where each term sits among the fitted values, worked out once: a profile is
        # evaluated at most new shapes a loop meets, and has hundreds of terms.
        at = {key: position for position, key in enumerate(self.keys)}
        self._counted = [position for position, key in enumerate(self.keys) if _counts(key)]
        self._steady_at = [(at[key], value) for key, value in self._steady.items()]
        self._terms = [_Terms.of(cost, at) for cost in self.template.modules]
        self._others = [(key, position) for key, position in at.items() if key.partition("/")[0] in _OTHERS]

    # ------------------------------------------------------------------ evaluation

    def leeway(self, sizes: Sizes) -> Optional[Tuple[float, float]]:
        """How far the monomials this fit leaves out could move its prediction at
        ``sizes``: the most that any one of them, fitted beside the fit's own, raises and
        lowers a phase's peak there, as shares of the highest. None where the measured
        shapes do not determine the costs at ``sizes`` at all: a monomial they cannot
        tell from the fit's own (a batch measured at one size, a length varied at one
        batch only, two lengths that changed together) takes another value there than
        the fit's give it."""
        sizes = tuple(int(size) for size in sizes)
        if self._tied:
            design = monomials(self._tied, self.points)
            scale = design.abs().amax(dim=0).clamp_min(1.0)
            query = monomials(self._tied, [sizes]) / scale
            combination = torch.linalg.lstsq((design / scale).T, query.T, driver="gelsd").solution
            miss = ((design / scale).T @ combination - query.T).norm()
            if miss > _SPAN_TOLERANCE * max(1.0, float(query.norm())):
                return None
        if self._peaks is None:
            return 0.0, 0.0
        own = self._peaks.at(sizes)
        highest = max(1.0, *own)
        raised = lowered = 0.0
        for other in self._others_fitted:
            for theirs, ours in zip(other.at(sizes), own):
                raised, lowered = max(raised, theirs - ours), max(lowered, ours - theirs)
        return raised / highest, lowered / highest

    def profile_at(self, sizes: Sizes, scale: float = 1.0) -> ModelProfile:
        """The fitted profile at ``sizes``; with ``scale``, every byte and FLOP of it that
        many times as large (counts of calls as they are)."""
        sizes = tuple(int(size) for size in sizes)
        values = [round(v) for v in self._ints.at(sizes)]
        for position, value in self._steady_at:
            values[position] = value
        if scale != 1.0:
            unscaled, values = values, [round(value * scale) for value in values]
            for position in self._counted:
                values[position] = unscaled[position]
        peaks: Dict[str, float] = {}
        if self._moments is not None:
            moments = [value * scale for value in self._moments.at(sizes)]
            peaks = {key: max(moments[start:stop]) for key, (start, stop) in self._slices.items()}
        ints = {key: values[position] for key, position in self._others}
        modules = tuple(
            self._module(cost, terms, values, peaks, ints["base_bytes"])
            for cost, terms in zip(self.template.modules, self._terms)
        )
        return ModelProfile(
            modules=modules,
            total_activation_bytes=max(0, ints["total_activation_bytes"]),
            base_bytes=max(0, ints["base_bytes"]),
            step=self._step(ints, peaks),
        )

    # ------------------------------------------------------------------ building

    def _left_out(self, batched: Sequence[bool], values: Sequence[Sequence[float]]) -> None:
        """What :meth:`leeway` reads: the phases' peaks (and the activations in all)
        fitted as this fit's monomials give them, and fitted again with each monomial it
        leaves out beside them, one at a time, where the samples tell that one apart;
        and the fit's monomials with those they cannot tell apart from them."""
        checked = [
            column for key, column in zip(self.keys, values)
            if key == "total_activation_bytes" or (key.startswith("step/") and not key.endswith("/over"))
        ]
        own = rank_of(self.powers, self.points)
        tied: List[Tuple[int, ...]] = []
        self._others_fitted: List[Poly] = []
        self._peaks = least_squares(self.powers, self.points, checked) if checked else None
        for powers in powers_of(self.names, batched):
            if powers in self.powers:
                continue
            if rank_of([*self.powers, powers], self.points) == own:
                tied.append(powers)
            elif self._peaks is not None:
                self._others_fitted.append(least_squares([*self.powers, powers], self.points, checked))
        self._tied = (*self.powers, *tied) if tied else ()

    def _time(self, samples: Sequence[Tuple[Sizes, ModelProfile]]) -> Dict[str, _Timing]:
        """Per candidate, ``overhead + rate * work`` fitted to its measured times (a rate
        alone from one)."""
        timings: Dict[str, _Timing] = {}
        for cost in self.template.modules:
            seen = [
                (_work(profile[cost.name]), profile[cost.name].forward_time)
                for _, profile in samples
                if cost.name in profile and profile[cost.name].forward_time > 0
            ]
            if not seen:
                continue
            works = {work for work, _ in seen}
            if len(works) < 2:
                work, seconds = max(seen)
                timings[cost.name] = _Timing(0.0, seconds / work if work > 0 else 0.0)
                if work <= 0:
                    timings[cost.name] = _Timing(seconds, 0.0)
                continue
            design = torch.tensor([[1.0, work] for work, _ in seen], dtype=torch.float64)
            times = torch.tensor([[seconds] for _, seconds in seen], dtype=torch.float64)
            scale = design.abs().amax(dim=0).clamp_min(1e-30)
            overhead, rate = (torch.linalg.lstsq(design / scale, times).solution[:, 0] / scale).tolist()
            if rate < 0:
                overhead, rate = min(seconds for _, seconds in seen), 0.0
            elif overhead < 0:
                overhead, rate = 0.0, max(seconds / work for work, seconds in seen if work > 0)
            timings[cost.name] = _Timing(overhead, rate)
        return timings

    def _module(
        self, cost: ModuleCost, terms: "_Terms", values: List[int], peaks: Mapping[str, float], base: int
    ) -> ModuleCost:
        fields: Dict[str, Any] = {field: max(0, values[position]) for field, position in terms.ints}
        fields.update((field, values[position]) for field, position in terms.counts)
        forward = peaks.get(terms.forward)
        if forward is not None:
            fields["forward_peak_bytes"] = max(0, round(forward))
        if terms.base_before is not None:
            # A part of the base, as measured; a fit must not make it more.
            fields["base_before_bytes"] = min(max(0, values[terms.base_before]), max(0, base))
        fields["self_saved_input_bytes"] = min(fields["self_saved_input_bytes"], fields["input_bytes"])
        fields["call_kept_bytes"] = min(fields["call_kept_bytes"], fields["kept_bytes"])
        fields["handed_over_bytes"] = min(fields["handed_over_bytes"], fields["kept_bytes"])
        work = _work_of(fields)
        timing = self._timings.get(cost.name)
        seconds = cost.forward_time if timing is None else timing.seconds(work)
        # One construction per operator (a profile has hundreds: evaluated at every new shape).
        share = timing.overhead / len(cost.ops) if timing is not None and cost.ops else 0.0
        ops = []
        for op, (at_bytes, at_flops) in zip(cost.ops, terms.ops):
            nbytes = max(0, op.bytes if at_bytes is None else values[at_bytes])
            flops = max(0, op.flops if at_flops is None else values[at_flops])
            spent = op.time if timing is None else share + timing.rate * (flops + _BYTES_PER_FLOP * nbytes)
            ops.append(OpCost(op.op, op.occurrence, nbytes, op.saved, flops, spent, op.mutated, op.random))
        recompute = None
        if cost.recompute_time is not None and cost.forward_time > 0:
            recompute = seconds * cost.recompute_time / cost.forward_time
        return dataclasses.replace(
            cost, **fields, forward_time=seconds, recompute_time=recompute, ops=tuple(ops), forward_moments=(),
        )

    def _step(self, ints: Mapping[str, int], peaks: Mapping[str, float]) -> Optional[StepPeaks]:
        template = self.template.step
        if template is None:
            return None

        def peak(key: str) -> int:
            """A phase's peak: its highest fitted moment and what the allocator held beyond
            the moments; where its moments did not line up, its peak fitted as it is."""
            runs = [peaks.get(f"step/{key}/{len(run)}") for run in template.moments.get(key, ())]
            if not runs or any(run is None for run in runs):
                return max(0, ints[f"step/{key}"])
            return max(0, round(max(runs)) + max(0, ints[f"step/{key}/over"]))  # type: ignore[type-var]

        tables = {
            table: {name: peak(f"{table}:{name}") for name in getattr(template, table)}
            for table in ("forward", "recompute", "backward")
        }
        end = peak(END)
        total = max([end, *(v for table in tables.values() for v in table.values())])
        return StepPeaks(
            tables["forward"], end, tables["recompute"], tables["backward"], total,
            at_allocator=template.at_allocator,
        )


@dataclasses.dataclass(frozen=True)
class _Terms:
    """Where one candidate's terms sit among a fit's values: ``(field, position)`` of its
    byte and count fields, its base share's position, and per operator the positions of
    its bytes and FLOPs (None: not fitted, the template's)."""

    ints: Tuple[Tuple[str, int], ...]
    counts: Tuple[Tuple[str, int], ...]
    base_before: Optional[int]
    forward: str
    ops: Tuple[Tuple[Optional[int], Optional[int]], ...]

    @classmethod
    def of(cls, cost: ModuleCost, at: Mapping[str, int]) -> "_Terms":
        name = cost.name
        return cls(
            ints=tuple((field, at[f"{name}/{field}"]) for field in _INT_FIELDS),
            counts=tuple((field, at[f"{name}/{field}"]) for field in _COUNT_FIELDS),
            base_before=None if cost.base_before_bytes is None else at[f"{name}/base_before_bytes"],
            forward=f"{name}/forward",
            ops=tuple((at.get(f"{name}/op{k}/bytes"), at.get(f"{name}/op{k}/flops")) for k in range(len(cost.ops))),
        )


# ---------------------------------------------------------------------- flattening


def _counts(key: str) -> bool:
    """Whether the term ``key`` counts calls or positions (never scaled with bytes)."""
    return key.rpartition("/")[2] in _COUNT_FIELDS


def _work_of(values: Mapping[str, Any]) -> float:
    return float(values["flops"]) + _BYTES_PER_FLOP * float(values["created_bytes"])


def _work(cost: ModuleCost) -> float:
    return float(cost.flops) + _BYTES_PER_FLOP * float(cost.created_bytes)


def _shape_of(profile: ModelProfile) -> Tuple[Any, ...]:
    """What must be the same in every profile fitted together: the candidates, how they
    were called, and the step's phases."""
    modules = tuple(
        (cost.name, *(getattr(cost, field) for field in _SHAPE_FIELDS), cost.base_before_bytes is None)
        for cost in profile.modules
    )
    step = profile.step
    phases = None if step is None else (
        tuple(sorted(step.forward)), tuple(sorted(step.recompute)), tuple(sorted(step.backward)),
        step.at_allocator,
    )
    return modules, phases


def _check_alike(profiles: Sequence[ModelProfile]) -> None:
    first = _shape_of(profiles[0])
    for profile in profiles[1:]:
        if _shape_of(profile) != first:
            raise ShapesDiffer("the model called other candidates, or called them otherwise, at another shape")


def _ops_lined_up(profiles: Sequence[ModelProfile]) -> Set[str]:
    """The candidates whose operators are the same at every shape (a batch of one, or a
    loop over the length, runs others): only theirs are fitted and offer levels."""
    def listed(cost: ModuleCost) -> Tuple[Any, ...]:
        return tuple((op.op, op.occurrence, op.saved, op.mutated, op.random) for op in cost.ops)

    names = set()
    for cost in profiles[0].modules:
        first = listed(cost)
        if first and all(listed(profile[cost.name]) == first for profile in profiles[1:]):
            names.add(cost.name)
    return names


def _without_ops(profile: ModelProfile, kept: Set[str]) -> ModelProfile:
    modules = tuple(cost if cost.name in kept else dataclasses.replace(cost, ops=()) for cost in profile.modules)
    return dataclasses.replace(profile, modules=modules)


def _flatten(profile: ModelProfile, with_ops: Set[str]) -> Tuple[Dict[str, int], Dict[str, Tuple[int, ...]]]:
    """Every integer term of a profile (operators' of the candidates ``with_ops``), and
    every run of moments, by key."""
    ints: Dict[str, int] = {
        "total_activation_bytes": profile.total_activation_bytes,
        "base_bytes": profile.base_bytes,
    }
    moments: Dict[str, Tuple[int, ...]] = {}
    for cost in profile.modules:
        for field in (*_INT_FIELDS, *_COUNT_FIELDS):
            ints[f"{cost.name}/{field}"] = int(getattr(cost, field))
        if cost.base_before_bytes is not None:
            ints[f"{cost.name}/base_before_bytes"] = int(cost.base_before_bytes)
        for k, op in enumerate(cost.ops if cost.name in with_ops else ()):
            ints[f"{cost.name}/op{k}/bytes"] = int(op.bytes)
            ints[f"{cost.name}/op{k}/flops"] = int(op.flops)
        if cost.forward_moments:
            moments[f"{cost.name}/forward"] = tuple(cost.forward_moments)
    step = profile.step
    if step is not None:
        peaks = {END: step.end}
        for table in ("forward", "recompute", "backward"):
            peaks.update((f"{table}:{name}", value) for name, value in getattr(step, table).items())
        for key, value in peaks.items():
            ints[f"step/{key}"] = int(value)
            runs = step.moments.get(key, ())
            for run in runs:
                moments[f"step/{key}/{len(run)}"] = tuple(run)
            highest = max((max(run) for run in runs if run), default=None)
            ints[f"step/{key}/over"] = 0 if highest is None else int(value) - highest
    return ints, moments

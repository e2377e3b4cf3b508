"""Costs over input shapes: every term of profiles measured at a few small shapes, fitted
as a polynomial in the inputs' shape variables, so that the profile at any other shape is
a few dot products rather than a new measurement.

Bytes that storages hold are sums of tensor sizes, so each is a polynomial in the batch
``b`` and the lengths: the fit uses every monomial of degree at most 1 in ``b`` and at most
2 in the lengths together (``1, b, s, b*s, s^2, b*s^2`` for one length). A peak is not
such a sum but the largest of its moments, and which moment is largest changes with the
shape (the feed-forward's hidden states at short lengths, attention scores at long ones),
so each moment is fitted, and a peak is the largest fitted moment. What the allocator
held beyond the meter's moments (workspaces, where moments are counted at operators'
outputs) is fitted as one more term.

Time does not scale from small shapes (they are all overhead), so seconds are modelled as
``overhead + rate * work`` per candidate, ``work`` being its counted FLOPs plus its
created bytes (both polynomials), the overhead the least seen at the small shapes and the
rate set from the largest shape timed (the forward planned for, once it has run).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ._profile import ModelProfile, ModuleCost
from ._step import END, StepPeaks

__all__ = ["CostFit", "ShapesDiffer"]

Sizes = Tuple[int, ...]

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


class ShapesDiffer(Exception):
    """The profiles cannot be fitted together: the model did something else at another
    shape (other candidates called, another number of moments in a phase...)."""


@dataclasses.dataclass(frozen=True)
class _Poly:
    """Polynomials over the shape variables, one per column of ``coefficients``."""

    powers: Tuple[Tuple[int, ...], ...]
    coefficients: torch.Tensor  # (monomials, columns), float64

    def at(self, sizes: Sizes) -> List[float]:
        return (_monomials(self.powers, [sizes]) @ self.coefficients)[0].tolist()


def _powers(names: Sequence[str]) -> Tuple[Tuple[int, ...], ...]:
    """Exponents of the monomials: degree <= 1 in the batch, <= 2 in the lengths."""
    batch = bool(names) and names[0] == "batch"
    lengths = len(names) - batch
    length_powers = [p for p in itertools.product(range(3), repeat=lengths) if sum(p) <= 2]
    return tuple(
        ((b,) if batch else ()) + p for b in ((0, 1) if batch else (0,)) for p in length_powers
    )


def _monomials(powers: Sequence[Tuple[int, ...]], points: Sequence[Sizes]) -> torch.Tensor:
    rows = [[float(math.prod(size**p for size, p in zip(point, exponents))) for exponents in powers] for point in points]
    return torch.tensor(rows, dtype=torch.float64)


def _fit(powers: Tuple[Tuple[int, ...], ...], points: Sequence[Sizes], values: torch.Tensor) -> Tuple[_Poly, torch.Tensor]:
    """Least-squares polynomials through ``values`` (points x columns), and each column's
    largest residual."""
    design = _monomials(powers, points)
    scale = design.abs().amax(dim=0).clamp_min(1.0)  # columns of like size: a stable solve
    solution = torch.linalg.lstsq(design / scale, values).solution / scale.unsqueeze(1)
    residual = (design @ solution - values).abs().amax(dim=0)
    return _Poly(powers, solution), residual


@dataclasses.dataclass
class _Timing:
    """``seconds = overhead + rate * work`` of one candidate's forward."""

    overhead: float
    rate: float

    def seconds(self, work: float) -> float:
        return self.overhead + self.rate * max(0.0, work)


class CostFit:
    """Profiles of one model measured at several sizes of its inputs' shape variables,
    fitted over them; :meth:`profile_at` gives the profile at any sizes.

    Args:
        names: The shape variables (``batch`` first if there is one), as the sizes give them.
        samples: ``(sizes, profile)`` pairs, each profile measured with a step
            (``profile_modules(..., step=True)``), at least as many as the fit has
            monomials; the first one timed (``repeats`` > 0), for per-operator times.

    Raises:
        ShapesDiffer: If the profiles do not line up: other candidates called, calls,
            positions or operators, or phases with other moments.
    """

    def __init__(self, names: Sequence[str], samples: Sequence[Tuple[Sizes, ModelProfile]]) -> None:
        self.names = tuple(names)
        self.powers = _powers(self.names)
        if len(samples) < len(self.powers):
            raise ShapesDiffer(f"{len(samples)} profiles cannot fit {len(self.powers)} terms")
        points = [tuple(int(size) for size in sizes) for sizes, _ in samples]
        profiles = [profile for _, profile in samples]
        self.template = profiles[0]
        self.points = points
        _check_alike(profiles)
        flat = [_flatten(profile) for profile in profiles]
        self.keys = sorted(flat[0][0])
        values = torch.tensor([[row[0][key] for key in self.keys] for row in flat], dtype=torch.float64)
        self._ints, residual = _fit(self.powers, points, values)
        self.residual = dict(zip(self.keys, residual.tolist()))
        # What the allocator held beyond a phase's counted moments is a difference of two
        # peaks: smooth where it is a workspace that grows with the shape, a step where
        # the allocator's peak falls elsewhere at some shapes (a generator state a region
        # keeps, freed just before). Where no polynomial follows it, its largest seen.
        highest = values.amax(dim=0)
        self._steady = {
            key: int(high)
            for key, high, miss in zip(self.keys, highest.tolist(), residual.tolist())
            if key.endswith("/over") and miss > max(_OVER_SLACK, _OVER_SHARE * abs(high))
        }
        # Every run of moments that lines up across the profiles, fitted as columns of one
        # polynomial (one product evaluates them all), with its columns' slice per key.
        self._slices: Dict[str, Tuple[int, int]] = {}
        columns: List[torch.Tensor] = []
        width = 0
        for key in sorted(flat[0][1]):
            traces = [row[1].get(key, ()) for row in flat]
            if len({len(trace) for trace in traces}) != 1:
                continue  # fitted through its peak alone
            columns.append(torch.tensor(traces, dtype=torch.float64))
            self._slices[key] = (width, width + len(traces[0]))
            width += len(traces[0])
        self._moments = _fit(self.powers, points, torch.cat(columns, dim=1))[0] if columns else None
        self._timings = self._time(samples)
        # Per-operator times and the selective mode's overhead, from the timed profile.
        self._timed = profiles[0]

    # ------------------------------------------------------------------ evaluation

    def profile_at(self, sizes: Sizes, step: Optional[StepPeaks] = None) -> ModelProfile:
        """The fitted profile at ``sizes``; with ``step``, that measured step instead of
        the fitted one."""
        sizes = tuple(int(size) for size in sizes)
        ints = dict(zip(self.keys, (round(v) for v in self._ints.at(sizes))))
        ints.update(self._steady)
        peaks: Dict[str, float] = {}
        if self._moments is not None:
            moments = self._moments.at(sizes)
            peaks = {key: max(moments[start:stop]) for key, (start, stop) in self._slices.items()}
        modules = tuple(self._module(cost, ints, peaks, sizes) for cost in self.template.modules)
        if step is None:
            step = self._step(ints, peaks)
        return ModelProfile(
            modules=modules,
            total_activation_bytes=max(0, ints["total_activation_bytes"]),
            base_bytes=max(0, ints["base_bytes"]),
            step=step,
        )

    def step_error(self, sizes: Sizes, measured: StepPeaks) -> float:
        """The largest difference between a measured step's phase peaks and the fitted
        ones at ``sizes``, as a share of the measured step's peak."""
        fitted = self.profile_at(sizes).step
        assert fitted is not None
        pairs = [(fitted.end, measured.end)]
        for table in ("forward", "recompute", "backward"):
            ours, theirs = getattr(fitted, table), getattr(measured, table)
            pairs += [(ours.get(name, 0), value) for name, value in theirs.items()]
        return max(abs(a - b) for a, b in pairs) / max(measured.total, 1)

    def calibrate(self, sizes: Sizes, measured: StepPeaks) -> None:
        """Set each candidate's time rate from a step measured at ``sizes`` (the shape
        planned for): its recomputation's seconds there against its work there."""
        profile = self.profile_at(sizes)
        for cost in profile.modules:
            seconds = measured.seconds.get(f"recompute:{cost.name}")
            timing = self._timings.get(cost.name)
            if seconds is None or timing is None:
                continue
            work = _work(cost)
            if work > 0:
                timing.rate = max(0.0, (seconds - timing.overhead) / work)

    # ------------------------------------------------------------------ building

    def _time(self, samples: Sequence[Tuple[Sizes, ModelProfile]]) -> Dict[str, _Timing]:
        """Per candidate, the overhead (its least recomputation time) and a first rate
        (from the sample of the most work)."""
        timings: Dict[str, _Timing] = {}
        for cost in self.template.modules:
            seen = []
            for _, profile in samples:
                step = profile.step
                seconds = None if step is None else step.seconds.get(f"recompute:{cost.name}")
                if seconds is not None:
                    seen.append((_work(profile[cost.name]), seconds))
            if not seen:
                continue
            overhead = min(seconds for _, seconds in seen)
            work, seconds = max(seen)
            rate = max(0.0, (seconds - overhead) / work) if work > 0 else 0.0
            timings[cost.name] = _Timing(overhead, rate)
        if timings:
            # A candidate never recomputed in the step (one nested in another) is timed as
            # the others are, by its own work.
            typical = _Timing(
                statistics.median(t.overhead for t in timings.values()),
                statistics.median(t.rate for t in timings.values()),
            )
            for cost in self.template.modules:
                timings.setdefault(cost.name, dataclasses.replace(typical))
        return timings

    def _module(self, cost: ModuleCost, ints: Mapping[str, int], peaks: Mapping[str, float], sizes: Sizes) -> ModuleCost:
        name = cost.name
        values: Dict[str, Any] = {field: max(0, ints[f"{name}/{field}"]) for field in _INT_FIELDS}
        values.update((field, ints[f"{name}/{field}"]) for field in _COUNT_FIELDS)
        if f"{name}/forward" in peaks:
            values["forward_peak_bytes"] = max(0, round(peaks[f"{name}/forward"]))
        if cost.base_before_bytes is not None:
            # A part of the base, as measured; a fit must not make it more.
            values["base_before_bytes"] = min(max(0, ints[f"{name}/base_before_bytes"]), max(0, ints["base_bytes"]))
        values["self_saved_input_bytes"] = min(values["self_saved_input_bytes"], values["input_bytes"])
        values["call_kept_bytes"] = min(values["call_kept_bytes"], values["kept_bytes"])
        values["handed_over_bytes"] = min(values["handed_over_bytes"], values["kept_bytes"])
        work = _work_of(values)
        timing = self._timings.get(name)
        seconds = cost.forward_time if timing is None else timing.seconds(work)
        ops = tuple(
            dataclasses.replace(
                op,
                bytes=max(0, ints[f"{name}/op{k}/bytes"]),
                flops=max(0, ints[f"{name}/op{k}/flops"]),
            )
            for k, op in enumerate(cost.ops)
        )
        if timing is not None and ops:
            share = timing.overhead / len(ops)
            ops = tuple(
                dataclasses.replace(op, time=share + timing.rate * (op.flops + _BYTES_PER_FLOP * op.bytes))
                for op in ops
            )
        recompute = None
        if cost.recompute_time is not None and cost.forward_time > 0:
            recompute = seconds * cost.recompute_time / cost.forward_time
        return dataclasses.replace(
            cost, **values, forward_time=seconds, recompute_time=recompute, ops=ops, forward_moments=(),
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


# ---------------------------------------------------------------------- flattening


def _work_of(values: Mapping[str, Any]) -> float:
    return float(values["flops"]) + _BYTES_PER_FLOP * float(values["created_bytes"])


def _work(cost: ModuleCost) -> float:
    return float(cost.flops) + _BYTES_PER_FLOP * float(cost.created_bytes)


def _shape_of(profile: ModelProfile) -> Tuple[Any, ...]:
    """What must be the same in every profile fitted together."""
    modules = tuple(
        (cost.name, *(getattr(cost, field) for field in _SHAPE_FIELDS), cost.base_before_bytes is None,
         tuple((op.op, op.occurrence, op.saved, op.mutated) for op in cost.ops))
        for cost in profile.modules
    )
    step = profile.step
    phases = None if step is None else (
        tuple(sorted(step.forward)), tuple(sorted(step.recompute)), tuple(sorted(step.backward)),
        tuple(sorted(step.moments)), step.at_allocator,
    )
    return modules, phases


def _check_alike(profiles: Sequence[ModelProfile]) -> None:
    first = _shape_of(profiles[0])
    for profile in profiles[1:]:
        if _shape_of(profile) != first:
            raise ShapesDiffer("the model called other candidates, or called them otherwise, at another shape")


def _flatten(profile: ModelProfile) -> Tuple[Dict[str, int], Dict[str, Tuple[int, ...]]]:
    """Every integer term of a profile, and every run of moments, by key."""
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
        for k, op in enumerate(cost.ops):
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

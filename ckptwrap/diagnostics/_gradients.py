"""Comparing the gradients of the checkpointed step with the plain step's, parameter by
parameter, and reporting differences per region (or per module outside the regions)."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch

from ._checks import display, few
from ._regions import Region
from ._report import Finding
from ._steps import CallLog, StepResult

__all__ = ["GradientComparison", "compare_gradients"]


@dataclasses.dataclass
class GradientComparison:
    """Findings of the comparison, and what it covered."""

    findings: List[Finding]
    compared: int
    """Parameters compared."""
    max_difference: float
    """Largest absolute difference over all parameters (inf for a missing gradient)."""
    missing: Dict[str, int]
    """Per region, how many of its parameters got no gradient with checkpointing only."""


@dataclasses.dataclass
class _Group:
    """The parameters of one region, or of one module outside every region."""

    region: Optional[Region]
    total: int = 0
    missing: List[str] = dataclasses.field(default_factory=list)
    differing: List[Tuple[str, float]] = dataclasses.field(default_factory=list)
    on_cpu: bool = False


def _difference(first: torch.Tensor, second: torch.Tensor) -> float:
    if first.shape != second.shape:
        return math.inf
    if first.numel() == 0:
        return 0.0
    return (first.detach().double() - second.detach().double()).abs().max().item()


def compare_gradients(
    regions: List[Region],
    logs: Dict[str, CallLog],
    checkpointed: StepResult,
    plain: StepResult,
    prefix: str,
) -> GradientComparison:
    """Compare every parameter and example-input gradient of the two steps, bit for bit."""
    by_name = {region.name: region for region in regions}
    # Innermost first, so a parameter belongs to the deepest region around it.
    order = sorted(by_name, key=len, reverse=True)
    groups: Dict[Optional[str], _Group] = {}
    largest = 0.0
    pairs = [(name, grad, plain.grads.get(name)) for name, grad in checkpointed.grads.items()]
    pairs += [(label, grad, plain.input_grads.get(label)) for label, grad in checkpointed.input_grads.items()]
    for name, mine, reference in pairs:
        key = None if name in checkpointed.input_grads else _region_of(name, order)
        group = groups.setdefault(key, _Group(None if key is None else by_name[key]))
        group.total += 1
        if mine is None and reference is None:
            continue
        if mine is None:
            group.missing.append(name)
            largest = math.inf
            continue
        group.on_cpu = group.on_cpu or mine.device.type == "cpu"
        if reference is not None and torch.equal(mine, reference):
            continue
        difference = math.inf if reference is None else _difference(mine, reference)
        group.differing.append((name, difference))
        largest = max(largest, difference)
    findings: List[Finding] = []
    missing: Dict[str, int] = {}
    # Regions first: gradients outside them usually differ because of a region.
    for key, group in sorted(groups.items(), key=lambda item: item[0] is None):
        findings += _findings(key, group, logs, prefix, checkpointed, plain)
        if key is not None and group.missing:
            missing[key] = len(group.missing)
    return GradientComparison(findings, len(checkpointed.grads), largest, missing)


def _region_of(parameter: str, regions_innermost_first: List[str]) -> Optional[str]:
    """The innermost region holding the parameter; None outside every region."""
    for region in regions_innermost_first:
        if region == "" or parameter.startswith(region + "."):
            return region
    return None


def _findings(
    key: Optional[str],
    group: _Group,
    logs: Dict[str, CallLog],
    prefix: str,
    checkpointed: StepResult,
    plain: StepResult,
) -> List[Finding]:
    region = group.region
    name = display(prefix, key or "")
    where = "outside the checkpointed regions" if key is None else f"in {name or 'the model'}"
    label = "outside the regions" if key is None else name or "<model>"
    findings = []
    if group.missing:
        findings.append(Finding(
            "error", "missing-gradient", name,
            f"parameters {where} get no gradient with checkpointing but do without it."
            + _trap(key, region, logs),
            _missing_fix(name, region),
            details=(
                f"{label}: {len(group.missing)} of {group.total} parameter(s) "
                f"({few(group.missing, 3)})",
            ),
        ))
    if group.differing:
        worst, difference = max(group.differing, key=lambda item: item[1])
        findings.append(Finding(
            _severity(group, checkpointed, plain), "gradient-mismatch", name,
            f"gradients {where} differ from the plain step's.",
            _mismatch_fix(name or "the model", region),
            details=(
                f"{label}: {len(group.differing)} of {group.total} gradient(s) differ, the "
                f"largest by {difference:.3g} (in {worst})",
            ),
        ))
    return findings


def _trap(key: Optional[str], region: Optional[Region], logs: Dict[str, CallLog]) -> str:
    if key is None or region is None or not region.reentrant:
        return ""
    if not logs[key].calls_without_grad_input:
        return ""
    return (
        " This is the frozen-embedding / LoRA trap of the re-entrant variant: no input of "
        "the region required grad."
    )


def _missing_fix(name: str, region: Optional[Region]) -> str:
    if region is None:
        return (
            "find the checkpointed region these gradients flow through and checkpoint it with "
            "use_reentrant=False: the re-entrant engine follows only tensors it can reach in "
            "the arguments (containers, dataclasses, registered pytrees)."
        )
    return (
        f"checkpoint {name or 'the model'} with use_reentrant=False, or make an input of it "
        f"require grad."
    )


def _severity(group: _Group, checkpointed: StepResult, plain: StepResult) -> str:
    """An error, except for tiny differences on accelerators, whose kernels may add in a
    different order from run to run with or without checkpointing."""
    if group.on_cpu or group.missing:
        return "error"
    mine = {**checkpointed.grads, **checkpointed.input_grads}
    theirs = {**plain.grads, **plain.input_grads}
    for name, _ in group.differing:
        first, second = mine.get(name), theirs.get(name)
        if first is None or second is None or first.shape != second.shape:
            return "error"
        if not torch.allclose(first, second, rtol=1e-5, atol=1e-7):
            return "error"
    return "warning"


def _mismatch_fix(where: str, region: Optional[Region]) -> str:
    if region is None:
        return (
            "these gradients flow back through checkpointed regions: fix the findings of "
            "those regions first (a region that recomputes differently changes the gradients "
            "of everything before it)."
        )
    if region.drops_rng_state:
        return f"checkpoint {where} with preserve_rng_state=True (the default)."
    return (
        f"make {where} recompute exactly what its forward computed: no state that changes "
        f"between forward and backward (counters, caches, in-place updates of its inputs), "
        f"no random numbers without preserve_rng_state=True; or leave it un-checkpointed."
    )

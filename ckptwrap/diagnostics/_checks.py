"""The checks that look at the regions themselves: how they are marked, what the
checkpointed step saw in their calls and what profiling says they save. Each returns
findings; the gradient comparison lives in ``_gradients``, the DDP check in ``_ddp``."""

from __future__ import annotations

from typing import Dict, List, Optional

from torch.nn.modules.dropout import _DropoutNd

from ..planner import ModelProfile
from ._regions import Region
from ._report import Finding
from ._steps import CallLog

__all__ = [
    "SAVINGS_THRESHOLD",
    "check_dropout_rng",
    "check_not_called",
    "check_reentrant_calls",
    "check_savings",
    "check_selected_twice",
    "display",
]

SAVINGS_THRESHOLD = 0.10
"""A region whose checkpoint drops less than this fraction of the activations its
forward keeps "saves almost nothing"."""

_HOW_TO_REMOVE = {
    "wrap_model": "leave it out of the wrap_model policy (unwrap_model(model), then wrap again)",
    "CheckpointWrapper": "use the bare module instead of CheckpointWrapper(module)",
    "@checkpointed": "remove @checkpointed from {kind}.forward",
}


def display(prefix: str, name: str) -> str:
    """The name of a module as the caller's model names it (``prefix`` is ``"module."``
    when the caller passed a DistributedDataParallel wrapper)."""
    return prefix + name if name else prefix.rstrip(".")


def _size(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(count) >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def check_selected_twice(regions: List[Region], prefix: str) -> List[Finding]:
    """Modules checkpointed by two markings, and regions nested inside other regions."""
    findings = []
    for region in regions:
        name = display(prefix, region.name)
        if len(region.markings) > 1:
            ways = [how for how, _ in region.markings]
            removals = "; or ".join(
                _HOW_TO_REMOVE[how].format(kind=region.kind) for how in dict.fromkeys(ways)
            )
            findings.append(Finding(
                "warning", "selected-twice", name,
                f"{name} ({region.kind}) is checkpointed twice, by {' and by '.join(ways)}: "
                f"the inner checkpoint runs inside the outer one, so its forward runs three "
                f"times per step instead of two and no more memory is saved.",
                f"keep one of the markings: {removals}.",
            ))
        if region.parent is not None:
            outer = display(prefix, region.parent)
            findings.append(Finding(
                "warning", "selected-twice", name,
                f"{name} is checkpointed inside checkpointed {outer}: it runs in the forward, "
                f"again when {outer} is recomputed, and a third time for its own "
                f"recomputation.",
                f"checkpoint only {outer} or only the modules inside it (wrap_model leaves "
                f"nested modules out unless nested=True); keep both only to bound the memory "
                f"of {outer}'s recomputation, at the cost of that third forward.",
            ))
    return findings


def check_not_called(regions: List[Region], logs: Dict[str, CallLog], prefix: str) -> List[Finding]:
    """Regions the step never called: their marking has no effect."""
    findings = []
    for region in regions:
        if logs[region.name].calls:
            continue
        name = display(prefix, region.name)
        findings.append(Finding(
            "warning", "not-called", name,
            f"{name} ({region.kind}) is checkpointed but the model never called it in the "
            f"step: its parent uses its submodules or parameters directly, so nothing there "
            f"is checkpointed.",
            "checkpoint a module that the forward calls (the parent, or the submodules it "
            "calls), or make sure the example inputs take the path you train on.",
        ))
    return findings


def check_savings(regions: List[Region], profile: ModelProfile, prefix: str) -> List[Finding]:
    """Regions whose checkpoint keeps inputs about as big as the activations it drops."""
    findings = []
    for region in regions:
        if region.name not in profile:
            continue
        cost = profile[region.name]
        if not cost.called:
            continue
        kept, inputs = cost.kept_bytes, cost.input_bytes
        saved = kept - inputs
        if kept > 0 and saved >= SAVINGS_THRESHOLD * kept:
            continue
        name = display(prefix, region.name)
        parent = display(prefix, region.name.rpartition(".")[0]) or "<model>"
        findings.append(Finding(
            "warning", "no-savings", name,
            f"checkpointing {name} ({region.kind}) saves almost nothing: its forward keeps "
            f"{_size(kept)} of activations and its checkpoint keeps its inputs, "
            f"{_size(inputs)}, so each step recomputes it to save {_size(max(saved, 0))}.",
            f"leave {name} un-checkpointed, or checkpoint a larger module that contains it "
            f"(such as {parent}), which drops more activations per input kept.",
        ))
    return findings


def _active_dropouts(region: Region) -> List[str]:
    """Dropout modules in the region that draw masks in training."""
    return [
        name
        for name, sub in region.module.named_modules(prefix=region.name)
        if isinstance(sub, _DropoutNd) and sub.p > 0 and sub.training
    ]


def check_dropout_rng(
    regions: List[Region], logs: Optional[Dict[str, CallLog]], prefix: str
) -> List[Finding]:
    """Regions recomputed without their RNG state that draw random numbers."""
    findings = []
    for region in regions:
        if not region.drops_rng_state:
            continue
        dropouts = [display(prefix, name) for name in _active_dropouts(region)]
        draws = logs is not None and logs[region.name].draws_random
        if not dropouts and not draws:
            continue
        name = display(prefix, region.name)
        if dropouts:
            shown = ", ".join(dropouts[:4]) + (f" and {len(dropouts) - 4} more" if len(dropouts) > 4 else "")
            what = f"has dropout ({shown})"
        else:
            what = "draws random numbers in its forward (functional dropout, torch.rand...)"
        findings.append(Finding(
            "error", "dropout-rng", name,
            f"{name} {what} and is checkpointed with preserve_rng_state=False: the "
            f"recomputation draws other random numbers than the forward did, so the "
            f"gradients differ from those of the un-checkpointed model.",
            f"checkpoint {name} with preserve_rng_state=True (the default).",
        ))
    return findings


def check_reentrant_calls(
    regions: List[Region],
    logs: Dict[str, CallLog],
    missing: Dict[str, int],
    prefix: str,
) -> List[Finding]:
    """What the re-entrant variant of torch would get wrong in these calls, which
    ckptwrap's handles: no input requiring grad, and tensors passed by keyword.

    Args:
        regions: The regions.
        logs: Their calls in the checkpointed step.
        missing: Per region, how many of its parameters got no gradient although the plain
            step gives them one; such regions get an error from the gradient check instead.
        prefix: See :func:`display`.
    """
    findings = []
    for region in regions:
        log = logs[region.name]
        if not region.reentrant or not log.grad_calls:
            continue
        name = display(prefix, region.name)
        trainable = sum(1 for p in region.module.parameters() if p.requires_grad)
        if log.calls_without_grad_input and trainable and not missing.get(region.name):
            findings.append(Finding(
                "info", "reentrant-no-grad-input", name,
                f"{name} uses the re-entrant engine, and in {log.calls_without_grad_input} of "
                f"{log.grad_calls} call(s) none of its tensor inputs required grad (raw data, or "
                f"a frozen embedding or LoRA base model before it). torch.utils.checkpoint with "
                f"use_reentrant=True would silently drop the gradients of its {trainable} "
                f"trainable parameter(s) there, with only a warning; ckptwrap's engine keeps "
                f"them, and they match the plain step.",
                "nothing to change with ckptwrap; on torch's checkpoint use "
                "use_reentrant=False, or make the region's input require grad.",
            ))
        if log.keyword_tensors:
            keys = ", ".join(sorted(log.keyword_tensors))
            findings.append(Finding(
                "info", "reentrant-keyword-tensors", name,
                f"{name} uses the re-entrant engine and gets tensors by keyword ({keys}). "
                f"torch.utils.checkpoint with use_reentrant=True refuses keyword arguments "
                f"('Unexpected keyword arguments'); ckptwrap's marking layer hands them to "
                f"the engine positionally, so they take part in autograd like the others.",
                "nothing to change for a marked module; a direct call ckptwrap.checkpoint(fn, "
                "..., use_reentrant=True, key=tensor) raises, so pass them positionally there "
                "or use use_reentrant=False.",
            ))
    return findings

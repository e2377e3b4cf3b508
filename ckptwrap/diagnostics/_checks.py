"""The checks that look at the regions themselves: how they are marked, what the
checkpointed step saw in their calls, what profiling says they save and how DDP runs
them. Each returns findings; the gradient comparison lives in ``_gradients``."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set

import torch
from torch import nn

from .. import _torch_private
from ..policy import code_units
from .._hf import checkpointing_flagged, checkpointing_on, describe_flags, flags_on, how_to_keep_off, library_of, owners
from ..measure import ModelProfile
from ..planner import format_bytes
from ._regions import Region
from ._report import Finding
from ._steps import CallLog

__all__ = [
    "SAVINGS_THRESHOLD",
    "check_ddp",
    "check_dropout_rng",
    "check_not_called",
    "check_reentrant_calls",
    "check_savings",
    "check_selected_twice",
    "buffers_of",
    "check_buffers_changed",
    "check_code_checkpointing",
    "check_transformers_checkpointing",
    "display",
    "few",
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
                f"{name} is checkpointed twice, by {' and by '.join(ways)}: the inner "
                f"checkpoint runs inside the outer one, so its forward runs three times per "
                f"step instead of two and no more memory is saved.",
                f"keep one of the markings: {removals}.",
                details=(f"{name} ({region.kind})",),
            ))
        if region.parent is not None:
            outer = display(prefix, region.parent)
            findings.append(Finding(
                "warning", "selected-twice", name,
                f"{name} is checkpointed inside another checkpointed region: it runs in the "
                f"forward, again when that region is recomputed, and a third time for its own "
                f"recomputation.",
                "checkpoint only the enclosing region or only the modules inside it "
                "(wrap_model leaves nested modules out unless nested=True); keep both only to "
                "bound the memory of the enclosing region's recomputation, at the cost of that "
                "third forward.",
                details=(f"{name} is inside checkpointed {outer or '<model>'}",),
            ))
    return findings


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def buffers_of(model: nn.Module) -> Dict[str, torch.Tensor]:
    """A copy of every buffer of ``model`` but normalisation statistics, by qualified name."""
    return {
        name: buffer.detach().clone() for name, buffer in model.named_buffers()
        if name.rsplit(".", 1)[-1] not in _STATISTICS
    }


def check_buffers_changed(
    model: nn.Module, before: Dict[str, torch.Tensor], regions: List[Region], prefix: str
) -> List[Finding]:
    """Regions whose forward changed buffers of theirs in place in the plain step
    (spectral normalisation's ``u`` and ``v``, a counter): said, with what ckptwrap does."""
    changed = [name for name, buffer in model.named_buffers()
               if name in before and not torch.equal(buffer, before[name])]
    findings = []
    for region in regions:
        mine = [name for name in changed if region.name == "" or name.startswith(region.name + ".")]
        if not mine:
            continue
        name = display(prefix, region.name)
        findings.append(Finding(
            "info", "buffers-changed", name,
            f"{name}'s forward changes buffers in place ({few([display(prefix, b) for b in mine])}): "
            f"ckptwrap copies them before the forward and replays them in each recomputation, so "
            f"the recomputation computes what the forward did and each buffer changes once per "
            f"step, as without checkpointing.",
            "nothing to change; a changed buffer over 64 KiB is not copied, and its recomputation "
            "is refused, naming it.",
            details=tuple(f"{display(prefix, b)}" for b in mine[:8]),
        ))
    return findings


def check_code_checkpointing(model: nn.Module, regions: List[Region], prefix: str) -> List[Finding]:
    """Regions that the model's own code also checkpoints (a forward handing a module to
    ``torch.utils.checkpoint``): the same module, one inside the region or around it."""
    by_code = code_units(list(model.named_modules()))
    findings = []
    for region in regions:
        overlaps = _overlapping(by_code, region.name)
        if not overlaps:
            continue
        name = display(prefix, region.name)
        owners_of = sorted({display(prefix, by_code[unit]) or "the model" for unit in overlaps})
        findings.append(Finding(
            "warning", "selected-twice", name,
            f"{name} is checkpointed by ckptwrap and by the model's own code (a checkpoint call "
            f"in the forward of {', '.join(owners_of)} checkpoints {few([display(prefix, u) for u in overlaps])}): "
            f"the module's forward runs three times per step instead of two and no more memory is saved.",
            "remove those checkpoint calls and let ckptwrap checkpoint (wrap_model leaves modules "
            "the model's code checkpoints out of its plans), or leave these modules out of ckptwrap's marking.",
            details=tuple(f"{display(prefix, u)} checkpointed in {display(prefix, by_code[u]) or 'the model'}.forward"
                          for u in overlaps[:8]),
        ))
    return findings


def check_transformers_checkpointing(
    model: nn.Module, regions: List[Region], prefix: str
) -> List[Finding]:
    """Regions that transformers' own gradient checkpointing also checkpoints: layers whose
    ``gradient_checkpointing`` flag is on, inside a region or around one."""
    modules = dict(checkpointing_flagged(model))
    flagged = [name for name, module in modules.items() if checkpointing_on(module)]
    findings = []
    for region in regions:
        overlaps = _overlapping(flagged, region.name)
        if not overlaps:
            continue
        name = display(prefix, region.name)
        ways = [how for how, _ in region.markings]
        later = (
            "wrap_model switches it off at the next training forward, with a warning; "
            if "wrap_model" in ways else
            f"{ways[0]} does not switch it off; "
        )
        libraries = sorted({library_of(modules[n]) for n in overlaps})
        flags = sorted({flag for n in overlaps for flag in flags_on(modules[n])})
        owner = owners(libraries)
        findings.append(Finding(
            "warning", "selected-twice", name,
            f"{name} is checkpointed by ckptwrap and by {owner} own gradient checkpointing "
            f"({describe_flags(flags)}): the module's forward runs three times per "
            f"step instead of two and no more memory is saved.",
            f"{later}switch {owner} checkpointing off: {how_to_keep_off(libraries)}.",
            details=(f"{name} ({region.kind}) with {owner} flag on {few([display(prefix, n) for n in overlaps])}",),
        ))
    return findings


def check_not_called(
    regions: List[Region],
    logs: Dict[str, CallLog],
    called: Set[str],
    prefix: str,
    grads: Optional[Dict[str, Optional[torch.Tensor]]] = None,
) -> List[Finding]:
    """Regions the step never called, said as what the step showed: their parent used
    their submodules or parameters directly (their marking has no effect), or nothing of
    theirs ran at all (the forward did not reach them on these inputs: a data-dependent
    exit or branch), so the step could not check them.

    Args:
        regions: The regions.
        logs: Their calls in the checkpointed step.
        called: Every module the plain step called (see ``recording_calls``).
        prefix: See :func:`display`.
        grads: The plain step's parameter gradients, by qualified name: a parameter of the
            region that got one was used although the region was not called.
    """
    findings = []
    for region in regions:
        if logs[region.name].calls:
            continue
        name = display(prefix, region.name)
        parts = [display(prefix, part) for part in _called_parts(region, called)]
        used = _parameters_used(region, grads or {})
        if not parts and not used:
            findings.append(Finding(
                "info", "not-called", name,
                f"{name} is checkpointed but was not called in the step doctor ran, nor was anything "
                f"inside it: the forward did not reach it on these inputs (a data-dependent exit or "
                f"branch, say), so doctor could not check it.",
                "nothing to change if training inputs reach it; to check it, give example inputs "
                "that take it. If no input ever does, its marking has no effect.",
                details=(f"{name} ({region.kind}): not called, nor its submodules, and its parameters got no gradient",),
            ))
            continue
        calls = f"; the forward calls {few(parts)} inside it" if parts else ""
        uses = f"; its parameters {few(used)} get gradients" if used and not parts else ""
        findings.append(Finding(
            "warning", "not-called", name,
            f"{name} is checkpointed but the model never called it in the step: its parent "
            f"uses its submodules or parameters directly, so nothing there is checkpointed.",
            "checkpoint a module that the forward calls (the parent, or the submodules it "
            "calls), or make sure the example inputs take the path you train on.",
            details=(f"{name} ({region.kind}){calls}{uses}",),
        ))
    return findings


def _parameters_used(region: Region, grads: Dict[str, Optional[torch.Tensor]]) -> List[str]:
    """The region's parameters that got a gradient in the plain step, by qualified name."""
    prefix = region.name + "." if region.name else ""
    return [
        prefix + name for name, _ in region.runs.named_parameters()
        if grads.get(prefix + name) is not None
    ]


def _called_parts(region: Region, called: Set[str]) -> List[str]:
    """The outermost modules inside ``region`` that the step called, in model order."""
    parts: List[str] = []
    for name, _ in region.module.named_modules(prefix=region.name):
        if name != region.name and name in called and not _inside_any(name, parts):
            parts.append(name)
    return parts


def _overlapping(names: Iterable[str], region: str) -> List[str]:
    """Those of ``names`` that are the region's module, inside it or around it."""
    return [name for name in names if name == region or _inside_any(name, [region]) or _inside_any(region, [name])]


def _inside_any(name: str, outer: List[str]) -> bool:
    return any(name.startswith(other + ".") for other in outer)


def few(names: List[str], shown: int = 4) -> str:
    """The first ``shown`` of ``names``, and how many more there are."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def check_savings(
    regions: List[Region], profile: ModelProfile, called: Set[str], prefix: str
) -> List[Finding]:
    """Regions whose checkpoint keeps inputs about as big as the activations it drops.

    Args:
        regions: The regions.
        profile: What each region keeps, measured un-checkpointed.
        called: Every module the plain step called: a larger module to checkpoint instead
            is named only among these (a ``ModuleList`` holding the region is never called).
        prefix: See :func:`display`.
    """
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
        larger = display(prefix, _called_ancestor(region.name, called)) or "<model>"
        findings.append(Finding(
            "warning", "no-savings", name,
            f"checkpointing {name} saves almost nothing: its checkpoint keeps its inputs, "
            f"which are about as big as the activations its forward keeps or bigger, so each "
            f"step recomputes it for little or no memory.",
            f"leave {name} un-checkpointed, or checkpoint the larger module listed with it "
            f"(one that contains it and that the forward calls), which drops more activations "
            f"per input kept.",
            details=(
                f"{name} ({region.kind}) keeps {format_bytes(kept)} of activations and {format_bytes(inputs)} "
                f"of inputs, saving {format_bytes(max(saved, 0))}; larger module: {larger}",
            ),
        ))
    return findings


def _called_ancestor(name: str, called: Set[str]) -> str:
    """The nearest module around ``name`` that the step called (``""``: the model)."""
    while name:
        name = name.rpartition(".")[0]
        if name in called:
            return name
    return ""


def _active_dropouts(region: Region) -> List[str]:
    """Dropout modules in the region that draw masks in training."""
    return [
        name
        for name, sub in region.module.named_modules(prefix=region.name)
        if isinstance(sub, _torch_private.dropout_classes) and sub.p > 0 and sub.training
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
            detail = f"{name} has dropout ({few(dropouts)})"
        else:
            detail = (
                f"{name} draws them outside dropout modules (functional dropout, torch.rand...)"
            )
        findings.append(Finding(
            "error", "dropout-rng", name,
            f"{name} draws random numbers in its forward and is checkpointed with "
            f"preserve_rng_state=False: the recomputation draws other random numbers than "
            f"the forward did, so the gradients differ from those of the un-checkpointed model.",
            f"checkpoint {name} with preserve_rng_state=True (the default).",
            details=(detail,),
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
                f"{name} uses the re-entrant engine, and in some of its calls none of its "
                f"tensor inputs required grad (raw data, or a frozen embedding or LoRA base "
                f"model before it). torch.utils.checkpoint with use_reentrant=True would "
                f"silently drop the gradients of its trainable parameters there, with only a "
                f"warning; ckptwrap's engine keeps them, and they match the plain step.",
                "nothing to change with ckptwrap; on torch's checkpoint use "
                "use_reentrant=False, or make the region's input require grad.",
                details=(
                    f"{name}: no input requiring grad in {log.calls_without_grad_input} of "
                    f"{log.grad_calls} call(s); {trainable} trainable parameter(s)",
                ),
            ))
        if log.keyword_tensors:
            keys = ", ".join(sorted(log.keyword_tensors))
            findings.append(Finding(
                "info", "reentrant-keyword-tensors", name,
                f"{name} uses the re-entrant engine and gets tensors by keyword. "
                f"torch.utils.checkpoint with use_reentrant=True refuses keyword arguments "
                f"('Unexpected keyword arguments'); ckptwrap's marking layer hands them to "
                f"the engine positionally, so they take part in autograd like the others.",
                "nothing to change for a marked module; a direct call ckptwrap.checkpoint(fn, "
                "..., use_reentrant=True, key=tensor) raises, so pass them positionally there "
                "or use use_reentrant=False.",
                details=(f"{name} gets tensors by keyword: {keys}",),
            ))
    return findings


# --------------------------------------------------------------------------- DDP

_DDP_FIX = (
    "construct DistributedDataParallel(module, static_graph=True) (the graph must not change "
    "between iterations), or checkpoint with use_reentrant=False (the default), which DDP "
    "serves in every configuration."
)


def check_ddp(
    model: nn.Module,
    local: nn.Module,
    regions: List[Region],
    logs: Dict[str, CallLog],
    prefix: str,
) -> List[Finding]:
    """Re-entrant regions under DistributedDataParallel without ``static_graph=True``.

    Each re-entrant region runs its backward as a nested backward pass. DDP without
    ``static_graph`` expects every parameter's gradient exactly once per iteration and
    finds unused parameters by searching the graph, so it fails ("marked as ready twice")
    with ``find_unused_parameters=True`` (the search cannot see inside a region) and when
    a parameter is reached by a region more than once or also outside it (a region called
    twice, a tied weight). Without those it works, but the next shared weight breaks it.

    Args:
        model: What the caller passed (a DDP wrapper or not).
        local: The module the regions belong to (a copy of the DDP wrapper's module).
        regions: The regions of ``local``.
        logs: Their calls in the checkpointed step.
        prefix: See :func:`display`: ``"module."`` when ``model`` is DistributedDataParallel.
    """
    if not prefix or getattr(model, "static_graph", False):
        return []
    reentrant = [region for region in regions if region.reentrant]
    if not reentrant:
        return []
    names = [display(prefix, region.name) for region in reentrant]
    setting = (
        f"the model is DistributedDataParallel without static_graph=True, and "
        f"{len(names)} region(s) use the re-entrant engine ({few(names)})"
    )
    reasons = []
    if getattr(model, "find_unused_parameters", False):
        reasons.append(
            "find_unused_parameters=True, whose search for unused parameters cannot see "
            "the parameters inside a re-entrant region"
        )
    reached_twice = _reached_twice(local, reentrant, logs)
    if reached_twice:
        reasons.append(
            f"parameters of {', '.join(display(prefix, name) for name in reached_twice)} "
            f"are reached more than once per step (a region called twice, or a weight "
            f"shared with other code)"
        )
    if reasons:
        return [Finding(
            "error", "reentrant-ddp", "",
            f"{setting}. Training fails ('Expected to mark a variable ready only once') "
            f"because of {' and '.join(reasons)}: each region's nested backward hands DDP "
            f"gradients it does not expect.",
            _DDP_FIX,
        )]
    return [Finding(
        "warning", "reentrant-ddp", "",
        f"{setting}. DDP serves that only while find_unused_parameters is False and every "
        f"parameter is reached once per step; the first tied weight or module called twice "
        f"makes training fail with 'Expected to mark a variable ready only once'.",
        _DDP_FIX,
    )]


def _reached_twice(local: nn.Module, reentrant: List[Region], logs: Dict[str, CallLog]) -> List[str]:
    """Re-entrant regions called more than once in the step, or holding a parameter that
    is also registered outside them."""
    names = sorted((region.name for region in reentrant), key=len, reverse=True)
    owners: Dict[int, Set[Optional[str]]] = {}
    for name, parameter in local.named_parameters(remove_duplicate=False):
        if parameter.requires_grad:
            region = next((r for r in names if r == "" or name.startswith(r + ".")), None)
            owners.setdefault(id(parameter), set()).add(region)
    shared = {region for regions in owners.values() if len(regions) > 1 for region in regions}
    return [
        region.name
        for region in reentrant
        if region.name in shared or logs[region.name].grad_calls > 1
    ]

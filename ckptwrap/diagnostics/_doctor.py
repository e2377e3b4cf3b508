"""``doctor``: run one checkpointed and one plain training step on copies of a wrapped
model and report what is wrong with its checkpointing, each finding with its fix."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..planner import as_example
from ..measure import ModelProfile
from ..wrap import PLAN_ATTRIBUTE, disabled, profile_modules, remove_pending
from . import _checks
from ._gradients import compare_gradients
from ._regions import Region, find_regions, region_running
from ._report import DoctorReport, Finding, group_findings
from ._steps import Observer, StepResult, copy_model, default_loss, recording_calls, run_step

__all__ = ["doctor"]


def doctor(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    example_kwargs: Optional[Mapping[str, Any]] = None,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> DoctorReport:
    """Check how a model is checkpointed, from one checkpointed and one plain training step.

    The model is one already marked with ``wrap_model``, ``CheckpointWrapper`` or
    ``@checkpointed``. Both steps run on deep copies from the same seed, in train mode,
    the plain one inside :func:`ckptwrap.disabled`; the model itself, its gradients and
    the global RNG state are left untouched. The report lists, each with its fix:

    - ``gradient-mismatch`` / ``missing-gradient`` (error): a parameter or example-input
      gradient that is not bit-for-bit the plain step's;
    - ``dropout-rng`` (error): dropout or other random draws in a region recomputed with
      ``preserve_rng_state=False``;
    - ``reentrant-ddp`` (error, or warning while it still works): re-entrant regions
      under ``DistributedDataParallel`` without ``static_graph=True``;
    - ``step-failed`` (error): the checkpointed step raises where the plain one does not
      (in the region and with the fix the error names, where it names them: a selective
      region whose saved operator output is changed in place, say);
    - ``no-savings`` (warning): a region whose inputs are about as big as the activations
      its checkpoint drops (it saves less than 10% of them);
    - ``selected-twice`` (warning): a module checkpointed by two markings, a region
      nested inside another, or a region that a library's own gradient checkpointing
      also checkpoints (transformers', diffusers' or timm's flag on, torch's
      ``CheckpointWrapper``), or that the model's own code hands to a checkpoint function;
    - ``not-called`` (warning): a region the forward never calls, its parent using its
      submodules or parameters directly; (info) a region the step did not reach at all,
      nor anything inside it (a data-dependent exit), which the step could not check;
    - ``buffers-changed`` (info): a region whose forward changes buffers in place
      (spectral normalisation's ``u`` and ``v``, a counter), named, with how ckptwrap
      replays them;
    - ``reentrant-no-grad-input``, ``reentrant-keyword-tensors`` (info): calls that
      torch's re-entrant variant gets wrong (it drops parameter gradients when no input
      requires grad, and refuses keyword arguments) and ckptwrap's handles.

    Findings that say the same about several modules (each layer of a model, say) are
    reported once, with all those modules in ``Finding.modules`` and what differs between
    them in ``Finding.details``. A larger module the doctor suggests is always one the
    forward calls (never a ``ModuleList`` that only holds modules).

    Args:
        model: The checkpointed model (a ``DistributedDataParallel`` wrapper is looked
            through: the steps run on its module, locally).
        example_inputs: Positional inputs of one training forward: a tensor, or a tuple
            or list of arguments.
        example_kwargs: Keyword inputs of that forward.
        loss_fn: Turns the model's output into a scalar loss. By default ``output.loss``
            when the output has one, a scalar output itself, else a fixed random weighting
            of every floating-point output.

    Returns:
        The report; ``report.ok`` is False when it holds an error or a warning.

    Raises:
        CheckpointConfigError: ``model`` is not an ``nn.Module``, ``loss_fn`` is not
            callable or returns no scalar, the model cannot be deep-copied, or the plain
            step itself fails on the example inputs.

    Example:
        >>> wrap_model(model, "blocks", use_reentrant=True)
        >>> report = doctor(model, (tokens,))
        >>> print(report)
        >>> assert report.ok, report
    """
    if not isinstance(model, nn.Module):
        raise CheckpointConfigError(f"doctor examines an nn.Module, got {type(model).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise CheckpointConfigError(
            f"loss_fn must be a callable taking the model's output and returning a scalar "
            f"loss, got {type(loss_fn).__name__}."
        )
    args, kwargs = as_example(example_inputs, example_kwargs)
    loss = loss_fn or default_loss
    local, prefix = _looked_through(model)
    findings: List[Finding] = []

    plain_model, checkpointed_model = _copies(local, args, kwargs, prefix, findings)
    regions = find_regions(checkpointed_model)
    if not regions:
        findings.append(_no_regions(local))
    findings += _checks.check_selected_twice(regions, prefix)
    findings += _checks.check_transformers_checkpointing(local, regions, prefix)
    findings += _checks.check_code_checkpointing(local, regions, prefix)

    buffers = _checks.buffers_of(plain_model)
    with recording_calls(plain_model) as called:
        plain = _plain_step(plain_model, args, kwargs, loss)
    findings += _checks.check_buffers_changed(plain_model, buffers, regions, prefix)
    with Observer(checkpointed_model, regions) as observer:
        try:
            checkpointed: Optional[StepResult] = run_step(
                checkpointed_model, args, kwargs, loss, plain=False
            )
        except Exception as error:  # reported: finding such failures is the doctor's job
            checkpointed = None
            findings.append(_step_failed(error, regions, prefix))
    logs = observer.logs
    findings += _checks.check_ddp(model, checkpointed_model, regions, logs, prefix)

    compared, largest = 0, 0.0
    if checkpointed is None:
        # The calls were cut short; only what the marking alone shows can be said.
        findings += _checks.check_dropout_rng(regions, None, prefix)
    else:
        comparison = compare_gradients(regions, logs, checkpointed, plain, prefix)
        compared, largest = comparison.compared, comparison.max_difference
        findings += _checks.check_dropout_rng(regions, logs, prefix)
        findings += comparison.findings
        findings += _loss_mismatch(checkpointed, plain)
        findings += _checks.check_not_called(regions, logs, called, prefix, plain.grads)
        findings += _checks.check_reentrant_calls(regions, logs, comparison.missing, prefix)
    if regions:
        measured = _profile(plain_model, regions, args, kwargs)
        if isinstance(measured, Finding):
            findings.append(measured)
        else:
            findings += _checks.check_savings(regions, measured, called, prefix)
    return DoctorReport(
        model=type(model).__name__,
        regions=tuple(_checks.display(prefix, region.name) for region in regions),
        # The same note on each of twelve alike layers reads better once, listing them.
        findings=tuple(group_findings(findings)),
        parameters_compared=compared,
        max_grad_difference=largest,
    )


def _copies(
    local: nn.Module, args: Any, kwargs: Dict[str, Any], prefix: str, findings: List[Finding]
) -> Tuple[nn.Module, nn.Module]:
    """The copies for the plain and the checkpointed step, in train mode, with a pending
    budget plan applied to the checkpointed one; notes on either go to ``findings``."""
    plain_model, checkpointed_model = copy_model(local), copy_model(local)
    if not local.training:
        findings.append(Finding(
            "info", "train-mode", "",
            f"{type(local).__name__} is in eval mode; doctor ran both steps in train mode, as "
            f"training would (dropout on, batch statistics used).",
            "nothing to change; call model.train() before doctor to silence this note.",
        ))
        plain_model.train()
        checkpointed_model.train()
    remove_pending(plain_model)  # it runs inside disabled(): no need to measure and plan
    findings += _apply_pending_plan(checkpointed_model, args, kwargs, prefix)
    return plain_model, checkpointed_model


def _looked_through(model: nn.Module) -> Tuple[nn.Module, str]:
    """The module the steps run on, and the prefix of its names in ``model``."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch built without distributed support
        return model, ""
    if isinstance(model, DistributedDataParallel):
        return model.module, "module."
    return model, ""


def _plain_step(model: nn.Module, args: Any, kwargs: Dict[str, Any], loss: Any) -> StepResult:
    try:
        return run_step(model, args, kwargs, loss, plain=True)
    except CheckpointConfigError:
        raise
    except Exception as error:  # the model's own error on these inputs
        raise CheckpointConfigError(
            f"{type(model).__name__} fails on the example inputs even without checkpointing "
            f"({type(error).__name__}: {_summary(error)}); doctor needs inputs and a "
            f"loss_fn with which one plain training step runs."
        ) from error


def _summary(error: Union[BaseException, str]) -> str:
    """The start of the error's message, on one line: a few lines, at most 400 characters."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:4])
    return text if len(text) <= 400 else text[:397] + "..."


def _apply_pending_plan(
    model: nn.Module, args: Any, kwargs: Dict[str, Any], prefix: str
) -> List[Finding]:
    """A ``budget:`` plan that waits for the first training forward: run that forward on
    the copy, so the step checks the regions the plan chooses."""
    plan = getattr(model, PLAN_ATTRIBUTE, None)
    if plan is None or not getattr(plan, "pending", False):
        return []
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), torch.enable_grad():
            warnings.simplefilter("ignore")
            model(*args, **kwargs)
    except Exception as error:  # the error the model's own first training forward raises
        remove_pending(model)
        return [Finding(
            "error", "pending-plan", _checks.display(prefix, ""),
            f"the {plan.policy!r} plan waits for the model's first training forward to "
            f"measure costs, and on the example inputs it fails: {type(error).__name__}: "
            f"{_summary(error)}",
            "change the policy as the message says; pass example_inputs to wrap_model to "
            "see such errors when wrapping rather than in the first step.",
        )]
    return [Finding(
        "info", "pending-plan", _checks.display(prefix, ""),
        f"the {plan.policy!r} plan waits for the model's first training forward to measure "
        f"costs; doctor applied it to its copy on the example inputs (your model still waits).",
        "nothing to change; pass example_inputs to wrap_model to plan up front.",
    )]


def _no_regions(model: nn.Module) -> Finding:
    return Finding(
        "warning", "no-regions", "",
        f"{type(model).__name__} has no checkpointed region (no module marked by wrap_model, "
        f"CheckpointWrapper or @checkpointed), so there is nothing to check.",
        "wrap it first, e.g. ckptwrap.wrap_model(model, 'blocks'), or pass --policy to "
        "python -m ckptwrap doctor.",
    )


def _step_failed(error: BaseException, regions: List[Region], prefix: str) -> Finding:
    """The failure, in the region it names and with the fix it gives, where it gives them
    (a ``CheckpointError``'s ``module`` and ``fix``)."""
    region = region_running(regions, getattr(error, "module", None))
    fix = getattr(error, "fix", None)
    text = str(error)
    if fix:
        text = text.replace(f"Fix: {fix}", "").strip()
    name = "" if region is None else _checks.display(prefix, region.name)
    cause = (
        "the message names the cause; the other findings may point at the region."
        if region is None else f"the message names the cause in {name}."
    )
    return Finding(
        "error", "step-failed", name,
        f"the checkpointed step fails{'' if region is None else f' in {name}'} where the plain step runs: "
        f"{type(error).__name__}: {_summary(text)}",
        fix or f"{cause} Run the step outside doctor for the full traceback.",
    )


def _loss_mismatch(checkpointed: StepResult, plain: StepResult) -> List[Finding]:
    if torch.equal(checkpointed.loss, plain.loss):
        return []
    return [Finding(
        "error", "output-mismatch", "",
        f"the checkpointed forward gives a different loss ({checkpointed.loss.item():.6g}) "
        f"than the plain forward ({plain.loss.item():.6g}): checkpointing changed what the "
        f"model computes, not only how its backward gets activations.",
        "look for code that behaves differently under checkpointing (is_recomputing(), "
        "torch.is_grad_enabled() or hooks that check either) and make the forward the same.",
    )]


def _profile(
    model: nn.Module, regions: List[Region], args: Any, kwargs: Dict[str, Any]
) -> Union[ModelProfile, Finding]:
    """Each region's kept and input bytes, measured un-checkpointed, or a note saying why
    they could not be measured."""
    names = [region.name for region in regions]
    try:
        with disabled(), torch.random.fork_rng(devices=[]):
            profile = profile_modules(model, names, args, kwargs, repeats=0, progress=False)
    except Exception as error:  # measurement is a help, not what the doctor must do
        return Finding(
            "info", "no-measurement", "",
            f"could not measure what the regions save ({type(error).__name__}: "
            f"{_summary(error)}), so regions that save almost nothing are not reported.",
            "nothing to change; the other checks ran.",
        )
    return profile

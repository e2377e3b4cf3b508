"""What the doctor found: one ``Finding`` per problem or note, gathered in a ``DoctorReport``
that prints as a readable list and converts to JSON-friendly data."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from typing import Any, Dict, Iterable, List, Tuple

from .._errors import CheckpointConfigError

__all__ = ["DoctorReport", "Finding", "SEVERITIES", "group_findings"]

SEVERITIES = ("error", "warning", "info")
"""From worst to mildest. Errors mean wrong gradients or a failing step; warnings mean
memory or compute spent for nothing; infos need no change."""

_WIDTH = 96
_EACH = "each of these modules"
"""What a grouped finding's message and fix say where a single one names its module."""
_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the doctor found in one module, and how to fix it."""

    severity: str
    """``"error"``, ``"warning"`` or ``"info"``."""
    check: str
    """Short identifier of the check that found it, such as ``"dropout-rng"``."""
    module: str
    """Qualified name of the module concerned, as in ``model.named_modules()``; ``""`` is
    the model itself."""
    message: str
    """What is wrong, in one or two sentences."""
    fix: str
    """What to change."""
    modules: Tuple[str, ...] = ()
    """Every module the finding applies to, in model order: ``(module,)`` unless the same
    thing was found in several alike modules (the layers of a model, say), which then share
    one finding whose message speaks of "each of these modules"."""
    details: Tuple[str, ...] = ()
    """What is particular to each module (sizes, counts, the submodules or parameters
    concerned), one phrase each that names its module; a grouped finding holds those of
    all its modules. The message and fix say what they have in common."""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise CheckpointConfigError(
                f"Finding.severity must be one of {', '.join(SEVERITIES)}, got {self.severity!r}"
            )
        modules = tuple(self.modules) or (self.module,)
        if modules[0] != self.module:
            raise CheckpointConfigError(
                f"Finding.module {self.module!r} must be the first of modules "
                f"{list(modules)!r}; give modules in model order, starting with module."
            )
        object.__setattr__(self, "modules", modules)
        object.__setattr__(self, "details", tuple(self.details))

    @property
    def where(self) -> str:
        """The module, or the modules, as the printed report names them."""
        if len(self.modules) == 1:
            return self.module or "<model>"
        shown = list(self.modules)
        if len(shown) > _SHOWN + 1:  # "..." stands for two names at least
            shown = shown[: _SHOWN - 1] + ["...", shown[-1]]
        return f"{', '.join(name or '<model>' for name in shown)} ({len(self.modules)} modules)"

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a JSON-friendly dict."""
        data = dataclasses.asdict(self)
        data["modules"] = list(self.modules)
        data["details"] = list(self.details)
        return data


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """The result of :func:`ckptwrap.doctor`: the checkpointed regions it found and
    the findings, worst first.

    ``print(report)`` shows every finding with its fix; ``report.ok`` says whether there is
    anything to fix.
    """

    model: str
    """Class name of the model examined."""
    regions: Tuple[str, ...]
    """Qualified names of the checkpointed regions, in model order."""
    findings: Tuple[Finding, ...]
    """Everything found, errors first, then warnings, then infos."""
    parameters_compared: int = 0
    """How many parameter gradients were compared between the two steps."""
    max_grad_difference: float = 0.0
    """The largest absolute difference between a gradient of the checkpointed step and the
    plain step's, over all parameters (0.0 when they are equal bit for bit)."""

    def __post_init__(self) -> None:
        order = {severity: rank for rank, severity in enumerate(SEVERITIES)}
        ranked = sorted(self.findings, key=lambda finding: order[finding.severity])
        object.__setattr__(self, "findings", tuple(ranked))
        object.__setattr__(self, "regions", tuple(self.regions))

    @property
    def errors(self) -> Tuple[Finding, ...]:
        """Findings that make training wrong or fail."""
        return self._of("error")

    @property
    def warnings(self) -> Tuple[Finding, ...]:
        """Findings that waste memory or compute."""
        return self._of("warning")

    @property
    def infos(self) -> Tuple[Finding, ...]:
        """Findings that need no change."""
        return self._of("info")

    @property
    def ok(self) -> bool:
        """True when there is nothing to fix: no error and no warning (infos are fine)."""
        return not self.errors and not self.warnings

    def _of(self, severity: str) -> Tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if finding.severity == severity)

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-friendly dict of the report."""
        return {
            "model": self.model,
            "ok": self.ok,
            "regions": list(self.regions),
            "parameters_compared": self.parameters_compared,
            "max_grad_difference": self.max_grad_difference,
            "findings": [finding.to_dict() for finding in self.findings],
        }

    def __str__(self) -> str:
        lines = [
            f"ckptwrap doctor: {self.model}, {len(self.regions)} checkpointed region(s), "
            f"{self.parameters_compared} parameter gradient(s) compared with a plain step"
        ]
        for finding in self.findings:
            lines.append("")
            lines.append(f"{finding.severity.upper():<8}{finding.where}  [{finding.check}]")
            lines += _wrapped(finding.message, "  ")
            for detail in _shown_details(finding.details):
                lines += _wrapped(f"- {detail}", "  ")
            lines += _wrapped(f"fix: {finding.fix}", "  ")
        counts = ", ".join(
            f"{len(self._of(severity))} {severity}(s)" for severity in SEVERITIES
        )
        verdict = "ok" if self.ok else "problems found"
        lines += ["", f"{counts}: {verdict}"]
        return "\n".join(lines)


def group_findings(findings: Iterable[Finding]) -> List[Finding]:
    """One finding for each set of findings that say the same about different modules.

    Findings group when their severity and check are the same and their message and fix
    are too once each one's own module name is set aside; what differs from module to
    module (sizes, counts, names inside it) is kept apart in ``details`` by every check, so
    that it does not split a group. A group of several becomes one finding with all their
    modules and details, at the place of its first member. The same finding on every
    layer of a model thus prints once, with one fix.

    Args:
        findings: Findings in the order the checks made them (modules in model order).

    Returns:
        The findings, grouped; a finding alike to no other is returned as it is.
    """
    groups: Dict[Tuple[str, str, str, str], List[Finding]] = {}
    for finding in findings:
        key = (
            finding.severity,
            finding.check,
            _without_names(finding.message, finding.modules),
            _without_names(finding.fix, finding.modules),
        )
        groups.setdefault(key, []).append(finding)
    grouped = []
    for (severity, check, message, fix), members in groups.items():
        modules = tuple(dict.fromkeys(name for member in members for name in member.modules))
        if len(members) == 1 or len(modules) == 1:
            grouped.append(members[0])
            continue
        grouped.append(Finding(
            severity, check, modules[0],
            message.replace("\0", _EACH), fix.replace("\0", _EACH), modules=modules,
            details=tuple(detail for member in members for detail in member.details),
        ))
    return grouped


def _shown_details(details: Tuple[str, ...]) -> List[str]:
    """The details a printed report shows: the first few, then how many more there are."""
    if len(details) <= _SHOWN + 1:
        return list(details)
    return [*details[:_SHOWN], f"... and {len(details) - _SHOWN} more"]


def _without_names(text: str, names: Tuple[str, ...]) -> str:
    """``text`` with each whole mention of ``names`` replaced by a NUL placeholder; a name
    inside a longer one (``layers.1`` in ``layers.10`` or ``layers.1.fc``) is not a mention."""
    for name in sorted((n for n in names if n), key=len, reverse=True):
        text = re.sub(rf"(?<![\w.]){re.escape(name)}(?!\.?\w)", "\0", text)
    return text


def _wrapped(text: str, indent: str) -> List[str]:
    return textwrap.wrap(
        text, _WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
        break_on_hyphens=False,
    )

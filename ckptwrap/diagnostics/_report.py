"""What the doctor found: one ``Finding`` per problem or note, gathered in a ``DoctorReport``
that prints as a readable list and converts to JSON-friendly data."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Dict, List, Tuple

from .._errors import CheckpointConfigError

__all__ = ["DoctorReport", "Finding", "SEVERITIES"]

SEVERITIES = ("error", "warning", "info")
"""From worst to mildest. Errors mean wrong gradients or a failing step; warnings mean
memory or compute spent for nothing; infos need no change."""

_WIDTH = 96


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

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise CheckpointConfigError(
                f"Finding.severity must be one of {', '.join(SEVERITIES)}, got {self.severity!r}"
            )

    def to_dict(self) -> Dict[str, str]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)


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
            where = finding.module or "<model>"
            lines.append("")
            lines.append(f"{finding.severity.upper():<8}{where}  [{finding.check}]")
            lines += _wrapped(finding.message, "  ")
            lines += _wrapped(f"fix: {finding.fix}", "  ")
        counts = ", ".join(
            f"{len(self._of(severity))} {severity}(s)" for severity in SEVERITIES
        )
        verdict = "ok" if self.ok else "problems found"
        lines += ["", f"{counts}: {verdict}"]
        return "\n".join(lines)


def _wrapped(text: str, indent: str) -> List[str]:
    return textwrap.wrap(
        text, _WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
        break_on_hyphens=False,
    )

"""The checkpointing doctor: ``doctor(model, example_inputs)`` runs one checkpointed and one
plain training step on copies of a wrapped model and reports, each with its fix, what is
wrong with how it is checkpointed; ``main`` is ``python -m ckptwrap doctor``.

Uses the marking layer (to find the regions), the engine's state and ``measure``.
"""

from ._cli import main
from ._doctor import doctor
from ._report import DoctorReport, Finding

__all__ = ["DoctorReport", "Finding", "doctor", "main"]

"""Checkpointing the model's own code does, which ckptwrap cannot switch off.

A forward that hands a module to ``torch.utils.checkpoint`` itself (``x =
checkpoint(block, x)``), with no library flag around it, checkpoints that module whatever
ckptwrap does: to the plan it is a checkpointed module, as one marked by ckptwrap is. A
policy's selection leaves it, and whatever holds it or lies in it, to that code (a module
checkpointed twice runs three times a step and saves nothing more), and says so once.
The calls are read from the source (``policy.code_units``), never by
running the model; one under ``if self.use_checkpoint:`` with that flag off does not count.
"""

from __future__ import annotations

from typing import Dict, List

from torch import nn

from .._warn import warn
from ..policy import code_units

__all__ = ["checkpointed_by_code", "say_left_to_code"]


def checkpointed_by_code(modules: Dict[str, nn.Module]) -> Dict[str, str]:
    """Per module the model's own code checkpoints (qualified name), what does it:
    ``a checkpoint call in Model.forward (the model)``."""
    return {
        name: f"a checkpoint call in {type(modules[owner]).__name__}.forward ({owner or 'the model'})"
        for name, owner in code_units(list(modules.items())).items()
    }


def say_left_to_code(model: nn.Module, left: List[str], by_code: Dict[str, str]) -> None:
    """One warning when the policy selected modules (``left``) that the model's own code
    checkpoints, or that hold them or lie in them: they are left to that code."""
    if not left:
        return
    calls = sorted(set(by_code.values()))
    warn(
        f"{type(model).__name__}: the model's own code checkpoints {len(by_code)} module(s) "
        f"({'; '.join(calls)}), so ckptwrap leaves {len(left)} module(s) the policy selected to "
        f"it ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}): checkpointed there and "
        f"again by ckptwrap, a module would run three times a step for no memory saved. To let "
        f"ckptwrap plan them, remove those checkpoint calls."
    )

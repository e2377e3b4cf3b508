"""transformers' own gradient checkpointing beside ckptwrap's: never both on one model.

transformers checkpoints its layers itself while their ``gradient_checkpointing`` flag is
on: ``model.gradient_checkpointing_enable()`` sets it, and so does the Trainer with
``TrainingArguments(gradient_checkpointing=True)``, inside ``train()``, after the training
script has wrapped the model. A layer checkpointed by both runs three times per step for
no memory saved, and a re-entrant checkpoint of transformers' cannot serve the planner's
measurement. So while ckptwrap checkpoints anything in a model, transformers' flags stay
off: switched off by ``wrap_model`` and, when something turns them on later, before the
next training forward, with one warning per model. ``unwrap_model`` turns back on the
flags it turned off.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from torch import nn

from .._compiling import outside_graph
from .._hf import checkpointing_flagged, checkpointing_on
from .._warn import warn

__all__ = ["TransformersSwitch", "switch_of"]

class TransformersSwitch:
    """Forward pre-hook of a wrapped model that keeps transformers' checkpointing off while
    ``marks_anything(model)`` holds; remembers what it turned off, to turn it back on."""

    def __init__(self, model: nn.Module, marks_anything: Callable[[nn.Module], bool]) -> None:
        self.flagged = [module for _, module in checkpointing_flagged(model)]
        self.marks_anything = marks_anything
        self.turned_off: List[nn.Module] = []
        self.said = False

    def __call__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if model.training and any(checkpointing_on(m) for m in self.flagged):
            _switch_off_outside_graph(self, model)
        return None

    def switch_off(self, model: nn.Module, force: bool = False) -> None:
        """Turn transformers' flags off if ckptwrap checkpoints anything in ``model`` (or
        is about to: ``force``)."""
        on = [m for m in self.flagged if checkpointing_on(m)]
        if not on or not (force or self.marks_anything(model)):
            return
        for module in on:
            module.gradient_checkpointing = False
        self.turned_off.extend(m for m in on if all(m is not t for t in self.turned_off))
        if self.said:
            return
        self.said = True
        layers = sorted({type(m).__name__ for m in on})
        warn(
            f"transformers' gradient checkpointing was on in {type(model).__name__} "
            f"({len(on)} module(s): {', '.join(layers)}); ckptwrap switched it off, so that "
            f"no layer is checkpointed twice (ckptwrap's plan does the checkpointing). Leave "
            f"it off where ckptwrap is used: no model.gradient_checkpointing_enable(), and "
            f"TrainingArguments(gradient_checkpointing=False)."
        )

    def turn_back_on(self) -> None:
        """Turn back on the flags this switch turned off (for ``unwrap_model``)."""
        for module in self.turned_off:
            module.gradient_checkpointing = True
        self.turned_off.clear()


def _switch_off(switch: TransformersSwitch, model: nn.Module) -> None:
    switch.switch_off(model)


_COMPILED = (
    "ckptwrap switches transformers' gradient checkpointing off eagerly, outside the "
    "compiled graph, when it finds it on; under fullgraph=True leave it off (no "
    "gradient_checkpointing_enable(), TrainingArguments(gradient_checkpointing=False))."
)
# Under torch.compile the hook is traced; the switch itself runs eagerly, outside the graph.
_switch_off_outside_graph = outside_graph(_switch_off, _COMPILED)


def switch_of(model: nn.Module) -> "TransformersSwitch | None":
    """The switch registered on ``model``, if any."""
    for hook in model._forward_pre_hooks.values():
        if isinstance(hook, TransformersSwitch):
            return hook
    return None

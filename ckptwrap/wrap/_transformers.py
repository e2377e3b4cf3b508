"""A library's own gradient checkpointing beside ckptwrap's: never both on one model.

transformers checkpoints its layers itself while their ``gradient_checkpointing`` flag is
on: ``model.gradient_checkpointing_enable()`` sets it, and so does the Trainer with
``TrainingArguments(gradient_checkpointing=True)`` (TRL's ``SFTConfig`` by default),
inside ``train()``, after the training script has wrapped the model. diffusers' blocks
carry the same flag (``enable_gradient_checkpointing()``), timm's models and stages a
``grad_checkpointing`` one (``set_grad_checkpointing()``), and torch's ``CheckpointWrapper``
(``checkpoint_wrapper``, ``apply_activation_checkpointing``) is switched like a flag: it
stays, so that no parameter is renamed, and calls its module directly. A module checkpointed by both
runs three times per step for no memory saved, and a re-entrant checkpoint of the
library's cannot serve the planner's measurement. So while ckptwrap checkpoints anything
in a model, those flags stay off: switched off by ``wrap_model`` and, when something turns
them on later, before the next training forward, with one warning per model naming the
library and how to keep it off. ``unwrap_model`` turns back on the flags it turned off.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from torch import nn

from .._compiling import outside_graph
from .._hf import checkpointing_flagged, checkpointing_on, flags_on, how_to_keep_off, library_of, owners, switch_off
from .._warn import warn

__all__ = ["TransformersSwitch", "switch_of"]


class TransformersSwitch:
    """Forward pre-hook of a wrapped model that keeps transformers' checkpointing off while
    ``marks_anything(model)`` holds; remembers what it turned off, to turn it back on."""

    def __init__(self, model: nn.Module, marks_anything: Callable[[nn.Module], bool]) -> None:
        self.flagged = [module for _, module in checkpointing_flagged(model)]
        self.marks_anything = marks_anything
        self.turned_off: List[Tuple[nn.Module, str, Any]] = []  # (module, flag, what turns it back on)
        self.said = False
        self.handle: Any = None  # its registration on the model (a RemovableHandle)

    def __call__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if model.training and any(checkpointing_on(m) for m in self.flagged):
            _switch_off_outside_graph(self, model)
        return None

    def switch_off(self, model: nn.Module, force: bool = False) -> None:
        """Turn the libraries' flags off if ckptwrap checkpoints anything in ``model`` (or
        is about to: ``force``)."""
        on = [(m, flag) for m in self.flagged for flag in flags_on(m)]
        if not on or not (force or self.marks_anything(model)):
            return
        for module, flag in on:
            before = switch_off(module, flag)
            if all(m is not module or f != flag for m, f, _ in self.turned_off):
                self.turned_off.append((module, flag, before))
        if self.said:
            return
        self.said = True
        libraries = sorted({library_of(m) for m, _ in on})
        layers = sorted({type(m).__name__ for m, _ in on})
        warn(
            f"{owners(libraries)} own gradient checkpointing was on in "
            f"{type(model).__name__} ({len(on)} module(s): {', '.join(layers)}); ckptwrap "
            f"switched it off, so that no module is checkpointed twice (ckptwrap's plan does "
            f"the checkpointing). Leave it off where ckptwrap is used: {how_to_keep_off(libraries)}."
        )

    def turn_back_on(self, since: int = 0) -> None:
        """Turn back on the flags this switch turned off (for ``unwrap_model``), or those
        turned off after the first ``since`` (a wrapping that failed)."""
        for module, flag, before in self.turned_off[since:]:
            setattr(module, flag, before)
        del self.turned_off[since:]


_COMPILED = (
    "ckptwrap switches a library's own gradient checkpointing (transformers, diffusers, "
    "timm) off eagerly, outside the compiled graph, when it finds it on; under "
    "fullgraph=True leave it off (no gradient_checkpointing_enable(), "
    "TrainingArguments(gradient_checkpointing=False), no enable_gradient_checkpointing() "
    "or set_grad_checkpointing())."
)
# Under torch.compile the hook is traced; the switch itself runs eagerly, outside the graph.
_switch_off_outside_graph = outside_graph(TransformersSwitch.switch_off, _COMPILED)


def switch_of(model: nn.Module) -> "TransformersSwitch | None":
    """The switch registered on ``model``, if any."""
    for hook in model._forward_pre_hooks.values():
        if isinstance(hook, TransformersSwitch):
            return hook
    return None

"""What a library's own checkpointing checkpoints, watched as it runs: the truth the
``blocks`` selection is checked against in the library tests."""

from __future__ import annotations

from typing import Any, Callable, List, Set

from torch import nn


def checkpointed_units(model: nn.Module, step: Callable[[], None], owner: Any, attr: str = "checkpoint") -> Set[str]:
    """The modules that each call of ``owner.attr`` (a checkpoint function, replaced by a
    watch for the while) runs first during ``step()``, with the model's own checkpointing
    switched on (``set_grad_checkpointing``); the innermost where calls nest."""
    names = {id(module): name for name, module in model.named_modules()}
    running: List[nn.Module] = []
    depths: List[int] = []
    units: Set[str] = set()

    def enter(module: nn.Module, args: Any) -> None:
        if depths and len(running) == depths[-1]:
            units.add(names[id(module)])
        running.append(module)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        running.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    original = getattr(owner, attr)

    def watched(function: Any, *args: Any, **kwargs: Any) -> Any:
        depths.append(len(running))
        try:
            return original(function, *args, **kwargs)
        finally:
            depths.pop()

    setattr(owner, attr, watched)
    model.set_grad_checkpointing(True)
    try:
        step()
    finally:
        setattr(owner, attr, original)
        model.set_grad_checkpointing(False)
        for handle in handles:
            handle.remove()
    return {name for name in units if not any(other.startswith(name + ".") for other in units)}

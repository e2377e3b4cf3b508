"""What a library's own checkpointing checkpoints, watched as it runs: the truth the
``blocks`` selection is checked against in the library tests."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Set, Tuple

from torch import nn


def recording(
    model: nn.Module, through: Optional[Callable[..., Any]] = None
) -> Tuple[Set[str], Callable[..., Any], Callable[[], None]]:
    """A set that fills, during a forward, with the modules each call of the returned
    checkpoint function runs first (all of them where calls nest), that function (which
    calls ``through(function, *args, **kwargs)``, or ``function`` itself without
    ``use_reentrant``), and what removes the hooks that watch."""
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

    def record(function: Any, *args: Any, **kwargs: Any) -> Any:
        depths.append(len(running))
        try:
            if through is not None:
                return through(function, *args, **kwargs)
            kwargs.pop("use_reentrant", None)
            return function(*args, **kwargs)
        finally:
            depths.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return units, record, remove


def checkpointed_units(model: nn.Module, step: Callable[[], None], owner: Any, attr: str = "checkpoint") -> Set[str]:
    """The modules that each call of ``owner.attr`` (a checkpoint function, replaced by a
    watch for the while) runs first during ``step()``, with the model's own checkpointing
    switched on (``set_grad_checkpointing``); the innermost where calls nest."""
    original = getattr(owner, attr)
    units, watched, remove = recording(model, original)
    setattr(owner, attr, watched)
    model.set_grad_checkpointing(True)
    try:
        step()
    finally:
        setattr(owner, attr, original)
        model.set_grad_checkpointing(False)
        remove()
    return {name for name in units if not any(other.startswith(name + ".") for other in units)}

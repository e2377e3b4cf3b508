"""``CheckpointWrapper``: an ``nn.Module`` that runs another module checkpointed.

The wrapper shares the wrapped module's parameter, buffer and child dictionaries instead
of holding it as a child, so every qualified name below it is exactly the wrapped
module's: no ``_checkpoint_wrapped_module.`` prefix to strip anywhere downstream.
"""

from __future__ import annotations

import textwrap
from typing import Any, Dict, Iterator, List

import torch
from torch import nn

from .._errors import CheckpointConfigError
from ..engine import CheckpointOptions, options_from
from ._region import run_region

__all__ = ["CheckpointWrapper", "refuse_torchscript"]

# The prefix torch's own checkpoint_wrapper puts in front of every key.
_TORCH_WRAPPER_PREFIX = "_checkpoint_wrapped_module."

# State that decides names and state_dict contents, shared with the wrapped module.
_SHARED = (
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_modules",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class CheckpointWrapper(nn.Module):
    """Run ``module`` as a checkpointed region, with the same state_dict keys as ``module``.

    Attribute access reaches the wrapped module, and so do indexing, ``len`` and
    iteration where the wrapped module has them (a ``Sequential`` or ``ModuleList``: the
    wrapper is then of a subclass that has them too, so that tools that ask any module
    with ``__len__`` for its length, as ``torch.compile`` before torch 2.12 does, never
    meet a wrapper without one). A state dict saved from the wrapper, from the bare module
    or from torch's ``checkpoint_wrapper`` loads into either.

    Args:
        module: The module to checkpoint.
        **options: Engine options of :func:`ckptwrap.checkpoint`.

    Raises:
        CheckpointConfigError: ``module`` is not an ``nn.Module`` or an option is unknown.

    Example:
        >>> layers = nn.ModuleList(CheckpointWrapper(Block()) for _ in range(12))
    """

    def __new__(cls, module: Any = None, **options: Any) -> "CheckpointWrapper":
        # Without arguments: copy and pickle make the object again, of its own class.
        if cls is CheckpointWrapper and hasattr(type(module), "__len__"):
            cls = _SequenceWrapper
        return super().__new__(cls)

    def __init__(self, module: nn.Module, **options: Any) -> None:
        if not isinstance(module, nn.Module):
            raise CheckpointConfigError(
                f"CheckpointWrapper wraps an nn.Module, got {type(module).__name__}."
            )
        refuse_torchscript(module, "CheckpointWrapper", type(module).__name__)
        resolved = options_from(options, where="CheckpointWrapper")
        super().__init__()
        object.__setattr__(self, "_ckptwrap_module", module)
        object.__setattr__(self, "_ckptwrap_options", resolved)
        for name in _SHARED:
            object.__setattr__(self, name, getattr(module, name))
        self.training = module.training

    @property
    def wrapped_module(self) -> nn.Module:
        """The module this wrapper runs."""
        return self.__dict__["_ckptwrap_module"]

    @property
    def checkpoint_options(self) -> CheckpointOptions:
        """The engine options used for every call."""
        return self.__dict__["_ckptwrap_options"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self.wrapped_module
        return run_region(module, module, args, kwargs, self.checkpoint_options)

    def train(self, mode: bool = True) -> "CheckpointWrapper":
        super().train(mode)
        self.wrapped_module.training = mode
        return self

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self.wrapped_module._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        legacy = prefix + _TORCH_WRAPPER_PREFIX
        for key in [k for k in state_dict if k.startswith(legacy)]:
            state_dict[prefix + key[len(legacy):]] = state_dict.pop(key)
        self.wrapped_module._load_from_state_dict(state_dict, prefix, *args)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_ckptwrap_module")
            if module is None:
                raise
            return getattr(module, name)

    def __dir__(self) -> List[str]:
        return sorted(set(super().__dir__()) | set(dir(self.wrapped_module)))

    def __repr__(self) -> str:
        options = self.checkpoint_options
        shown = ", ".join(
            f"{name}={value!r}"
            for name, value in options.as_kwargs().items()
            if value != getattr(CheckpointOptions, name)
        )
        inner = textwrap.indent(repr(self.wrapped_module), "  ")
        tail = f",\n  {shown}" if shown else ""
        return f"CheckpointWrapper(\n{inner}{tail}\n)"


class _SequenceWrapper(CheckpointWrapper):
    """A :class:`CheckpointWrapper` of a module with a length (``Sequential``,
    ``ModuleList``...): indexing, ``len`` and iteration reach the wrapped module."""

    def __getitem__(self, index: Any) -> Any:
        return self.wrapped_module[index]  # type: ignore[index]

    def __len__(self) -> int:
        return len(self.wrapped_module)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.wrapped_module)  # type: ignore[call-overload]


def refuse_torchscript(module: nn.Module, where: str, name: str) -> None:
    """Raise if ``module`` is TorchScript: its forward is compiled code that ckptwrap cannot
    run as a checkpointed region, and setting attributes on it fails deep inside torch."""
    if not isinstance(module, torch.jit.ScriptModule):
        return
    original = getattr(module, "original_name", type(module).__name__)
    raise CheckpointConfigError(
        f"{where} cannot checkpoint {name} ({original}, a TorchScript module from "
        f"torch.jit.script or torch.jit.trace): its forward is compiled TorchScript, not a "
        f"Python forward that can run as a checkpointed region. Checkpoint the eager module "
        f"instead (torch.compile works with checkpointed modules), or leave this module out "
        f"of the policy."
    )

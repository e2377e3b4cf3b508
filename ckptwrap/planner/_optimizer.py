"""The optimizer as the device's memory sees it: its state and its step's temporaries,
measured from two steps of it over fake stand-ins of the model's parameters.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .. import _torch_private
from .._errors import CheckpointConfigError
from ..measure import StorageCounter
from ._unreal import RealWhereItCan

__all__ = ["OPTIMIZERS", "OptimizerSpec", "optimizer_costs", "optimizer_spec"]

OPTIMIZERS: Dict[str, str] = {
    "adamw": "AdamW",
    "adam": "Adam",
    "sgd": "SGD",
    "sgd-momentum": "SGD",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
}
"""Optimizers that can be named (``optimizer="adamw"``): ``torch.optim`` classes, with
their defaults (``sgd-momentum``: SGD with momentum 0.9)."""


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as plain data: its class and, per parameter group, the positions of its
    parameters among ``model.parameters()`` and its hyperparameters."""

    kind: type
    groups: Tuple[Tuple[Tuple[int, ...], Tuple[Tuple[str, Any], ...]], ...]
    defaults: Tuple[Tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.kind.__name__


def optimizer_spec(model: nn.Module, optimizer: Any) -> Optional[OptimizerSpec]:
    """``optimizer`` (None, a name of :data:`OPTIMIZERS`, or a ``torch.optim.Optimizer``
    over ``model``'s parameters) as an :class:`OptimizerSpec`. Parameters of the
    optimizer's that are not the model's are not counted.

    Raises:
        CheckpointConfigError: Anything else, or an optimizer none of whose parameters
            is the model's.
    """
    if optimizer is None:
        return None
    params = list(model.parameters())
    if isinstance(optimizer, str):
        name = optimizer.strip().lower()
        kind = getattr(torch.optim, OPTIMIZERS.get(name, ""), None)
        if kind is None:
            raise CheckpointConfigError(
                f"optimizer={optimizer!r} is not an optimizer ckptwrap knows by name; name one "
                f"of {', '.join(OPTIMIZERS)}, or pass the optimizer itself."
            )
        trainable = tuple(i for i, p in enumerate(params) if p.requires_grad)
        hyper = (("momentum", 0.9),) if name == "sgd-momentum" else ()
        return OptimizerSpec(kind, ((trainable, hyper),))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointConfigError(
            f"optimizer must be a torch.optim.Optimizer over the model's parameters or a name "
            f"({', '.join(OPTIMIZERS)}), got {type(optimizer).__name__}."
        )
    index = {id(p): i for i, p in enumerate(params)}
    groups = []
    for group in optimizer.param_groups:
        positions = tuple(index[id(p)] for p in group["params"] if id(p) in index)
        hyper = tuple((key, value) for key, value in group.items() if key != "params")
        groups.append((positions, hyper))
    if not any(positions for positions, _ in groups):
        raise CheckpointConfigError(
            f"the {type(optimizer).__name__} given as optimizer holds none of "
            f"{type(model).__name__}'s parameters: pass the optimizer that trains this model."
        )
    return OptimizerSpec(type(optimizer), tuple(groups), tuple(optimizer.defaults.items()))


def optimizer_costs(model: nn.Module, spec: OptimizerSpec, accelerator: bool) -> Tuple[int, int]:
    """(state, step temporaries) of ``spec``'s optimizer over stand-ins of ``model``'s
    parameters on fake tensors: the state its first step leaves, and the peak of its
    second step beyond it. On an accelerator the multi-tensor (foreach) implementation
    torch picks there is asked for where the optimizer leaves it to torch."""
    fake = _torch_private.fake_tensor
    if fake is None:
        raise CheckpointConfigError(
            "counting the optimizer's state needs fake tensors (torch 2.1 or later); write the "
            "budget as budget:SIZE of the training step instead."
        )
    params = list(model.parameters())
    with fake.outside():
        mode = fake.mode_class()
        mode.allow_non_fake_inputs = True  # the step counters are real (tiny, made for real)
        with mode:
            stand_ins = [_stand_in(p) for p in params]
        groups = _groups(spec, stand_ins, accelerator)
        counters = []
        optimizer = None
        try:
            for _ in range(2):
                counter = StorageCounter("cpu")
                with mode, RealWhereItCan(fake), counter:
                    # Some optimizers make their state when made (Adagrad), most at the first step.
                    if optimizer is None:
                        optimizer = _build(spec, groups)
                    optimizer.step()
                counters.append(counter)
        except CheckpointConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - said with the optimizer, then raised on
            raise _refused(f"{spec.name} could not step on fake tensors", error) from error
        # The second step's counter sees only what that step creates: the state is there.
        return counters[0].live_bytes, counters[1].peak_bytes


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    local = param.to_local() if hasattr(param, "to_local") else param
    made = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="cpu")
    stand_in = nn.Parameter(made, requires_grad=param.requires_grad)
    if param.requires_grad:
        stand_in.grad = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="cpu")
    return stand_in


def _init_options(kind: type) -> Mapping[str, Any]:
    try:
        return inspect.signature(kind).parameters
    except (TypeError, ValueError):
        return {}


def _build(spec: OptimizerSpec, groups: Any) -> torch.optim.Optimizer:
    try:
        return spec.kind(groups, **dict(spec.defaults))
    except TypeError:
        pass
    try:
        return spec.kind(groups)
    except Exception as error:  # noqa: BLE001 - said with the optimizer, then raised on
        raise _refused(f"ckptwrap could not make a {spec.name} over stand-ins of the parameters", error) from error


def _refused(what: str, error: Exception) -> CheckpointConfigError:
    return CheckpointConfigError(
        f"{what} to count its state ({type(error).__name__}: {error}); write the budget as "
        f"budget:SIZE of the training step instead."
    )


def _groups(spec: OptimizerSpec, stand_ins: List[torch.Tensor], accelerator: bool) -> List[Dict[str, Any]]:
    """``spec``'s parameter groups over the stand-ins; on an accelerator, the multi-tensor
    implementation where the optimizer has one and leaves the choice to torch."""
    groups = []
    for positions, hyper in spec.groups:
        group: Dict[str, Any] = dict(hyper)
        group["params"] = [stand_ins[i] for i in positions]
        if accelerator and group.get("foreach") is None and not group.get("fused"):
            if "foreach" in _init_options(spec.kind):
                group["foreach"] = True
        groups.append(group)
    return groups

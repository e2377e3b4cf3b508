"""One rank of N under FSDP2, for ``python -m ckptwrap plan --ranks``: the model made of
fake tensors (built on the meta device, each tensor then made fake) and sharded with
``fully_shard`` over a fake process group of N as training scripts shard it
(:func:`shard_blocks`), then planned there as any model on fake tensors is. Over several
counts, the smallest whose plan fits the device.

Nothing is allocated and nothing communicates: the fake group answers every collective
at once, and each count gets a group and a model of its own (the group is process-wide,
so one already initialized, the caller's, is refused). The rank planned is rank 0, whose
shard of each parameter is the largest where FSDP2 pads the first dimension.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

import torch
from torch import nn

from . import _torch_private
from ._cli_common import UsageError
from ._errors import CheckpointConfigError
from .policy import find_blocks

__all__ = ["RankPlan", "beyond_reach", "parse_ranks", "plan_ranks", "shard_blocks", "sharding_options"]


class RankPlan(NamedTuple):
    """What planning one rank of ``ranks`` gave: the plan, or the memory it would need."""

    ranks: int
    group: int
    """The ranks one parameter is sharded over: ``ranks``, or under HSDP a replica's."""
    plan: Any = None
    """The plan (a ``Plan``) where it fits; None where it does not."""
    needed: Optional[int] = None
    """Where it does not fit: what one rank would need, in bytes."""
    offered: Optional[int] = None
    """Where it does not fit: the device's memory it was planned for, in bytes."""
    why: str = ""


AUTO_LIMIT = 4096
"""``--ranks auto`` tries powers of two up to this many ranks."""


def parse_ranks(text: str, replicas: int = 1) -> List[int]:
    """``--ranks N[,N...]``: the rank counts, without repeats, smallest first, each a
    multiple of ``replicas`` (HSDP's); ``auto``: ``replicas`` times the powers of two, up
    to :data:`AUTO_LIMIT`."""
    if text.strip().lower() == "auto":
        return [replicas << power for power in range(AUTO_LIMIT.bit_length()) if replicas << power <= AUTO_LIMIT]
    counts = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise UsageError(
                f"bad --ranks {text!r}: expected rank counts of 1 or more, such as 8 or 1,2,4,8, or auto"
            )
        counts.append(int(part))
    uneven = [count for count in counts if count % replicas]
    if uneven:
        raise UsageError(
            f"--replicas {replicas} splits each rank count into that many FSDP groups: "
            f"{', '.join(map(str, uneven))} is not a multiple of it"
        )
    return sorted(set(counts))


def sharding_options(
    keep_gathered: bool, param_dtype: Optional[torch.dtype], reduce_dtype: torch.dtype
) -> Dict[str, Any]:
    """``fully_shard``'s options from the command line's FSDP2 flags: with ``param_dtype``,
    parameters gathered and computed in it and gradients reduced in ``reduce_dtype`` (the
    parameters' own, as torchtitan reduces float32 gradients of bfloat16 compute)."""
    options: Dict[str, Any] = {"reshard_after_forward": not keep_gathered}
    if param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return options


def plan_ranks(
    counts: Sequence[int],
    build: Callable[[], nn.Module],
    inputs: Sequence[torch.Tensor],
    kwargs: Dict[str, torch.Tensor],
    plan: Callable[[nn.Module, Sequence[torch.Tensor], Dict[str, torch.Tensor]], Any],
    options: Dict[str, Any],
    *,
    smallest: bool,
    replicas: int = 1,
) -> List[RankPlan]:
    """Plan one rank of each count in ``counts`` (in order): ``build()`` made on fake
    tensors (:func:`_on_fake_tensors`), sharded, and ``plan(model, inputs, kwargs)``
    called on fake copies of the inputs. With ``replicas`` above 1, HSDP: each count's
    ranks are that many replicas of FSDP groups of the count over ``replicas`` ranks
    (each count a multiple of it, as :func:`parse_ranks` gives). With ``smallest``, stop
    at the first count that fits, or once no larger count can (:func:`beyond_reach`). A
    count whose plan does not fit (a ``CheckpointConfigError`` naming what a rank would
    need) is recorded so; any other error is raised."""
    fake = _torch_private.fake_tensor
    if fake is None:
        raise UsageError("--ranks plans on fake tensors, which this torch lacks (torch 2.1 and later have them)")
    found = []
    for count in counts:
        mode = fake.mode_class()
        with _fake_group(count, replicas) as mesh, _on_fake_tensors(build, mode) as model, mode:
            units = shard_blocks(model, mesh, options)
            fake_inputs = [mode.from_tensor(t) for t in inputs]
            fake_kwargs = {name: mode.from_tensor(t) for name, t in kwargs.items()}
            try:
                made = plan(model, fake_inputs, fake_kwargs)
            except CheckpointConfigError as error:
                if error.needed is None:
                    raise
                found.append(RankPlan(
                    count, count // replicas, needed=error.needed, offered=error.offered, why=str(error)
                ))
            else:
                found.append(RankPlan(count, count // replicas, plan=made, why=f"{units} blocks and the root sharded"))
        if smallest and (found[-1].plan is not None or beyond_reach(found) is not None):
            break
    return found


def beyond_reach(found: Sequence[RankPlan]) -> Optional[int]:
    """Where no larger count can fit, the least any would need; else None.

    A rank's parameters, gradients and optimizer state shrink with the count and the
    rest does not, so what a rank needs falls by half as much from 2N to 4N as from N to
    2N: from the last two counts, sharding over groups twice apart of 2 or more ranks,
    that did not fit, no larger count needs less than what the larger needed less what
    doubling took off (FSDP2's padding of each shard only adds). Known only from two
    such counts; a group of one rank is no guide (it gathers nothing, and its step makes
    no all-gather or reduce-scatter buffers)."""
    if len(found) < 2 or None in (found[-1].needed, found[-2].needed, found[-1].offered):
        return None
    if found[-2].group < 2 or found[-1].group != 2 * found[-2].group:
        return None
    least = found[-1].needed - (found[-2].needed - found[-1].needed)
    return least if least > found[-1].offered else None


def shard_blocks(model: nn.Module, mesh: Any, options: Dict[str, Any]) -> int:
    """Shard ``model`` as training scripts do: each block the ``blocks`` policy finds,
    the innermost first (FSDP2 shards nested units from the inside out), then the root,
    with ``fully_shard``'s ``options`` over ``mesh`` (None: the default group). Returns
    the blocks sharded."""
    from torch.distributed.fsdp import fully_shard

    names = find_blocks(model)
    modules = dict(model.named_modules())
    for name in sorted(names, key=lambda name: -name.count(".")):
        fully_shard(modules[name], mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return len(names)


@contextlib.contextmanager
def _on_fake_tensors(build: Callable[[], nn.Module], mode: Any) -> Iterator[nn.Module]:
    """``build()``'s model, in train mode, with each parameter and buffer a fake tensor
    of ``mode`` on the CPU, for the block.

    Built on the meta device, then each tensor put in its place: built under the fake
    mode itself, a model's weight initialisation would run on fake tensors, and one
    that reads values (ViT's truncated normal) fails there; and a module's own
    conversions (``.to(dtype)``, ``to_empty``) cannot swap a fake parameter for its
    converted copy. Tied tensors stay tied."""
    with torch.device("meta"):
        model = build().train()
    made: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, value in table.items():
                if isinstance(value, torch.Tensor):
                    if id(value) not in made:
                        with mode:
                            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
                        if isinstance(value, nn.Parameter):
                            fake = nn.Parameter(fake, requires_grad=value.requires_grad)
                        made[id(value)] = fake
                    table[name] = made[id(value)]
    yield model


@contextlib.contextmanager
def _fake_group(ranks: int, replicas: int = 1) -> Iterator[Any]:
    """A fake process group of ``ranks`` (this process rank 0) and its mesh, for the
    block (one dimension; with ``replicas``, HSDP's two: replicate, shard); torn down
    after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available():
        raise UsageError("--ranks plans under FSDP2, which needs torch.distributed; this torch build lacks it")
    if dist.is_initialized():
        raise UsageError(
            "--ranks plans on a fake process group of its own, and a process group is initialized "
            "already: plan from a process of its own (python -m ckptwrap plan ... --ranks N)"
        )
    store = _torch_private.fake_process_group_store()
    if store is None:
        raise UsageError("--ranks needs torch's fake process group (torch.testing's fake_pg), which this torch lacks")
    # Each init wraps sys.excepthook to prefix "[rank0]:" and nothing unwraps it.
    hook = sys.excepthook
    dist.init_process_group("fake", rank=0, world_size=ranks, store=store)
    try:
        if replicas == 1:
            yield init_device_mesh("cpu", (ranks,))
        else:
            yield init_device_mesh("cpu", (replicas, ranks // replicas), mesh_dim_names=("replicate", "shard"))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook

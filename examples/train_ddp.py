"""Train a small GPT on several processes with activation checkpointing, under
DistributedDataParallel or FSDP2, with the policy from the ``--activation-checkpointing`` flag.

    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --activation-checkpointing blocks
    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --activation-checkpointing every:2 --ac-use-reentrant
    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --parallel fsdp2 --activation-checkpointing blocks

``wrap_model`` marks the model first; then DDP wraps it, or ``fully_shard`` shards each
block and the root. Each rank trains on its share of every global batch. At the end every
rank compares its parameters with the same training run in one process on whole batches,
without checkpointing; the script exits non-zero if any rank's differ.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import ckptwrap.config
from gpt import GPT, GPTConfig, synthetic_batch

# Equal up to rounding: the ranks sum their gradients in a different order than one process,
# so the comparison allows this much (torch.allclose) and says so.
_RTOL, _ATOL = 1e-4, 1e-6


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: sizes, training, parallelism and ckptwrap's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp", help="how ranks share the model")
    parser.add_argument(
        "--static-graph", action="store_true",
        help="DDP's static_graph=True, needed by the re-entrant engine with shared weights "
        "or find_unused_parameters",
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="global batch: sequences per step over all ranks")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=64, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument(
        "--dropout", type=float, default=0.0,
        help="dropout probability (default 0: with dropout every rank draws its own masks, "
        "so the one-process comparison is skipped)",
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument("--device", default="cpu", help="device type to train on: cpu, cuda, xpu, ...")
    ckptwrap.config.add_argparse_args(parser)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.batch % world:
        parser.error(f"--batch must be a multiple of the {world} ranks, got {args.batch}")
    return args


def init_distributed(device_type: str) -> torch.device:
    """Join the process group torchrun describes; return this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    dist.init_process_group(dist.get_default_backend_for_device(device))
    return device


def parallelize(model: GPT, how: str, device: torch.device, *, static_graph: bool) -> nn.Module:
    """The module to call in training: DDP around ``model``, or ``model`` itself sharded."""
    if how == "ddp":
        device_ids = None if device.type == "cpu" else [device.index]
        return DistributedDataParallel(model, device_ids=device_ids, static_graph=static_graph)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def train(
    runner: nn.Module,
    model: nn.Module,
    config: GPTConfig,
    args: argparse.Namespace,
    device: torch.device,
    *,
    rows: slice = slice(None),
    on_step: Callable[[int, float, float], None] = lambda step, loss, ms: None,
) -> None:
    """Train for ``args.steps`` steps with SGD, on some rows of every global batch.

    Args:
        runner: What to call on a batch: DDP, the sharded model or the plain model.
        model: The model whose parameters the optimizer updates.
        config: The model's sizes, for the synthetic batches.
        args: The command line (steps, batch, lr, seed).
        device: Where the batches go.
        rows: This rank's rows of each global batch; all of them in one process.
        on_step: Called after each step with its number, the loss of the whole global
            batch (averaged over the ranks) and its time in milliseconds.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        tokens, targets = synthetic_batch(config, args.batch, seed=args.seed + step, device=device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = runner(tokens[rows], targets[rows])
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        if rows != slice(None):
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        on_step(step + 1, loss.item(), (time.perf_counter() - start) * 1000)


def full_parameters(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter in full, by qualified name (FSDP2's shards are gathered)."""
    return {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()
        for name, param in model.named_parameters()
    }


def one_process_run(
    config: GPTConfig, args: argparse.Namespace, device: torch.device
) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """The same training without checkpointing or parallelism: its losses and parameters."""
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    losses: List[float] = []
    train(model, model, config, args, device, on_step=lambda step, loss, ms: losses.append(loss))
    return losses, full_parameters(model)


def main(argv: Sequence[str] | None = None) -> int:
    """Train, print one line per step on rank 0, compare with one process; 0 if within tolerance."""
    args = parse_args(argv)
    device = init_distributed(args.device)
    try:
        return run(args, device)
    finally:
        # A DDP or FSDP2 module that outlives its process group can crash or hang the
        # process at exit; FSDP2's modules sit in reference cycles, hence the collection.
        gc.collect()
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> int:
    """The body of :func:`main`, inside the process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    config = GPTConfig(
        width=args.width, heads=args.heads, layers=args.layers, seq_len=args.seq_len, dropout=args.dropout
    )
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = ckptwrap.config.apply_from_args(GPT(config).to(device), args)
    plan = model.ckptwrap_plan
    say(
        f"{world} ranks ({args.parallel} on {device.type}, {dist.get_backend()}), GPT: {config.layers} "
        f"blocks, width {config.width}, sequence {config.seq_len}, global batch {args.batch}\n"
        f"activation checkpointing {plan.policy!r}"
        f"{' (re-entrant)' if plan.options.use_reentrant else ''}: {len(plan)} module(s) "
        f"{', '.join(entry.name for entry in plan.selected) or '-'}"
    )
    runner = parallelize(model, args.parallel, device, static_graph=args.static_graph)
    check = args.dropout == 0
    reference_losses, reference = one_process_run(config, args, device) if check else ([], {})
    share = args.batch // world
    say(f"{'step':>4}  {'loss':>8}  {'1 process':>9}  {'ms':>7}")

    def report(step: int, loss: float, ms: float) -> None:
        alone = f"{reference_losses[step - 1]:.5f}" if check else "-"
        say(f"{step:>4}  {loss:>8.5f}  {alone:>9}  {ms:>7.1f}")

    train(runner, model, config, args, device, rows=slice(rank * share, (rank + 1) * share), on_step=report)
    params = full_parameters(model)
    if not check:
        say("dropout is on, so the ranks draw other masks than one process would: no comparison")
        return 0
    worst, close = compare(params, reference)
    same = torch.tensor(float(close), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    say(verdict(args.steps, worst.item(), same.item() == 1))
    return 0 if same.item() == 1 else 1


def compare(params: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, bool]:
    """The largest absolute difference from the reference, and whether every parameter is
    within the tolerance (``torch.allclose`` with ``_RTOL`` and ``_ATOL``)."""
    worst = torch.stack([(params[name] - value).abs().max() for name, value in reference.items()]).max()
    close = all(torch.allclose(params[name], value, rtol=_RTOL, atol=_ATOL) for name, value in reference.items())
    return worst, close


def verdict(steps: int, worst: float, close: bool) -> str:
    """The closing line: bit-for-bit equal, within the stated tolerance, or different."""
    head = f"parameters after {steps} steps on every rank:"
    tolerance = f"rtol={_RTOL:g}, atol={_ATOL:g} (max |difference| {worst:.2e})"
    if close and worst == 0:
        return f"{head} equal the one-process run, bit for bit"
    if close:
        return f"{head} match the one-process run within {tolerance}"
    return f"{head} DIFFERENT from the one-process run beyond {tolerance}"


if __name__ == "__main__":
    sys.exit(main())

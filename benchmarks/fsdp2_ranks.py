"""Plans and budgets per rank under real FSDP2: N processes on the CPU (gloo, loopback),
each training a small Llama (or, with ``--model t5``, a small T5) sharded with
``fully_shard`` (each block, then the root) on batches of its own shapes.

Two tables, one row per rank:

- **Planned with example inputs.** Each rank plans its own batch with
  ``ckptwrap.plan(model, policy, example_kwargs=batch, optimizer=adamw)`` and runs the
  plan; its predicted whole-iteration peak (``Plan.device_peak``) beside torch's
  ``FSDPMemTracker`` over the same iteration on real tensors (an independent meter of
  the tensors FSDP2 and the model hold) and the allocator's readings (``torch.profiler``'s
  memory events, plus the storages held before: the least and the most of four
  iterations). Shardings: the default, ``reshard_after_forward=False`` (each layer's
  gathered parameters kept from its forward to its backward) and FSDP2's mixed precision
  (bfloat16 parameters, float32 gradient reduction); policies ``none``, ``blocks`` and a
  ``budget:total`` halfway between them, applied with example inputs after one training
  step (that budget's row is the most any of four iterations read, against the total).
- **A lazy budget.** ``wrap_model(model, "budget:total=SIZE", optimizer=adamw)``, the
  total halfway between ``blocks`` and ``none`` at the longest batch, then a loop whose
  batches differ per rank from the first step on; per step, the allocator's reading of
  the whole iteration and how far above the total it went, as a share of the largest
  un-checkpointed step so far on that rank (the allocator's peak over an iteration of an
  unwrapped copy, sharded the same, on the same batch, above what it held before). The
  budget's promise is at most 3%.

Gloo's own threads hold an all-gather's buffer (one layer's gathered parameters) for a
while after FSDP2 is done with it, at times past the step's peak: an allocator reading is
then that much high (up to two layers' gathered parameters in runs here), which neither
FSDPMemTracker (steady to the byte over repeated iterations) nor the plan sees. Hence the
least and the most of four readings, and the lazy loop's slack of two layers' gathered
parameters over the budget's 3%.

    python benchmarks/fsdp2_ranks.py [--ranks 2,4] [--model llama|t5]

A rank is this script run with ``--rank-of WORLD`` and the environment torchrun would set
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); ``tests/distributed``
imports :func:`rank_report` and runs it in its own two-process launch.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import ckptwrap  # noqa: E402
from ckptwrap._cli_ranks import shard_blocks, sharding_options  # noqa: E402
from ckptwrap.policy import find_blocks  # noqa: E402
from ckptwrap.wrap._marks import apply_plan  # noqa: E402
from whole_iteration import held, iteration, reading  # noqa: E402

VOCAB = 1024
PLANNED = {0: (1, 96), 1: (2, 256), 2: (2, 160), 3: (3, 64)}
"""Per rank, the (batch, length) it plans and runs with example inputs."""
LAZY = {
    0: [(2, 128), (2, 384), (1, 512), (2, 256), (2, 384), (2, 512), (1, 64), (2, 512)],
    1: [(4, 400), (1, 64), (2, 512), (3, 200), (2, 512), (4, 320), (2, 448), (2, 96)],
    2: [(1, 32), (2, 512), (2, 128), (2, 512), (1, 256), (2, 448), (3, 160), (2, 480)],
    3: [(2, 480), (2, 480), (2, 480), (2, 128), (2, 192), (2, 512), (1, 512), (4, 256)],
}
"""Per rank, each step's (batch, length) of the lazy loop: the ranks differ from the first
step on (a batch of one against batches of several, short against long), and each meets
some of its shapes again."""
LONGEST = (2, 512)
SHARDINGS = {
    "default": {}, "keep-gathered": {"reshard_after_forward": False}, "bf16-params": {"mixed": True},
    "hsdp": {"replicas": 2},
}
"""How the model is sharded: FSDP2's defaults; each layer's gathered parameters kept from
its forward to its backward; bfloat16 parameters with gradients reduced in float32; and
HSDP, two replicas of FSDP groups of half the ranks (from 4 ranks on)."""
PROMISE = 0.03
READINGS = 4


MODELS = ("llama", "t5")
"""``llama``: a small Llama (width 64, 4 layers); ``t5``: a small T5 v1.1-style
encoder-decoder (width 64, 4 + 4 layers, gated GELU, eager attention with relative
position bias, which every block of a stack takes from its first)."""


def build(model: str = "llama") -> torch.nn.Module:
    """One of :data:`MODELS`, the same on every rank (seeded), in train mode."""
    import transformers

    torch.manual_seed(0)
    if model == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=64, d_ff=160, d_kv=16, num_heads=8, num_layers=4, num_decoder_layers=4,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
            use_cache=False,
        )
        return transformers.T5ForConditionalGeneration(config).train()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()


def shard(
    model: torch.nn.Module, reshard_after_forward: bool = True, mixed: bool = False, replicas: int = 1,
) -> torch.nn.Module:
    """Each block, then the root, as one FSDP2 unit over every rank (or, with
    ``replicas``, over each replica's share of the ranks, replicated across them: HSDP),
    as ``python -m ckptwrap plan --ranks`` shards it; ``mixed``: bfloat16 parameters,
    float32 gradient reduction."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = None
    if replicas > 1:
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    options = sharding_options(not reshard_after_forward, torch.bfloat16 if mixed else None, torch.float32)
    shard_blocks(model, mesh, options)
    return model


def batch_of(rank: int, rows: int, length: int, seed: int) -> Dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (rows, length), generator=torch.Generator().manual_seed(1000 * seed + rank))
    return {"input_ids": ids, "labels": ids.clone()}


def tracked(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Dict[str, Any]) -> int:
    """``FSDPMemTracker``'s peak over one iteration on this rank."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((batch,))
    with tracker:
        iteration(model, optimizer, batch)()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def largest_unit(model: torch.nn.Module) -> int:
    """Bytes of the largest FSDP2 unit's gathered parameters."""
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    sizes = []
    for unit in units:
        own = {id(p): p for p in unit.parameters()}
        for inner in units:
            if inner is not unit and any(inner is m for m in unit.modules()):
                for p in inner.parameters():
                    own.pop(id(p), None)
        sizes.append(sum(p.numel() * p.element_size() for p in own.values()))
    return max(sizes)


def planned(rank: int, world: int, kind: str) -> List[Dict[str, Any]]:
    """The first table's rows for this rank (see the module)."""
    rows, length = PLANNED[rank]
    batch = batch_of(rank, rows, length, seed=0)
    found = []
    for sharding, options in SHARDINGS.items():
        if world < 2 * options.get("replicas", 1):
            continue
        for policy in ("none", "blocks", "budget:total"):
            if policy == "budget:total" and sharding != "default":
                continue
            model = shard(build(kind), **options)
            optimizer = torch.optim.AdamW(model.parameters())
            total = None
            if policy == "budget:total":
                lo = ckptwrap.plan(model, "blocks", example_kwargs=batch, optimizer=optimizer).device_peak
                hi = ckptwrap.plan(model, "none", example_kwargs=batch, optimizer=optimizer).device_peak
                total = (lo + hi) // 2
                iteration(model, optimizer, batch)()  # trained a step before the budget
                plan = ckptwrap.plan(model, f"budget:total={total}B", example_kwargs=batch, optimizer=optimizer)
            else:
                plan = ckptwrap.plan(model, policy, example_kwargs=batch, optimizer=optimizer)
            apply_plan(model, plan)
            iteration(model, optimizer, batch)()  # the optimizer makes its state
            readings = [reading(model, optimizer, batch) for _ in range(READINGS)]
            found.append(dict(
                rank=rank, batch=[rows, length], sharding=sharding, policy=policy, total=total,
                checkpointed=len(plan.selected), predicted=plan.device_peak, plain_step=plan.plain_peak,
                tracked=tracked(model, optimizer, batch), least=min(readings), most=max(readings),
                unit=largest_unit(model), blocks=len(find_blocks(model)),
            ))
            del model, optimizer
            gc.collect()
    return found


def lazy(rank: int, kind: str) -> Dict[str, Any]:
    """The second table's rows for this rank (see the module)."""
    plain = shard(build(kind))
    plain_optimizer = torch.optim.AdamW(plain.parameters())
    longest = batch_of(rank, *LONGEST, seed=0)
    lo = ckptwrap.plan(plain, "blocks", example_kwargs=longest, optimizer=plain_optimizer).device_peak
    hi = ckptwrap.plan(plain, "none", example_kwargs=longest, optimizer=plain_optimizer).device_peak
    total = (lo + hi) // 2
    iteration(plain, plain_optimizer, longest)()  # its optimizer's state made, as the loop's will be
    model = shard(build(kind))
    optimizer = torch.optim.AdamW(model.parameters())
    ckptwrap.wrap_model(model, f"budget:total={total}B", optimizer=optimizer)
    steps = []
    for step, (rows, length) in enumerate(LAZY[rank]):
        batch = batch_of(rank, rows, length, seed=step + 1)
        peak = reading(model, optimizer, batch)
        plain_held = held(plain, plain_optimizer, batch)
        steps.append(dict(
            batch=[rows, length], peak=peak, plain=reading(plain, plain_optimizer, batch) - plain_held,
            checkpointed=len(model.ckptwrap_plan),
        ))
    return dict(rank=rank, total=total, slack=2 * largest_unit(model), steps=steps)


def rank_report(rank: int, world: int, kind: str = "llama") -> Dict[str, Any]:
    """Both tables' rows for this rank of ``world`` on the model ``kind`` (of
    :data:`MODELS`); every rank of the group must call it together (FSDP2's collectives)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"planned": planned(rank, world, kind), "lazy": lazy(rank, kind)}


def worst_over(report: Dict[str, Any]) -> float:
    """The lazy loop's largest step above its total, as a share of the largest plain
    step so far (negative: under)."""
    largest, worst = 0, -float("inf")
    for step in report["steps"]:
        largest = max(largest, step["plain"])
        worst = max(worst, (step["peak"] - report["total"]) / largest)
    return worst


def _run_rank(world: int, kind: str, out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        out.write_text(json.dumps(rank_report(rank, world, kind)))
    finally:
        gc.collect()  # a sharded model that outlives the group can crash the process at exit
        dist.destroy_process_group()


def _launch(world: int, kind: str, folder: Path) -> List[Dict[str, Any]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ranks = [
        subprocess.Popen(
            [
                sys.executable, __file__, "--rank-of", str(world), "--model", kind,
                "--out", str(folder / f"rank{rank}.json"),
            ],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(world)
    ]
    outputs = [process.communicate()[0] for process in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs)):
        if process.returncode != 0:
            raise SystemExit(f"rank {rank} of {world} exited with {process.returncode}:\n{output[-4000:]}")
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def _print_planned(world: int, reports: Sequence[Dict[str, Any]]) -> None:
    print(f"\n{world} ranks, planned with example inputs (MiB per rank; the allocator: least and most of {READINGS} iterations)\n")
    print("| rank | batch | sharding | policy | checkpointed | predicted | FSDPMemTracker | predicted / tracker | allocator least | allocator most |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for report in reports:
        for row in report["planned"]:
            policy = row["policy"] if row["total"] is None else f"budget:total={_mib(row['total'])}MiB"
            print(
                f"| {row['rank']} | {row['batch'][0]}x{row['batch'][1]} | {row['sharding']} | {policy} "
                f"| {row['checkpointed']}/{row['blocks']} "
                f"| {_mib(row['predicted'])} | {_mib(row['tracked'])} | {row['predicted'] / row['tracked']:.4f} "
                f"| {_mib(row['least'])} | {_mib(row['most'])} |"
            )


def _print_lazy(world: int, reports: Sequence[Dict[str, Any]]) -> None:
    print(f"\n{world} ranks, a lazy budget:total, batches of each rank's own shapes (MiB per rank)\n")
    print("| rank | total | steps (batch: iteration / plain step, checkpointed) | most above the total, share of plain |")
    print("|---|---|---|---|")
    for report in reports:
        lazy = report["lazy"]
        steps = ", ".join(
            f"{s['batch'][0]}x{s['batch'][1]}: {_mib(s['peak'])}/{_mib(s['plain'])} ({s['checkpointed']})" for s in lazy["steps"]
        )
        print(f"| {lazy['rank']} | {_mib(lazy['total'])} | {steps} | {100 * worst_over(lazy):+.2f}% |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes (at most 4)")
    parser.add_argument("--model", default="llama", choices=MODELS, help="the model (default: llama)")
    parser.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of is not None:
        _run_rank(args.rank_of, args.model, args.out)
        return 0
    import tempfile

    worlds = [int(part) for part in args.ranks.split(",")]
    if any(world not in (1, 2, 3, 4) for world in worlds):
        parser.error(f"--ranks {args.ranks!r}: each world size must be 1 to 4 (the ranks' batches are given for 4)")
    for world in worlds:
        with tempfile.TemporaryDirectory() as folder:
            reports = _launch(world, args.model, Path(folder))
        _print_planned(world, reports)
        _print_lazy(world, reports)
    return 0


if __name__ == "__main__":
    sys.exit(main())

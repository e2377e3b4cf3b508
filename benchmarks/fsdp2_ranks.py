"""Plans and budgets per rank under real FSDP2: N processes on the CPU (gloo, loopback),
or one per GPU with ``--device cuda`` (NCCL), each training a small Llama (or, with
``--model t5``, a small T5) sharded with ``fully_shard`` (each block, then the root) on
batches of its own shapes.

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

    python benchmarks/fsdp2_ranks.py [--ranks 2,4] [--model llama|t5] [--width 64 --layers 4]
    python benchmarks/fsdp2_ranks.py --device cuda --ranks 1 --width 1024 --layers 8 [--json PATH]

On CUDA the allocator is CUDA's (its events under ``torch.profiler``; no gloo copies,
so the readings are steady) and FSDPMemTracker reads the GPU; a rank count is at most
the GPUs there are (one GPU: one rank, whose all-gathers and reduce-scatters still run
through NCCL and FSDP2's buffers). ``--json`` writes both tables and the targets (every
planned row within 3% of the allocator's least reading; the lazy loop within its promise
and slack) for ``scripts/gpu_check.py``.

A rank is this script run with ``--rank-of WORLD`` and the environment torchrun would set
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); ``tests/distributed``
imports :func:`rank_report` and runs it in its own two-process launch.
"""

from __future__ import annotations

import argparse
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every rank trains, and where: the model (of :data:`MODELS`), its width and
    layers (per stack), the device type (``cpu``: gloo; ``cuda``: NCCL, a GPU per rank)."""

    model: str = "llama"
    width: int = 64
    layers: int = 4
    device: str = "cpu"

    def where(self) -> torch.device:
        """This rank's device (``LOCAL_RANK``'s GPU on CUDA)."""
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device(self.device, int(os.environ.get("LOCAL_RANK", "0")))


def build(setup: Setup = Setup()) -> torch.nn.Module:
    """The model ``setup`` names, the same on every rank (seeded), in train mode on the
    rank's device."""
    import transformers

    torch.manual_seed(0)
    width, layers = setup.width, setup.layers
    if setup.model == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=width, d_ff=width * 5 // 2, d_kv=16, num_heads=width // 8, num_layers=layers,
            num_decoder_layers=layers, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
            decoder_start_token_id=0, pad_token_id=0, use_cache=False,
        )
        model = transformers.T5ForConditionalGeneration(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
            num_attention_heads=width // 16, num_key_value_heads=width // 16, use_cache=False,
        )
        model = transformers.LlamaForCausalLM(config)
    return model.to(setup.where()).train()


def shard(
    model: torch.nn.Module, reshard_after_forward: bool = True, mixed: bool = False, replicas: int = 1,
    device: str = "cpu",
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
        mesh = init_device_mesh(device, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    options = sharding_options(not reshard_after_forward, torch.bfloat16 if mixed else None, torch.float32)
    shard_blocks(model, mesh, options)
    return model


def batch_of(rank: int, rows: int, length: int, seed: int, setup: Setup = Setup()) -> Dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (rows, length), generator=torch.Generator().manual_seed(1000 * seed + rank))
    ids = ids.to(setup.where())
    return {"input_ids": ids, "labels": ids.clone()}


def tracked(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Dict[str, Any], setup: Setup) -> int:
    """``FSDPMemTracker``'s peak over one iteration on this rank."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((batch,))
    with tracker:
        iteration(model, optimizer, batch)()
    return tracker.get_tracker_snapshot("peak")[setup.where()]["Total"]


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


def planned(rank: int, world: int, setup: Setup) -> List[Dict[str, Any]]:
    """The first table's rows for this rank (see the module)."""
    rows, length = PLANNED[rank]
    batch = batch_of(rank, rows, length, seed=0, setup=setup)
    found = []
    for sharding, options in SHARDINGS.items():
        replicas = options.get("replicas", 1)
        if replicas > 1 and world < 2 * replicas:  # HSDP needs groups of two or more
            continue
        for policy in ("none", "blocks", "budget:total"):
            if policy == "budget:total" and sharding != "default":
                continue
            model = shard(build(setup), **options, device=setup.device)
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
            readings = [reading(model, optimizer, batch, setup.device) for _ in range(READINGS)]
            found.append(dict(
                rank=rank, batch=[rows, length], sharding=sharding, policy=policy, total=total,
                checkpointed=len(plan.selected), predicted=plan.device_peak, plain_step=plan.plain_peak,
                tracked=tracked(model, optimizer, batch, setup), least=min(readings), most=max(readings),
                unit=largest_unit(model), blocks=len(find_blocks(model)),
            ))
            del model, optimizer
            _collect(setup)
    return found


def _collect(setup: Setup) -> None:
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()


def lazy(rank: int, setup: Setup) -> Dict[str, Any]:
    """The second table's rows for this rank (see the module)."""
    plain = shard(build(setup), device=setup.device)
    plain_optimizer = torch.optim.AdamW(plain.parameters())
    longest = batch_of(rank, *LONGEST, seed=0, setup=setup)
    lo = ckptwrap.plan(plain, "blocks", example_kwargs=longest, optimizer=plain_optimizer).device_peak
    hi = ckptwrap.plan(plain, "none", example_kwargs=longest, optimizer=plain_optimizer).device_peak
    total = (lo + hi) // 2
    iteration(plain, plain_optimizer, longest)()  # its optimizer's state made, as the loop's will be
    model = shard(build(setup), device=setup.device)
    optimizer = torch.optim.AdamW(model.parameters())
    ckptwrap.wrap_model(model, f"budget:total={total}B", optimizer=optimizer)
    steps = []
    for step, (rows, length) in enumerate(LAZY[rank]):
        batch = batch_of(rank, rows, length, seed=step + 1, setup=setup)
        peak = reading(model, optimizer, batch, setup.device)
        plain_held = held(plain, plain_optimizer, batch)
        steps.append(dict(
            batch=[rows, length], peak=peak, plain=reading(plain, plain_optimizer, batch, setup.device) - plain_held,
            checkpointed=len(model.ckptwrap_plan),
        ))
    return dict(rank=rank, total=total, slack=2 * largest_unit(model), steps=steps)


def rank_report(rank: int, world: int, setup: Setup = Setup()) -> Dict[str, Any]:
    """Both tables' rows for this rank of ``world`` on what ``setup`` says; every rank of
    the group must call it together (FSDP2's collectives)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"planned": planned(rank, world, setup), "lazy": lazy(rank, setup)}


def worst_over(report: Dict[str, Any]) -> float:
    """The lazy loop's largest step above its total, as a share of the largest plain
    step so far (negative: under)."""
    largest, worst = 0, -float("inf")
    for step in report["steps"]:
        largest = max(largest, step["plain"])
        worst = max(worst, (step["peak"] - report["total"]) / largest)
    return worst


def worst_within(report: Dict[str, Any]) -> float:
    """The lazy loop's largest step above its total less the slack (two layers'
    gathered parameters), as a share of the largest plain step so far: at most
    :data:`PROMISE` where the budget holds."""
    largest, worst = 0, -float("inf")
    for step in report["steps"]:
        largest = max(largest, step["plain"])
        worst = max(worst, (step["peak"] - report["total"] - report["slack"]) / largest)
    return worst


def _run_rank(world: int, setup: Setup, out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    timeout = datetime.timedelta(seconds=600)
    if setup.device == "cuda":
        torch.cuda.set_device(setup.where())
        dist.init_process_group("nccl", timeout=timeout, device_id=setup.where())
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        out.write_text(json.dumps(rank_report(rank, world, setup)))
    finally:
        gc.collect()  # a sharded model that outlives the group can crash the process at exit
        dist.destroy_process_group()


def _launch(world: int, setup: Setup, folder: Path) -> List[Dict[str, Any]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    flags = ["--model", setup.model, "--width", str(setup.width), "--layers", str(setup.layers), "--device", setup.device]
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-of", str(world), *flags, "--out", str(folder / f"rank{rank}.json")],
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


def _planned_table(world: int, reports: Sequence[Dict[str, Any]]) -> str:
    lines = [
        f"{world} ranks, planned with example inputs (MiB per rank; the allocator: least and most of {READINGS} iterations)",
        "",
        "| rank | batch | sharding | policy | checkpointed | predicted | FSDPMemTracker | predicted / tracker | allocator least | allocator most |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        for row in report["planned"]:
            policy = row["policy"] if row["total"] is None else f"budget:total={_mib(row['total'])}MiB"
            lines.append(
                f"| {row['rank']} | {row['batch'][0]}x{row['batch'][1]} | {row['sharding']} | {policy} "
                f"| {row['checkpointed']}/{row['blocks']} "
                f"| {_mib(row['predicted'])} | {_mib(row['tracked'])} | {row['predicted'] / row['tracked']:.4f} "
                f"| {_mib(row['least'])} | {_mib(row['most'])} |"
            )
    return "\n".join(lines)


def _lazy_table(world: int, reports: Sequence[Dict[str, Any]]) -> str:
    lines = [
        f"{world} ranks, a lazy budget:total, batches of each rank's own shapes (MiB per rank)",
        "",
        "| rank | total | steps (batch: iteration / plain step, checkpointed) | most above the total, share of plain |",
        "|---|---|---|---|",
    ]
    for report in reports:
        lazy = report["lazy"]
        steps = ", ".join(
            f"{s['batch'][0]}x{s['batch'][1]}: {_mib(s['peak'])}/{_mib(s['plain'])} ({s['checkpointed']})" for s in lazy["steps"]
        )
        lines.append(f"| {lazy['rank']} | {_mib(lazy['total'])} | {steps} | {100 * worst_over(lazy):+.2f}% |")
    return "\n".join(lines)


def _targets(world: int, reports: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every planned row within 3% of the allocator's least reading; each rank's lazy
    loop within the promise and the slack."""
    rows = [row for report in reports for row in report["planned"]]
    off = max(abs(row["predicted"] / row["least"] - 1) for row in rows)
    within = max(worst_within(report["lazy"]) for report in reports)
    return [
        {"name": f"{world} ranks: every plan within 3% of the allocator's least reading", "value": round(off, 4),
         "passed": off <= 0.03},
        {"name": f"{world} ranks: no lazy step above budget:total by > {PROMISE:.0%} of plain (beyond the slack)",
         "value": round(within, 4), "passed": within <= PROMISE},
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes (at most 4; on CUDA, at most the GPUs)")
    parser.add_argument("--model", default="llama", choices=MODELS, help="the model (default: llama)")
    parser.add_argument("--width", type=int, default=64, help="the model's width (default 64; a multiple of 16)")
    parser.add_argument("--layers", type=int, default=4, help="layers per stack (default 4)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (gloo) or cuda (NCCL, a GPU per rank)")
    parser.add_argument("--json", type=Path, help="write the tables and targets here (for scripts/gpu_check.py)")
    parser.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = Setup(args.model, args.width, args.layers, args.device)
    if args.rank_of is not None:
        _run_rank(args.rank_of, setup, args.out)
        return 0
    import tempfile

    if args.width % 16 or args.width < 16:
        parser.error(f"--width {args.width}: must be a positive multiple of 16 (heads of 16)")
    worlds = [int(part) for part in args.ranks.split(",")]
    most = 4 if args.device == "cpu" else min(4, torch.cuda.device_count())
    if any(world < 1 or world > most for world in worlds):
        parser.error(f"--ranks {args.ranks!r}: each world size must be 1 to {most} "
                     f"(the ranks' batches are given for 4{'' if args.device == 'cpu' else '; one GPU per rank'})")
    tables, targets = [], []
    for world in worlds:
        with tempfile.TemporaryDirectory() as folder:
            reports = _launch(world, setup, Path(folder))
        tables += [_planned_table(world, reports), _lazy_table(world, reports)]
        targets += _targets(world, reports)
        print("\n" + "\n\n".join(tables[-2:]), flush=True)
    for target in targets:
        print(f"{target['name']}: {'PASS' if target['passed'] else 'FAIL'} ({target['value']})")
    if args.json is not None:
        args.json.write_text(json.dumps({"table": "\n\n".join(tables), "targets": targets}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

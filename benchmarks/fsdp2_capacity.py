"""Will it fit on N GPUs? Llama 3.1 8B and 70B and a Mixtral 8x7B shape, fine-tuned with
AdamW in bfloat16 under FSDP2, planned per rank without the hardware: each model built on
fake tensors and sharded with ``fully_shard`` (each decoder layer, then the root) over a
fake process group of N ranks, then ``ckptwrap.plan(model, "blocks;budget:device",
optimizer="adamw", device_rates=GPU)``.

Two tables:

- ``--table`` (the default): for each model, length and kind of GPU, the smallest number
  of ranks, among powers of two up to how many such GPUs one machine holds (8 H100 80 GiB,
  8 A100 40 GiB, 4 RTX 4090 24 GiB), at which a plan fits the GPU's memory less 5%, with
  what it recomputes and one rank's predicted peak; where none does, what one rank would
  need at the most ranks.
- ``--compare``: ckptwrap's whole-iteration peak per rank beside torch's
  ``FSDPMemTracker`` (an independent meter) over two iterations of the same model,
  sharding, inputs and optimizer on fake tensors (after one untracked iteration of
  another model: DTensor's first use of an operator on shards computes it on fake
  tensors of the whole parameter, which the tracker would count; and with Hugging Face's
  search for packed sequences answering none, as it does on real position ids), with
  both times.

Assumptions, as in training scripts: one sequence per rank (batch 1) of the given
length, labels for the causal loss, SDPA attention, no KV cache, AdamW's state in the
parameters' dtype (bfloat16; ``foreach``, as on a GPU), no mixed-precision policy, each
layer's parameters freed after its forward (``reshard_after_forward=True``). The
parameters, gradients and optimizer state per rank are the model's divided by N; the
layer being run holds its gathered parameters, and its gradients before they are
reduce-scattered.

    python benchmarks/fsdp2_capacity.py [--only llama-8b,...] [--lengths 4096,8192,32768]
                                        [--devices h100-sxm,a100-40gb,rtx-4090]
    python benchmarks/fsdp2_capacity.py --compare [--only llama-8b] [--lengths 4096] [--ranks 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

GIB = float(1 << 30)

MODELS: Dict[str, Dict[str, Any]] = {
    "llama-8b": {
        "about": "Llama 3.1 8B shape (32 layers of width 4096, 8 KV heads, vocabulary 128256)",
        "config": "LlamaConfig",
        "fields": dict(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256,
        ),
    },
    "llama-70b": {
        "about": "Llama 3.1 70B shape (80 layers of width 8192, 8 KV heads, vocabulary 128256)",
        "config": "LlamaConfig",
        "fields": dict(
            hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
            num_key_value_heads=8, vocab_size=128256,
        ),
    },
    "mixtral-8x7b": {
        "about": "Mixtral 8x7B shape (32 layers of width 4096, 8 experts, 2 per token, vocabulary 32000)",
        "config": "MixtralConfig",
        "fields": dict(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        ),
    },
    "t5-7b": {
        "about": "T5 v1.1-style encoder-decoder, 7.5B (16 + 16 layers of width 4096, gated GELU, eager attention)",
        "config": "T5Config",
        "class": "T5ForConditionalGeneration",
        "fields": dict(
            d_model=4096, d_ff=10240, d_kv=128, num_heads=32, num_layers=16, num_decoder_layers=16,
            feed_forward_proj="gated-gelu", vocab_size=32128, tie_word_embeddings=False,
            decoder_start_token_id=0, pad_token_id=0,
        ),
    },
}
DEVICES = {"h100-sxm": 8, "a100-40gb": 8, "rtx-4090": 4}
"""Each kind of GPU and how many of it one machine holds."""


# ---------------------------------------------------------------------------- one rank


def _rank(request: Dict[str, Any]) -> Dict[str, Any]:
    """In a process of its own (the fake process group is process-wide): build, shard and
    plan one configuration, and with ``compare``, track it with ``FSDPMemTracker``."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import ckptwrap
    from ckptwrap._cli_ranks import shard_blocks
    from ckptwrap.policy import find_blocks

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    spec = MODELS[request["model"]]
    config = getattr(transformers, spec["config"])(**spec["fields"], use_cache=False)
    model_class = getattr(transformers, spec.get("class") or spec["config"].replace("Config", "ForCausalLM"))
    ranks, tokens = request["ranks"], request["tokens"]
    dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    mesh = init_device_mesh("cpu", (ranks,))
    torch.set_default_dtype(torch.bfloat16)

    def sharded() -> torch.nn.Module:
        # Each block (a decoder layer; T5's encoder and decoder blocks), then the root.
        model = model_class(config).train()
        shard_blocks(model, mesh, {})
        return model

    ids = torch.randint(config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    found: Dict[str, Any] = {}
    with FakeTensorMode() as mode:
        fake_ids = mode.from_tensor(ids)
        batch = {"input_ids": fake_ids, "labels": fake_ids}
        model = sharded()
        started = time.perf_counter()
        try:
            plan = ckptwrap.plan(
                model, request["policy"], example_kwargs=batch, optimizer="adamw", device_rates=request["device"]
            )
        except ckptwrap.CheckpointConfigError as error:
            if error.needed is None:
                raise
            found.update(fits=False, needed=error.needed)
        else:
            step = plan.plain_peak if request["policy"] == "none" else plan.predicted_peak
            found.update(
                fits=True, peak=plan.device_memory.whole_peak(step), recomputed=len(plan.names),
                blocks=len(find_blocks(model)), seconds=plan.step_time,
            )
        found["planning_s"] = time.perf_counter() - started
        if request.get("compare"):
            found.update(_tracked(sharded, batch, request["policy"]))
    dist.destroy_process_group()
    return found


def _tracked(sharded: Any, batch: Dict[str, Any], policy: str) -> Dict[str, Any]:
    """``FSDPMemTracker``'s peak per rank over two iterations, after an untracked one of
    another model; ``policy`` applied with ckptwrap as training would."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    import ckptwrap

    def iteration(model: Any, optimizer: Any) -> None:
        out = model(**batch)  # kept through the backward, as planned without a loss_fn
        out.loss.backward()
        del out
        optimizer.step()
        optimizer.zero_grad()

    # On fake position ids Hugging Face's mask code cannot tell that each row is one
    # sequence (a fake tensor counts as tracing there) and builds a mask for packed
    # sequences, which every layer's attention then takes whole: a real step (and the
    # planned one, which runs such tiny factories for real) finds no packed sequences.
    try:
        from transformers import masking_utils

        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    except (ImportError, AttributeError):
        pass
    for warm_up in (True, False):
        model = sharded()
        if policy != "none":
            ckptwrap.wrap_model(model, policy)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        if warm_up:
            iteration(model, optimizer)
    started = time.perf_counter()
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((batch["input_ids"],))
    with tracker:
        for _ in range(2):
            iteration(model, optimizer)
            tracker.reset_mod_stats()
    snapshot = tracker.get_tracker_snapshot("peak")
    total = next(value["Total"] for device, value in snapshot.items() if device.type == "cpu")
    return {"tracked": total, "tracking_s": time.perf_counter() - started}


def run(request: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`_rank` in a fresh process; its error, if it failed."""
    done = subprocess.run(
        [sys.executable, __file__, "--rank", json.dumps(request)], capture_output=True, text=True, timeout=3600,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------- tables


def smallest_fit(model: str, tokens: int, device: str) -> Dict[str, Any]:
    """The smallest power-of-two rank count up to the machine's that fits, or what the
    most ranks would need."""
    found: Dict[str, Any] = {}
    ranks = 1
    while ranks <= DEVICES[device]:
        found = run({"model": model, "tokens": tokens, "ranks": ranks, "policy": "blocks;budget:device", "device": device})
        found["ranks"] = ranks
        if found.get("fits") or "error" in found:
            return found
        ranks *= 2
    return found


def shown(found: Dict[str, Any]) -> str:
    if "error" in found:
        return "error: " + found["error"]
    if not found["fits"]:
        return f"no: {found['needed'] / GIB:.1f} GiB per rank at {found['ranks']}"
    recomputed = "nothing recomputed" if not found["recomputed"] else f"{found['recomputed']}/{found['blocks']} blocks"
    ranks = f"{found['ranks']} rank{'s' if found['ranks'] > 1 else ''}"
    return f"{ranks}: {recomputed}, {found['peak'] / GIB:.1f} GiB"


def table(models: Sequence[str], lengths: Sequence[int], devices: Sequence[str]) -> None:
    header = ["model", "tokens"] + [f"{DEVICES[d]} x {d}" for d in devices]
    rows: List[List[str]] = []
    started = time.perf_counter()
    for model in models:
        for tokens in lengths:
            rows.append([model, str(tokens)] + [shown(smallest_fit(model, tokens, d)) for d in devices])
            print("  ".join(rows[-1]), flush=True)
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n" + "\n".join(f"- {m}: {MODELS[m]['about']}" for m in models))
    print(f"\n(planned in {time.perf_counter() - started:.0f} s)")


def compare(models: Sequence[str], lengths: Sequence[int], ranks: Sequence[int]) -> None:
    header = ["model", "tokens", "ranks", "policy", "ckptwrap GiB", "FSDPMemTracker GiB", "ckptwrap / tracker",
              "planning s", "tracking s"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for model in models:
        for tokens in lengths:
            for count in ranks:
                for policy in ("none", "blocks"):
                    found = run({
                        "model": model, "tokens": tokens, "ranks": count, "policy": policy,
                        "device": "h100-sxm", "compare": True,
                    })
                    if "error" in found or not found.get("fits", True) or "tracked" not in found:
                        cells = [found.get("error", "no plan")] + ["-"] * 4
                    else:
                        cells = [
                            f"{found['peak'] / GIB:.2f}", f"{found['tracked'] / GIB:.2f}",
                            f"{found['peak'] / found['tracked']:.4f}", f"{found['planning_s']:.1f}",
                            f"{found['tracking_s']:.1f}",
                        ]
                    print("| " + " | ".join([model, str(tokens), str(count), policy] + cells) + " |", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated of " + ", ".join(MODELS))
    parser.add_argument("--lengths", default="4096,8192,32768")
    parser.add_argument("--devices", default=",".join(DEVICES), help="comma-separated of " + ", ".join(DEVICES))
    parser.add_argument("--compare", action="store_true", help="ckptwrap beside FSDPMemTracker")
    parser.add_argument("--ranks", default="8", help="with --compare: comma-separated rank counts")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        print(json.dumps(_rank(json.loads(args.rank))))
        return 0
    models = args.only.split(",") if args.only else list(MODELS)
    unknown = [m for m in models if m not in MODELS] + [d for d in args.devices.split(",") if d not in DEVICES]
    if unknown:
        parser.error(f"unknown {unknown}; models: {', '.join(MODELS)}; devices: {', '.join(DEVICES)}")
    lengths = [int(text) for text in args.lengths.split(",")]
    if args.compare:
        compare(models, lengths, [int(text) for text in args.ranks.split(",")])
    else:
        table(models, lengths, args.devices.split(","))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())

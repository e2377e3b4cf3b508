"""What fits where: Llama 1B and 8B and a 7.5B encoder-decoder, fine-tuned with AdamW in
bfloat16 at 2k, 4k and 8k tokens, on a 24, 40 and 80 GiB GPU, planned without the
hardware (each model built on the meta device, nothing allocated).

For each model and length, ``ckptwrap.plan(model, "blocks;budget:device",
optimizer="adamw", device_rates=GPU)`` chooses the blocks to recompute so that the whole
iteration (parameters, AdamW's state, the training step, AdamW's own step) fits the GPU's
memory less 5%; the cell says the plan (nothing, or how many blocks are recomputed),
the device's predicted peak and the step time priced at that GPU's dense peak rates (a
lower bound: FLOPs at peak, each tensor written and read once), or, where nothing fits,
the memory it would need.

    python benchmarks/capacity.py [--only llama-1b,...] [--lengths 2048,4096,8192] [--devices rtx-4090,a100-40gb,h100-sxm]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import ckptwrap
from ckptwrap import CheckpointConfigError
from ckptwrap.measure import DEVICE_RATES

GIB = float(1 << 30)


def _llama(**fields: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))

    return build


def _t5(**fields: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        return transformers.T5ForConditionalGeneration(transformers.T5Config(**fields))

    return build


MODELS: Dict[str, Tuple[str, Callable[[], torch.nn.Module]]] = {
    "llama-1b": (
        "Llama 3.2 1B shape (16 layers of width 2048, vocabulary 128256, tied embeddings)",
        _llama(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
        ),
    ),
    "llama-8b": (
        "Llama 3.1 8B shape (32 layers of width 4096, vocabulary 128256)",
        _llama(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256,
        ),
    ),
    "t5-7b": (
        "T5 v1.1-style encoder-decoder, 7.5B (16 + 16 layers of width 4096, gated GELU, "
        "eager attention with relative position bias)",
        _t5(
            d_model=4096, d_ff=10240, d_kv=128, num_heads=32, num_layers=16, num_decoder_layers=16,
            feed_forward_proj="gated-gelu", vocab_size=32128, tie_word_embeddings=False,
            decoder_start_token_id=0, pad_token_id=0,
        ),
    ),
}
DEVICES = ("rtx-4090", "a100-40gb", "h100-sxm")


def build_meta(name: str) -> torch.nn.Module:
    """``name``'s model in bfloat16 on the meta device, in train mode."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return MODELS[name][1]().train()
    finally:
        torch.set_default_dtype(default)


def batch_of(model: torch.nn.Module, length: int) -> Dict[str, torch.Tensor]:
    """One sequence of ``length`` tokens, labelled (for the encoder-decoder, ``length``
    target tokens too), real tensors on the CPU."""
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (1, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def cell(model: torch.nn.Module, batch: Dict[str, torch.Tensor], device: str) -> Dict[str, Any]:
    """The plan on ``device``: what it recomputes, the device's peak and the step's time,
    or what it would need."""
    blocks = len(ckptwrap.plan(model, "blocks").names)
    try:
        plan = ckptwrap.plan(
            model, "blocks;budget:device", example_kwargs=batch, optimizer="adamw", device_rates=device
        )
    except CheckpointConfigError as error:
        if error.needed is None:
            raise
        return {"fits": False, "needed": error.needed}
    return {
        "fits": True, "recomputed": len(plan.names), "blocks": blocks, "peak": plan.device_peak,
        "seconds": plan.step_time, "memory": plan.device_memory,
    }


def shown(result: Dict[str, Any]) -> str:
    if not result["fits"]:
        return f"no: needs {result['needed'] / GIB:.1f} GiB"
    plan = "nothing recomputed" if not result["recomputed"] else f"{result['recomputed']}/{result['blocks']} blocks"
    return f"{plan}; {result['peak'] / GIB:.1f} GiB; {result['seconds']:.2f} s"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated of " + ", ".join(MODELS))
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--devices", default=",".join(DEVICES))
    args = parser.parse_args(argv)
    devices = args.devices.split(",")
    rows: List[List[str]] = []
    parts: List[str] = []
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in args.only.split(",") if args.only else MODELS:
            model = build_meta(name)
            for length in (int(text) for text in args.lengths.split(",")):
                batch = batch_of(model, length)
                results = [cell(model, batch, device) for device in devices]
                rows.append([name, str(length)] + [shown(result) for result in results])
                print("  ".join(rows[-1]), flush=True)
                memory = next((r["memory"] for r in results if r["fits"]), None)
                if memory is not None and length == int(args.lengths.split(",")[0]):
                    parts.append(
                        f"- {name}: {MODELS[name][0]}; parameters {memory.parameters / GIB:.1f} GiB, "
                        f"gradients {memory.gradients / GIB:.1f} GiB, AdamW state "
                        f"{memory.optimizer_state / GIB:.1f} GiB, AdamW step temporaries "
                        f"{memory.optimizer_step / GIB:.1f} GiB"
                    )
    header = ["model", "tokens"] + [
        f"{device} ({DEVICE_RATES[device].memory_bytes / GIB:.0f} GiB)" for device in devices
    ]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print("\n".join(parts))
    print(f"\n(planned in {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

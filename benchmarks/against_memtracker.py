"""Peaks of models too large to run here: ckptwrap's plan made on the meta device against
torch's ``MemTracker`` run over the same training step on fake tensors.

Llama 3.2 1B-shaped and Llama 2 7B-shaped configurations (transformers' ``LlamaConfig``,
random weights, nothing downloaded) and a T5-XL-shaped encoder-decoder (``T5Config``, T5
v1.1's gated GELU, eager attention with a relative position bias), one sequence of 4096 or
8192 tokens, bfloat16 and float32: the step peak above the parameters and buffers
(activations, gradients of activations, parameter gradients, the loss) with nothing
checkpointed and under ``blocks``, and the whole iteration's peak with AdamW (parameters,
buffers, AdamW's state, the step, and AdamW's own step). ckptwrap predicts them from one
step on fake tensors (``plan`` on the meta device, ``optimizer="adamw"``); ``MemTracker``
follows every fake allocation of the step (with ``blocks`` applied by ``wrap_model``) and
gives its peak, less the parameters and buffers it counts too, and of two whole
iterations (forward, backward, ``AdamW.step()``, ``zero_grad()``). Target: within 2%.

A third meter, "storages", follows the same step with nothing but a dispatch mode that
counts each fake storage from the operator that makes it until it is freed: no module
hooks. ``MemTracker``'s module tracker hooks every module's positional tensor inputs
with ``register_multi_grad_hook``, which holds each input's gradient until the gradients
of all of them have come: T5's blocks take the position bias (the encoder's) or the
encoder's output (the decoder's) beside their hidden states, so during the backward
``MemTracker`` keeps the gradients of the hidden states of every block whose shared
input has not had its gradient yet, which the training step has freed. That is the
difference between the two on T5 under ``blocks`` (22 x tokens x width x 2 bytes at the
XL shape); on Llama, whose layers take one positional tensor, they agree. The target is
read against the storages.

    python benchmarks/against_memtracker.py [--only llama-1b,t5-xl] [--lengths 4096,8192]
                                            [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence

import torch

import ckptwrap

CONFIGS: Dict[str, Dict[str, int]] = {
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    ),
    "llama-7b": dict(),  # LlamaConfig's defaults: 32 layers of width 4096
    "t5-xl": dict(
        d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_decoder_layers=24, num_heads=32,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
    ),
}
TARGET = 0.02


def configuration(name: str):
    """The transformers configuration of ``CONFIGS[name]``."""
    import transformers

    if name.startswith("t5"):
        config = transformers.T5Config(**CONFIGS[name])
        config._attn_implementation = "eager"
        return config
    return transformers.LlamaConfig(**CONFIGS[name])


def build(config, dtype: torch.dtype):
    """The model of ``config`` (a ``LlamaForCausalLM``, or a ``T5ForConditionalGeneration``
    for a ``T5Config``) made in ``dtype`` (under whatever device or fake mode is in force)."""
    import transformers

    kind = (
        transformers.T5ForConditionalGeneration
        if isinstance(config, transformers.T5Config)
        else transformers.LlamaForCausalLM
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return kind(config).train()
    finally:
        torch.set_default_dtype(default)


def storages_peak(config, dtype: torch.dtype, ids: torch.Tensor, policy: str) -> int:
    """The peak of one training step on fake tensors under ``policy`` (applied by
    ``wrap_model``), above the parameters and buffers, counted by a bare dispatch mode:
    each storage an operator makes, from then until it is freed."""
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    counted: "weakref.WeakKeyDictionary[torch.UntypedStorage, int]" = weakref.WeakKeyDictionary()
    state = {"live": 0, "peak": 0}

    def freed(nbytes: int) -> None:
        state["live"] -= nbytes

    class Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage() not in counted:
                    storage = tensor.untyped_storage()
                    counted[storage] = storage.nbytes()
                    state["live"] += storage.nbytes()
                    weakref.finalize(storage, freed, storage.nbytes())
            state["peak"] = max(state["peak"], state["live"])
            return out

    with FakeTensorMode() as mode:
        model = build(config, dtype)
        if policy != "none":
            ckptwrap.wrap_model(model, policy)
        fake_ids = mode.from_tensor(ids)
        for tensor in [*model.parameters(), *model.buffers(), fake_ids]:
            counted[tensor.untyped_storage()] = 0
        with Storages():
            out = model(input_ids=fake_ids, labels=fake_ids)
            out.loss.backward()
            del out
    return state["peak"]


def memtracker_peak(config, dtype: torch.dtype, ids: torch.Tensor, policy: str) -> int:
    """MemTracker's peak of one training step of a ``LlamaForCausalLM`` on fake tensors,
    less the parameters and buffers, under ``policy`` applied by ``wrap_model``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode() as mode:
        model = build(config, dtype)
        if policy != "none":
            ckptwrap.wrap_model(model, policy)
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        tracker = MemTracker()
        tracker.track_external(model)
        fake_ids = mode.from_tensor(ids)
        with tracker:
            out = model(input_ids=fake_ids, labels=fake_ids)
            out.loss.backward()
        peaks = tracker.get_tracker_snapshot("peak")
    return next(value["Total"] for device, value in peaks.items() if device.type == "cpu") - held


def memtracker_iteration_peak(config, dtype: torch.dtype, ids: torch.Tensor, policy: str) -> int:
    """MemTracker's peak over two training iterations with AdamW of a ``LlamaForCausalLM``
    on fake tensors (the second holds AdamW's state throughout), everything counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode() as mode:
        model = build(config, dtype)
        if policy != "none":
            ckptwrap.wrap_model(model, policy)
        optimizer = torch.optim.AdamW(model.parameters())
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        fake_ids = mode.from_tensor(ids)
        with tracker:
            for _ in range(2):
                out = model(input_ids=fake_ids, labels=fake_ids)
                out.loss.backward()
                del out
                optimizer.step()
                optimizer.zero_grad()
                tracker.reset_mod_stats()  # per-module numbers; the peak stays
        peaks = tracker.get_tracker_snapshot("peak")
    return next(value["Total"] for device, value in peaks.items() if device.type == "cpu")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated of " + ", ".join(CONFIGS))
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args(argv)

    rows: List[List[str]] = []
    worst = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in args.only.split(",") if args.only else CONFIGS:
            config = configuration(name)
            for length in (int(text) for text in args.lengths.split(",")):
                ids = torch.randint(config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
                for dtype_name in args.dtypes.split(","):
                    dtype = getattr(torch, dtype_name)
                    with torch.device("meta"):
                        meta = build(config, dtype)
                    for policy in ("none", "blocks"):
                        start = time.perf_counter()
                        plan = ckptwrap.plan(
                            meta, policy, example_kwargs={"input_ids": ids, "labels": ids}, optimizer="adamw"
                        )
                        ours_s = time.perf_counter() - start
                        ours = plan.plain_peak if policy == "none" else plan.predicted_peak
                        ours_whole = plan.device_memory.whole_peak(ours)
                        start = time.perf_counter()
                        theirs = memtracker_peak(config, dtype, ids, policy)
                        theirs_whole = memtracker_iteration_peak(config, dtype, ids, policy)
                        theirs_s = time.perf_counter() - start
                        counted = storages_peak(config, dtype, ids, policy)
                        worst = max(worst, abs(ours / counted - 1), abs(ours_whole / theirs_whole - 1))
                        rows.append([
                            name, str(length), dtype_name, policy, f"{ours / 2**30:.2f}", f"{counted / 2**30:.2f}",
                            f"{ours / counted - 1:+.2%}", f"{theirs / 2**30:.2f}", f"{ours / theirs - 1:+.2%}",
                            f"{ours_whole / 2**30:.2f}", f"{theirs_whole / 2**30:.2f}",
                            f"{ours_whole / theirs_whole - 1:+.2%}", f"{ours_s:.1f}", f"{theirs_s:.1f}",
                        ])
                        print("  ".join(rows[-1]), flush=True)
    header = [
        "model", "tokens", "dtype", "policy", "step: ckptwrap GiB", "storages GiB", "difference",
        "MemTracker GiB", "difference", "iteration with AdamW: ckptwrap GiB", "MemTracker GiB", "difference",
        "ckptwrap s", "MemTracker s",
    ]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        f"\ntarget (the step within {TARGET:.0%} of the storages, the iteration of MemTracker): "
        f"{'met' if worst <= TARGET else 'MISSED'} (worst {worst:.2%})"
    )
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())

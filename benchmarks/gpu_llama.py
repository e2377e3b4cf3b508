"""Benchmark ckptwrap's tiers on a Llama-style model of about 1B parameters, on CUDA.

The model is transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` (hidden 2048,
16 layers, 16 heads, intermediate 5632, vocabulary 32000 by default), parameters in
bfloat16, sequences of 4096 tokens. Without transformers it falls back to the examples'
GPT at the same sizes, and says so. Configurations: ``none``, ``blocks``,
``blocks;selective``, ``budget:50%``, ``offload`` (``blocks;offload``) and torch's
``save_on_cpu(pin_memory=True)`` around the whole step, the offload baseline.

Configurations take turns step by step (order rotating each round) after warm-up rounds;
the table shows the median step time, tokens/s, the peak allocated memory above the
step's start (``torch.cuda.max_memory_allocated``), ratios to ``none``, and each
configuration's gradients against ``none`` (max |difference|, bit-equal). It checks the
offload target: step time at most 5% above ``none`` at 8192 tokens per step or more.

    python benchmarks/gpu_llama.py [--seq 8192] [--steps 5] [--warmup 2] [--strict]
    python benchmarks/gpu_llama.py --device cpu --tiny      # smoke test, no GPU needed
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

import ckptwrap

_MIB = 1024 * 1024
OFFLOAD_TIME_TARGET = 1.05
"""Offload step time / ``none`` step time, checked at OFFLOAD_TARGET_TOKENS or more."""
OFFLOAD_TARGET_TOKENS = 8192
CONFIGURATIONS = ("none", "blocks", "blocks;selective", "budget:50%", "offload", "save_on_cpu")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TINY = dict(hidden=32, layers=4, heads=2, intermediate=64, vocab=128, seq=512)
"""Sizes of ``--tiny``; the sequence is long enough for activations to outweigh the
parameter gradients, as at full size, so that ``budget:50%`` is reachable."""


@dataclasses.dataclass
class Result:
    """What was measured for one configuration."""

    name: str
    step_ms: List[float] = dataclasses.field(default_factory=list)
    peak_bytes: int = 0
    max_abs_diff: float = 0.0
    bit_equal: bool = True

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)


class Workload:
    """The model (one copy per configuration), its batch and how to run a step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.dtype = DTYPES[args.dtype]
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=generator).to(self.device)
        self.inputs, self.labels = ids[:, :-1], ids[:, 1:]
        torch.manual_seed(0)
        self.base, self.kind = _build(args)
        self.base = self.base.to(device=self.device, dtype=self.dtype).train()

    def loss(self, model: nn.Module) -> torch.Tensor:
        if self.kind == "llama":
            # Shifted already: the model's own shift would drop a position.
            logits = model(input_ids=self.inputs).logits
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), self.labels.flatten())
        return model(self.inputs, self.labels)

    def runner(self, name: str) -> Callable[[], None]:
        """A training step (forward and backward, fresh gradients) for configuration ``name``."""
        model = copy.deepcopy(self.base)
        if name == "offload":
            ckptwrap.wrap_model(model, "blocks;offload")
        elif name.startswith("budget:"):
            batch = {"input_ids": self.inputs} if self.kind == "llama" else None
            inputs = None if self.kind == "llama" else (self.inputs, self.labels)
            ckptwrap.wrap_model(model, name, example_inputs=inputs, example_kwargs=batch)
        elif name not in ("none", "save_on_cpu"):
            ckptwrap.wrap_model(model, name)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            if name == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda"):
                    loss = self.loss(model)
            else:
                loss = self.loss(model)
            loss.backward()

        step.model = model  # type: ignore[attr-defined]
        return step


def _build(args: argparse.Namespace):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("transformers is not installed: using the examples' GPT at the same sizes instead")
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
        from gpt import GPT, GPTConfig

        config = GPTConfig(vocab=args.vocab, width=args.hidden, heads=args.heads, layers=args.layers,
                           seq_len=args.seq, dropout=0.0)
        return GPT(config), "gpt"
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, use_cache=False,
    )
    return LlamaForCausalLM(config), "llama"


def run(args: argparse.Namespace) -> List[Result]:
    """Measure every configuration; the first is the reference."""
    work = Workload(args)
    params = sum(p.numel() for p in work.base.parameters())
    print(f"model: {work.kind}, {params / 1e9:.2f}B parameters in {args.dtype}, batch {args.batch} x "
          f"sequence {args.seq} = {args.batch * args.seq} tokens/step, {work.device}, torch {torch.__version__}")
    steps = {}
    for name in args.configs:
        try:
            steps[name] = work.runner(name)
        except ckptwrap.CheckpointError as error:  # a budget out of reach for these sizes
            print(f"{name}: left out: {error}")
    names = list(steps)
    results = {name: Result(name) for name in names}
    reference: Dict[str, torch.Tensor] = {}
    for name in names:  # untimed: gradients against the reference, and warms everything up
        steps[name]()
        got = {k: p.grad.detach().float().cpu() for k, p in steps[name].model.named_parameters()}
        if not reference:
            reference = got
        else:
            diffs = [(got[k] - reference[k]).abs().max().item() for k in reference]
            results[name].max_abs_diff = max(diffs)
            results[name].bit_equal = all(torch.equal(got[k], reference[k]) for k in reference)
        steps[name].model.zero_grad(set_to_none=True)
    del reference
    for index in range(args.warmup + args.steps):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed, peak = _timed(work.device, steps[name])
            if index >= args.warmup:
                results[name].step_ms.append(elapsed)
                results[name].peak_bytes = max(results[name].peak_bytes, peak)
            steps[name].model.zero_grad(set_to_none=True)
    return [results[name] for name in names]


def _timed(device: torch.device, step: Callable[[], None]):
    """Milliseconds of one step, and the peak bytes it allocated above its start."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = (time.perf_counter() - start) * 1000
    peak = torch.cuda.max_memory_allocated(device) - start_bytes if device.type == "cuda" else 0
    return elapsed, peak


def format_table(results: Sequence[Result], tokens: int) -> str:
    """The results as a text table, with ratios to the first (``none``)."""
    base = results[0]
    header = ("configuration", "median ms", "tokens/s", "peak MiB", "time ratio", "mem ratio", "max |diff|", "bit-equal")
    rows = [header]
    for r in results:
        rows.append((
            r.name, f"{r.median_ms:.1f}", f"{tokens / (r.median_ms / 1000):.0f}", f"{r.peak_bytes / _MIB:.0f}",
            f"{r.median_ms / base.median_ms:.3f}", f"{r.peak_bytes / max(base.peak_bytes, 1):.3f}",
            "reference" if r is base else f"{r.max_abs_diff:.3g}",
            "reference" if r is base else ("yes" if r.bit_equal else "NO"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def offload_verdict(results: Sequence[Result], tokens: int) -> Optional[bool]:
    """Whether ``offload`` meets its time target; None where it is not checked."""
    by_name = {r.name: r for r in results}
    if "offload" not in by_name or "none" not in by_name or tokens < OFFLOAD_TARGET_TOKENS:
        return None
    return by_name["offload"].median_ms / by_name["none"].median_ms <= OFFLOAD_TIME_TARGET


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark. Returns 0; 1 with ``--strict`` when a gradient differs or the
    offload target is missed; 2 when no CUDA device is available (without ``--tiny``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu with --tiny")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, one step: a smoke test that runs on the CPU")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="parameter dtype")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (>= 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS),
                        help="comma-separated, 'none' first (default: " + ",".join(CONFIGURATIONS).replace("%", "%%") + ")")
    parser.add_argument("--strict", action="store_true", help="exit 1 if gradients differ or the offload target is missed")
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in _TINY.items():
            setattr(args, key, value)
        args.steps, args.warmup = 1, 0
    args.configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [n for n in args.configs if n not in CONFIGURATIONS and not n.startswith("budget:")]
    if not args.configs or args.configs[0] != "none" or unknown:
        parser.error(f"--configs must start with 'none' and name only {', '.join(CONFIGURATIONS)} "
                     f"(or another budget:X); got {','.join(args.configs)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if torch.device(args.device).type != "cuda" and not args.tiny:
        print(f"error: this benchmark measures CUDA; --device {args.device} runs only with --tiny (a smoke test)",
              file=sys.stderr)
        return 2
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device is available (torch.cuda.is_available() is False); this benchmark "
              "needs one. For a smoke test on the CPU, pass --device cpu --tiny.", file=sys.stderr)
        return 2
    tokens = args.batch * args.seq
    results = run(args)
    print(format_table(results, tokens))
    verdict = offload_verdict(results, tokens)
    if verdict is None:
        print(f"offload target (step time <= {OFFLOAD_TIME_TARGET:.2f} x none at >= {OFFLOAD_TARGET_TOKENS} "
              f"tokens/step): not checked ({tokens} tokens/step)")
    else:
        ratio = {r.name: r for r in results}
        print(f"offload target (step time <= {OFFLOAD_TIME_TARGET:.2f} x none): "
              f"{'PASS' if verdict else 'FAIL'} ({ratio['offload'].median_ms / ratio['none'].median_ms:.3f})")
    all_equal = all(r.bit_equal for r in results)
    if not all_equal:
        print("note: some gradients are not bit-equal to the none configuration", file=sys.stderr)
    return 1 if args.strict and (not all_equal or verdict is False) else 0


if __name__ == "__main__":
    sys.exit(main())

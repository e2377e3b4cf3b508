"""Benchmark ckptwrap's tiers on a Llama-style model of about 1B parameters, on CUDA.

The model is transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` (hidden 2048,
16 layers, 16 heads, intermediate 5632, vocabulary 32000 by default), parameters in
bfloat16, sequences of 4096 tokens. Without transformers it falls back to the examples'
GPT at the same sizes, its attention through ``scaled_dot_product_attention`` (no
(batch, heads, s, s) score tensor), and says so. Configurations: ``none``, ``blocks``,
``blocks;selective``, ``budget:50%`` (planned with the benchmark's own loss), ``offload``
(``blocks;offload``: every block), ``first:K;offload`` (the K blocks whose copies the host
link can hide behind compute, from the arithmetic below) and torch's
``save_on_cpu(pin_memory=True)`` around the whole step, the offload baseline.

Kernels are deterministic (``torch.use_deterministic_algorithms`` and
``CUBLAS_WORKSPACE_CONFIG``, set before CUDA starts), so every configuration's gradients
can equal ``none``'s bit for bit; an operator without a deterministic kernel is named.
Configurations take turns step by step (order rotating each round) after warm-up rounds;
the table shows the median step time, tokens/s, the peak allocated memory above the
step's start (``torch.cuda.max_memory_allocated``), ratios to ``none``, the bytes the
offload rows move each way per step (ckptwrap's offloader statistics), and each row's
gradients against ``none``. A row that fails (out of memory included) is reported as
such and the others go on.

The offload target, from arithmetic: a block's saved tensors cross the host link twice
per step, to the host during the forward and back during the backward. At 8k tokens a
Llama layer of this size saves about 0.7 GB; over a ~50 GB/s link that is ~14 ms per
block and direction, ~0.22 s for 16 blocks, against a plain step of ~0.14 s. So
offloading every block cannot stay within 5% of ``none``; the link hides
K = floor(min(to-host bandwidth x forward time, from-host bandwidth x backward time) /
bytes per block) blocks (the first K: their copies have the rest of the forward, and
later blocks' backward, to hide behind). The link's bandwidth is measured (CUDA events
around a 1 GiB pinned copy each way), the bytes per block come from the offloader's
statistics, and the target (step time <= 1.05 x ``none`` at >= 8192 tokens per step) is
checked on ``first:K;offload``.

    python benchmarks/gpu_llama.py [--seq 8192] [--steps 5] [--warmup 2] [--strict] [--json PATH]
    python benchmarks/gpu_llama.py --device cpu --tiny      # smoke test, no GPU needed
"""

from __future__ import annotations

import os

# cuBLAS reads this when it makes its first handle: it must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ckptwrap  # noqa: E402
from ckptwrap.wrap._offload import default_offloader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _host_link import Arithmetic, Link, blocks_hidden, describe, measure_link, partial_offload_policy  # noqa: E402,F401

_MIB = 1024 * 1024
_GB = 1e9
OFFLOAD_TIME_TARGET = 1.05
"""Offload step time / ``none`` step time, checked at OFFLOAD_TARGET_TOKENS or more."""
OFFLOAD_TARGET_TOKENS = 8192
CONFIGURATIONS = ("none", "blocks", "blocks;overlap", "torch", "hf", "blocks;selective",
                  "blocks;selective;overlap", "budget:50%", "offload", "save_on_cpu")
"""The rows asked for by name; with ``offload`` comes ``first:K;offload``, K from the link.
``torch`` is the baseline for ``blocks``: ``torch.utils.checkpoint`` (non-re-entrant) around
each decoder layer; ``hf`` is transformers' own gradient checkpointing of the same layers
(``gradient_checkpointing_enable``, which calls torch's checkpoint). ``blocks;overlap``
recomputes each layer ahead of the backward, in a worker thread on a side stream."""
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TINY = dict(hidden=32, layers=4, heads=2, intermediate=64, vocab=128, seq=512)
"""Sizes of ``--tiny``; the sequence is long enough for activations to outweigh the
parameter gradients, as at full size, so that ``budget:50%`` is reachable."""
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclasses.dataclass
class Result:
    """What was measured for one configuration."""

    name: str
    step_ms: List[float] = dataclasses.field(default_factory=list)
    peak_bytes: int = 0
    max_abs_diff: float = 0.0
    bit_equal: bool = True
    error: Optional[str] = None
    """Why the row has no measurement (out of memory, an error while wrapping...)."""
    to_host: Optional[int] = None
    """Bytes the offloader copied to the host in one step (None: not an offload row)."""
    from_host: Optional[int] = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)


class Workload:
    """The model (one copy per configuration), its batch, its loss and how to run a step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.dtype = DTYPES[args.dtype]
        self.vocab = args.vocab
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randint(args.vocab, (args.batch, args.seq), generator=generator).to(self.device)
        torch.manual_seed(0)
        self.base, self.kind = _build(args)
        self.base = self.base.to(device=self.device, dtype=self.dtype).train()
        self.blocks = args.layers

    def loss_fn(self, output: Any) -> torch.Tensor:
        """Cross-entropy of the logits against labels made from their shape alone, so that
        the planner can measure the same loss at the smaller shapes it profiles."""
        logits = output.logits if hasattr(output, "logits") else output
        count = logits.shape[:-1].numel()
        labels = (torch.arange(count, device=logits.device) * 2654435761) % self.vocab
        return nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels)

    def forward(self, model: nn.Module) -> Any:
        return model(input_ids=self.inputs) if self.kind == "llama" else model(self.inputs)

    def runner(self, name: str) -> "Step":
        """A training step (forward and backward, fresh gradients) for configuration ``name``."""
        model = copy.deepcopy(self.base)
        if name.startswith("budget:"):
            inputs = {"example_kwargs": {"input_ids": self.inputs}} if self.kind == "llama" else {"example_inputs": (self.inputs,)}
            ckptwrap.wrap_model(model, name, loss_fn=self.loss_fn, **inputs)
            print(f"  {name}'s plan:\n" + "\n".join("    " + line for line in str(model.ckptwrap_plan).splitlines()), flush=True)
        elif name == "torch":
            _torch_checkpoint_layers(model)
        elif name == "hf":
            if self.kind != "llama":
                raise RuntimeError("the hf row needs transformers' Llama")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif name not in ("none", "save_on_cpu"):
            ckptwrap.wrap_model(model, "blocks;offload" if name == "offload" else name)
        return Step(self, model, save_on_cpu=name == "save_on_cpu")


class Step:
    """One configuration's training step; ``marks`` (three CUDA events) time its phases."""

    def __init__(self, work: Workload, model: nn.Module, *, save_on_cpu: bool) -> None:
        self.work, self.model, self.save_on_cpu = work, model, save_on_cpu

    def __call__(self, marks: Optional[Sequence[Any]] = None) -> None:
        work = self.work
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        hooks = (torch.autograd.graph.save_on_cpu(pin_memory=work.device.type == "cuda")
                 if self.save_on_cpu else contextlib.nullcontext())
        if marks:
            marks[0].record()
        with hooks:
            loss = work.loss_fn(work.forward(self.model))
        if marks:
            marks[1].record()
        loss.backward()
        if marks:
            marks[2].record()


def _torch_checkpoint_layers(model: nn.Module) -> None:
    """Run every block of ``model`` (its decoder layers) through
    ``torch.utils.checkpoint.checkpoint`` (non-re-entrant), names unchanged."""
    import torch.utils.checkpoint as torch_checkpoint

    for layer in (model.model.layers if hasattr(model, "model") else model.blocks):
        original = layer.forward

        def forward(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return torch_checkpoint.checkpoint(_original, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def _build(args: argparse.Namespace) -> Tuple[nn.Module, str]:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("transformers is not installed: using the examples' GPT at the same sizes instead, "
              "its attention through scaled_dot_product_attention")
        return _gpt_with_sdpa(args), "gpt"
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, use_cache=False,
    )
    return LlamaForCausalLM(config), "llama"


def _gpt_with_sdpa(args: argparse.Namespace) -> nn.Module:
    """The examples' GPT with each block's attention computed by SDPA: its written-out
    attention keeps (batch, heads, s, s) scores, 2 GiB per block at 8k tokens in bf16."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from gpt import GPT, CausalSelfAttention, GPTConfig

    class SdpaAttention(CausalSelfAttention):
        def __init__(self, config: GPTConfig) -> None:
            super().__init__(config)
            del self.causal_mask  # SDPA masks by is_causal

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, seq, width = x.shape
            q, k, v = self.qkv(x).split(width, dim=2)
            q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.resid_drop(self.proj(out.transpose(1, 2).reshape(batch, seq, width)))

    config = GPTConfig(vocab=args.vocab, width=args.hidden, heads=args.heads, layers=args.layers,
                       seq_len=args.seq, dropout=0.0)
    model = GPT(config)
    for block in model.blocks:
        block.attn = SdpaAttention(config)
    return model


def _offloaded() -> Tuple[int, int]:
    stats = default_offloader().stats
    return int(getattr(stats, "bytes_offloaded", 0)), int(getattr(stats, "bytes_fetched", 0))


@contextlib.contextmanager
def _recorded(result: Result, steps: Dict[str, Step]) -> Iterator[None]:
    """Run a row's work; on an error (out of memory included) record it on the row, drop
    the row's model and free what it held, and go on with the other rows."""
    try:
        yield
    except _OOM as error:
        result.error = "out of memory: " + str(error).split("\n")[0][:160]
    except Exception as error:  # noqa: BLE001 - every row reports, whatever fails
        result.error = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    if result.error is not None:
        steps.pop(result.name, None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> Tuple[List[Result], Arithmetic, List[str]]:
    """Measure every configuration (the first is the reference); also the link, the
    offload arithmetic, and the operators that lack a deterministic kernel."""
    work = Workload(args)
    params = sum(p.numel() for p in work.base.parameters())
    print(f"model: {work.kind}, {params / 1e9:.2f}B parameters in {args.dtype}, batch {args.batch} x "
          f"sequence {args.seq} = {args.batch * args.seq} tokens/step, {work.device}, torch {torch.__version__}")
    arithmetic = Arithmetic(measure_link(work.device), blocks=work.blocks)
    names = list(args.configs)
    results = {name: Result(name) for name in names}
    steps: Dict[str, Step] = {}
    reference: Dict[str, torch.Tensor] = {}
    nondeterministic: List[str] = []

    def first_step(name: str) -> None:  # untimed: gradients against the reference, warm-up
        nonlocal reference
        started = time.perf_counter()
        with _recorded(results[name], steps):
            steps[name] = work.runner(name)
            before = _offloaded()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                steps[name]()
            nondeterministic.extend(str(w.message).split("\n")[0] for w in caught if "deterministic" in str(w.message))
            after = _offloaded()
            if "offload" in name:
                results[name].to_host, results[name].from_host = after[0] - before[0], after[1] - before[1]
                if name == "offload":
                    arithmetic.offload_to_host, arithmetic.offload_from_host = results[name].to_host, results[name].from_host
            got = {k: p.grad.detach().float().cpu() for k, p in steps[name].model.named_parameters()}
            if name == names[0]:
                reference = got
            elif not reference:  # none did not run: nothing to compare with
                results[name].max_abs_diff, results[name].bit_equal = float("nan"), False
            else:
                results[name].max_abs_diff = max((got[k] - reference[k]).abs().max().item() for k in reference)
                results[name].bit_equal = all(torch.equal(got[k], reference[k]) for k in reference)
            steps[name].model.zero_grad(set_to_none=True)
            if name == "none":
                _phase_times(work.device, steps[name], arithmetic)
        # Progress, so that a run stopped by its time limit still says how far it got.
        state = "ready" if results[name].error is None else f"left out ({results[name].error})"
        print(f"  {name}: {state} after {time.perf_counter() - started:.1f} s", flush=True)

    for name in names:
        first_step(name)
    offload = results.get("offload")
    partial = partial_offload_policy(arithmetic, smoke_test=args.tiny) if offload and not offload.error else None
    if partial is not None:
        names.insert(names.index("offload") + 1, partial)
        results[partial] = Result(partial)
        first_step(partial)
    del reference
    live = [name for name in names if name in steps]
    for index in range(args.warmup + args.steps):
        shift = index % max(len(live), 1)
        for name in live[shift:] + live[:shift]:
            if name not in steps:
                continue
            with _recorded(results[name], steps):
                elapsed, peak = _timed(work.device, steps[name])
                if index >= args.warmup:
                    results[name].step_ms.append(elapsed)
                    results[name].peak_bytes = max(results[name].peak_bytes, peak)
                steps[name].model.zero_grad(set_to_none=True)
    if args.profile:
        _profile(work.device, {name: steps[name] for name in live if name in steps}, Path(args.profile),
                 trace=args.trace)
    return [results[name] for name in names], arithmetic, sorted(set(nondeterministic))


def _profile(device: torch.device, steps: Dict[str, "Step"], directory: Path,
             trace: Sequence[str] = ()) -> None:
    """One more step of each row under torch.profiler: its operators by device time, to
    ``DIRECTORY/profile-ROW.txt`` (after the timed steps, so it changes none of them)."""
    from torch.profiler import ProfilerActivity, profile

    directory.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    summaries = []
    for name, step in steps.items():
        with _labelled_recomputation(), profile(activities=activities, **_all_threads()) as prof:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        step.model.zero_grad(set_to_none=True)
        events = prof.key_averages()
        kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
        text = events.table(sort_by=sort, row_limit=40)
        label = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        summary = _timeline(name, prof.events())
        summaries.append(summary)
        (directory / f"profile-{label}.txt").write_text(f"row {name}: {kernels} device events\n{summary}\n{text}\n")
        if trace and name in trace:
            prof.export_chrome_trace(str(directory / f"trace-{label}.json"))
        print(f"  profiled {name}: {kernels} device events", flush=True)
    print("where the step's time goes (one profiled step per row):\n" + "\n".join(summaries), flush=True)


def _all_threads() -> Dict[str, Any]:
    """Profile every thread (the worker that recomputes ahead too) where torch can."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


@contextlib.contextmanager
def _labelled_recomputation() -> Iterator[None]:
    """Label each ckptwrap recomputation in the profile (``ckptwrap.recompute``), so the
    timeline shows its thread and its host time."""
    from ckptwrap.engine import _nonreentrant

    original = _nonreentrant._rerun

    def labelled(*args: Any, **kwargs: Any) -> None:
        with torch.profiler.record_function("ckptwrap.recompute"):
            original(*args, **kwargs)

    _nonreentrant._rerun = labelled
    try:
        yield
    finally:
        _nonreentrant._rerun = original


def _timeline(name: str, events: Any) -> str:
    """One line: the step's span, kernel time, time the GPU is busy (kernels' union),
    host time per thread (top-level operators), synchronizations, recomputations."""
    device_kind = torch.autograd.DeviceType.CUDA
    kernels, threads, syncs, recomputes = [], {}, [], []
    start, end = float("inf"), 0.0
    for event in events:
        span = event.time_range
        start, end = min(start, span.start), max(end, span.end)
        if getattr(event, "device_type", None) == device_kind:
            if event.name != "ckptwrap.recompute":  # the label's span on the device, not a kernel
                kernels.append((span.start, span.end))
            continue
        if "Synchronize" in event.name or event.name in ("cudaMemcpy", "cudaStreamWaitEvent"):
            syncs.append(span.end - span.start)
        if event.name == "ckptwrap.recompute":
            recomputes.append((event.thread, span.end - span.start))
        if event.cpu_parent is None:
            threads[event.thread] = threads.get(event.thread, 0.0) + (span.end - span.start)
    busy, last = 0.0, float("-inf")
    for begin, finish in sorted(kernels):
        if finish > last:
            busy += finish - max(begin, last)
            last = finish
    kernel_sum = sum(f - b for b, f in kernels)
    host = ", ".join(f"{t}: {v / 1000:.1f}" for t, v in sorted(threads.items(), key=lambda kv: -kv[1])[:3])
    by_thread: Dict[int, float] = {}
    for thread, span in recomputes:
        by_thread[thread] = by_thread.get(thread, 0.0) + span
    recomputed = ", ".join(f"{t}: {v / 1000:.1f} ms" for t, v in by_thread.items()) or "-"
    return (f"  {name}: span {(end - start) / 1000:.1f} ms, kernels {kernel_sum / 1000:.1f} ms ({len(kernels)}), "
            f"GPU busy {busy / 1000:.1f} ms ({busy / max(end - start, 1):.0%}); host ms by thread [{host}]; "
            f"syncs {len(syncs)} ({sum(syncs) / 1000:.1f} ms); recomputations {len(recomputes)} [{recomputed}]")


def _phase_times(device: torch.device, step: Step, arithmetic: Arithmetic) -> None:
    """The plain step's forward and backward seconds (CUDA events), after its warm-up."""
    if device.type != "cuda":
        return
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    step(marks)
    torch.cuda.synchronize(device)
    arithmetic.forward_s = marks[0].elapsed_time(marks[1]) / 1000
    arithmetic.backward_s = marks[1].elapsed_time(marks[2]) / 1000
    step.model.zero_grad(set_to_none=True)


def _timed(device: torch.device, step: Callable[[], None]) -> Tuple[float, int]:
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
    header = ("configuration", "median ms", "tokens/s", "peak MiB", "time ratio", "mem ratio",
              "to host GB", "from host GB", "max |diff|", "bit-equal")
    rows = [header]
    for r in results:
        if r.error is not None or not r.step_ms:
            rows.append((r.name, *(["-"] * (len(header) - 2)), "ERROR"))
            continue
        measured = base.error is None and bool(base.step_ms)
        rows.append((
            r.name, f"{r.median_ms:.1f}", f"{tokens / (r.median_ms / 1000):.0f}", f"{r.peak_bytes / _MIB:.0f}",
            f"{r.median_ms / base.median_ms:.3f}" if measured else "-",
            f"{r.peak_bytes / max(base.peak_bytes, 1):.3f}" if measured else "-",
            "-" if r.to_host is None else f"{r.to_host / _GB:.2f}",
            "-" if r.from_host is None else f"{r.from_host / _GB:.2f}",
            "reference" if r is base else f"{r.max_abs_diff:.3g}",
            "reference" if r is base else ("yes" if r.bit_equal else "NO" if r.max_abs_diff == r.max_abs_diff else "no-ref"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    errors = [f"  {r.name}: {r.error}" for r in results if r.error is not None]
    return "\n".join(lines + (["rows that did not run:"] + errors if errors else []))


def _target_row(results: Sequence[Result]) -> Optional[Result]:
    """The row the offload target is checked on: ``first:K;offload`` if there is one,
    else ``offload`` (every block, when the link hides them all or K is not known)."""
    by_name = {r.name: r for r in results}
    partial = [r for r in results if r.name.startswith("first:") and r.name.endswith(";offload")]
    return partial[0] if partial else by_name.get("offload")


def offload_verdict(results: Sequence[Result], tokens: int) -> Optional[bool]:
    """Whether the offload target is met; None where it is not checked."""
    by_name = {r.name: r for r in results}
    row, none = _target_row(results), by_name.get("none")
    if row is None or none is None or tokens < OFFLOAD_TARGET_TOKENS:
        return None
    if row.error is not None or none.error is not None or not row.step_ms or not none.step_ms:
        return False
    return row.median_ms / none.median_ms <= OFFLOAD_TIME_TARGET


def targets(results: Sequence[Result], tokens: int) -> List[Dict[str, Any]]:
    """Every target with its verdict (None: not checked): each row ran, each row's
    gradients equal ``none``'s, the budget's peak, the offload time."""
    found: List[Dict[str, Any]] = []
    base = results[0]
    for r in results:
        found.append({"name": f"{r.name}: ran", "value": r.error, "passed": r.error is None})
        if r is not base and r.error is None:
            compared = r.max_abs_diff == r.max_abs_diff  # NaN where none did not run
            found.append({"name": f"{r.name}: gradients bit-equal to none", "value": r.max_abs_diff if compared else None,
                          "passed": r.bit_equal if compared else None})
        if r.name.startswith("budget:") and r.name.endswith("%") and r.error is None and base.error is None and r.step_ms:
            cap = float(r.name[len("budget:"):-1]) / 100
            ratio = r.peak_bytes / max(base.peak_bytes, 1)
            found.append({"name": f"{r.name}: peak <= {cap:.2f} x none's", "value": round(ratio, 4),
                          "passed": ratio <= cap if base.peak_bytes else None})
    row = _target_row(results)
    verdict = offload_verdict(results, tokens)
    if row is not None:
        ratio = (row.median_ms / base.median_ms) if row.step_ms and base.step_ms else None
        found.append({"name": f"{row.name}: step time <= {OFFLOAD_TIME_TARGET:.2f} x none at >= "
                              f"{OFFLOAD_TARGET_TOKENS} tokens/step",
                      "value": None if ratio is None else round(ratio, 4), "passed": verdict})
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark. Returns 0; 1 with ``--strict`` when a target is missed (a row
    that failed, gradients that differ, the budget's peak or the offload time); 2 when
    no CUDA device is available (without ``--tiny``)."""
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
    parser.add_argument("--strict", action="store_true", help="exit 1 if any target is missed")
    parser.add_argument("--json", default=None, help="also write the results to this file, as JSON")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="after timing, profile one step of each row into DIR/profile-ROW.txt")
    parser.add_argument("--trace", default="", metavar="ROWS",
                        help="with --profile, also export these rows' timelines (DIR/trace-ROW.json, comma-separated)")
    args = parser.parse_args(argv)
    args.trace = [name.strip() for name in args.trace.split(",") if name.strip()]
    if args.tiny:
        for key, value in _TINY.items():
            setattr(args, key, value)
        args.steps, args.warmup = 1, 0
    args.configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [n for n in args.configs if n not in CONFIGURATIONS and not n.startswith("budget:")
               and not n.startswith("blocks;")]
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
    with _deterministic():
        results, arithmetic, nondeterministic = run(args)
    table = format_table(results, tokens)
    print(table)
    arithmetic_lines = describe(arithmetic)
    print("\n".join(arithmetic_lines))
    verdict = offload_verdict(results, tokens)
    row = _target_row(results)
    if verdict is None:
        print(f"offload target (step time <= {OFFLOAD_TIME_TARGET:.2f} x none at >= {OFFLOAD_TARGET_TOKENS} "
              f"tokens/step): not checked ({tokens} tokens/step)")
    else:
        ratio = f"{row.median_ms / results[0].median_ms:.3f}" if row.step_ms and results[0].step_ms else "no timing"
        print(f"offload target (step time <= {OFFLOAD_TIME_TARGET:.2f} x none, on {row.name}): "
              f"{'PASS' if verdict else 'FAIL'} ({ratio})")
    if nondeterministic:
        print("operators without a deterministic kernel (their rows may differ):\n  " + "\n  ".join(nondeterministic))
    if not all(r.bit_equal for r in results):
        print("note: some gradients are not bit-equal to the none configuration", file=sys.stderr)
    checked = targets(results, tokens)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": str(args.device), "torch": torch.__version__, "tokens": tokens, "table": table,
            "arithmetic": arithmetic_lines, "nondeterministic": nondeterministic, "targets": checked,
            "rows": [dataclasses.asdict(r) | {"median_ms": r.median_ms if r.step_ms else None} for r in results],
        }, indent=2))
    return 1 if args.strict and any(t["passed"] is False for t in checked) else 0


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic kernels for the run (HF Llama's SDPA backward is not otherwise), put
    back as they were afterwards; an operator without one warns instead of failing."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


if __name__ == "__main__":
    sys.exit(main())

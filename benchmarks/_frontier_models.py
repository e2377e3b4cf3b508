"""The models ``benchmarks/frontier.py`` measures, with their inputs and losses.

The GPT stack of ``examples/gpt.py`` and the convolutional pyramid of
``examples/factories.py`` are built as ``benchmarks/policies.py`` builds them, and
Hugging Face GPT-2 and Llama from small configurations (random weights, nothing is
downloaded). Dropout is off everywhere: compiled code draws its random numbers
differently from eager code, and the gradients of every configuration are compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import types
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptwrap  # noqa: E402
import policies  # noqa: E402  (it puts examples/ on sys.path)
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

__all__ = ["Bench", "add_size_flags", "build_benches", "parse_run_args", "QUICK_SIZES"]


@dataclasses.dataclass(frozen=True)
class Bench:
    """One model of the benchmark and how a training step calls it."""

    name: str
    description: str
    model: nn.Module
    args: Tuple[Any, ...]
    """Positional inputs of the forward; also the planner's example inputs."""
    kwargs: Dict[str, Any]
    """Keyword inputs of the forward; also the planner's example keyword inputs."""
    loss: Callable[[Any], torch.Tensor]
    """The training loss, from the forward's output."""
    sequential: Callable[[nn.Module], nn.Module]
    """Given a copy of ``model``, the same model running its stages through
    ``ckptwrap.checkpoint_sequential`` with round(sqrt(n)) segments."""
    segments: str = ""
    """How checkpoint_sequential cuts the stages, for the row's label."""


QUICK_SIZES = dict(
    layers=2, width=32, heads=2, seq_len=32, batch=2, image_batch=2, image_size=32,
    pyramid_blocks=2, hf_layers=2, hf_width=32, hf_heads=2, hf_seq_len=32, hf_batch=2, hf_vocab=128,
)
"""Sizes of ``--quick``: every model tiny, for a smoke run."""


def add_size_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that size the models; defaults give a few minutes on one CPU thread."""
    add = parser.add_argument
    add("--layers", type=int, default=8, help="GPT blocks")
    add("--width", type=int, default=128, help="GPT hidden size")
    add("--heads", type=int, default=4, help="GPT attention heads")
    add("--seq-len", type=int, default=128, help="GPT tokens per sequence")
    add("--batch", type=int, default=8, help="GPT sequences per step")
    add("--image-batch", type=int, default=4, help="pyramid images per step")
    add("--image-size", type=int, default=64, help="pyramid image side")
    add("--pyramid-blocks", type=int, default=2, help="residual blocks per pyramid stage")
    add("--hf-layers", type=int, default=6, help="GPT-2 and Llama decoder layers")
    add("--hf-width", type=int, default=128, help="GPT-2 and Llama hidden size")
    add("--hf-heads", type=int, default=4, help="GPT-2 and Llama attention heads")
    add("--hf-seq-len", type=int, default=128, help="GPT-2 and Llama tokens per sequence")
    add("--hf-batch", type=int, default=4, help="GPT-2 and Llama sequences per step")
    add("--hf-vocab", type=int, default=1024, help="GPT-2 and Llama vocabulary")


def parse_run_args(
    parser: argparse.ArgumentParser, argv: Optional[Sequence[str]], *, rounds: str, quick_rounds: int
) -> argparse.Namespace:
    """Adds the flags every benchmark over these models shares (``--threads``, ``--only``,
    ``--quick`` and the sizes) to ``parser``, which already has ``--warmup`` and the
    flag named ``rounds``; parses ``argv``, applies ``--quick`` and sets torch's threads."""
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    parser.add_argument("--only", choices=("gpt", "pyramid", "gpt2", "llama"), help="one model")
    parser.add_argument("--quick", action="store_true", help="tiny models, few rounds: a smoke run")
    add_size_flags(parser)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK_SIZES, warmup=1, **{rounds: quick_rounds})
    counted = getattr(args, rounds)
    if min(counted, args.threads) < 1 or args.warmup < 0:
        parser.error(f"need --{rounds} and --threads >= 1 and --warmup >= 0; got {counted}, "
                     f"{args.threads} and {args.warmup}")
    torch.set_num_threads(args.threads)
    return args


def build_benches(args: argparse.Namespace, only: Optional[str]) -> Tuple[List[Bench], List[str]]:
    """The models selected by ``only`` (all when None), and notes on those skipped."""
    builders = {"gpt": _gpt, "pyramid": _pyramid, "gpt2": _hf_gpt2, "llama": _hf_llama}
    benches, notes = [], []
    for key, build in builders.items():
        if only not in (None, key):
            continue
        if key in ("gpt2", "llama") and not _has_transformers():
            notes.append(f"{key}: skipped, transformers is not installed")
            continue
        benches.append(build(args))
    return benches, notes


def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _segments(stages: int) -> int:
    return max(1, round(math.sqrt(stages)))


def _gpt(args: argparse.Namespace) -> Bench:
    config = GPTConfig(
        width=args.width, heads=args.heads, layers=args.layers, seq_len=args.seq_len, dropout=0.0
    )
    torch.manual_seed(0)
    model = GPT(config).train()
    inputs = synthetic_batch(config, args.batch, seed=0)
    # policies.py's Workload and StagedModel give checkpoint_sequential over the blocks.
    workload = policies.Workload(
        "GPT stack", "", model, inputs, loss=lambda loss: loss,
        stages=lambda m: list(m.blocks), staged_forward=policies._gpt_staged_forward, uniform=True,
    )
    segments = _segments(config.layers)
    return Bench(
        "GPT stack",
        f"examples/gpt.py, {config.layers} blocks, width {config.width}, {config.heads} heads, "
        f"sequence {config.seq_len}, batch {args.batch}, no dropout",
        model, inputs, {}, loss=lambda loss: loss,
        sequential=lambda m: policies.StagedModel(workload, m, segments),
        segments=f"{segments} of {config.layers}",
    )


def _pyramid(args: argparse.Namespace) -> Bench:
    workload = policies.pyramid_workload(args, "cpu")
    stages = len(workload.stages(workload.model))
    segments = _segments(stages)
    return Bench(
        "conv pyramid",
        f"examples/factories.py's ConvPyramid, {workload.description}",
        workload.model, workload.inputs, {}, loss=workload.loss,
        sequential=lambda m: policies.StagedModel(workload, m, segments),
        segments=f"{segments} of {stages}",
    )


def _hf_inputs(args: argparse.Namespace, vocab: int) -> Tuple[Tuple[torch.Tensor], Dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (args.hf_batch, args.hf_seq_len), generator=generator)
    return (ids,), {"use_cache": False}


def _next_token_loss(ids: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    # Computed here rather than through ``labels=``: transformers' loss lookup logs a
    # warning, which torch.compile cannot trace without a graph break.
    targets = ids[:, 1:].flatten()
    return lambda out: F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets)


def _hf_gpt2(args: argparse.Namespace) -> Bench:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=args.hf_vocab, n_positions=args.hf_seq_len, n_embd=args.hf_width,
        n_layer=args.hf_layers, n_head=args.hf_heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return _hf_bench(args, "HF GPT-2", GPT2LMHeadModel(config), _gpt2_staged)


def _hf_llama(args: argparse.Namespace) -> Bench:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.hf_vocab, hidden_size=args.hf_width, intermediate_size=4 * args.hf_width,
        num_hidden_layers=args.hf_layers, num_attention_heads=args.hf_heads,
        num_key_value_heads=args.hf_heads, max_position_embeddings=args.hf_seq_len,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return _hf_bench(args, "HF Llama", LlamaForCausalLM(config), _llama_staged)


def _hf_bench(args: argparse.Namespace, name: str, model: nn.Module, staged: Callable) -> Bench:
    """A transformers causal LM built from ``args``' sizes, in training mode, as a Bench."""
    model.train()
    inputs, kwargs = _hf_inputs(args, model.config.vocab_size)
    segments = _segments(args.hf_layers)
    return Bench(
        name,
        f"transformers {type(model).__name__}, {args.hf_layers} layers, width {args.hf_width}, "
        f"{args.hf_heads} heads, vocab {args.hf_vocab}, sequence {args.hf_seq_len}, "
        f"batch {args.hf_batch}, random weights",
        model, inputs, kwargs, loss=_next_token_loss(inputs[0]),
        sequential=lambda m: _HFSequential(m, segments, staged),
        segments=f"{segments} of {args.hf_layers}",
    )


class _HFSequential(nn.Module):
    """A transformers causal LM whose decoder layers run through checkpoint_sequential.

    The layers take their masks and rotary embeddings as keyword inputs, which
    checkpoint_sequential does not pass along: each stage is the layer with those bound.
    With no attention mask the attention is causal, as in the model's own forward; the
    gradients, compared with the plain model's, show that the two agree.
    """

    def __init__(self, model: nn.Module, segments: int, staged: Callable) -> None:
        super().__init__()
        self.model = model
        self.segments = segments
        self._staged = staged

    def forward(self, ids: torch.Tensor, **_: Any) -> Any:
        return types.SimpleNamespace(logits=self._staged(self.model, self.segments, ids))


def _gpt2_staged(model: nn.Module, segments: int, ids: torch.Tensor) -> torch.Tensor:
    # GPT2LMHeadModel's forward without cache or mask, the block loop cut into segments.
    body = model.transformer
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    x = body.drop(body.wte(ids) + body.wpe(positions))
    stages = [functools.partial(block, attention_mask=None) for block in body.h]
    x = ckptwrap.checkpoint_sequential(stages, segments, x)
    return model.lm_head(body.ln_f(x))


def _llama_staged(model: nn.Module, segments: int, ids: torch.Tensor) -> torch.Tensor:
    # LlamaForCausalLM's forward without cache or mask, the layer loop cut into segments.
    body = model.model
    x = body.embed_tokens(ids)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    rotary = body.rotary_emb(x, position_ids=positions)
    stages = [
        functools.partial(layer, attention_mask=None, position_embeddings=rotary, position_ids=positions)
        for layer in body.layers
    ]
    x = ckptwrap.checkpoint_sequential(stages, segments, x)
    return model.lm_head(body.norm(x))

"""The model zoo the budget planner is judged on: models that are stacks of blocks and
models that are not, with their inputs, losses and candidate policies.

Hugging Face models are built from small configs (random weights, nothing is
downloaded): GPT-2, Llama, BERT, T5 and BART (encoder-decoders), ViT, Mixtral (mixture
of experts) and ALBERT, whose one shared layer runs once per layer (``type:AlbertLayer``).
Beside them a U-Net, whose skip connections join early outputs to late blocks with
``torch.cat``, an ``nn.LSTMCell`` stepped over time (one module called once per time
step) and the GPT stack of ``examples/gpt.py``. Each model is built in train mode with
the same weights every call; ``size`` scales its batch and length (or image side).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

__all__ = ["Workload", "ZOO", "has_transformers"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model of the zoo at one size."""

    name: str
    model: nn.Module
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    loss: Callable[[Any], torch.Tensor]
    candidates: str
    """The policy term that names its candidates (``blocks``, ``type:LSTMCell``...)."""

    def step(self) -> torch.Tensor:
        """One forward and backward; returns the loss."""
        loss = self.loss(self.model(*self.args, **self.kwargs))
        loss.backward()
        return loss.detach()


def has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _tokens(rows: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _hf(name: str, model: nn.Module, kwargs: Dict[str, Any], candidates: str = "blocks") -> Workload:
    return Workload(name, model.train(), (), kwargs, lambda output: output.loss, candidates)


def _language_model(
    name: str, build: Callable[[], nn.Module], rows: int, length: int, candidates: str = "blocks"
) -> Workload:
    """A transformers model that takes token ids and is its own labels (a causal or masked
    language model), built from the seed 0."""
    torch.manual_seed(0)
    model = build()
    ids = _tokens(rows, length, 256)
    return _hf(name, model, dict(input_ids=ids, labels=ids), candidates)


def gpt_stack(rows: int, length: int) -> Workload:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, width=64, heads=4, layers=4, seq_len=max(length, 64))).train()
    ids = _tokens(rows, length + 1, 256)
    return Workload("GPT stack", model, (ids[:, :-1], ids[:, 1:]), {}, lambda loss: loss, "blocks")


def gpt2(rows: int, length: int) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=max(length, 64),
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )
    return _language_model("HF GPT-2", lambda: GPT2LMHeadModel(config), rows, length)


def llama(rows: int, length: int) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=172, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=max(length, 64),
    )
    return _language_model("HF Llama", lambda: LlamaForCausalLM(config), rows, length)


def bert(rows: int, length: int) -> Workload:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=256, num_attention_heads=4,
        vocab_size=256, max_position_embeddings=max(length, 64),
    )
    return _language_model("HF BERT", lambda: BertForMaskedLM(config), rows, length)


def t5(rows: int, length: int) -> Workload:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
        vocab_size=256, decoder_start_token_id=0, pad_token_id=0,
    )
    kwargs = dict(input_ids=_tokens(rows, length, 256), labels=_tokens(rows, max(2, length // 2), 256, 1))
    return _hf("HF T5", T5ForConditionalGeneration(config), kwargs)


def bart(rows: int, length: int) -> Workload:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        encoder_layers=2, decoder_layers=2, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=256,
        max_position_embeddings=max(length, 64),
    )
    kwargs = dict(input_ids=_tokens(rows, length, 256), labels=_tokens(rows, max(2, length // 2), 256, 1))
    return _hf("HF BART", BartForConditionalGeneration(config), kwargs)


def vit(rows: int, length: int) -> Workload:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    side = max(16, length // 2) // 8 * 8
    config = ViTConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        image_size=side, patch_size=8, num_labels=10,
    )
    images = torch.randn(rows, 3, side, side, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (rows,), generator=torch.Generator().manual_seed(1))
    return _hf("HF ViT", ViTForImageClassification(config), dict(pixel_values=images, labels=labels))


def mixtral(rows: int, length: int) -> Workload:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
        max_position_embeddings=max(length, 64),
    )
    return _language_model("HF Mixtral", lambda: MixtralForCausalLM(config), rows, length)


def albert(rows: int, length: int) -> Workload:
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        num_hidden_layers=6, hidden_size=64, intermediate_size=256, num_attention_heads=4,
        embedding_size=32, vocab_size=256, max_position_embeddings=max(length, 64),
    )
    return _language_model("HF ALBERT", lambda: AlbertForMaskedLM(config), rows, length, "type:AlbertLayer")


class UBlock(nn.Module):
    """Two convolutions with batch norm and ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout)
        self.c2, self.n2 = nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.n2(self.c2(F.relu(self.n1(self.c1(x))))))


class UNet(nn.Module):
    """A stem block, three down blocks and three up blocks: each up block takes the
    upsampled output before it joined (``torch.cat``) to the skip of the same resolution."""

    def __init__(self, widths: Tuple[int, ...] = (8, 16, 32, 64), classes: int = 4) -> None:
        super().__init__()
        self.stem = UBlock(3, widths[0])
        self.down = nn.ModuleList(UBlock(widths[i], widths[i + 1]) for i in range(3))
        self.up = nn.ModuleList(UBlock(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(3)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = [x]
        for block in self.down:
            x = block(F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for block in self.up:
            x = block(torch.cat([F.interpolate(x, scale_factor=2.0), skips.pop()], dim=1))
        return self.head(x)


def unet(rows: int, length: int) -> Workload:
    torch.manual_seed(0)
    side = max(16, length // 2) // 16 * 16
    images = torch.randn(rows, 3, side, side, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 4, (rows, side, side), generator=torch.Generator().manual_seed(1))
    return Workload(
        "U-Net", UNet().train(), (images,), {}, lambda out: F.cross_entropy(out, target), "type:UBlock"
    )


class CellRNN(nn.Module):
    """An ``nn.LSTMCell`` stepped over the time steps of its input, a head on every step."""

    def __init__(self, features: int = 16, hidden: int = 64, out: int = 8) -> None:
        super().__init__()
        self.cell, self.head, self.hidden = nn.LSTMCell(features, hidden), nn.Linear(hidden, out), hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.hidden)
        c = x.new_zeros(x.shape[0], self.hidden)
        outputs = []
        for step in range(x.shape[1]):
            h, c = self.cell(x[:, step], (h, c))
            outputs.append(h)
        return self.head(torch.stack(outputs, 1))


def lstm(rows: int, length: int) -> Workload:
    torch.manual_seed(0)
    steps = max(8, length // 4)
    x = torch.randn(rows, steps, 16, generator=torch.Generator().manual_seed(0))
    return Workload("LSTM cell", CellRNN().train(), (x,), {}, lambda out: out.square().mean(), "type:LSTMCell")


ZOO: Dict[str, Callable[[int, int], Workload]] = {
    "gpt_stack": gpt_stack, "gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5, "bart": bart,
    "vit": vit, "mixtral": mixtral, "albert": albert, "unet": unet, "lstm": lstm,
}
"""Each builder takes the batch's rows and a length (sequence, or twice an image side)."""

HF_MODELS: List[str] = ["gpt2", "llama", "bert", "t5", "bart", "vit", "mixtral", "albert"]

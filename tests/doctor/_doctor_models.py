"""Small models for the doctor's tests, each healthy or broken in one deliberate way, and
the factories ``python -m ckptwrap doctor`` loads from this file."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import ckptwrap

WIDTH = 8


class Layer(nn.Module):
    """A residual MLP block: keeps a 4x wider hidden activation, so checkpointing it pays."""

    def __init__(self, width: int = WIDTH, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, *, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.drop(torch.tanh(self.fc(x)))
        if scale is not None:
            hidden = hidden * scale
        return x + self.out(hidden)


class NoisyLayer(Layer):
    """A layer with functional dropout: no dropout module shows that it draws masks."""

    def forward(self, x: torch.Tensor, *, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = nn.functional.dropout(torch.tanh(self.fc(x)), 0.5, self.training)
        return x + self.out(hidden)


class DecoratedLayer(Layer):
    """A layer whose class checkpoints every call."""

    @ckptwrap.checkpointed
    def forward(self, x: torch.Tensor, *, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x, scale=scale)


class Stack(nn.Module):
    """Optional embedding, a stack of layers in a ModuleList, a linear head.

    Args:
        depth: Number of layers.
        dropout: Dropout inside every layer.
        vocab: If non-zero, inputs are token ids looked up in an embedding.
        scale_by_keyword: Pass a learned scale to every layer by keyword.
    """

    def __init__(
        self, depth: int = 3, dropout: float = 0.0, vocab: int = 0, scale_by_keyword: bool = False
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH) if vocab else None
        self.layers = nn.ModuleList(Layer(WIDTH, dropout) for _ in range(depth))
        self.scale = nn.Parameter(torch.full((4 * WIDTH,), 0.5)) if scale_by_keyword else None
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x) if self.scale is None else layer(x, scale=self.scale)
        return self.head(x)


class Bypass(nn.Module):
    """Calls the submodules of ``layer`` itself, never ``layer``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.out(torch.tanh(self.layer.fc(x)))


class Counting(nn.Module):
    """Scales its input by how often it has run, so a recomputation saves other tensors
    than the forward did; with ``change_shape`` their shapes differ too."""

    def __init__(self, change_shape: bool = False) -> None:
        super().__init__()
        self.inner = Layer()
        self.calls = 0
        self.change_shape = change_shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.change_shape and self.calls > 1:
            return self.inner(torch.cat([x, x]))[: x.shape[0]]
        return self.inner(x * self.calls)


class DetachesWhenRecomputed(nn.Module):
    """Cuts its output from the graph when recomputed (a wrong use of is_recomputing)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out.detach() if ckptwrap.is_recomputing() else out


class Pair(nn.Module):
    """Two modules in a row, for models that wrap one by hand."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first = first
        self.second = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def inputs(batch: int = 4) -> torch.Tensor:
    """Example inputs of the float models, from a private generator."""
    return torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------- factories for the CLI


def plain_stack() -> nn.Module:
    """A stack nothing marks."""
    return Stack()


def rng_broken_stack() -> nn.Module:
    """A stack whose layers have dropout and are wrapped without their RNG state."""
    model = Stack(dropout=0.5)
    for index, layer in enumerate(model.layers):
        model.layers[index] = ckptwrap.CheckpointWrapper(layer, preserve_rng_state=False)
    return model


def not_a_model() -> int:
    """Returns something that is not a module."""
    return 3


# --------------------------------------------------------------------- models of issue reports


class Projection(nn.Module):
    """One linear projection: it keeps only its input, so checkpointing it saves nothing."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class DecodeHead(nn.Module):
    """Like Segformer's decode head: projections held in a ModuleList the head iterates."""

    def __init__(self, count: int = 4) -> None:
        super().__init__()
        self.linear_projections = nn.ModuleList(Projection() for _ in range(count))
        self.fuse = nn.Linear(count * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fuse(torch.cat([torch.tanh(p(x)) for p in self.linear_projections], dim=-1))


class Segmenter(nn.Module):
    """A model whose decode head holds its projections in a ModuleList, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.decode_head = DecodeHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode_head(x)


class Recurrent(nn.Module):
    """An LSTMCell run over time steps (inputs are ``(steps, batch, WIDTH)``); the cell adds
    to the output of its own ``addmm`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        h = xs.new_zeros(xs.shape[1], WIDTH)
        c = xs.new_zeros(xs.shape[1], WIDTH)
        for x in xs:
            h, c = self.cell(x, (h, c))
        return self.head(h)


def sequence(steps: int = 3, batch: int = 2) -> torch.Tensor:
    """Example inputs of ``Recurrent``, from a private generator."""
    return torch.randn(steps, batch, WIDTH, generator=torch.Generator().manual_seed(2))

"""State a checkpointed forward keeps in plain attributes: a causal video convolution
that pads each chunk of frames with the last frames of the chunk before
(``self.prev_features``, assigned anew by every call, as diffusers' Magvit VAE does),
called over the chunks of one clip in one forward. Each recomputation must run from the
attribute as its forward found it, and leave it as the step left it: gradients equal the
plain model's bit for bit, whole or at a selective level, and the model's state after the
step is the plain model's. Without the replay the recomputation pads with the last
chunk's frames: silently other gradients where chunks are alike, a refused recomputation
where they differ in size (Magvit's first chunk)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap.wrap import _region


class CausalConv(nn.Module):
    """A temporal convolution padded, at each chunk, with the frames the previous chunk
    left in ``prev_features`` (zeros at the first)."""

    def __init__(self, channels: int = 4, padding: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv3d(channels, channels, (padding + 1, 3, 3), padding=(0, 1, 1))
        self.padding = padding
        self.prev_features = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prev_features is None:
            before = x.new_zeros(x.shape[0], x.shape[1], self.padding, *x.shape[3:])
        else:
            before = self.prev_features
        self.prev_features = x[:, :, -self.padding:].clone()
        return self.conv(torch.cat([before, x], dim=2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)
        self.conv = CausalConv()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(torch.nn.functional.silu(self.norm(x)))


class ChunkedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def reset(self) -> None:
        for module in self.modules():
            if isinstance(module, CausalConv):
                module.prev_features = None

    def forward(self, video: torch.Tensor, chunk: int = 4) -> torch.Tensor:
        self.reset()
        outputs = []
        for start in range(0, video.shape[2], chunk):
            x = video[:, :, start:start + chunk]
            for block in self.blocks:
                x = block(x)
            outputs.append(x)
        return torch.cat(outputs, dim=2)


def _step(model: nn.Module) -> torch.Tensor:
    video = torch.randn(2, 4, 12, 8, 8, generator=torch.Generator().manual_seed(0))
    loss = model(video).square().mean()
    loss.backward()
    return loss.detach()


def _state(model: nn.Module):
    return [m.prev_features for m in model.modules() if isinstance(m, CausalConv)]


@pytest.mark.parametrize("policy", ["blocks", "type:CausalConv", "blocks;selective"])
def test_a_chunked_causal_convolution_trains_as_the_plain_model(policy):
    torch.manual_seed(0)
    plain = ChunkedEncoder()
    ours = ckptwrap.wrap_model(copy.deepcopy(plain), policy)
    assert ours.ckptwrap_plan.names
    for _ in range(2):
        assert torch.equal(_step(plain), _step(ours))
        for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad), name
        assert all(torch.equal(a, b) for a, b in zip(_state(ours), _state(plain)))
        ours.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)


def test_without_the_replay_the_gradients_differ(monkeypatch):
    # Every chunk the same size: the recomputation pads with the wrong frames silently.
    state_before = _region._state_before
    monkeypatch.setattr(_region, "_state_before", lambda modules: (state_before(modules)[0], []))
    torch.manual_seed(0)
    plain = ChunkedEncoder()
    ours = ckptwrap.wrap_model(copy.deepcopy(plain), "blocks")
    _step(plain), _step(ours)
    assert not all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), plain.parameters()))


def test_the_reentrant_engine_names_the_state_that_leaves_the_region():
    # The frames kept for the next chunk carry gradient out of the region another way
    # than its outputs, which the re-entrant engine cannot differentiate.
    ours = ckptwrap.wrap_model(ChunkedEncoder(), "blocks", use_reentrant=True)
    with pytest.raises(ckptwrap.CheckpointError, match="stored on a module"):
        _step(ours)


def test_magvit_trains_bit_exact_under_blocks():
    pytest.importorskip("diffusers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _diffusion import TINY

    if "AutoencoderKLMagvit" not in TINY:
        pytest.skip("this diffusers has no Magvit VAE")
    tiny = TINY["AutoencoderKLMagvit"]
    batch = tiny.batch()
    plain, ours = tiny.build(), ckptwrap.wrap_model(tiny.build(), "blocks")
    assert ours.ckptwrap_plan.names
    grads = []
    for model in (plain, ours):
        torch.manual_seed(0)
        tiny.loss(model(**batch)).backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])



class FirstFrameApart(nn.Module):
    """Causal convolutions over Magvit's chunks: the first frame alone, then chunks of four,
    so that the frames the first chunk leaves for the second are fewer than any later
    chunk leaves, and the second chunk's output is shorter than the others'."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CausalConv() for _ in range(2))

    def forward(self, video: torch.Tensor, chunk: int = 4) -> torch.Tensor:
        for block in self.blocks:
            block.prev_features = None
        outputs = []
        for start, stop in [(0, 1), *((s, s + chunk) for s in range(1, video.shape[2], chunk))]:
            x = video[:, :, start:stop]
            for block in self.blocks:
                x = block(x)
            outputs.append(x)
        return torch.cat(outputs, dim=2)


@pytest.mark.parametrize("policy", ["blocks", "budget:98%"])
def test_a_step_measured_on_given_inputs_replays_the_attributes_as_training_does(policy):
    # The planner's measured step runs its regions as the plan's run: without the replay
    # its recomputation of the second chunk padded with the last chunk's frames, and was
    # refused for giving another shape than the forward.
    torch.manual_seed(0)
    plain = FirstFrameApart()
    video = torch.randn(2, 4, 9, 8, 8, generator=torch.Generator().manual_seed(0))
    ours = ckptwrap.wrap_model(copy.deepcopy(plain), policy, example_inputs=(video,))
    assert ours.ckptwrap_plan.predicted_peak is not None
    for model in (plain, ours):
        model(video).square().mean().backward()
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name

"""Reliability: long runs, threads and failures leave no leaks and no cross-talk.

- a soak of 200 training steps of a small GPT, checkpointed by ``blocks``: process memory
  and the number of live tensors do not grow, and the weights end equal to those of the
  same 200 steps without checkpointing;
- two threads train two models at once with different engine settings, and each ends
  exactly where it ends alone, un-checkpointed;
- a checkpointed forward (or recomputation) that raises halfway, 100 times in a row,
  leaves no recomputation flag, saved-tensors hook or module hook behind, and the next
  step's gradients equal the un-checkpointed ones.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap.engine import _state
from ckptwrap.wrap import _region

_GPT_PATH = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"


def _gpt_module():
    """examples/gpt.py, imported by path under a name of its own."""
    name = "_ckptwrap_reliability_gpt"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _GPT_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    return sys.modules[name]


def _rss_bytes() -> Optional[int]:
    """Resident memory of this process, or None where /proc is not available."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _live_tensors() -> int:
    gc.collect()
    # type(), not isinstance(): some objects warn when their __class__ is looked up.
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def _assert_clean_state() -> None:
    assert ckptwrap.is_recomputing() is False
    assert _region.is_disabled() is False
    # With a saved-tensors hook left on the stack, autograd would save something else.
    x = torch.randn(3, requires_grad=True)
    saved = x.sin().grad_fn._saved_self
    assert torch.equal(saved, x) and saved.data_ptr() == x.data_ptr()


# --------------------------------------------------------------------------- 1. soak


def _train(model: nn.Module, steps: int, probe: Callable[[int], None] = lambda step: None) -> None:
    gpt = _gpt_module()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, steps + 1):
        tokens, targets = gpt.synthetic_batch(model.config, batch=4, seed=step % 7)
        torch.manual_seed(step)  # the same dropout masks with and without checkpointing
        loss = model(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        del loss
        probe(step)


def test_soak_200_steps_memory_and_tensors_flat():
    gpt = _gpt_module()
    config = gpt.GPTConfig(vocab=64, width=32, heads=2, layers=2, seq_len=16, dropout=0.1)
    torch.manual_seed(0)
    reference = gpt.GPT(config)
    model = ckptwrap.wrap_model(copy.deepcopy(reference), "blocks")
    assert len(model.ckptwrap_plan) == config.layers

    samples: Dict[int, tuple] = {}

    def probe(step: int) -> None:
        if step in (10, 200):
            samples[step] = (_live_tensors(), _rss_bytes())

    _train(model, 200, probe)
    (tensors_10, rss_10), (tensors_200, rss_200) = samples[10], samples[200]
    print(f"\nsoak: live tensors {tensors_10} -> {tensors_200}; RSS {rss_10} -> {rss_200} bytes")
    assert tensors_200 <= tensors_10
    if rss_10 is None:
        pytest.skip("no /proc/self/statm here: resident memory not measured (tensors were)")
    assert rss_200 <= rss_10 * 1.05, f"RSS grew from {rss_10} to {rss_200} bytes"

    _train(reference, 200)
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(mine, theirs), name


# --------------------------------------------------------------------------- 2. threads


class _Tail(nn.Module):
    """Saves nothing for backward, so a recomputation reaches it only without early stop;
    records the early-stop setting its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.recomputed = 0
        self.settings: List[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ckptwrap.is_recomputing():
            self.recomputed += 1
        else:
            self.settings.append(_state.early_stop_setting(None))
        return x


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.tail = _Tail()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(x + self.out(torch.tanh(self.fc(x))))


def _thread_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[_Block(16) for _ in range(3)], nn.Linear(16, 1))


def _thread_steps(model: nn.Module, seed: int, steps: int) -> List[float]:
    """SGD on fixed data from a private generator: no global RNG is drawn."""
    generator = torch.Generator().manual_seed(seed)
    data = [torch.randn(8, 16, generator=generator) for _ in range(steps)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x in data:
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_two_threads_with_different_engine_settings_match_their_references():
    # Dropout draws from torch's one global generator, which threads share: interleaved,
    # the two models would take each other's random numbers. These models use no RNG in
    # training (data comes from private generators), so any difference is cross-talk.
    steps = 50
    references = {}
    for seed in (1, 2):
        model = _thread_model(seed)
        references[seed] = (_thread_steps(model, seed, steps), list(model.parameters()))

    reentrant = ckptwrap.wrap_model(_thread_model(1), "type:_Block", use_reentrant=True)
    hooks = ckptwrap.wrap_model(_thread_model(2), "type:_Block")
    results: Dict[int, List[float]] = {}
    errors: List[BaseException] = []
    start = threading.Barrier(2)

    def run(seed: int, model: nn.Module, early_stop: Optional[bool]) -> None:
        try:
            start.wait()
            if early_stop is None:
                results[seed] = _thread_steps(model, seed, steps)
            else:
                with ckptwrap.set_checkpoint_early_stop(early_stop):
                    results[seed] = _thread_steps(model, seed, steps)
        except BaseException as error:  # handed to the main thread
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(1, reentrant, None)),
        threading.Thread(target=run, args=(2, hooks, False)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for seed, model in ((1, reentrant), (2, hooks)):
        losses, parameters = references[seed]
        assert results[seed] == losses
        for mine, theirs in zip(model.parameters(), parameters):
            assert torch.equal(mine, theirs)

    tails = lambda model: [m for m in model.modules() if isinstance(m, _Tail)]  # noqa: E731
    # The main thread's default (early stop on) reached the first thread, not the second's.
    assert all(setting is True for tail in tails(reentrant) for setting in tail.settings)
    assert all(setting is False for tail in tails(hooks) for setting in tail.settings)
    # Without early stop every recomputation runs to the end, through the tail.
    assert all(tail.recomputed == steps for tail in tails(hooks))
    assert _state.early_stop_setting(None) is True


# --------------------------------------------------------------------------- 3. failures


class _Boom(RuntimeError):
    pass


class _Exploding(nn.Module):
    """A block that raises halfway through its forward or its recomputation when armed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.armed: Optional[str] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc(x))  # tensors are saved (or held) by now
        if self.armed == "forward" or (self.armed == "recompute" and ckptwrap.is_recomputing()):
            raise _Boom(f"raised in the {self.armed}")
        return x + self.out(hidden)


def _grads(model: nn.Module, x: torch.Tensor) -> List[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("where", ["forward", "recompute"])
def test_raising_100_times_leaves_nothing_behind(use_reentrant, where):
    torch.manual_seed(0)
    reference = nn.Sequential(*[_Exploding(16) for _ in range(3)])
    model = ckptwrap.wrap_model(copy.deepcopy(reference), "blocks", use_reentrant=use_reentrant)
    x = torch.randn(8, 16)
    hooks_before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]

    model[1].armed = where
    tensors_before = None
    for attempt in range(100):
        with pytest.raises(_Boom, match=f"raised in the {where}"):
            model(x).square().mean().backward()
        if attempt == 9:
            tensors_before = _live_tensors()
        _assert_clean_state()
    tensors_after = _live_tensors()
    model[1].armed = None

    print(f"\nraised {where} (use_reentrant={use_reentrant}): live tensors after 10 failures "
          f"{tensors_before}, after 100 {tensors_after}")
    assert tensors_after <= tensors_before, (tensors_before, tensors_after)
    assert hooks_before == [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    for mine, theirs in zip(_grads(model, x), _grads(reference, x)):
        assert torch.equal(mine, theirs)
    _assert_clean_state()

"""Training loops as people write them, for judging a lazy ``budget:`` on any model: the
batches each loop feeds, the step each one runs, and the two passes that judge a model
under it (memory, read at the allocator beside the plain model trained alongside; time,
beside ``blocks``). Shared by ``benchmarks/budget_loops.py`` and its test.

Four loops:

- ``loss``: dynamic lengths, ``model(**batch).loss.backward()`` (the output is dropped
  before the backward).
- ``held``: the same batches, ``out = model(**batch); out.loss.backward()`` (the output,
  logits and caches, stays alive through the backward).
- ``padded``: right-padded attention masks as a collator makes them, batch sizes and
  lengths changing every step, the output held.
- ``accumulate``: gradient accumulation over two micro-batches of other lengths, with an
  evaluation forward (and ``generate`` where the model generates) every few steps.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import math
import random
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

import ckptwrap
from _allocator import allocator_peak
from _noted import NotedSteps

__all__ = ["LOOPS", "MemoryResult", "TimeResult", "budget_for", "memory_pass", "schedule", "shortfalls", "time_pass"]

LOOPS = ("loss", "held", "padded", "accumulate")
OVER = 0.03
"""A step may peak above the budget by this share of the plain peak at the largest shape so far."""
SHORTEST = 3.0
"""Seconds of ``blocks`` training below which a time row is run again (see ``time_pass``)."""
REPEATS = 5
"""The most runs of one time row."""
EVAL_EVERY = 6
"""In the ``accumulate`` loop, an evaluation forward (and ``generate``) after every this many steps."""
_LR = 1e-3

Step = Tuple[int, int, int, bool]
"""(rows, length, seed, padded) of one forward."""


def schedule(arch: Any, loop: str, steps: int, seed: int = 0, grow: bool = False) -> List[List[Step]]:
    """Per training step, the forwards it runs (two micro-batches when accumulating).
    Lengths are drawn at random, the longest once and early; with ``grow``, they grow
    instead from the shortest to the longest, by one factor each step (a curriculum, or a
    loop's first steps while it meets longer and longer batches)."""
    rng = random.Random(f"{arch.name}-{loop}-{seed}")
    low, high = arch.lengths
    plan: List[List[Step]] = []
    for step in range(steps):
        if grow:
            length = round(low * (high / low) ** (step / max(1, steps - 1)))
        else:
            length = high if step == steps // 3 else rng.randint(low, high)  # the longest once, early
        if loop == "padded":
            rows = rng.choice((4, 3, 2))
            plan.append([(rows, length, step, True)])
        elif loop == "accumulate":
            other = length if grow else rng.randint(low, high)
            plan.append([(2, length, 2 * step, False), (2, other, 2 * step + 1, False)])
        else:
            plan.append([(4, length, step, False)])
    return plan


def budget_for(arch: Any, model: nn.Module, device: str = "cpu", percent: bool = False) -> int:
    """Bytes halfway between the least peak any plan reaches and the plain peak, at the
    longest length, as the planner predicts both on a copy: in reach at every shape, and
    below the plain peak at the longest, so that long batches checkpoint. With
    ``percent``, that share of the plain peak, in whole percent."""
    batch = _inputs(model, arch, (4, arch.lengths[1], 0, False), device)
    every = ckptwrap.plan(copy.deepcopy(model), arch.candidates or "blocks", example_kwargs=batch)
    budget = (every.predicted_peak + every.plain_peak) // 2
    return math.ceil(100 * budget / every.plain_peak) if percent else budget


def _policy(arch: Any, budget: int, percent: bool = False) -> str:
    return ";".join(filter(None, (arch.candidates, f"budget:{budget}{'%' if percent else 'B'}")))


def _inputs(model: nn.Module, arch: Any, forward: Step, device: str = "cpu") -> Dict[str, Any]:
    """One forward's inputs. A model that would write a KV cache in training runs without
    (``use_cache=False``), as transformers' own gradient checkpointing runs it and as a
    checkpointed layer must (its recomputation cannot write the cache again): with the
    cache on, the plain model takes other kernels at some lengths, and gradients that
    differ in the last bit from the checkpointed model's would say nothing of ckptwrap."""
    batch = _on(arch.batch(*forward), device)
    if "use_cache" in inspect.signature(type(model).forward).parameters:
        batch["use_cache"] = False
    return batch


def _on(batch: Dict[str, Any], device: str) -> Dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def _forward(
    model: nn.Module, arch: Any, forward: Step, held: bool, batch: Optional[Dict[str, Any]] = None, device: str = "cpu",
) -> torch.Tensor:
    """One forward and backward; ``batch``, if given, made beforehand (as a loop's collator
    makes it before the step)."""
    batch = _inputs(model, arch, forward, device) if batch is None else batch
    torch.manual_seed(forward[2])  # the same dropout in every model
    if held:
        out = model(**batch)
        out.loss.backward()
        loss = out.loss.detach()
        del out
        return loss
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def _evaluate(model: nn.Module, arch: Any, seed: int, device: str = "cpu") -> None:
    """An evaluation forward, and a few generated tokens where the model generates."""
    model.eval()
    batch = _on(arch.batch(2, arch.lengths[0], seed, False), device)
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    with torch.no_grad():
        model(**batch)
        if arch.generates and ids is not None:
            model.generate(input_ids=ids[:1], attention_mask=None if mask is None else mask[:1], max_new_tokens=4)
    model.train()


def train_step(
    model: nn.Module, arch: Any, loop: str, forwards: List[Step], index: int, optimizer: Any, device: str = "cpu",
) -> List[torch.Tensor]:
    """One optimizer step of ``loop``: its forwards and backwards from fresh gradients."""
    optimizer.zero_grad(set_to_none=True)
    losses = [_forward(model, arch, forward, held=loop != "loss", device=device) for forward in forwards]
    optimizer.step()
    if loop == "accumulate" and (index + 1) % EVAL_EVERY == 0:
        _evaluate(model, arch, index, device)
    return losses


@dataclasses.dataclass
class MemoryResult:
    budget: int
    worst_over: float = -1.0
    """The largest step peak above the budget, as a share of the plain peak at the largest
    shape so far."""
    steps_over: int = 0
    exact: bool = True
    measured: int = 0
    checked: int = 0
    error: Optional[str] = None
    unchanged: bool = True
    worst_prediction: float = 0.0
    """The largest miss of a solved step's predicted peak, either way, as a share of the
    plain peak at the largest shape so far, as ``worst_over`` is (steps from fresh
    gradients: a later micro-batch's step adds to gradients already there, and peaks lower
    than planned)."""
    worst_under: float = 0.0
    """The largest share (of the same) by which a solved step's peak passed its prediction."""


def shortfalls(result: MemoryResult, arch: Any, loop: str, steps: int, grow: bool = False) -> List[str]:
    """What a memory pass of ``steps`` steps fell short of, in words (none: it held)."""
    if result.error is not None:
        return [result.error]
    found = []
    if result.worst_over > OVER:
        found.append(f"a step peaked {result.worst_over:.1%} of plain above the budget")
    if not result.exact:
        found.append("a loss or gradient differs from the plain model's")
    if not result.unchanged:
        found.append("planning left the model changed")
    forwards = sum(len(step) for step in schedule(arch, loop, steps, grow=grow))
    if not 1 <= result.measured < forwards:
        found.append(f"{result.measured} of {forwards} forwards measured")
    return found


def memory_pass(
    arch: Any, loop: str, steps: int, device: str = "cpu", grow: bool = False, percent: bool = False,
) -> MemoryResult:
    """Train the budget and the plain model side by side; every forward and backward read
    at the allocator (around each micro-step, from fresh or accumulated gradients). With
    ``percent``, the budget is a share of the plain peak (``budget:NN%``), held to that
    share of the largest plain peak read so far."""
    template = arch.build().to(device)
    plain = copy.deepcopy(template)
    model = copy.deepcopy(template)
    result = MemoryResult(0)
    if torch.device(device).type != "cpu":
        _warm(device)
    try:
        result.budget = budget_for(arch, template, device, percent)
        ckptwrap.wrap_model(model, _policy(arch, result.budget, percent))
        with NotedSteps() as noted:
            optimizers = [torch.optim.SGD(m.parameters(), lr=_LR) for m in (model, plain)]
            largest = 0
            for index, forwards in enumerate(schedule(arch, loop, steps, grow=grow)):
                for each, optimizer in zip((model, plain), optimizers):
                    optimizer.zero_grad(set_to_none=True)
                for micro, forward in enumerate(forwards):
                    losses, peaks = [], []
                    for each in (model, plain):
                        # The batch is made before the step, outside what its peak counts.
                        batch = _inputs(each, arch, forward, device)

                        def step(each: nn.Module = each, batch: Dict[str, Any] = batch, forward: Step = forward) -> None:
                            losses.append(_forward(each, arch, forward, loop != "loss", batch))

                        peaks.append(allocator_peak(step, device))
                        del batch, step
                    if peaks[1] <= 0:
                        raise RuntimeError("the allocator's events showed nothing allocated in a plain training step")
                    largest = max(largest, peaks[1])
                    # What the step ran under, as the planner says it (the logger's note).
                    ran = noted.forward
                    if ran["predicted_peak"] is not None and micro == 0:  # from fresh gradients, as plans are made for
                        missed = (peaks[0] - ran["predicted_peak"]) / max(largest, 1)
                        result.worst_prediction = max(result.worst_prediction, abs(missed))
                        result.worst_under = max(result.worst_under, missed)
                    limit = result.budget
                    if percent:
                        # A share of a short batch's peak may be out of any plan's reach (the
                        # gradients alone pass it): the plan of least memory's, as predicted.
                        applied = model.ckptwrap_plan
                        limit = max(result.budget * largest / 100, applied.predicted_peak or 0)
                    over = (peaks[0] - limit) / max(largest, 1)
                    result.worst_over = max(result.worst_over, over)
                    result.steps_over += over > OVER
                    result.exact &= torch.equal(losses[0], losses[1]) and _same_grads(model, plain)
                for optimizer in optimizers:
                    optimizer.step()
                if loop == "accumulate" and (index + 1) % EVAL_EVERY == 0:
                    for each in (model, plain):
                        _evaluate(each, arch, index, device)
            result.measured, result.checked = noted.measured, noted.checked
        result.unchanged = _same_model(model, plain)
    except Exception as error:  # noqa: BLE001 - reported in the table
        result.error = f"{type(error).__name__}: {error}"[:200]
    return result


@dataclasses.dataclass
class TimeResult:
    budget_s: float
    blocks_s: float

    @property
    def ratio(self) -> float:
        return self.budget_s / self.blocks_s


def time_pass(
    arch: Any, loop: str, steps: int, budget: int, device: str = "cpu", grow: bool = False, percent: bool = False,
) -> TimeResult:
    """The budget and ``blocks`` taking turns step by step, nothing metered.

    A row whose ``blocks`` loop takes less than ``SHORTEST`` seconds is run again, from
    fresh models each time (so every run measures its own first steps, as a new training
    run would), up to ``REPEATS`` runs, and the times are summed: a loop of 48 steps of 10
    ms moves by several percent with whatever else the machine does in that half second.

    The objects this process made before each run (every model built so far) are frozen
    out of the garbage collector's reach while it runs: a full collection would walk them
    all, a pause of a tenth of a second or more that lands on whichever model allocates
    at that moment, and a training process holds one model, not sixty. What either model
    allocates during the run is collected as usual."""
    totals = {"budget": 0.0, "blocks": 0.0}
    for _ in range(REPEATS):
        for name, seconds in _timed_run(arch, loop, steps, budget, device, grow, percent).items():
            totals[name] += seconds
        if totals["blocks"] >= SHORTEST:
            break
    return TimeResult(totals["budget"], totals["blocks"])


def _timed_run(
    arch: Any, loop: str, steps: int, budget: int, device: str, grow: bool = False, percent: bool = False,
) -> Dict[str, float]:
    """One run of the loop for each model, from fresh models: seconds per model."""
    template = arch.build().to(device)
    models = {"budget": ckptwrap.wrap_model(copy.deepcopy(template), _policy(arch, budget, percent)),
              "blocks": ckptwrap.wrap_model(copy.deepcopy(template), arch.candidates or "blocks")}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=_LR) for name, m in models.items()}
    totals = {name: 0.0 for name in models}
    gc.collect()
    gc.freeze()
    try:
        for index, forwards in enumerate(schedule(arch, loop, steps, grow=grow)):
            order = list(models) if index % 2 == 0 else list(reversed(list(models)))
            for name in order:
                _synchronize(device)
                start = time.perf_counter()
                train_step(models[name], arch, loop, forwards, index, optimizers[name], device)
                _synchronize(device)
                totals[name] += time.perf_counter() - start
    finally:
        gc.unfreeze()
    return totals


def _warm(device: str) -> None:
    """What a process allocates once on an accelerator, allocated before anything is
    measured: the profiler's first start, and cuBLAS's workspaces for the forward's thread
    and for the backward's (autograd runs it on a thread of its own, with its own handle).
    Else the first plan's measured step holds them, and the budget made from it is high."""
    def matmuls() -> None:
        weight = torch.ones(8, 8, device=device, requires_grad=True)
        (weight @ weight).sum().backward()

    allocator_peak(matmuls, device)


def _synchronize(device: str) -> None:
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()


def _same_grads(model: nn.Module, plain: nn.Module) -> bool:
    return all(
        (a.grad is None and b.grad is None) or (a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad))
        for a, b in zip(model.parameters(), plain.parameters())
    )


def _same_model(model: nn.Module, plain: nn.Module) -> bool:
    """Planning left the model as training the plain one did: its configuration, its
    modules, and every parameter and buffer."""
    config = getattr(model, "config", None)
    if config is not None and config.to_dict() != plain.config.to_dict():
        return False
    if [name for name, _ in model.named_modules()] != [name for name, _ in plain.named_modules()]:
        return False
    theirs = plain.state_dict()
    return all(torch.equal(value, theirs[name]) for name, value in model.state_dict().items())

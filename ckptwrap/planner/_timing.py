"""What operators cost in time, and keeping the random number generators' state (so that a
step run to be measured changes neither what it draws nor what the model draws next):
what one operator costs to run through a measuring dispatch mode, so that times metered
under one are told apart from the work itself; and the prices the budget solver weighs
recomputations at, from what they run (operators, FLOPs, bytes), so that a run's timing
noise decides no plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, ContextManager, Dict, List, Tuple

import torch

from .. import _torch_private

__all__ = [
    "ACCELERATOR_RATES",
    "CPU_RATES",
    "OperatorRates",
    "RecomputePrices",
    "dispatch_cost",
    "selective_cost",
]


_CALIBRATION_OPS = 400


@functools.lru_cache(maxsize=1)
def dispatch_cost() -> float:
    """Seconds one operator spends in a measuring dispatch mode (the phase meter's storage
    counter, following moments) beyond running: measured once per process on tiny CPU
    tensors, where an operator's own time is negligible. Times of a metered step are
    corrected by it (times only rank plans; bytes are exact)."""
    from ._phases import PhaseMeter  # the meter whose cost this is

    return _added_per_op(lambda: PhaseMeter(torch.device("cpu")))


@functools.lru_cache(maxsize=1)
def selective_cost() -> float:
    """Seconds torch's selective checkpointing adds to one operator of a forward (its
    dispatch mode, saving nothing): measured once per process on tiny CPU tensors. A
    selective level pays it twice per operator (forward and recomputation)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def nothing(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    return _added_per_op(lambda: create_selective_checkpoint_contexts(nothing)[0])


def _added_per_op(context: Callable[[], ContextManager[Any]]) -> float:
    """Seconds the context made by ``context()`` adds to one tiny CPU operator (read
    outside any dispatch mode in force, a fake step's included: it is kept per process)."""
    with _torch_private.disable_current_modes():
        return _timed_per_op(context)


def _timed_per_op(context: Callable[[], ContextManager[Any]]) -> float:
    x = torch.zeros(1)

    def work() -> float:
        start = time.perf_counter()
        value = x
        for _ in range(_CALIBRATION_OPS):
            value = value + 1.0
        return time.perf_counter() - start

    work()
    plain = min(work() for _ in range(3))
    with context():
        inside = min(work() for _ in range(3))
    return max(0.0, (inside - plain) / _CALIBRATION_OPS)


# --------------------------------------------------------------------------- prices


@dataclasses.dataclass(frozen=True)
class OperatorRates:
    """What running operators costs in time on a kind of device: the terms a
    recomputation is priced at from what it runs, not from how long it once took.

    Example:
        >>> rates = OperatorRates("toy", operator=1e-6, flops_per_second=1e9, bytes_per_second=1e9, selective=2e-6)
        >>> rates.seconds(operators=10, flops=10**6, created_bytes=10**6)
        0.00201
    """

    name: str
    """What the rates are of, for messages."""
    operator: float
    """Seconds each operator costs beyond its work: its dispatch, its launch, autograd's
    bookkeeping."""
    flops_per_second: float
    """Floating-point operations per second (per intra-op thread where ``threaded``)."""
    bytes_per_second: float
    """Bytes of new storage per second: allocated, written and read again."""
    selective: float
    """Seconds torch's selective checkpointing mode adds to each operator of a pass (the
    forward, or the recomputation)."""
    threaded: bool = False
    """Whether FLOPs run on torch's intra-op threads (the CPU): the rate is then per thread."""

    def seconds(self, *, operators: int, flops: int, created_bytes: int) -> float:
        """What running these operators takes: a fixed cost each, and their work."""
        return operators * self.operator + flops / self.flop_rate() + created_bytes / self.bytes_per_second

    def flop_rate(self) -> float:
        """FLOPs per second at torch's thread count now."""
        return self.flops_per_second * (max(1, torch.get_num_threads()) if self.threaded else 1)


CPU_RATES = OperatorRates(
    "cpu", operator=4e-6, flops_per_second=2e11, bytes_per_second=2.5e9, selective=1.5e-5, threaded=True
)
"""A CPU core running eager PyTorch: fitted to the recomputations (autograd on) of seven
of the catalogue's architectures (GPT-2, Llama, BERT, T5, ViT, Whisper, Mamba) at three
widths and two shapes each, single-threaded, every one within 1.4 times of its measured
time; the selective mode's cost is the median of theirs (12 to 20 microseconds an operator)."""

ACCELERATOR_RATES = OperatorRates(
    "accelerator", operator=1.5e-5, flops_per_second=2e14, bytes_per_second=2e12, selective=1.6e-5
)
"""An H100-class GPU in eager PyTorch: the host's time per operator and what the selective
mode adds to it as measured in docs/gpu.md (a 0.95B Llama at 4096 tokens, where the step
is bound by the launches), kernels at a realistic share of the bfloat16 peak."""


class RecomputePrices:
    """The seconds the budget solver weighs for recomputing each candidate of one profile,
    and for each of its operators and the selective mode's cost: priced from counts that
    repeat exactly from run to run (its operators, their FLOPs, the bytes they create) at
    the rates of the device's kind (:data:`CPU_RATES`, :data:`ACCELERATOR_RATES`), never
    from a candidate's own measured time.

    A measured time is one sample of a busy machine: the same block of the same model
    measured 12 ms in one process and 195 ms in the next while another process ran
    beside it, so any choice a measured time enters (one candidate against another, a
    selective level against recomputing all of a block) was decided by that noise, and
    each process planned otherwise. Priced, the same computation costs the same in every
    process, a first or last block that holds a few bytes more costs what the others do
    (ties go to the earlier in model order), and a level pays where its operators' work
    outweighs the selective mode's cost, by the same counts everywhere.

    Measured times only calibrate: one factor (all measured seconds over all priced ones,
    rounded to 6 significant bits) takes the prices to the measured scale, for the plan's
    recompute times; a factor common to every price changes no choice. Profiles stepped
    on fake tensors come priced at a device's rates already and are kept so (but for the
    CPU's rates, measured in each process: the CPU's kind priced, calibrated to them); a
    profile without times (``repeats=0``) prices everything at zero.

    Prices are whole multiples of one quantum (each rounded to 30 significant bits of the
    profile's largest), so that sums of them are exact and equal plans tie exactly.

    Args:
        profile: The profile, each candidate with its counts (``ops``, ``forward_ops``,
            ``flops``, ``created_bytes``) and measured (or priced) times.
    """

    def __init__(self, profile: Any) -> None:
        measured = profile.priced_at is None
        refit = measured or profile.priced_at == CPU_RATES.name
        rates = CPU_RATES
        if measured and profile.step is not None and profile.step.at_allocator:
            rates = ACCELERATOR_RATES
        flop_rate = rates.flop_rate()
        raw = {
            cost.name: _priced(cost, rates, flop_rate) if refit else _as_priced(cost)
            for cost in profile.modules
        }
        scale = _scale(profile.modules, raw) if refit else 1.0
        largest = max((price for price, _, _ in raw.values()), default=0.0)
        # 2**30 quanta for the largest price: sums of many stay exact in a float's 53 bits.
        tick = math.ldexp(1.0, math.frexp(largest)[1] - 30) if largest > 0 else 1.0
        quantum = _rounded(scale) * tick
        self._prices: Dict[str, Tuple[float, Tuple[float, ...], float]] = {}
        for name, (price, ops, selective) in raw.items():
            units = [round(op / tick) for op in ops]
            whole = sum(units) if units else round(price / tick)
            self._prices[name] = (
                quantum * whole,
                tuple(quantum * unit for unit in units),
                quantum * round(selective / tick),
            )

    def time(self, name: str) -> float:
        """Seconds the recomputation of candidate ``name`` is priced at: the sum of its
        operators' where it has them."""
        return self._prices[name][0]

    def op_times(self, name: str) -> Tuple[float, ...]:
        """Seconds each of its operators (as in its ``ops``) is priced at."""
        return self._prices[name][1]

    def selective(self, name: str) -> float:
        """Seconds the selective mode adds to one pass of it (0 where none was measured)."""
        return self._prices[name][2]


def _priced(cost: Any, rates: OperatorRates, flop_rate: float) -> Tuple[float, List[float], float]:
    """A candidate's price at ``rates``, each operator's, and the selective mode's."""
    calls = max(1, int(cost.calls))
    ops = cost.ops or ()
    # Each operator entry stands for one call of it per call of the candidate. Written
    # out, not through ``rates.seconds``: a profile has hundreds of operators, priced at
    # every solve.
    fixed, per_byte = calls * rates.operator, 1.0 / rates.bytes_per_second
    per_flop = 1.0 / flop_rate
    prices = [fixed + op.flops * per_flop + op.bytes * per_byte for op in ops]
    operators = int(getattr(cost, "forward_ops", 0) or 0) or calls * len(ops)
    if prices:
        whole = math.fsum(prices)
    else:
        whole = operators * rates.operator + cost.flops * per_flop + cost.created_bytes * per_byte
    # Charged where the step measured the mode's cost at all (a step measured without
    # times, or told the mode is free, measured none).
    selective = operators * rates.selective if cost.selective_overhead > 0 else 0.0
    return whole, prices, selective


def _as_priced(cost: Any) -> Tuple[float, List[float], float]:
    """A candidate of a profile priced already (a step on fake tensors), as it is."""
    time = cost.forward_time if cost.recompute_time is None else cost.recompute_time
    return float(time), [float(op.time) for op in cost.ops], float(cost.selective_overhead)


def _scale(costs: Any, raw: Dict[str, Tuple[float, List[float], float]]) -> float:
    """Measured seconds per priced second, over every candidate (0 if none was timed)."""
    measured = math.fsum(
        float(cost.forward_time if cost.recompute_time is None else cost.recompute_time) for cost in costs
    )
    priced = math.fsum(price for price, _, _ in raw.values())
    return measured / priced if measured > 0 and priced > 0 else 0.0


def _rounded(value: float) -> float:
    """``value`` to 6 significant bits: its product with a whole number of quanta is exact."""
    if value <= 0:
        return 0.0
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 64), exponent - 6)

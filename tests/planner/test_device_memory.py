"""Budgets in a device's terms: ``budget:total=SIZE`` (a whole device, the parameters,
buffers, optimizer state and the optimizer's own step included) and ``budget:device``
(the device's memory now, less a margin), with the optimizer's state and step measured
from two steps of it on fake stand-ins of the parameters.

Before this, a budget was the forward and backward alone: ``budget:1GiB`` held the step
at 1017 MiB while the training loop peaked at 1534 MiB. Every prediction here is checked
against a real training iteration on the CPU: the storages held before it (parameters,
buffers, the optimizer's state, counted one by one) plus the allocator's peak over the
iteration (forward, backward, ``optimizer.step()``, ``zero_grad()``).
"""

from __future__ import annotations

import copy
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import CheckpointConfigError
from ckptwrap.measure import StorageCounter
from ckptwrap.planner import optimizer_spec
from ckptwrap.measure import DEVICE_RATES, DeviceRates
from ckptwrap.planner._device_memory import DEVICE_MARGIN
from ckptwrap.planner._device_memory import device_memory
from ckptwrap.policy import Budget
from ckptwrap.wrap._marks import apply_plan

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _allocator import allocator_peak  # noqa: E402
from _architectures import ARCHITECTURES  # noqa: E402
from whole_iteration import held as _held, iteration_peak as _iteration_peak  # noqa: E402

_OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {}),
    "adam": (torch.optim.Adam, {}),
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {}),
    "rmsprop": (torch.optim.RMSprop, {"momentum": 0.9}),
}


def _batch(name: str):
    arch = ARCHITECTURES[name]
    padded = arch.family in ("causal", "encoder", "encoder-decoder")
    return arch.batch(2, arch.lengths[1], 0, padded)


# ----------------------------------------------------------------------------- the term


@pytest.mark.parametrize(
    "written, scope, parsed",
    [
        ("40%", "step", (0.4, None)),
        ("2GiB", "step", (None, 2 << 30)),
        ("total=80GiB", "total", (None, 80 << 30)),
        ("Total = 1.5e9B", "total", (None, 1_500_000_000)),
        ("device", "device", (None, None)),
        (" DEVICE ", "device", (None, None)),
    ],
)
def test_the_budget_term_reads_a_devices_terms(written, scope, parsed):
    budget = Budget(written)
    assert budget.scope == scope and budget.parsed() == parsed


@pytest.mark.parametrize(
    "written, message",
    [
        ("total=50%", r"budget:total=50% is malformed: total= takes the device's memory in bytes"),
        ("total=", r"budget:total= is malformed: .*budget:total=80GiB, or budget:device"),
        ("total=0B", r"budget:total=0B is out of range"),
        ("devices", r"budget:devices is malformed"),
        ("total=80 apples", r"budget:total=80 apples is malformed"),
    ],
)
def test_a_malformed_device_budget_is_refused_naming_it(written, message):
    with pytest.raises(CheckpointConfigError, match=message):
        Budget(written)
    with pytest.raises(CheckpointConfigError, match=message):
        ckptwrap.wrap_model(nn.Sequential(nn.Linear(2, 2)), f"blocks;budget:{written}")


# ----------------------------------------------------------------------------- the optimizer


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("variant", [{}, {"foreach": True}])
def test_the_optimizers_state_and_step_are_those_of_a_real_one(name, variant):
    """The state a real optimizer makes (at its making and first step) and the peak of its
    second step's temporaries, counted storage by storage, equal those measured on fake
    stand-ins."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 400), nn.LayerNorm(400), nn.Linear(400, 7))
    model[1].weight.requires_grad_(False)  # frozen: no gradient, no state
    kind, options = _OPTIMIZERS[name]

    def real_make() -> torch.optim.Optimizer:
        return kind(model.parameters(), **options, **variant)

    optimizer = real_make()
    predicted = device_memory(model, torch.device("cpu"), optimizer_spec(model, optimizer), total=1 << 30)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    counted = StorageCounter("cpu")
    with counted:
        optimizer = real_make()
        optimizer.step()
    again = StorageCounter("cpu")
    with again:
        optimizer.step()
    # The step counters some optimizers keep are 0-dim tensors: a few bytes each.
    assert abs(predicted.optimizer_state - counted.live_bytes) <= 8 * len(list(model.parameters()))
    assert predicted.optimizer_step == again.peak_bytes
    assert predicted.gradients == sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert predicted.parameters == sum(p.numel() * 4 for p in model.parameters())


def test_on_an_accelerator_the_multi_tensor_step_is_counted():
    """torch picks the foreach implementation on CUDA: its temporaries, not the CPU's."""
    model = nn.Sequential(nn.Linear(300, 400), nn.Linear(400, 7))
    spec = optimizer_spec(model, "adamw")
    here = device_memory(model, torch.device("cpu"), spec, total=1 << 30)
    there = device_memory(model, torch.device("cuda"), spec, total=1 << 30)
    foreach = device_memory(
        model, torch.device("cpu"), optimizer_spec(model, torch.optim.AdamW(model.parameters(), foreach=True)),
        total=1 << 30,
    )
    assert there.optimizer_step == foreach.optimizer_step != here.optimizer_step
    assert there.optimizer_state == here.optimizer_state


@pytest.mark.parametrize(
    "optimizer, message",
    [
        ("lion", r"optimizer='lion' is not an optimizer ckptwrap knows by name; name one of adamw, adam"),
        (3, r"optimizer must be a torch.optim.Optimizer over the model's parameters or a name .*got int"),
    ],
)
def test_a_bad_optimizer_is_refused_naming_it(optimizer, message):
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(CheckpointConfigError, match=message):
        ckptwrap.wrap_model(model, "all;budget:total=1GiB", optimizer=optimizer)
    assert not hasattr(model, "ckptwrap_plan")  # nothing left applied


def test_an_optimizer_of_another_models_parameters_is_refused():
    model, other = nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)
    with pytest.raises(CheckpointConfigError, match="holds none of Sequential's parameters"):
        ckptwrap.plan(
            model, "all;budget:total=1GiB", example_inputs=torch.randn(2, 4),
            optimizer=torch.optim.SGD(other.parameters()),
        )


def test_an_optimizer_that_reads_values_is_refused_naming_it():
    model = nn.Sequential(nn.Linear(8, 8))
    optimizer = torch.optim.Adafactor(model.parameters())
    with pytest.raises(CheckpointConfigError, match=r"Adafactor could not step on fake tensors .*_local_scalar_dense"):
        ckptwrap.plan(model, "all;budget:total=1GiB", example_inputs=torch.randn(2, 8), optimizer=optimizer)


# ----------------------------------------------------------------------------- whole iterations

_ARCHS = ["llama", "gpt2", "bert", "t5", "bart", "vit", "swin", "convnext", "whisper", "clip", "mamba2"]


@pytest.mark.parametrize("name", _ARCHS)
@pytest.mark.parametrize("policy", ["none", "blocks", "budget:total"])
def test_the_whole_iteration_peaks_as_predicted(name, policy):
    """Parameters, buffers, AdamW's state, the step and AdamW's own step: the device's peak
    over a real iteration is the plan's ``device_peak`` (within 1% for a fixed policy), and
    within the total (by at most 3% of the plain step, the budget's promise)."""
    arch = ARCHITECTURES[name]
    batch = _batch(name)
    torch.manual_seed(0)
    model = arch.build()
    if policy == "budget:total":
        plain = ckptwrap.plan(model, "blocks", example_kwargs=batch, optimizer="adamw")
        low = plain.device_memory.whole_peak(plain.predicted_peak)
        high = plain.device_memory.whole_peak(plain.plain_peak)
        policy = f"budget:total={(low + high) // 2}B"
    planned = ckptwrap.plan(model, policy, example_kwargs=batch, optimizer="adamw")
    memory = planned.device_memory
    assert memory.optimizer == "AdamW" and memory.optimizer_state == 2 * memory.gradients
    apply_plan(model, planned)  # the plan predicted (a new one could weigh times otherwise)
    measured = _iteration_peak(model, torch.optim.AdamW(model.parameters()), batch)
    # A budget's plan carries the planner's own error on the step (Mamba2's selective
    # levels, GPT-2's: 1 to 4%, as plans made on the real model); the parts are exact.
    share = 0.01 if memory.total is None else 0.05
    assert abs(planned.device_peak - measured) <= share * measured, (planned.device_peak, measured)
    if memory.total is not None:
        assert measured <= memory.total + 0.03 * planned.plain_peak, (measured, memory.total)
        assert "fits in" in str(planned)


def test_an_unreachable_total_says_what_the_device_needs_and_that_is_enough():
    arch = ARCHITECTURES["llama"]
    batch = _batch("llama")
    model = arch.build()
    with pytest.raises(CheckpointConfigError) as caught:
        ckptwrap.plan(model, "budget:total=1MiB", example_kwargs=batch, optimizer="adamw")
    message = str(caught.value)
    assert "budget:total=1MiB less parameters" in message and "AdamW state" in message
    assert "the device needs at least" in message
    needed = caught.value.needed
    assert caught.value.offered == 1 << 20 < needed  # the device as given, in the same terms
    planned = ckptwrap.plan(model, f"budget:total={needed}B", example_kwargs=batch, optimizer="adamw")
    assert planned.device_peak <= needed
    assert len(planned.names) == len(ckptwrap.plan(model, "blocks").names)  # every block: the least memory


def test_an_optimizer_step_past_the_device_is_an_error_with_example_inputs_and_said_once_without():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(4)])
    x = torch.randn(2, 512)
    # Room for the parameters, AdamW's state and the step (its activations are small
    # beside its gradients), but not for the gradients and AdamW's temporaries together.
    parts = ckptwrap.plan(model, "blocks", example_inputs=x, optimizer="adamw")
    total = parts.device_memory.held + parts.device_memory.inputs + parts.plain_peak
    assert parts.device_memory.optimizer_peak > total
    with pytest.raises(CheckpointConfigError, match="optimizer step alone needs") as caught:
        ckptwrap.plan(model, f"budget:total={total}B", example_inputs=x, optimizer="adamw")
    assert caught.value.needed > total == caught.value.offered
    ckptwrap.wrap_model(model, f"budget:total={total}B", optimizer="adamw")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            model(x).sum().backward()
    assert sum("optimizer step alone needs" in str(w.message) for w in said) == 1


def test_a_total_without_an_optimizer_says_to_give_one():
    model = ARCHITECTURES["gpt2"].build()
    with pytest.warns(UserWarning, match="counts the parameters, buffers and gradients of GPT2LMHeadModel, but no optimizer state: pass optimizer="):
        planned = ckptwrap.plan(model, "budget:total=1GiB", example_kwargs=_batch("gpt2"))
    assert planned.device_memory.optimizer is None and planned.device_memory.optimizer_state == 0
    assert "optimizer state (none given)" in str(planned)


def test_a_lazy_total_holds_through_accumulation_and_eval():
    """Lazily planned: every iteration, the accumulating ones (which start with gradients
    held) included, stays within the total."""
    arch = ARCHITECTURES["llama"]
    torch.manual_seed(0)
    model = arch.build()
    batch = _batch("llama")
    plain = ckptwrap.plan(model, "blocks", example_kwargs=batch, optimizer="adamw")
    total = plain.device_memory.whole_peak(plain.predicted_peak) + plain.device_memory.gradients
    ckptwrap.wrap_model(model, f"budget:total={total}B", optimizer="adamw")
    optimizer = torch.optim.AdamW(model.parameters())
    reference = copy.deepcopy(model)
    peaks = []
    for step in range(4):
        def micro() -> None:
            for _ in range(2):
                out = model(**batch)
                out.loss.backward()
                del out
        held = _held(model, optimizer, batch)
        peaks.append(held + allocator_peak(micro))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            model(**batch)
        model.train()
    assert max(peaks) <= total, (peaks, total)
    assert model.ckptwrap_plan.device_memory.total == total
    # Pickled and copied with the plan's device memory (plain data: no optimizer inside).
    assert pickle.loads(pickle.dumps(model)).ckptwrap_plan.device_memory == model.ckptwrap_plan.device_memory
    assert reference is not None


def _accumulation_peak(model, plan, batch, micro_steps: int = 4) -> int:
    """The device's peak over the second of two iterations of ``micro_steps`` micro-steps
    and an AdamW step with ``plan`` applied (the first makes the optimizer's state): the
    storages held before each part (gradients held from the micro-step before included),
    and the allocator's peak over it."""
    model = copy.deepcopy(model)
    apply_plan(model, plan)
    optimizer = torch.optim.AdamW(model.parameters())

    def gradients() -> int:
        return sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)

    def micro() -> None:
        out = model(**batch)
        out.loss.backward()
        del out

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    peaks = []
    for _ in range(2):
        peaks = [_held(model, optimizer, batch) + gradients() + allocator_peak(part) for part in [micro] * micro_steps + [step]]
    return max(peaks)


@pytest.mark.parametrize("name", ["vit", "llama", "t5", "gpt2"])
def test_a_plan_for_gradient_accumulation_bounds_every_micro_step(name):
    """With ``accumulation=4`` the micro-steps after the first start with the gradients
    held: the plan counts them, and its device peak bounds the loop's (by at most the
    gradients the step's backward has made by its peak, which accumulating does not make
    again). A plan for fresh gradients is below this loop's peak where the step peaks
    late (ViT: 12-16% under)."""
    batch = _batch(name)
    torch.manual_seed(0)
    model = ARCHITECTURES[name].build()
    for policy in ("none", "blocks"):
        fresh = ckptwrap.plan(model, policy, example_kwargs=batch, optimizer="adamw")
        planned = ckptwrap.plan(model, policy, example_kwargs=batch, optimizer="adamw", accumulation=4)
        memory = planned.device_memory
        assert memory.held_gradients == memory.gradients == fresh.device_memory.gradients
        assert fresh.device_memory.held_gradients == 0
        assert "gradients held from the micro-step before" in str(planned)
        measured = _accumulation_peak(model, planned, batch)
        # Within the plans' own error on the step (1%, as for a fixed policy above).
        assert 0.99 * measured <= planned.device_peak <= 1.06 * measured, (policy, planned.device_peak, measured)
        if name == "vit":
            assert fresh.device_peak < 0.95 * measured, (policy, fresh.device_peak, measured)


def test_a_total_for_gradient_accumulation_holds_every_micro_step():
    """A total that a step from fresh gradients meets but the accumulating micro-steps do
    not: planned for accumulation it is refused, saying what the device needs, and that is
    enough for the loop."""
    batch = _batch("vit")
    torch.manual_seed(0)
    model = ARCHITECTURES["vit"].build()
    blocks = ckptwrap.plan(model, "blocks", example_kwargs=batch, optimizer="adamw")
    total = blocks.device_peak + blocks.device_memory.gradients // 4
    fresh = ckptwrap.plan(model, f"budget:total={total}B", example_kwargs=batch, optimizer="adamw")
    assert fresh.fits
    assert _accumulation_peak(model, fresh, batch) > total  # what the issue saw: said to fit, and over
    with pytest.raises(CheckpointConfigError) as caught:
        ckptwrap.plan(model, f"budget:total={total}B", example_kwargs=batch, optimizer="adamw", accumulation=4)
    assert "gradients held from earlier steps" in str(caught.value)
    needed = caught.value.needed
    planned = ckptwrap.plan(model, f"budget:total={needed}B", example_kwargs=batch, optimizer="adamw", accumulation=4)
    assert planned.fits and _accumulation_peak(model, planned, batch) <= needed


@pytest.mark.parametrize("accumulation", [0, -2, 1.5, True, "4"])
def test_a_bad_accumulation_is_refused_naming_it(accumulation):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(CheckpointConfigError, match=f"accumulation must be .*got {accumulation!r}"):
        ckptwrap.plan(model, "blocks", example_inputs=(torch.randn(2, 4),), accumulation=accumulation)


# ----------------------------------------------------------------------------- budget:device


def test_budget_device_on_the_cpu_is_refused_naming_what_to_write():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(CheckpointConfigError, match=r"cannot read the free memory of a cpu device .*budget:total=SIZE"):
        ckptwrap.plan(model, "all;budget:device", example_inputs=torch.randn(2, 8), optimizer="sgd")


def test_budget_device_on_the_meta_device_reads_the_named_devices_memory():
    with torch.device("meta"):
        model = ARCHITECTURES["llama"].build()
    batch = _batch("llama")
    with pytest.raises(CheckpointConfigError, match="name the device with device_rates="):
        ckptwrap.plan(model, "budget:device", example_kwargs=batch, optimizer="adamw")
    planned = ckptwrap.plan(model, "budget:device", example_kwargs=batch, optimizer="adamw", device_rates="l4")
    assert planned.device_memory.total == int(DEVICE_RATES["l4"].memory_bytes * (1 - DEVICE_MARGIN))
    assert "l4's" in planned.device_memory.source
    custom = DeviceRates("mine", {torch.float32: 1e12}, 1e11)  # no memory given
    with pytest.raises(CheckpointConfigError, match="budget:total=80GiB"):
        ckptwrap.plan(model, "budget:device", example_kwargs=batch, optimizer="adamw", device_rates=custom)


def test_budget_device_reads_free_cached_and_held_memory(monkeypatch):
    """On an accelerator: the free memory, what the caching allocator holds unused, and what
    the model holds there already, less the margin of the whole device."""
    gib = 1 << 30
    module = torch.cuda
    monkeypatch.setattr(module, "mem_get_info", lambda device=None: (10 * gib, 16 * gib), raising=False)
    monkeypatch.setattr(module, "memory_reserved", lambda device=None: 3 * gib, raising=False)
    monkeypatch.setattr(module, "memory_allocated", lambda device=None: 2 * gib, raising=False)
    model = nn.Linear(4, 4)
    memory = device_memory(model, torch.device("cuda", 0), None, from_device=True)
    assert memory.total == 11 * gib - int(16 * gib * DEVICE_MARGIN)
    assert "free memory" in memory.source


# ----------------------------------------------------------------------------- priced time


def test_the_priced_step_time_counts_the_plain_steps_flops():
    """On the meta device the step is priced from the FLOPs of the step with nothing
    checkpointed (recomputations left out): with a bandwidth too high to matter, the time
    at 1 FLOP per second is torch's FLOP count of the real model's plain step."""
    from torch.utils.flop_counter import FlopCounterMode

    arch = ARCHITECTURES["llama"]
    batch = _batch("llama")
    torch.manual_seed(0)
    real = arch.build()
    with FlopCounterMode(display=False) as counter:
        real(**batch).loss.backward()
    with torch.device("meta"):
        meta = arch.build()
    rates = DeviceRates("unit", {torch.float32: 1.0}, 1e30)
    for policy in ("none", "blocks"):
        planned = ckptwrap.plan(meta, policy, example_kwargs=batch, device_rates=rates)
        plain = planned.step_time - planned.recompute_time
        assert plain == pytest.approx(counter.get_total_flops(), rel=1e-9)
        assert "training step time:" in str(planned)

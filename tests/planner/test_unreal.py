"""Planning without the hardware: a model on the meta device or made of fake tensors
(``FakeTensorMode``) is planned from one step run on fake tensors, with the user's real
inputs kept real, so that its bytes are those a real step allocates and its times are
priced from FLOPs and bytes at a device's rates (``ckptwrap.measure.DeviceRates``).

Before this, planning there was refused (and before that, silently wrong: a Llama's plain
step predicted 29% high and ``blocks`` 67% low, from the meta kernels and a traced
path). Each prediction here is compared with the same model built for real: with the
real model's own plan, and with the allocator's reading of a real step run under the
plan made without the hardware.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import CheckpointConfigError
from ckptwrap.measure import DEVICE_RATES, DeviceRates, device_rates
from ckptwrap.wrap._marks import apply_plan
from ckptwrap.wrap._planning import plan_and_profile

transformers = pytest.importorskip("transformers")
FakeTensorMode = pytest.importorskip("torch._subclasses.fake_tensor").FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _allocator import allocator_peak  # noqa: E402
from _architectures import ARCHITECTURES  # noqa: E402

# One or more of each family: LayerDrop's random draw (OPT, BART, Whisper), global
# attention read from its mask (LED), windows (Swin), two towers (CLIP), a scan (Mamba2).
_FAMILIES = ["gpt2", "llama", "opt", "bert", "t5", "bart", "led", "whisper", "vit", "swin", "convnext", "clip", "mamba2"]


def _batch(name: str):
    arch = ARCHITECTURES[name]
    padded = arch.family in ("causal", "encoder", "encoder-decoder")  # a collator's masks
    return arch.batch(2, arch.lengths[1], 0, padded)


def _on_meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return ARCHITECTURES[name].build()


def _close(ours: int, theirs: int, share: float = 0.01) -> bool:
    return abs(ours - theirs) <= share * theirs


@pytest.mark.parametrize("name", _FAMILIES)
def test_a_meta_model_is_planned_as_the_real_one_measures(name):
    batch = _batch(name)
    real = ckptwrap.plan(ARCHITECTURES[name].build(), "blocks", example_kwargs=batch)
    meta = _on_meta(name)
    before = {key: (value, value.device.type) for key, value in meta.state_dict(keep_vars=True).items()}
    planned = ckptwrap.plan(meta, "blocks", example_kwargs=batch)
    assert planned.names == real.names
    assert _close(planned.plain_peak, real.plain_peak), (planned.plain_peak, real.plain_peak)
    assert _close(planned.predicted_peak, real.predicted_peak), (planned.predicted_peak, real.predicted_peak)
    assert planned.priced_at == "cpu" and real.priced_at is None
    after = meta.state_dict(keep_vars=True)
    assert all(after[key] is value and value.device.type == kind for key, (value, kind) in before.items())


# Built inside the user's FakeTensorMode (and planned there), or on the meta device (a
# ViT's truncated-normal initialisation reads values, so it cannot be built fake).
_WORKLOADS = [("gpt2", "fake"), ("llama", "meta"), ("t5", "fake"), ("vit", "meta")]


@pytest.mark.parametrize("policy", ["none", "blocks", "budget:85%"])
@pytest.mark.parametrize("name, made", _WORKLOADS)
def test_a_plan_made_without_the_hardware_predicts_the_real_step(name, made, policy):
    """The plan applied to the model built for real: its step peaks as predicted, within
    3%, and under the budget."""
    arch = ARCHITECTURES[name]
    batch = _batch(name)
    if made == "fake":
        with FakeTensorMode():
            planned = ckptwrap.plan(arch.build(), policy, example_kwargs=batch)
    else:
        planned = ckptwrap.plan(_on_meta(name), policy, example_kwargs=batch)
    assert planned.priced_at == "cpu"
    model = arch.build()
    apply_plan(model, planned)

    def step() -> None:
        out = model(**batch)
        out.loss.backward()

    measured = allocator_peak(step)
    assert abs(planned.predicted_peak - measured) <= 0.03 * measured, (planned.predicted_peak, measured)
    if planned.budget is not None:
        assert measured <= planned.budget + 0.03 * planned.plain_peak, (measured, planned.budget)


def test_times_are_priced_at_the_rates_given():
    rates = DeviceRates("test", {torch.float32: 1e12, torch.bfloat16: 4e12}, 1e11)
    with torch.device("meta"):
        model = ARCHITECTURES["llama"].build().to(torch.bfloat16)
    batch = _batch("llama")
    plan, profile = plan_and_profile(model, "blocks", example_kwargs=batch, device_rates=rates)
    assert profile.priced_at == plan.priced_at == "test"
    assert "priced at test's peak rates" in str(plan)
    for cost in profile.modules:
        assert cost.flops > 0
        expected = cost.flops / 4e12 + 2 * cost.created_bytes / 1e11  # the bfloat16 rate
        assert cost.forward_time == pytest.approx(expected)
        assert sum(op.time for op in cost.ops) == pytest.approx(expected, rel=0.05)
    by_name = {entry.name: entry for entry in plan.selected}
    for cost in profile.modules:
        assert by_name[cost.name].recompute_time == pytest.approx(cost.forward_time)


def test_a_gpu_is_named_by_its_own_name_or_the_tables():
    assert device_rates(torch.device("cuda"), "NVIDIA H100 80GB HBM3") is DEVICE_RATES["h100-sxm"]
    assert device_rates(torch.device("cpu"), "a100-80gb").memory_bytes == 80 << 30
    with pytest.raises(CheckpointConfigError, match="device_rates must be.*'h100-sxm'.*got 'tpu-v9'"):
        ckptwrap.plan(_on_meta("gpt2"), "blocks", example_kwargs=_batch("gpt2"), device_rates="tpu-v9")
    with pytest.raises(CheckpointConfigError, match="needs a torch.float32 rate"):
        DeviceRates("half only", {torch.bfloat16: 1e12}, 1e11)
    with pytest.raises(CheckpointConfigError, match="bytes_per_second must be above 0"):
        DeviceRates("no memory", {torch.float32: 1e12}, 0)


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.sum() > 0:  # the values of an activation: no fake tensor has them
                x = x.relu()
        return x


def test_a_forward_that_reads_an_activations_values_is_refused_naming_the_operator():
    with torch.device("meta"):
        model = _Branching()
    with pytest.raises(CheckpointConfigError, match=r"_Branching.*_local_scalar_dense.*Give real inputs"):
        ckptwrap.plan(model, "budget:60%", example_inputs=(torch.randn(4, 8),))
    assert all(p.device.type == "meta" for p in model.parameters())


def test_real_inputs_stay_real_so_code_reading_them_runs():
    """A Wav2Vec2-style check on the labels' values and LED's global attention read from
    its mask run on the real tensors; only a loss whose output size follows its targets
    (CTC) cannot, and is named."""
    planned = ckptwrap.plan(_on_meta("led"), "blocks", example_kwargs=_batch("led"))
    assert planned.predicted_peak > 0
    with pytest.raises(CheckpointConfigError, match="_ctc_loss"):
        ckptwrap.plan(_on_meta("wav2vec2"), "blocks", example_kwargs=_batch("wav2vec2"))


def test_the_users_fake_mode_is_left_as_it_was():
    mode = FakeTensorMode()
    with mode:
        model = ARCHITECTURES["gpt2"].build()
    parameters = list(model.parameters())
    ckptwrap.plan(model, "blocks", example_kwargs=_batch("gpt2"))
    assert mode.allow_non_fake_inputs is False
    assert all(ours is theirs for ours, theirs in zip(model.parameters(), parameters))
    assert "ckptwrap_plan" not in model.__dict__


def test_wrapped_on_the_meta_device_then_materialised_trains_exactly():
    """Planned at wrap time on the meta device from real example inputs (as a model too big
    to build twice is set up), then materialised and trained: the plan is kept, and every
    gradient equals the plain model's."""
    batch = _batch("llama")
    model = ckptwrap.wrap_model(_on_meta("llama"), "budget:70%", example_kwargs=batch)
    plan = model.ckptwrap_plan
    assert not plan.pending and plan.priced_at == "cpu" and plan.names
    reference = ARCHITECTURES["llama"].build()
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    for name, buffer in reference.named_buffers():
        model.get_buffer(name).copy_(buffer)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model(**batch).loss.backward()
    torch.manual_seed(0)
    reference(**batch).loss.backward()
    assert model.ckptwrap_plan.names == plan.names
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad), name


def _llama(device: str) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def test_a_selection_without_measuring_applies_on_the_meta_device():
    model = ckptwrap.wrap_model(_llama("meta"), "blocks")
    assert list(model.ckptwrap_plan) == ["model.layers.0", "model.layers.1"]


def test_a_lazy_budget_on_the_meta_device_plans_once_the_model_is_real():
    model = ckptwrap.wrap_model(_llama("meta"), "budget:50%").train()
    meta_ids = torch.randint(0, 128, (2, 32), device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(input_ids=meta_ids, labels=meta_ids).loss.backward()
    said = [str(w.message) for w in caught if "meta device" in str(w.message)]
    assert len(said) == 1 and "plan of least memory" in said[0], said
    assert list(model.ckptwrap_plan) == ["model.layers.0", "model.layers.1"]

    # Materialised as FSDP2 and big-model loading do it, then trained: planned from real steps.
    reference = _llama("cpu")
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    for name, buffer in reference.named_buffers():
        model.get_buffer(name).copy_(buffer)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
    plan = model.ckptwrap_plan
    assert not plan.pending and plan.predicted_peak is not None and plan.predicted_peak > 0
    reference.train()
    reference(input_ids=ids, labels=ids).loss.backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad), name


def test_a_copy_of_a_meta_model_plans_alike():
    """The stand-ins are the step's own: a deep copy of the model plans the same."""
    batch = _batch("gpt2")
    meta = _on_meta("gpt2")
    first = ckptwrap.plan(meta, "blocks", example_kwargs=batch)
    second = ckptwrap.plan(copy.deepcopy(meta), "blocks", example_kwargs=batch)
    assert (first.names, first.predicted_peak) == (second.names, second.predicted_peak)


def test_without_fake_tensors_a_meta_model_is_refused_naming_why(monkeypatch):
    from ckptwrap import _torch_private

    monkeypatch.setattr(_torch_private, "fake_tensor", None)
    with pytest.raises(CheckpointConfigError, match="meta device, and this torch has no fake tensors"):
        ckptwrap.plan(_on_meta("gpt2"), "blocks", example_kwargs=_batch("gpt2"))


def test_a_real_model_asked_at_a_larger_shape_is_planned_without_running_it():
    """``fake=True``: the plan at a shape not run, from a step on fake tensors: the bytes
    the real step there has, and almost nothing allocated to find them."""
    arch = ARCHITECTURES["gpt2"]
    model = arch.build()
    parameters = [(name, p, p.detach().clone()) for name, p in model.named_parameters()]
    large = arch.batch(8, arch.lengths[1], 0, True)
    device_rates(torch.device("cpu"))  # measured once per process (two buffers of 8 MiB)
    asked = []
    allocated = allocator_peak(lambda: asked.append(ckptwrap.plan(model, "blocks", example_kwargs=large, fake=True)))
    planned = asked[0]
    real = ckptwrap.plan(arch.build(), "blocks", example_kwargs=large)
    assert (planned.plain_peak, planned.predicted_peak) == (real.plain_peak, real.predicted_peak)
    assert planned.priced_at == "cpu"
    assert allocated < 0.1 * real.plain_peak, (allocated, real.plain_peak)
    for (name, ours, before), (_, now) in zip(parameters, model.named_parameters()):
        assert ours is now and torch.equal(ours, before) and ours.grad is None, name
    with pytest.raises(CheckpointConfigError, match="fake must be True or False, got 'yes'"):
        ckptwrap.plan(model, "blocks", example_kwargs=large, fake="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_peaks_agree_with_torchs_memtracker_on_fake_tensors(dtype):
    """torch's ``MemTracker`` run over a plain and a ``blocks`` step on fake tensors (an
    independent meter): its peak above the parameters and buffers is the peak ckptwrap
    predicts from the meta device."""
    pytest.importorskip("torch.distributed._tools.mem_tracker")
    from against_memtracker import build, memtracker_peak

    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4,
    )
    ids = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    with torch.device("meta"):
        meta = build(config, dtype)
    ours = {
        "none": ckptwrap.plan(meta, "none", example_kwargs=batch).plain_peak,
        "blocks": ckptwrap.plan(meta, "blocks", example_kwargs=batch).predicted_peak,
    }
    for policy, predicted in ours.items():
        theirs = memtracker_peak(config, dtype, ids, policy)
        assert abs(predicted - theirs) <= 0.01 * theirs, (policy, predicted, theirs)


@pytest.mark.parametrize("policy", ["none", "blocks"])
def test_the_whole_iteration_agrees_with_torchs_memtracker(policy):
    """Two whole iterations with AdamW tracked by ``MemTracker`` on fake tensors: their peak
    (parameters, buffers, AdamW's state, the step or AdamW's step) is the ``device_peak``
    ckptwrap predicts from the meta device with ``optimizer="adamw"``."""
    pytest.importorskip("torch.distributed._tools.mem_tracker")
    from against_memtracker import build, memtracker_iteration_peak

    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4,
    )
    ids = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        meta = build(config, torch.float32)
    planned = ckptwrap.plan(meta, policy, example_kwargs={"input_ids": ids, "labels": ids}, optimizer="adamw")
    step = planned.plain_peak if policy == "none" else planned.predicted_peak
    predicted = planned.device_memory.whole_peak(step)
    theirs = memtracker_iteration_peak(config, torch.float32, ids, policy)
    assert abs(predicted - theirs) <= 0.01 * theirs, (predicted, theirs)

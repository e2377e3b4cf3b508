"""Tests of ``doctor``: a healthy model is ok, and each problem built on purpose is found
in the right module with the right fix."""

from __future__ import annotations

import copy
import types
from typing import List

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckptwrap
from ckptwrap._errors import CheckpointConfigError
from ckptwrap.diagnostics import DoctorReport, Finding, doctor

from _doctor_models import (
    Bypass,
    Counting,
    DecoratedLayer,
    DetachesWhenRecomputed,
    Layer,
    NoisyLayer,
    Pair,
    Stack,
    inputs,
)

LAYERS = ["layers.0", "layers.1", "layers.2"]


def found(report: DoctorReport, check: str) -> List[Finding]:
    return [finding for finding in report.findings if finding.check == check]


def modules(report: DoctorReport, check: str) -> List[str]:
    return [finding.module for finding in found(report, check)]


def wrapped_stack(**options) -> nn.Module:
    model = Stack(dropout=0.5)
    return ckptwrap.wrap_model(model, "blocks", **options)


def wrapper_stack(**options) -> nn.Module:
    model = Stack(dropout=0.5)
    for index, layer in enumerate(model.layers):
        model.layers[index] = ckptwrap.CheckpointWrapper(layer, **options)
    return model


def decorated_stack(**options) -> nn.Module:
    model = Stack(dropout=0.5)
    for index in range(len(model.layers)):
        model.layers[index] = DecoratedLayer(dropout=0.5)
    return model


# ------------------------------------------------------------------------------- healthy


@pytest.mark.parametrize("build", [wrapped_stack, wrapper_stack, decorated_stack])
def test_healthy_model_is_ok_with_equal_gradients(build):
    model = build()
    report = doctor(model, inputs())
    assert report.ok, report
    assert report.findings == ()
    assert report.regions == tuple(LAYERS)
    assert report.parameters_compared == len(list(model.parameters()))
    assert report.max_grad_difference == 0.0


def test_doctor_leaves_the_model_and_the_rng_alone():
    model = wrapped_stack()
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    doctor(model, inputs())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_keyword_inputs_and_input_gradients_are_compared():
    model = ckptwrap.wrap_model(Pair(Layer(), Layer()), "all")
    x = inputs().requires_grad_()
    report = doctor(model, example_kwargs={"x": x})
    assert report.ok, report
    assert x.grad is None  # the doctor's steps run on copies of the inputs too


# ------------------------------------------------------------------------------- RNG


def test_dropout_without_rng_state_is_an_error_and_gradients_differ():
    report = doctor(wrapped_stack(preserve_rng_state=False), inputs())
    assert not report.ok
    [rng] = found(report, "dropout-rng")  # one finding for the three alike layers
    assert rng.modules == tuple(LAYERS) and rng.severity == "error"
    assert rng.details == tuple(f"{name} has dropout ({name}.drop)" for name in LAYERS)
    assert "preserve_rng_state=True" in rng.fix
    # The consequence, found by comparing gradients: against the control below, whose
    # only difference is that the RNG state is replayed.
    mismatch = found(report, "gradient-mismatch")
    assert LAYERS[0] in mismatch[0].modules
    assert "preserve_rng_state=True" in mismatch[0].fix
    assert report.max_grad_difference > 0
    control = doctor(wrapped_stack(preserve_rng_state=True), inputs())
    assert control.ok and control.max_grad_difference == 0.0


def test_functional_dropout_is_caught_by_its_random_draws():
    model = Pair(NoisyLayer(), Layer())
    model.first = ckptwrap.CheckpointWrapper(model.first, preserve_rng_state=False)
    report = doctor(model, inputs())
    [finding] = found(report, "dropout-rng")
    assert finding.module == "first"
    assert "draws random numbers" in finding.message
    assert "functional dropout" in finding.details[0]
    assert modules(report, "gradient-mismatch")[0] == "first"


def test_dropout_is_fine_in_eval_mode_but_the_doctor_trains():
    model = wrapped_stack(preserve_rng_state=False).eval()
    report = doctor(model, inputs())
    assert modules(report, "train-mode") == [""]
    [rng] = found(report, "dropout-rng")
    assert rng.modules == tuple(LAYERS)
    assert not model.training  # the caller's model keeps its mode


# ------------------------------------------------------------------------------- re-entrant


def test_reentrant_region_without_grad_input_is_noted_and_keeps_its_gradients():
    model = Stack(vocab=10)
    model.embed.requires_grad_(False)  # the frozen-embedding trap
    tokens = torch.randint(10, (4,), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model)
    ckptwrap.wrap_model(model, "blocks", use_reentrant=True)

    report = doctor(model, tokens)
    assert report.ok, report
    assert report.max_grad_difference == 0.0
    [finding] = found(report, "reentrant-no-grad-input")
    assert (finding.severity, finding.module) == ("info", "layers.0")
    assert "use_reentrant=False" in finding.fix

    # What the note warns about: torch's re-entrant variant drops those gradients.
    first = reference.layers[0]
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        hidden = torch_checkpoint.checkpoint(first, reference.embed(tokens), use_reentrant=True)
    reference.head(hidden).sum().backward()
    assert reference.head.weight.grad is not None
    assert all(p.grad is None for p in first.parameters())


def test_parameters_without_gradient_are_an_error():
    model = ckptwrap.wrap_model(
        Pair(Layer(), DetachesWhenRecomputed()), "name:second", use_reentrant=True
    )
    report = doctor(model, inputs())
    missing = {f.module: f for f in found(report, "missing-gradient")}
    assert missing["second"].severity == "error"
    assert "second.inner.fc.weight" in missing["second"].details[0]
    assert "use_reentrant=False" in missing["second"].fix
    assert "first.fc.weight" in missing[""].details[0]  # upstream of the region as well
    assert report.max_grad_difference == float("inf")


def test_tensors_by_keyword_to_reentrant_regions_are_noted():
    model = ckptwrap.wrap_model(Stack(scale_by_keyword=True), "blocks", use_reentrant=True)
    report = doctor(model, inputs())
    assert report.ok, report
    [note] = found(report, "reentrant-keyword-tensors")  # one note for the three alike layers
    assert note.modules == tuple(LAYERS) and note.module == LAYERS[0]
    assert note.details == tuple(f"{name} gets tensors by keyword: scale" for name in LAYERS)
    assert note.severity == "info"
    plain = ckptwrap.wrap_model(Stack(scale_by_keyword=True), "blocks")
    assert found(doctor(plain, inputs()), "reentrant-keyword-tensors") == []


def test_the_same_note_on_many_alike_layers_is_one_finding_listing_them():
    model = ckptwrap.wrap_model(Stack(depth=12, scale_by_keyword=True), "blocks", use_reentrant=True)
    report = doctor(model, inputs())
    names = [f"layers.{i}" for i in range(12)]
    [note] = found(report, "reentrant-keyword-tensors")
    assert note.modules == tuple(names)
    assert note.message.startswith("each of these modules uses the re-entrant engine")
    assert not any(name in note.message or name in note.fix for name in names)
    text = str(report)
    assert text.count("[reentrant-keyword-tensors]") == 1
    assert "INFO    layers.0, layers.1, ..., layers.11 (12 modules)  [reentrant-keyword-tensors]" in text
    assert report.to_dict()["findings"][0]["modules"] == names


@pytest.fixture
def process_group(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch built without distributed support")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_reentrant_under_ddp_needs_a_static_graph(process_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    report = doctor(DDP(wrapped_stack(use_reentrant=True)), inputs())
    [finding] = found(report, "reentrant-ddp")
    # Works while nothing is shared and no unused parameters are searched: fragile.
    assert (finding.severity, finding.module) == ("warning", "")
    assert "module.layers.0" in finding.message
    assert "static_graph=True" in finding.fix and "use_reentrant=False" in finding.fix
    assert report.regions == tuple(f"module.{name}" for name in LAYERS)

    searching = DDP(wrapped_stack(use_reentrant=True), find_unused_parameters=True)
    [finding] = found(doctor(searching, inputs()), "reentrant-ddp")
    assert finding.severity == "error"
    assert "find_unused_parameters=True" in finding.message

    twice = Pair(Layer(), Layer())
    twice.second = twice.first  # one block called twice
    ckptwrap.wrap_model(twice, "name:first", use_reentrant=True)
    [finding] = found(doctor(DDP(twice), inputs()), "reentrant-ddp")
    assert finding.severity == "error"
    assert "parameters of module.first are reached more than once" in finding.message

    static = DDP(wrapped_stack(use_reentrant=True), static_graph=True)
    assert found(doctor(static, inputs()), "reentrant-ddp") == []
    assert doctor(DDP(wrapped_stack()), inputs()).ok


# ------------------------------------------------------------------------------- selection


def test_module_marked_twice_is_a_warning():
    model = Pair(Layer(), ckptwrap.CheckpointWrapper(DecoratedLayer()))
    report = doctor(model, inputs())
    [finding] = found(report, "selected-twice")
    assert (finding.severity, finding.module) == ("warning", "second")
    assert "by CheckpointWrapper and by @checkpointed" in finding.message
    assert "remove @checkpointed from DecoratedLayer.forward" in finding.fix
    assert report.max_grad_difference == 0.0  # wasteful, not wrong


def test_nested_region_is_a_warning():
    model = nn.Sequential(Layer(), Layer())
    ckptwrap.wrap_model(model, "all")
    ckptwrap.wrap_model(model, "name:0.fc", nested=True)
    report = doctor(model, inputs())
    [finding] = found(report, "selected-twice")
    assert finding.module == "0.fc"
    assert finding.details == ("0.fc is inside checkpointed 0",)


def test_region_that_saves_almost_nothing_is_a_warning():
    model = ckptwrap.wrap_model(Stack(), "name:head")
    report = doctor(model, inputs())
    [finding] = found(report, "no-savings")
    assert (finding.severity, finding.module) == ("warning", "head")
    assert "un-checkpointed" in finding.fix
    # The blocks, whose hidden activation is four times their input, do save.
    assert doctor(ckptwrap.wrap_model(Stack(), "blocks"), inputs()).ok


def test_region_never_called_is_a_warning():
    model = ckptwrap.wrap_model(Bypass(), "name:layer")
    report = doctor(model, inputs())
    assert modules(report, "not-called") == ["layer"]


def test_unwrapped_model_has_nothing_to_check():
    report = doctor(Stack(), inputs())
    assert modules(report, "no-regions") == [""]
    assert not report.ok


def test_pending_budget_plan_is_applied_to_the_copy():
    model = ckptwrap.wrap_model(Stack(), "budget:90%")
    # Enough rows that activations, not parameter gradients, make most of the training
    # step's peak, so that checkpointing can bring it to 90%.
    report = doctor(model, inputs(256))
    assert modules(report, "pending-plan") == [""]
    assert report.regions and report.ok, report
    assert model.ckptwrap_plan.pending  # the caller's model still waits


# ------------------------------------------------------------------------------- recomputation


def test_region_that_recomputes_differently_gets_a_gradient_mismatch():
    model = ckptwrap.wrap_model(Pair(Layer(), Counting()), "name:second")
    report = doctor(model, inputs())
    mismatch = {f.module: f for f in found(report, "gradient-mismatch")}
    assert mismatch["second"].severity == "error"
    assert "recompute exactly" in mismatch["second"].fix
    assert "outside the checkpointed regions" in mismatch[""].message


def test_failing_recomputation_is_reported_not_raised():
    model = ckptwrap.wrap_model(Pair(Layer(), Counting(change_shape=True)), "name:second")
    report = doctor(model, inputs())
    [finding] = found(report, "step-failed")
    assert finding.severity == "error"
    assert "CheckpointError" in finding.message


# ------------------------------------------------------------------------------- losses, errors


def test_loss_attribute_and_custom_loss():
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Pair(Layer(), Layer())

        def forward(self, x):
            out = self.body(x)
            return types.SimpleNamespace(loss=out.square().mean(), logits=out)

    model = ckptwrap.wrap_model(WithLoss(), "name:body.*")
    assert doctor(model, inputs()).ok
    assert doctor(model, inputs(), loss_fn=lambda out: out.logits.sum()).ok


def test_bad_arguments_raise_naming_what_was_passed():
    model = wrapped_stack()
    with pytest.raises(CheckpointConfigError, match="nn.Module, got list"):
        doctor([model], inputs())
    with pytest.raises(CheckpointConfigError, match="loss_fn must be a callable.*got str"):
        doctor(model, inputs(), loss_fn="mse")
    with pytest.raises(CheckpointConfigError, match="one-element tensor.*shape \\(4, 2\\)"):
        doctor(model, inputs(), loss_fn=lambda out: out)
    with pytest.raises(CheckpointConfigError, match="fails on the example inputs even without"):
        doctor(model, torch.randn(4, 3))
    with pytest.raises(CheckpointConfigError, match="no floating-point tensor.*loss_fn="):
        doctor(nn.Flatten(), inputs())

"""Tests of what the doctor's findings say: a larger module it suggests is one the forward
calls, one mistake on alike blocks is one finding per kind, and a failing selective step
names the module, the operator and the fix."""

from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap.diagnostics import DoctorReport, Finding, doctor

from _doctor_models import (
    Bypass,
    DecoratedLayer,
    Recurrent,
    Segmenter,
    Stack,
    inputs,
    sequence,
)

BLOCKS = tuple(f"layers.{i}" for i in range(4))


def found(report: DoctorReport, check: str) -> List[Finding]:
    return [finding for finding in report.findings if finding.check == check]


def mentions(finding: Finding) -> str:
    return " ".join((finding.message, finding.fix, *finding.details))


# ------------------------------------------------------------------------ suggested modules


def test_a_larger_module_suggested_is_one_the_forward_calls_not_its_module_list():
    model = ckptwrap.wrap_model(Segmenter(), "type:Projection")
    report = doctor(model, inputs())
    # The ModuleList holding them is never called: checkpointing it would do nothing.
    assert "decode_head.linear_projections)" not in str(report)
    assert "decode_head.linear_projections," not in str(report)
    [finding] = found(report, "no-savings")
    projections = tuple(f"decode_head.linear_projections.{i}" for i in range(4))
    assert finding.modules == projections
    assert all(detail.endswith("larger module: decode_head") for detail in finding.details)
    assert "larger module: decode_head.linear_projections" not in mentions(finding)


def test_on_segformer_the_decode_head_is_suggested_not_its_linear_projections():
    transformers = pytest.importorskip("transformers")
    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 1], mlp_ratios=[2, 2],
        decoder_hidden_size=16, num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.SegformerForSemanticSegmentation(config)
    ckptwrap.wrap_model(model, "type:SegformerMLP")
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    [finding] = found(doctor(model, images), "no-savings")
    assert finding.modules == tuple(f"decode_head.linear_projections.{i}" for i in range(2))
    assert all(detail.endswith("larger module: decode_head") for detail in finding.details)


def test_a_module_never_called_is_reported_with_the_parts_the_forward_calls():
    report = doctor(ckptwrap.wrap_model(Bypass(), "name:layer"), inputs())
    [finding] = found(report, "not-called")
    # layer.drop is never called either, so it is not offered.
    assert finding.details == ("layer (Layer); the forward calls layer.fc, layer.out inside it",)


# ------------------------------------------------------------------------ one finding per kind


def _without_rng_state() -> nn.Module:
    return ckptwrap.wrap_model(Stack(depth=4, dropout=0.5), "blocks", preserve_rng_state=False)


def _marked_twice() -> nn.Module:
    model = Stack(depth=4)
    for index in range(4):
        model.layers[index] = ckptwrap.CheckpointWrapper(DecoratedLayer())
    return model


def _nested() -> nn.Module:
    model = ckptwrap.wrap_model(Stack(depth=4), "blocks")
    return ckptwrap.wrap_model(model, "name:layers.*.fc", nested=True)


def _reentrant_with_keywords() -> nn.Module:
    return ckptwrap.wrap_model(Stack(depth=4, scale_by_keyword=True), "blocks", use_reentrant=True)


NESTED = tuple(f"layers.{i}.fc" for i in range(4))


@pytest.mark.parametrize(
    "build, expected",
    [
        (_without_rng_state, {"dropout-rng": BLOCKS, "gradient-mismatch": BLOCKS}),
        (_marked_twice, {"selected-twice": BLOCKS}),
        (_nested, {"selected-twice": NESTED, "no-savings": NESTED}),
        (_reentrant_with_keywords, {"reentrant-keyword-tensors": BLOCKS}),
    ],
    ids=["dropout-rng", "marked-twice", "nested", "reentrant-keywords"],
)
def test_one_mistake_on_four_blocks_is_one_finding_per_kind(build, expected):
    report = doctor(build(), inputs())
    checks = [finding.check for finding in report.findings]
    assert sorted(checks) == sorted(expected), report
    for check, names in expected.items():
        [finding] = found(report, check)
        assert finding.modules == names
        assert len(finding.details) == len(names)
        assert all(name in detail for name, detail in zip(names, finding.details))
        assert not any(name in finding.message or name in finding.fix for name in names)
        assert f"{', '.join(names)} (4 modules)  [{check}]" in str(report)
        assert str(report).count(f"[{check}]") == 1


def test_grouped_details_say_what_differs_from_block_to_block():
    report = doctor(_without_rng_state(), inputs())
    [rng] = found(report, "dropout-rng")
    assert rng.details == tuple(f"{name} has dropout ({name}.drop)" for name in BLOCKS)
    assert rng.fix == "checkpoint each of these modules with preserve_rng_state=True (the default)."
    [mismatch] = found(report, "gradient-mismatch")
    assert all("gradient(s) differ, the largest by" in detail for detail in mismatch.details)
    [nested] = found(doctor(_nested(), inputs()), "selected-twice")
    assert nested.details == tuple(
        f"layers.{i}.fc is inside checkpointed layers.{i}" for i in range(4)
    )


# ------------------------------------------------------------------------ selective mutation


def test_a_selective_step_that_mutates_a_saved_output_names_module_operator_and_fix():
    model = ckptwrap.wrap_model(Recurrent(), "type:LSTMCell;selective")
    report = doctor(model, sequence())
    [finding] = found(report, "step-failed")
    assert (finding.severity, finding.module) == ("error", "cell")
    assert "CheckpointError" in finding.message and "aten.addmm.default" in finding.message
    assert finding.fix.startswith("leave addmm out of the saved operators (selective:mm,")
    assert "checkpoint the module whole" in finding.fix
    assert "the message names the cause" not in finding.fix
    # The fix the doctor gives works.
    fixed = ckptwrap.wrap_model(Recurrent(), "type:LSTMCell;selective:mm")
    assert doctor(fixed, sequence()).ok
    assert doctor(ckptwrap.wrap_model(Recurrent(), "type:LSTMCell"), sequence()).ok


# ------------------------------------------------------ double checkpointing, transformers'


def _tiny_gpt2(transformers):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


@pytest.mark.parametrize("marking", ["wrap_model", "CheckpointWrapper"])
def test_transformers_own_checkpointing_on_a_region_is_named_with_its_switch(marking):
    transformers = pytest.importorskip("transformers")
    model = _tiny_gpt2(transformers)
    if marking == "wrap_model":
        ckptwrap.wrap_model(model, "blocks")
    else:
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = ckptwrap.CheckpointWrapper(block)
    model.gradient_checkpointing_enable()  # as the Trainer does, after the script wrapped
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    report = doctor(model, example_kwargs={"input_ids": ids, "labels": ids})
    [finding] = [f for f in found(report, "selected-twice") if "transformers" in f.message]
    assert "gradient_checkpointing" in finding.message
    assert "gradient_checkpointing_disable()" in finding.fix
    assert "TrainingArguments(gradient_checkpointing=False)" in finding.fix
    assert len(finding.modules) == 2, "the two layers, in one finding"
    assert model.is_gradient_checkpointing, "the doctor leaves the model as it was"


def test_no_transformers_finding_when_its_checkpointing_is_off():
    transformers = pytest.importorskip("transformers")
    model = ckptwrap.wrap_model(_tiny_gpt2(transformers), "blocks")
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    report = doctor(model, example_kwargs={"input_ids": ids, "labels": ids})
    assert not [f for f in report.findings if "transformers" in f.message]

"""Outputs and every gradient of the corpus equal the un-checkpointed run and torch's checkpoint."""

from __future__ import annotations

import pytest

from _models import CORPUS, assert_same, run_case

VARIANTS = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]
CASES = [pytest.param(case, id=case.name) for case in CORPUS]


def test_corpus_is_broad_enough():
    assert len(CORPUS) >= 6


@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_equal_to_plain_run(case, use_reentrant):
    if use_reentrant and not case.reentrant:
        pytest.skip("keyword arguments are not supported by the re-entrant variant")
    plain = run_case(case, "plain")
    ours = run_case(case, "ours", use_reentrant=use_reentrant)
    assert_same(ours.outputs, plain.outputs, "outputs")
    assert_same(ours.grads, plain.grads, "gradients")
    assert all(g is not None for g in ours.grads.values()), "every parameter and input gets a gradient"


@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_equal_to_torch_checkpoint(case, use_reentrant):
    if use_reentrant and not case.torch_reentrant:
        pytest.skip("torch's re-entrant variant does not support this case")
    reference = run_case(case, "torch", use_reentrant=use_reentrant)
    ours = run_case(case, "ours", use_reentrant=use_reentrant)
    assert_same(ours.outputs, reference.outputs, "outputs")
    assert_same(ours.grads, reference.grads, "gradients")
    # BatchNorm running statistics are updated again by the recomputation, in torch and
    # in ours alike, so they are compared with torch's checkpoint and not with the plain run.
    assert_same(ours.buffers, reference.buffers, "buffers")


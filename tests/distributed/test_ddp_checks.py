"""The re-entrant engine under DDP without ``static_graph``: the setups DDP cannot serve fail
in the forward with the fix, the others train.

A one-process gloo group is enough: DDP's reducer checks its gradient hooks the same way
for any number of ranks.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ckptwrap
from _dist_setup import CONFIG, build_model, loopback_environment, synthetic_batch
from ckptwrap.wrap import _region

pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="needs torch.distributed with the gloo backend",
    ),
    pytest.mark.filterwarnings("ignore:You passed find_unused_parameters=true"),
]

_FAILING = {
    "find_unused_parameters": ("gpt", {"find_unused_parameters": True}, r"find_unused_parameters=True"),
    "module run twice": ("shared", {}, r"'blocks\.0\.\w+.*' was already used by a re-entrant region"),
    "tied weight": ("tied", {}, r"shares its parameter 'blocks\.3\.ln_mlp\.weight' with 'ln_f\.weight'"),
}


@pytest.fixture(scope="module")
def process_group():
    mp = pytest.MonkeyPatch()
    for name, value in loopback_environment().items():
        mp.setenv(name, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # no DDP module may outlive the group: that can crash the process at exit
        dist.destroy_process_group()
        mp.undo()


def _step(ddp: DistributedDataParallel) -> None:
    tokens, targets = synthetic_batch(CONFIG, 2, seed=0)
    ddp(tokens, targets).backward()


@pytest.mark.parametrize("setup", list(_FAILING))
def test_reentrant_setups_ddp_cannot_serve_fail_early_with_the_fix(setup, process_group):
    kind, options, match = _FAILING[setup]
    ddp = DistributedDataParallel(ckptwrap.wrap_model(build_model(kind), "blocks", use_reentrant=True), **options)
    with pytest.raises(ckptwrap.CheckpointError, match=match) as caught:
        _step(ddp)
    message = str(caught.value)
    assert "static_graph=True" in message and "use_reentrant=False" in message


@pytest.mark.parametrize("setup", list(_FAILING))
def test_the_check_guards_a_real_failure_of_ddp(setup, process_group, monkeypatch):
    # Without the check, DDP fails deep inside its reducer: the check is no false alarm.
    monkeypatch.setattr(_region, "check_reentrant_region", lambda owner: None)
    kind, options, _ = _FAILING[setup]
    ddp = DistributedDataParallel(ckptwrap.wrap_model(build_model(kind), "blocks", use_reentrant=True), **options)
    with pytest.raises(RuntimeError, match="marked as ready twice"):
        _step(ddp)


@pytest.mark.parametrize("setup", list(_FAILING))
@pytest.mark.parametrize("fix", ["static_graph", "use_reentrant=False"])
def test_each_fix_the_message_names_works(setup, fix, process_group):
    kind, options, _ = _FAILING[setup]
    model = build_model(kind)
    reference = build_model(kind)
    tokens, targets = synthetic_batch(CONFIG, 2, seed=0)
    reference(tokens, targets).backward()
    ckptwrap.wrap_model(model, "blocks", use_reentrant=fix != "use_reentrant=False")
    ddp = DistributedDataParallel(model, **options, static_graph=fix == "static_graph")
    for _ in range(2):  # static_graph takes the first iteration to record the graph
        model.zero_grad(set_to_none=True)
        _step(ddp)
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected.grad, msg=name)


def test_no_check_outside_ddp_and_under_no_sync(process_group):
    model = ckptwrap.wrap_model(build_model("shared"), "blocks", use_reentrant=True)
    tokens, targets = synthetic_batch(CONFIG, 2, seed=0)
    model(tokens, targets).backward()  # a module run twice is fine without DDP
    ddp = DistributedDataParallel(model)
    with ddp.no_sync():  # DDP does not watch gradients while accumulating them locally
        _step(ddp)

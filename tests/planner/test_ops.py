"""The per-operator record of each candidate call: numbering, new bytes, what autograd
saves, and agreement with what selective checkpointing sees in a checkpointed call."""

from __future__ import annotations

import collections
import contextlib
import json
from typing import Any, List, Tuple

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

import ckptwrap
from ckptwrap.measure import ModelProfile
from ckptwrap.wrap import profile_modules
from tests.wrap._models import TinyGPT, gpt_batch, make


class TwoLayer(nn.Module):
    """Two bias-free linears around a ReLU and an exp, on 2-D inputs: two ``mm``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10, bias=False)
        self.b = nn.Linear(10, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x).relu()
        return self.b(hidden).exp()


class Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).sum(-1)


def _profile_two_layer(calls: int = 1) -> Tuple[Any, torch.Tensor]:
    model = make(lambda: Holder(TwoLayer()))
    x = torch.randn(5, 6, requires_grad=True)
    if calls == 2:
        model.forward = lambda x: model.inner(model.inner(x @ torch.ones(6, 6)) @ torch.ones(3, 6))  # type: ignore[assignment]
    return profile_modules(model, ["inner"], (x,), repeats=2)["inner"], x


def test_each_packet_is_numbered_from_zero_within_the_call():
    cost, _ = _profile_two_layer()
    counts = collections.Counter(op.op for op in cost.ops)
    assert counts["mm"] == 2 and counts["relu"] == 1 and counts["exp"] == 1
    for name, count in counts.items():
        assert [op.occurrence for op in cost.ops if op.op == name] == list(range(count))


def test_new_bytes_are_the_output_sizes_and_views_are_free():
    cost, x = _profile_two_layer()
    by_instance = {op.instance: op for op in cost.ops}
    size = x.element_size()
    # mm(x, a.T): (5, 10); relu: (5, 10); mm(h, b.T): (5, 3); exp: (5, 3)
    assert by_instance[("mm", 0)].bytes == 5 * 10 * size
    assert by_instance[("relu", 0)].bytes == 5 * 10 * size
    assert by_instance[("mm", 1)].bytes == 5 * 3 * size
    assert by_instance[("exp", 0)].bytes == 5 * 3 * size
    assert all(op.bytes == 0 for op in cost.ops if op.op == "t"), "a transpose is a view"


def test_saved_flags_follow_autograd():
    cost, _ = _profile_two_layer()
    by_instance = {op.instance: op for op in cost.ops}
    # relu saves its output (for its own backward and for the second mm); exp saves its
    # output; the first mm's output is consumed by relu alone, which saves its result.
    assert by_instance[("relu", 0)].saved and by_instance[("exp", 0)].saved
    assert not by_instance[("mm", 0)].saved and not by_instance[("mm", 1)].saved
    # What autograd saves of the new storages adds up to the module's kept bytes.
    assert sum(op.bytes for op in cost.ops if op.saved) == cost.kept_bytes


def test_flops_and_times_per_operator():
    cost, _ = _profile_two_layer()
    mm = [op for op in cost.ops if op.op == "mm"]
    assert [op.flops for op in mm] == [2 * 5 * 6 * 10, 2 * 5 * 10 * 3]
    assert sum(op.flops for op in cost.ops) == cost.flops
    assert all(op.time > 0 for op in cost.ops)


def test_calls_of_a_shared_module_add_up():
    single, _ = _profile_two_layer()
    double, _ = _profile_two_layer(calls=2)
    assert double.calls == 2
    assert [op.instance for op in double.ops] == [op.instance for op in single.ops]
    assert [op.bytes for op in double.ops] == [2 * op.bytes for op in single.ops]


def test_an_output_written_in_place_later_is_marked():
    model = make(lambda: Holder(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))))
    model.train()
    cost = profile_modules(model, ["inner"], (torch.randn(3, 4),), repeats=0)["inner"]
    mutated = [op for op in cost.ops if op.mutated]
    assert mutated and all(op.bytes > 0 for op in mutated)


def test_ops_survive_a_json_round_trip():
    model = make(TinyGPT)
    profile = profile_modules(model, ["h.0"], (gpt_batch()[0],), repeats=1)
    again = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile and again["h.0"].ops == profile["h.0"].ops


# --------------------------------------------------------------------------- agreement with SAC


class _Names(TorchDispatchMode):
    """Records the packet names of the operators that selective checkpointing numbers."""

    def __init__(self, into: List[str]) -> None:
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAC_IGNORED_OPS:
            self.into.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _Seen:
    """A context_fn whose SAC policy records the operators it is asked about in the
    forward, and whose recomputation context records those it runs."""

    def __init__(self) -> None:
        self.policy: List[str] = []
        self.recomputed: List[str] = []

    def __call__(self):
        def policy(ctx, op, *args, **kwargs):
            if not ctx.is_recompute:  # torch before 2.12 asks again as it recomputes
                self.policy.append(op.overloadpacket.__name__)
            return CheckpointPolicy.PREFER_RECOMPUTE

        forward, recompute = create_selective_checkpoint_contexts(policy)

        @contextlib.contextmanager
        def recomputing():
            with recompute, _Names(self.recomputed):
                yield

        return forward, recomputing()


def _numbered(names: List[str]) -> List[Tuple[str, int]]:
    counts: collections.Counter = collections.Counter()
    numbered = []
    for name in names:
        numbered.append((name, counts[name]))
        counts[name] += 1
    return numbered


def _compare_with_sac(model: nn.Module, name: str, args: Tuple[Any, ...], kwargs: Any = None) -> None:
    model.train()
    kwargs = kwargs or {}
    profile = profile_modules(model, [name], args, kwargs, repeats=1)
    recorded = [op.instance for op in profile[name].ops]
    assert recorded, "nothing recorded"
    seen = _Seen()
    ckptwrap.wrap_model(model, f"name:{name}", context_fn=seen)
    try:
        with ckptwrap.set_checkpoint_early_stop(False):
            out = model(*args, **kwargs)
            out = out if isinstance(out, torch.Tensor) else out.logits
            out.float().sum().backward()
    finally:
        ckptwrap.unwrap_model(model)
    assert _numbered(seen.policy) == recorded, "the forward's operators differ from the profile's"
    assert _numbered(seen.recomputed) == recorded, "the recomputation's operators differ"


def test_profiled_operators_are_those_sac_sees_in_a_gpt_block():
    _compare_with_sac(make(TinyGPT), "h.1", (gpt_batch()[0],))


def test_profiled_operators_are_those_sac_sees_in_a_hf_gpt2_block():
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    _compare_with_sac(model, "transformer.h.0", (ids,), {"use_cache": False})


def test_which_calls_draw_random_numbers():
    """Seeded-nondeterministic operators draw, unless their arguments say they draw
    nothing here (an attention's ``dropout_p`` of 0, ``train=False``)."""
    from ckptwrap.policy import draws_random

    aten = torch.ops.aten
    q = torch.randn(1, 1, 4, 2)
    assert draws_random(aten.native_dropout.default, (q, 0.1, True))
    assert not draws_random(aten.native_dropout.default, (q, 0.1, False))
    assert draws_random(aten.bernoulli_.float, (q, 0.5))
    assert draws_random(aten.rand.default, ([2],))
    flash = aten._scaled_dot_product_flash_attention.default
    assert draws_random(flash, (q, q, q, 0.1)) and not draws_random(flash, (q, q, q, 0.0))
    assert not draws_random(flash, (q, q, q), {"dropout_p": 0.0})
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert draws_random(efficient, (q, q, q, None, True, 0.1))
    assert not draws_random(efficient, (q, q, q, None, True))  # dropout_p at its default, 0
    assert not draws_random(aten.mm.default, (q, q)) and not draws_random(aten.addmm.default)


def test_the_record_marks_a_fused_dropout_as_drawn():
    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.native_dropout(self.a(x), 0.3, True)[0].exp()

    model = make(lambda: Holder(Fused()))
    ops = profile_modules(model, ["inner"], (torch.randn(3, 6),), repeats=0)["inner"].ops
    drawn = [op for op in ops if op.random]
    assert [op.op for op in drawn] == ["native_dropout"] and drawn[0].bytes > 0 and drawn[0].saved
    assert not any(op.random for op in ops if op.op != "native_dropout")

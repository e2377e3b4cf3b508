"""Every ``wrap_model`` call is applied as asked or refused, at once, leaving the model as
it was: stacking onto a budget (before or after its first steps), a budget onto marks, a
tier change by stacking, ``budget:device`` where the device's memory cannot be read. A
selection that rounds to nothing says so in the plan, and ``max_shapes`` keys that the
training forward never receives are said at the first one."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

import ckptwrap
from ckptwrap import CheckpointConfigError, unwrap_model, wrap_model


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.out = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


class _Stack(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(depth))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Single(nn.Module):
    """One block: a picking term has one candidate."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


class _Keywords(nn.Module):
    """A forward that takes ``*args`` and ``**kwargs``, as a transformers model's does: any max_shapes
    key passes the check against its signature."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, features: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = features
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _model(seed: int = 0) -> _Stack:
    torch.manual_seed(seed)
    return _Stack().train()


def _step(model: nn.Module, batch: int = 8) -> None:
    x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))
    model(x).sum().backward()


def _state(model: nn.Module) -> Dict[str, Any]:
    """Everything a wrapping changes: instance forwards, the plan, the hooks."""
    return {
        "forwards": {name: m.__dict__.get("forward") for name, m in model.named_modules()},
        "plan": model.__dict__.get("ckptwrap_plan"),
        "pre_hooks": list(model._forward_pre_hooks.values()),
        "hooks": list(model._forward_hooks.values()),
        "layer_hooks": [list(m._forward_pre_hooks.values()) for m in model.modules()],
    }


def _refused(model: nn.Module, policy: str, pattern: str, **options: Any) -> CheckpointConfigError:
    before = _state(model)
    with pytest.raises(CheckpointConfigError, match=pattern) as info:
        wrap_model(model, policy, **options)
    assert _state(model) == before, f"{policy!r} was refused but left the model changed"
    return info.value


def _both(first: str, second: str) -> str:
    return rf"(?s){re.escape(repr(first))}.*{re.escape(repr(second))}"


# ----------------------------------------------------------------------------- stacking


def test_nothing_stacks_onto_a_budget_before_or_after_its_first_steps():
    # docs/budget.md: an error at once, whatever the steps so far have planned (the
    # budget's marks after a step can make the second policy select nothing new).
    others = ["last:1", "blocks", "every:2", "none", "budget:40%", "first:1;offload", "name:layers.0"]
    for steps in (0, 1, 2):
        for second in others:
            model = wrap_model(_model(), "budget:50%")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an unreachable budget at this shape, said
                for _ in range(steps):
                    _step(model)
            error = _refused(model, second, _both("budget:50%", second))
            assert "unwrap_model" in str(error), (steps, second)
            # Unwrapped first, the second policy applies as asked.
            wrap_model(unwrap_model(model), second)
            assert model.ckptwrap_plan.policy == second, (steps, second)


def test_a_budget_never_goes_onto_marks_of_another_policy():
    for first in ("blocks", "last:1", "every:2;offload", "first:1;selective"):
        model = wrap_model(_model(), first)
        _refused(model, "budget:50%", _both(first, "budget:50%"))
    # The same budget twice is no refusal: still one planning hook.
    model = wrap_model(_model(), "budget:50%")
    wrap_model(model, "budget:50%")
    assert [type(h).__name__ for h in model._forward_pre_hooks.values()] == ["PlanPerShape"]


@pytest.mark.parametrize(
    "first, second",
    [
        ("blocks", "blocks;offload"),
        ("blocks;offload", "blocks"),
        ("blocks", "blocks;selective"),
        ("blocks;selective", "blocks"),
        ("blocks", "blocks;overlap"),
        ("blocks;overlap", "blocks"),
        ("first:1", "last:1;offload"),
        ("first:1", "last:1;selective"),
        ("first:1;selective", "last:1;selective:mm"),
    ],
)
def test_stacking_cannot_change_how_marked_modules_are_checkpointed(first, second):
    model = wrap_model(_model(), first)
    error = _refused(model, second, _both(first, second))
    assert "tier" in str(error) and "unwrap_model" in str(error)
    # Unwrapped first, the tier asked for is the one applied.
    wrap_model(unwrap_model(model), second)
    assert model.ckptwrap_plan.policy == second
    assert model.ckptwrap_plan.tier == ckptwrap.plan(_model(), second).tier


def test_stacking_alike_adds_modules_and_wrapping_twice_is_a_no_op():
    # Beside the refusals above: what stacking does apply, it applies.
    model = wrap_model(wrap_model(_model(), "first:1;offload"), "last:1;offload")
    assert model.ckptwrap_plan.names == ["layers.0", "layers.3"]
    assert model.ckptwrap_plan.tier == "offload"
    before = _state(model)
    wrap_model(model, "last:1;offload")
    assert _state(model) == before
    # ... and a tier change over a plan that marks nothing is no stacking at all.
    model = wrap_model(wrap_model(_model(), "none"), "blocks;offload")
    assert model.ckptwrap_plan.tier == "offload" and len(model.ckptwrap_plan) == 4


# ----------------------------------------------------------------------------- budget:device


@pytest.mark.parametrize("policy", ["budget:device", "blocks;budget:device", "last:2;budget:device"])
def test_budget_device_on_a_cpu_model_is_refused_by_wrap_model_itself(policy):
    model = _model()
    plain = copy.deepcopy(model)
    before = _state(model)
    with pytest.raises(CheckpointConfigError, match=r"(?s)budget:device.*cpu.*nothing was wrapped.*budget:total=SIZE"):
        wrap_model(model, policy, optimizer="adamw")
    assert _state(model) == before
    # Nothing applied: training forwards run as the plain model's.
    x = torch.randn(4, 16, requires_grad=True)
    torch.testing.assert_close(model(x), plain(x))
    _step(model)
    # With example inputs too, before any measurement.
    with pytest.raises(CheckpointConfigError, match=r"nothing was wrapped"):
        wrap_model(model, policy, example_inputs=(x,))
    assert _state(model) == before
    # On the meta device it is left to the memory of the device the rates name: not refused.
    with torch.device("meta"):
        fake = _Stack()
    assert wrap_model(fake, policy).ckptwrap_plan.pending


# ----------------------------------------------------------------------------- rounding


@pytest.mark.parametrize(
    "factory, policy, rounds",
    [
        (_Single, "type:_Block;fraction:0.5", True),  # round(0.5 x 1) == 0
        (_model, "fraction:0.1", True),  # round(0.4) == 0 of the 4 blocks
        (lambda: _Stack(depth=2), "every:2;last:1", False),  # picks block 0 and block 1: none in common
        (_model, "first:1;last:1", False),
    ],
)
def test_a_selection_that_picks_nothing_says_so_in_the_plan(factory, policy, rounds):
    model = factory()
    candidates = [name for name, m in model.named_modules() if isinstance(m, _Block)]
    for made in (ckptwrap.plan(model, policy), wrap_model(factory(), policy).ckptwrap_plan):
        assert len(made) == 0
        assert [name for name, _ in made.dropped] == candidates, made
        reasons = {why for _, why in made.dropped}
        assert len(reasons) == 1
        [reason] = reasons
        assert ("rounds to none" in reason) == rounds, reason
        assert f"{len(candidates)} candidate" in reason
        assert any(name in str(made) for name in candidates), "the printed plan shows them"
        assert "dropped" in made.to_dict() and made.to_dict()["dropped"]


# ----------------------------------------------------------------------------- max_shapes


def _warnings_of(run) -> List[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "max_shapes" in str(w.message)]


def test_max_shapes_keys_the_forward_never_receives_are_said_at_the_first_training_forward():
    torch.manual_seed(0)
    model = wrap_model(
        _Keywords().train(), "budget:90%",
        max_shapes={"featurez": (8, 16), "mask": (8, 16), 3: (8, 16), "features": (8, 16, 1)},
    )
    features = torch.randn(4, 16)
    said = _warnings_of(lambda: model(features=features).backward())
    assert len(said) == 1, said
    [message] = said
    # Each key that cannot apply is named, with what the forward did receive.
    for fragment in ("'featurez' was not received", "'mask' was not received", "position 3 was not received",
                     "'features'", "of 3 dimensions", "keywords 'features'", "no positional input"):
        assert fragment in message, (fragment, message)
    # Said once: later forwards stay quiet.
    assert _warnings_of(lambda: model(features=features).backward()) == []
    # A key the forward receives by position is told how to name it.
    model = wrap_model(_Keywords().train(), "budget:90%", max_shapes={"features": (8, 16)})
    [message] = _warnings_of(lambda: model(features).backward())
    assert "'features' was received by position, as input 0: key it 0" in message
    # Keys that apply are not said.
    model = wrap_model(_Keywords().train(), "budget:90%", max_shapes={"features": (8, 16)})
    assert _warnings_of(lambda: model(features=features).backward()) == []


def test_max_shapes_of_a_transformers_model_are_checked_against_its_training_forward():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    wrap_model(model, "budget:90%", max_shapes={"input_idz": (2, 32)})
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    [message] = _warnings_of(lambda: model(input_ids=ids, labels=ids).loss.backward())
    assert "'input_idz' was not received" in message and "'input_ids', 'labels'" in message

"""Tests of the per-module profiler, against independent counts made in the test.

Every expected number comes from running the module (or the whole model) here under a
simple saved-tensors counter or ``FlopCounterMode``, never from a previous run.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.measure import ModelProfile, ModuleCost
from ckptwrap.wrap import profile_modules
from ckptwrap.measure._metering import should_show


# --- independent counts ---------------------------------------------------------------------


class _SavedCounter:
    """Distinct storages saved for backward inside the block, other than ``excluded`` ones.

    Keeps a strong reference to each storage, so no address is reused during the count.
    """

    def __init__(self, excluded: set) -> None:
        self.excluded = excluded
        self.storages: Dict[int, torch.UntypedStorage] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in self.excluded:
            self.storages.setdefault(storage._cdata, storage)
        return tensor

    def __enter__(self) -> "_SavedCounter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(storage.nbytes() for storage in self.storages.values())


def _keys(tensors) -> set:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def _state_keys(model: nn.Module) -> set:
    return _keys([*model.parameters(), *model.buffers()])


def _full_forward_bytes(model: nn.Module, args: Tuple[Any, ...]) -> int:
    """Activation bytes of a plain forward: saved storages other than state and inputs."""
    with _SavedCounter(_state_keys(model) | _keys(args)) as counter:
        output = model(*args)
    del output
    return counter.bytes


def _calls(model: nn.Module, names: List[str], args: Tuple[Any, ...]) -> Dict[str, List[Tuple]]:
    """The positional inputs of every call of each named module in a no_grad forward."""
    found: Dict[str, List[Tuple]] = {name: [] for name in names}
    modules = dict(model.named_modules())
    handles = [
        modules[name].register_forward_pre_hook(lambda m, a, name=name: found[name].append(a))
        for name in names
    ]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _alone(module: nn.Module, call_args: Tuple, model_inputs: set, state: set) -> Tuple[int, int, int]:
    """Kept bytes, input bytes and FLOPs of the module run alone on detached inputs; the
    model's own inputs, alive before the step, are no input bytes."""
    inputs, input_bytes = [], 0
    for arg in call_args:
        is_model_input = arg.untyped_storage()._cdata in model_inputs
        needs_grad = arg.is_floating_point() and not is_model_input
        inputs.append(arg.detach().requires_grad_(needs_grad))
        input_bytes += 0 if is_model_input else arg.nbytes
    with _SavedCounter(state | model_inputs | _keys(inputs)) as counter:
        output = module(*inputs)
    del output
    with FlopCounterMode(display=False) as flops:
        module(*inputs)
    return counter.bytes, input_bytes, flops.get_total_flops()


def _check_against_alone(
    model: nn.Module, names: List[str], args: Tuple[Any, ...], profile: ModelProfile
) -> None:
    state, model_inputs = _state_keys(model), _keys(args)
    modules = dict(model.named_modules())
    for name, calls in _calls(model, names, args).items():
        expected = [_alone(modules[name], call, model_inputs, state) for call in calls]
        cost = profile[name]
        assert cost.calls == len(calls) and cost.called
        assert cost.kept_bytes == sum(kept for kept, _, _ in expected), name
        assert cost.input_bytes == sum(size for _, size, _ in expected), name
        assert cost.flops == sum(flops for _, _, flops in expected), name
        assert cost.forward_time > 0
        assert cost.kind == type(modules[name]).__name__


# --- models ---------------------------------------------------------------------------------


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def _mlp(depth: int = 4, width: int = 32) -> nn.Sequential:
    return nn.Sequential(*[_Layer(width) for _ in range(depth)], nn.Linear(width, 10))


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        weights = self.drop(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, length, dim)
        return self.drop(self.proj(out))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads, dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _GPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(16, dim)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList([_Block(dim, heads, 0.1) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _conv_net() -> nn.Sequential:
    def stage(channels_in: int, channels_out: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels_out),
            nn.ReLU(),
        )

    return nn.Sequential(
        stage(3, 8), nn.MaxPool2d(2), stage(8, 16), stage(16, 16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def _snapshot(model: nn.Module) -> Dict[str, Any]:
    return {
        "state": {name: value.clone() for name, value in model.state_dict().items()},
        "training": [module.training for module in model.modules()],
        "rng": torch.get_rng_state(),
    }


def _assert_unchanged(model: nn.Module, before: Dict[str, Any]) -> None:
    after = _snapshot(model)
    assert after["training"] == before["training"]
    assert after["state"].keys() == before["state"].keys()
    for name, value in before["state"].items():
        assert torch.equal(after["state"][name], value), name
    assert torch.equal(after["rng"], before["rng"])


# --- tests ----------------------------------------------------------------------------------


def test_mlp_costs_match_each_layer_run_alone() -> None:
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(8, 32)
    names = ["0", "1", "2", "3", "4"]
    profile = profile_modules(model, names, (x,))
    assert [cost.name for cost in profile.modules] == names
    _check_against_alone(model, names, (x,), profile)
    # The first layer's input is the model's input, there before the step: no input bytes.
    assert profile["0"].input_bytes == 0 and profile["1"].input_bytes == x.nbytes
    # Each layer keeps its ReLU output; the head keeps only its input, which is not its own.
    assert profile["1"].kept_bytes > 0 and profile["4"].kept_bytes == 0


@pytest.mark.parametrize(
    "names", [["0", "1", "2", "3"], ["1", "3"], ["1", "1.fc", "2"], ["4"], [""]], ids=repr
)
def test_mlp_total_matches_a_full_forward_count(names: List[str]) -> None:
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(8, 32)
    profile = profile_modules(model, names, (x,), repeats=1)
    assert profile.total_activation_bytes == _full_forward_bytes(model, (x,))
    assert 0 <= profile.base_bytes <= profile.total_activation_bytes


def test_gpt_costs_match_each_block_run_alone() -> None:
    torch.manual_seed(0)
    model, idx = _GPT(), _tokens()
    names = ["blocks.0", "blocks.1", "blocks.2", "blocks.1.attn"]
    profile = profile_modules(model, names, (idx,))
    assert [cost.name for cost in profile.modules] == ["blocks.0", "blocks.1", "blocks.1.attn", "blocks.2"]
    _check_against_alone(model, names, (idx,), profile)


@pytest.mark.parametrize("frozen_embedding", [False, True], ids=["trainable", "frozen-embedding"])
@pytest.mark.parametrize(
    "names",
    [
        ["blocks.0", "blocks.1", "blocks.2"],
        ["blocks.1.attn", "blocks.2.mlp"],
        ["blocks.0", "blocks.0.mlp.1", "ln_f"],
        [""],
    ],
    ids=repr,
)
def test_gpt_total_matches_a_full_forward_count(names: List[str], frozen_embedding: bool) -> None:
    torch.manual_seed(0)
    model, idx = _GPT(), _tokens()
    if frozen_embedding:
        # The frozen-embedding (LoRA) shape: the first block's input does not need grad.
        model.wte.requires_grad_(False)
        model.wpe.requires_grad_(False)
    profile = profile_modules(model, names, (idx,), repeats=1)
    assert profile.total_activation_bytes == _full_forward_bytes(model, (idx,))
    # Here nesting by call follows nesting by name; "" (the model) holds every other module.
    def nested(name: str) -> bool:
        return any(name != other and (other == "" or name.startswith(other + ".")) for other in names)

    outer = [cost for cost in profile.modules if not nested(cost.name)]
    assert profile.total_activation_bytes == profile.base_bytes + sum(cost.kept_bytes for cost in outer)


class _TanhGate(nn.Module):
    """Saves ``tanh(x)`` only when ``x`` needs grad: its cost depends on where grad starts."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.tanh(x).mean()


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen-embedding"])
def test_inputs_that_need_no_grad_are_measured_as_such(frozen: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), _TanhGate(16), _TanhGate(16))
    model[0].requires_grad_(not frozen)
    idx = torch.randint(0, 32, (4, 8))
    profile = profile_modules(model, ["1", "2"], (idx,), repeats=1)
    assert profile.total_activation_bytes == _full_forward_bytes(model, (idx,))
    # The first gate's tanh is recorded only when the embedding trains; the second's always.
    assert (profile["1"].kept_bytes == 0) == frozen
    assert profile["2"].kept_bytes > 0


def test_in_place_modules_do_not_change_the_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True))
    x = torch.randn(4, 8)
    expected = model(x)
    profile = profile_modules(model, ["1", "3"], (x,))
    assert torch.equal(model(x), expected)
    assert profile.total_activation_bytes == _full_forward_bytes(model, (x,))
    assert profile["1"].kept_bytes == 0  # it saves its output, which is its input's storage


def test_conv_net_costs_match_each_stage_run_alone() -> None:
    torch.manual_seed(0)
    model, images = _conv_net(), torch.randn(2, 3, 16, 16)
    names = ["0", "2", "3"]
    profile = profile_modules(model, names, (images,))
    _check_against_alone(model, names, (images,), profile)


@pytest.mark.parametrize("build", ["mlp", "gpt", "conv"])
def test_profiling_leaves_state_modes_and_rng_unchanged(build: str) -> None:
    torch.manual_seed(0)
    if build == "mlp":
        model, args, names = _mlp(), (torch.randn(8, 32),), ["1", "2"]
    elif build == "gpt":
        model, args, names = _GPT(), (_tokens(),), ["blocks.0", "blocks.2"]
    else:
        model, args, names = _conv_net(), (torch.randn(2, 3, 16, 16),), ["0", "2"]
        model[3][1].eval()  # a frozen BatchNorm inside a training model keeps its own mode
    before = _snapshot(model)
    reference = copy.deepcopy(model)
    profile_modules(model, names, args)
    _assert_unchanged(model, before)
    assert torch.is_grad_enabled()
    # The next training step is the one it would have been: same dropout masks, same BN update.
    rng = torch.get_rng_state()
    expected = reference(*args)
    torch.set_rng_state(rng)
    assert torch.equal(model(*args), expected)


def test_a_module_called_twice_sums_its_calls() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = _Layer(16)
            self.head = nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.layer(self.layer(x)))

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(4, 16, requires_grad=True)
    profile = profile_modules(model, ["layer"], (x,))
    assert profile["layer"].calls == 2
    _check_against_alone(model, ["layer"], (x,), profile)
    assert profile.total_activation_bytes == _full_forward_bytes(model, (x,))


def test_a_module_never_called_is_reported_with_zeros() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = _Layer(8)
            self.spare = _Layer(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model, x = Unused(), torch.randn(2, 8)
    profile = profile_modules(model, ["spare", "used"], (x,))
    spare = profile["spare"]
    assert not spare.called and spare.calls == 0
    figures = (spare.kept_bytes, spare.input_bytes, spare.output_bytes, spare.flops, spare.forward_time)
    assert figures == (0, 0, 0, 0, 0.0)
    assert profile["used"].called


def test_kwargs_and_nested_inputs_are_measured() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, pair: Tuple[torch.Tensor, torch.Tensor], *, scale: torch.Tensor) -> torch.Tensor:
            return self.fc(pair[0]) * torch.sigmoid(pair[1]) * scale

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 8)
            self.gate = Gate()

        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            return self.gate((h, h * 2), scale=scale)

    model, x, scale = Model(), torch.randn(3, 8), torch.randn(3, 8)
    profile = profile_modules(model, ["gate"], (x,), {"scale": scale})
    # Inputs: h and h * 2, each a fresh storage; the model's own scale was there before.
    assert profile["gate"].input_bytes == 2 * x.nbytes
    with _SavedCounter(_state_keys(model) | _keys([x, scale])) as counter:
        model(x, scale=scale)
    assert profile.total_activation_bytes == counter.bytes


def test_unknown_names_raise_and_name_them() -> None:
    model = _GPT()
    with pytest.raises(CheckpointConfigError, match=r"'blocks\.9'.*did you mean .*'blocks\.0'"):
        profile_modules(model, ["blocks.0", "blocks.9"], (_tokens(),))
    with pytest.raises(CheckpointConfigError, match=r"'nowhere'.*valid names include 'wte'"):
        profile_modules(model, ["nowhere"], (_tokens(),))
    with pytest.raises(CheckpointConfigError, match=r"got the string 'blocks\.0'"):
        profile_modules(model, "blocks.0", (_tokens(),))
    with pytest.raises(CheckpointConfigError, match="repeats must be an integer >= 0, got -1"):
        profile_modules(model, ["blocks.0"], (_tokens(),), repeats=-1)


def test_errors_inside_the_forward_leave_no_hooks_and_restore_state() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = _Layer(4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.layer(self.bn(x))
            raise RuntimeError("boom")

    model, x = Broken(), torch.randn(3, 4)
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        profile_modules(model, ["layer", "bn"], (x,))
    _assert_unchanged(model, before)
    assert torch.is_grad_enabled()
    assert not model.layer._forward_pre_hooks and not model.layer._forward_hooks
    assert not model.bn._forward_pre_hooks and not model.bn._forward_hooks


def test_repeats_zero_skips_timing_only() -> None:
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(8, 32)
    timed = profile_modules(model, ["1", "2"], (x,), repeats=1)
    untimed = profile_modules(model, ["1", "2"], (x,), repeats=0)
    assert all(cost.forward_time == 0.0 for cost in untimed.modules)
    strip = [_without_time(cost) for cost in timed.modules]
    assert strip == [_without_time(cost) for cost in untimed.modules]
    assert timed.total_activation_bytes == untimed.total_activation_bytes


def _without_time(cost: ModuleCost) -> Dict[str, Any]:
    fields = cost.to_dict()
    fields.pop("forward_time")
    fields["ops"] = [dict(op, time=0.0) for op in fields["ops"]]
    fields.pop("selective_overhead")
    return fields


def test_profile_round_trips_through_json() -> None:
    model, x = _mlp(), torch.randn(8, 32)
    profile = profile_modules(model, ["0", "2"], (x,), repeats=1)
    again = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile
    assert "2" in again and "1" not in again
    with pytest.raises(KeyError, match="'1' was not profiled"):
        again["1"]


def test_progress_bar_only_on_a_terminal_or_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    model, x = _mlp(depth=24, width=4), torch.randn(2, 4)
    names = [str(index) for index in range(24)]
    profile_modules(model, names, (x,), repeats=1)
    assert capsys.readouterr().err == ""
    profile_modules(model, names, (x,), repeats=1, progress=False)
    assert capsys.readouterr().err == ""
    profile_modules(model, names, (x,), repeats=1, progress=True)
    err = capsys.readouterr().err
    assert "48/48" in err and err.endswith("\n")


class _Terminal:
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_shown_on_a_terminal_for_many_modules() -> None:
    assert should_show(None, 24, stream=_Terminal())
    assert not should_show(None, 5, stream=_Terminal())
    assert not should_show(False, 24, stream=_Terminal())
    assert should_show(True, 5)


def test_inputs_a_module_saves_itself_are_reported_apart():
    class SavesInput(torch.nn.Module):
        def forward(self, x):
            return x.sin()  # sin saves its input for backward

    class SavesNothingOfIt(torch.nn.Module):
        def forward(self, x):
            return x * 2.0  # a product with a constant saves no tensor

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), SavesInput(), SavesNothingOfIt())
    x = torch.randn(3, 4)
    profile = profile_modules(model, ["1", "2"], (x,), repeats=0)
    expected = 3 * 4 * x.element_size()
    assert profile["1"].input_bytes == profile["1"].self_saved_input_bytes == expected
    assert profile["2"].input_bytes == expected and profile["2"].self_saved_input_bytes == 0


# --- what the order-aware peak model needs ------------------------------------------------------


class _ReluBlock(nn.Module):
    """Linear then ReLU: the ReLU saves its output, which the next block's Linear saves too."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def test_outputs_saved_again_after_the_module_are_handed_over_to_the_base():
    torch.manual_seed(0)
    model = nn.Sequential(_ReluBlock(8), _ReluBlock(8), _ReluBlock(8), nn.Linear(8, 1))
    x = torch.randn(5, 8)
    names = ["0", "1", "2"]
    profile = profile_modules(model, names, (x,), repeats=0)
    # Each block's ReLU output is saved by the Linear after it, block or head alike, so a
    # checkpoint of the block would not free it.
    output_bytes = [profile[name].output_bytes for name in names]
    assert [profile[name].handed_over_bytes for name in names] == output_bytes
    # A block saves its Linear's input (counted in the base) and its ReLU output: with the
    # latter handed over, checkpointing a block frees nothing.
    assert all(profile[name].kept_bytes == profile[name].handed_over_bytes for name in names)
    # Without a head that saves it, the last block's output is freed by its checkpoint.
    head_free = nn.Sequential(*list(model)[:3])
    alone = profile_modules(head_free, names, (x,), repeats=0)
    assert alone["2"].handed_over_bytes == 0 and alone["2"].kept_bytes == output_bytes[2]
    for profiled in (profile, alone):
        kept = sum(c.kept_bytes - c.handed_over_bytes for c in profiled.modules)
        assert profiled.total_activation_bytes == profiled.base_bytes + kept
    assert profile.total_activation_bytes == _full_forward_bytes(model, (x,))


def test_base_before_and_position_follow_the_forward_not_the_registration():
    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.late = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.early = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # sin saves its input: base bytes before ``early``, between and after.
            return self.late(self.early(x.sin()).sin()).sin()

    model = Reversed()
    x = torch.randn(4, 8, requires_grad=True)
    profile = profile_modules(model, ["late", "early"], (x,), repeats=0)
    early, late = profile["early"], profile["late"]
    assert (early.position, late.position) == (0, 1)
    # Before ``early`` nothing is saved (sin's input is the model input); before ``late``,
    # ``early``'s output as saved by the sin between them, and ``late``'s own saved input.
    assert early.base_before_bytes == early.self_saved_input_bytes
    assert late.base_before_bytes > early.base_before_bytes
    assert late.base_before_bytes < profile.base_bytes  # the last sin comes after both
    never = profile_modules(model, ["late", "early"], (x,), repeats=0)
    assert never == profile  # deterministic


def test_forward_peak_counts_temporaries_beside_saved_tensors():
    class Temporary(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            big = x.repeat(1, 16)  # a temporary no one saves
            return (big.sum(dim=1, keepdim=True) * x).sin()

    x = torch.randn(32, 64)
    model = nn.Sequential(nn.Linear(64, 64), Temporary())
    profile = profile_modules(model, ["1"], (x,), repeats=0)
    cost = profile["1"]
    assert cost.forward_peak_bytes >= cost.kept_bytes + 16 * x.numel() * x.element_size()


def test_a_save_policy_is_measured_as_a_selective_checkpoint_would_run():
    from torch.utils.checkpoint import CheckpointPolicy

    def save_matmuls(ctx, op, *args, **kwargs):
        if op.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    model = nn.Sequential(nn.Linear(16, 16), block)
    x = torch.randn(8, 16)
    plain = profile_modules(model, ["1"], (x,), repeats=1)
    selective = profile_modules(model, ["1"], (x,), repeats=1, save_policy=save_matmuls)
    cost = selective["1"]
    element = x.element_size()
    # The two addmm outputs (8x64 and 8x16); GELU saves the first, so only it is in both.
    assert cost.policy_saved_bytes == (8 * 64 + 8 * 16) * element
    assert cost.policy_saved_kept_bytes == 8 * 64 * element
    assert cost.recompute_time is not None and plain["1"].recompute_time is None
    assert plain["1"].policy_saved_bytes == 0
    with pytest.raises(CheckpointConfigError, match="save_policy must be a callable.*str"):
        profile_modules(model, ["1"], (x,), save_policy="mm")


class _Widening(nn.Module):
    """A block whose first layer makes a wide temporary, then a narrow output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def test_a_nested_candidate_is_charged_only_what_its_own_recomputation_holds():
    """A candidate nested in another is recomputed inside its parent's recomputation: what
    the parent recomputed before it (its wide temporaries) is the parent's working set,
    not the nested one's. Its recomputation peak is what it is measured at alone."""
    torch.manual_seed(0)
    model = nn.Sequential(_Widening(), _Widening())
    x = torch.randn(4, 16, 32)
    nested = profile_modules(model, ["0", "1", "0.down", "1.down"], (x,), step=True)
    alone = profile_modules(model, ["0.down", "1.down"], (x,), step=True)
    for name in ("0.down", "1.down"):
        assert nested[name].forward_peak_bytes == alone[name].forward_peak_bytes
    wide = 4 * 16 * 256 * 4
    assert nested["0.down"].forward_peak_bytes < wide <= nested["0"].forward_peak_bytes


def test_candidates_under_a_save_policy_measure_the_same_every_run():
    """Under a save policy the matmuls come back from the policy's cache when recomputed,
    and are freed inside the backward's readings of the allocator: what a recomputation
    holds must not depend on where the allocator put blocks (the nested candidates' peaks
    varied with it, and their parents')."""
    from torch.utils.checkpoint import CheckpointPolicy

    def save_matmuls(ctx, op, *args, **kwargs):
        if op.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64, bias=False)
            self.o = nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.o(torch.relu(self.a(x)).softmax(-1))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    x = torch.randn(2, 16, 64)
    names = ["0", "1", "2", "0.o", "1.o", "2.o"]
    # A process's first measured step reads 32 bytes more in its first recomputation (made once).
    profile_modules(model, names, (x,), step=True, save_policy=save_matmuls)
    runs = set()
    for _ in range(8):
        profile = profile_modules(model, names, (x,), step=True, save_policy=save_matmuls)
        runs.add(tuple(profile[name].forward_peak_bytes for name in names))
    assert len(runs) == 1, runs

"""Selective checkpointing whose saved operator output is changed in place before backward:
the error torch raises bare becomes a ``CheckpointError`` naming the module, the operator
and the fix, raised where torch raises it; regions that mutate nothing are unaffected."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckptwrap
from ckptwrap import CheckpointError, wrap_model
from ckptwrap.policy import parse_policy
from ckptwrap.wrap._selective import SavedInstances, SelectiveContexts

from ._models import assert_same, grads

WIDTH = 6
_TORCH_MESSAGE = "Tensor cached during selective activation checkpoint has been mutated"


class ShiftedProduct(nn.Module):
    """Adds to the output of its own matrix product in place."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.matmul(self.weight)
        y.add_(1)
        return torch.sin(y)


class Chain(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Recurrent(nn.Module):
    """An LSTMCell over time steps; the cell adds to its own ``addmm`` output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(WIDTH, WIDTH)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        h = c = xs.new_zeros(xs.shape[1], WIDTH)
        for x in xs:
            h, c = self.cell(x, (h, c))
        return h


def _made(factory, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def _chain() -> nn.Module:
    return Chain(ShiftedProduct(), ShiftedProduct())


def _rows() -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _sequence() -> torch.Tensor:
    return torch.randn(3, 2, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)


def test_mutated_saved_output_names_module_operator_and_fix():
    model = wrap_model(_made(_chain), "blocks;selective")
    out = model(_rows())  # the forward runs; the error comes with the recomputation
    with pytest.raises(CheckpointError) as caught:
        out.sum().backward()
    error = caught.value
    message = str(error)
    assert message.startswith("ShiftedProduct 'blocks.1' is checkpointed at a selective level")
    assert "the output of aten.mm.default" in message
    assert error.fix == (
        "leave mm out of the saved operators "
        "(selective:addmm,bmm,baddbmm,scaled_dot_product_attention), or checkpoint the "
        "module whole (the same policy without its selective term)."
    )
    assert message.endswith(f"Fix: {error.fix}")
    assert error.module is model.blocks[1]  # backward reaches the last block first
    assert isinstance(error.__cause__, RuntimeError)
    assert str(error.__cause__).startswith(_TORCH_MESSAGE)


def test_when_the_mutated_operator_is_the_only_one_saved_the_fix_is_to_checkpoint_whole():
    model = wrap_model(_made(_chain), "blocks;selective:mm")
    whole = r"aten\.mm\.default.*Fix: Checkpoint the module whole"
    with pytest.raises(CheckpointError, match=whole):
        model(_rows()).sum().backward()


def test_lstm_cell_over_time_steps_names_its_addmm():
    model = wrap_model(_made(Recurrent), "type:LSTMCell;selective")
    with pytest.raises(
        CheckpointError,
        match=r"^LSTMCell 'cell' is checkpointed .* aten\.addmm\.default .*Fix: leave addmm out of the "
        r"saved operators \(selective:mm,bmm,",
    ) as caught:
        model(_sequence()).sum().backward()
    assert caught.value.module is model.cell


@pytest.mark.parametrize("policy", ["type:LSTMCell;selective:mm", "type:LSTMCell"])
def test_the_fixes_it_gives_train_with_the_plain_gradients(policy):
    plain = _made(Recurrent)
    model = wrap_model(copy.deepcopy(plain), policy)
    xs = _sequence()
    model(xs).sum().backward()
    plain(xs.detach().requires_grad_()).sum().backward()
    assert_same(grads(model), grads(plain), "gradients")


def test_it_raises_where_torch_raises():
    """torch's own selective checkpoint of the same function fails in the same backward."""
    block = _made(ShiftedProduct)
    ops = [torch.ops.aten.mm.default]
    out = torch_checkpoint.checkpoint(
        block, _rows(), use_reentrant=False,
        context_fn=lambda: torch_checkpoint.create_selective_checkpoint_contexts(ops),
    )
    with pytest.raises(RuntimeError, match=_TORCH_MESSAGE):
        out.sum().backward()
    out = ckptwrap.checkpoint(block, _rows(), context_fn=SelectiveContexts(("mm",)))
    with pytest.raises(CheckpointError, match="ShiftedProduct .* aten.mm.default"):
        out.sum().backward()


def test_a_plain_function_and_a_budget_plan_level_get_their_own_wording():
    weight = torch.randn(WIDTH, WIDTH, requires_grad=True)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        y = x.matmul(weight)
        y.mul_(2)
        return y.sin()

    out = ckptwrap.checkpoint(shifted, _rows(), context_fn=SelectiveContexts(("mm", "bmm")))
    function = r"^A checkpointed function .* aten\.mm\.default"
    with pytest.raises(CheckpointError, match=function) as caught:
        out.sum().backward()
    assert caught.value.module is None
    out = ckptwrap.checkpoint(shifted, _rows(), context_fn=SavedInstances((("mm", 0),)))
    with pytest.raises(CheckpointError, match=r"budget plan chose to save this output.*;recompute"):
        out.sum().backward()


class _Block(nn.Module):
    """Products and elementwise work, nothing in place."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)) * torch.sigmoid(self.up(x)))


def test_regions_that_mutate_nothing_keep_the_plain_gradients_bit_for_bit():
    plain = _made(lambda: Chain(_Block(), _Block(), _Block()))
    model = wrap_model(copy.deepcopy(plain), "blocks;selective")
    x, y = _rows(), _rows()
    model(x).square().sum().backward()
    plain(y).square().sum().backward()
    assert_same(grads(model), grads(plain), "gradients")
    assert torch.equal(x.grad, y.grad)


class TwoDropouts(nn.Module):
    """Two fused dropouts (as a GPU runs ``F.dropout``), each after a product."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.native_dropout(self.a(x), 0.5, True)[0]
        return torch.native_dropout(self.b(hidden), 0.5, True)[0]


@pytest.mark.parametrize(
    "context",
    [SavedInstances((("native_dropout", 0),)), SavedInstances((("native_dropout", 0), ("addmm", 1)))],
    ids=repr,
)
def test_an_operator_that_drew_random_numbers_is_recomputed_even_when_named(context):
    """Skipped by the recomputation, the first dropout would leave the second drawing
    other numbers than the forward did: it is recomputed, and the gradients are the plain
    module's bit for bit (they were not before, on any engine: torch's own selective
    checkpointing skips it)."""
    torch.manual_seed(0)
    module, x = TwoDropouts(), torch.randn(4, WIDTH)
    torch.manual_seed(1)
    module(x).pow(2).sum().backward()
    expected = grads(module)
    module.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    ckptwrap.checkpoint(module, x, use_reentrant=False, context_fn=context).pow(2).sum().backward()
    assert_same(grads(module), expected, f"gradients under {context!r}")


@pytest.mark.parametrize("ops", ["native_dropout", "mm,dropout", "bernoulli"])
def test_naming_an_operator_that_always_draws_random_numbers_is_refused(ops):
    """Never saved (see above), so naming it would save nothing: said when the policy is read."""
    with pytest.raises(ckptwrap.CheckpointConfigError, match=r"names '\w+', which draws random numbers .* saves nothing"):
        parse_policy(f"blocks;selective:{ops}")


def test_attention_and_products_stay_nameable():
    """Attention draws only with a dropout probability above 0: it may still be named."""
    assert parse_policy("blocks;selective:mm,scaled_dot_product_attention,lstm") is not None

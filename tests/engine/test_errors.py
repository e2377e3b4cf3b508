"""Errors: the determinism check, debug logs, bad arguments and the exception family."""

from __future__ import annotations

import re

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import ckptwrap


def _shrinks_on_recompute(x):
    """Saves a (4, 3) tensor in forward and a (1, 3) one when recomputed."""
    if ckptwrap.is_recomputing():
        x = x[:1]
    return torch.sin(x)


def _changes_dtype_on_recompute(x):
    if ckptwrap.is_recomputing():
        x = x.double()
    return torch.sin(x)


def _input():
    torch.manual_seed(0)
    return torch.randn(4, 3, requires_grad=True)


def test_exception_family():
    assert issubclass(ckptwrap.CheckpointError, torch_checkpoint.CheckpointError)
    assert issubclass(ckptwrap.CheckpointError, RuntimeError)


def test_different_shape_on_recompute_raises():
    out = ckptwrap.checkpoint(_shrinks_on_recompute, _input())
    with pytest.raises(ckptwrap.CheckpointError, match="shape") as info:
        out.sum().backward()
    message = str(info.value)
    assert "4, 3" in message and "1, 3" in message, message  # both descriptions
    assert re.search(r"(?i)(position|index|#)\s*:?\s*0\b", message), message  # the position


def test_different_dtype_on_recompute_raises():
    out = ckptwrap.checkpoint(_changes_dtype_on_recompute, _input())
    with pytest.raises(ckptwrap.CheckpointError, match="dtype") as info:
        out.sum().backward()
    assert "float32" in str(info.value) and "float64" in str(info.value)


def test_torch_raises_the_same_kind_of_error():
    """The scenario is a real mismatch for torch too, so the check above is not ours alone."""
    calls = []

    def shrinks_on_second_call(x):
        calls.append(1)
        return torch.sin(x[:1] if len(calls) > 1 else x)

    out = torch_checkpoint.checkpoint(shrinks_on_second_call, _input(), use_reentrant=False)
    with pytest.raises(torch_checkpoint.CheckpointError, match="shape"):
        out.sum().backward()


def test_different_number_of_saved_tensors_raises():
    def fn(x):
        y = torch.sin(x)
        if not ckptwrap.is_recomputing():
            y = torch.cos(y)  # saves one more tensor in forward than in recomputation
        return y * 2.0

    out = ckptwrap.checkpoint(fn, _input(), early_stop=False)
    with pytest.raises(ckptwrap.CheckpointError):
        out.sum().backward()


def test_determinism_check_none_turns_the_check_off():
    x = _input()
    out = ckptwrap.checkpoint(_shrinks_on_recompute, x, determinism_check="none")
    out.sum().backward()  # no CheckpointError; the (1, 3) tensor broadcasts in SinBackward
    plain_x = _input()
    torch.sin(plain_x).sum().backward()
    assert not torch.equal(x.grad, plain_x.grad), "the check was off, so the mismatch went unnoticed"


def test_determinism_check_none_does_not_raise_checkpoint_error_on_dtype():
    out = ckptwrap.checkpoint(_changes_dtype_on_recompute, _input(), determinism_check="none")
    try:
        out.sum().backward()
    except ckptwrap.CheckpointError as exc:  # pragma: no cover - the failure being tested
        pytest.fail(f"determinism_check='none' still raised {exc!r}")
    except RuntimeError:
        pass  # autograd may reject the float64 gradient; only a CheckpointError is wrong


def test_invalid_determinism_check_names_value_and_allowed_ones():
    with pytest.raises(ValueError, match=r"(?s)(?=.*strict)(?=.*default)(?=.*none)") as info:
        ckptwrap.checkpoint(torch.sin, _input(), determinism_check="strict")
    assert isinstance(info.value, ckptwrap.CheckpointError)


def test_debug_puts_operator_lists_in_the_message():
    def fn(x):
        if ckptwrap.is_recomputing():
            x = torch.rad2deg(x)[:2]  # rad2deg saves nothing, so it runs before the mismatch
        return torch.sin(torch.expm1(x))

    out = ckptwrap.checkpoint(fn, _input(), debug=True)
    with pytest.raises(ckptwrap.CheckpointError, match="expm1") as info:
        out.sum().backward()
    message = str(info.value)
    assert "rad2deg" in message, "the recomputation's operators are listed"
    assert message.count("expm1") >= 2, "expm1 ran in forward and in recomputation"


def _mismatching(x):
    if ckptwrap.is_recomputing():
        x = torch.rad2deg(x)[:2]
    return torch.sin(torch.expm1(x))


@pytest.mark.parametrize("switch, debug, listed", [
    (True, False, True),  # torch's switch on wins over debug=False
    (False, True, False),  # and off wins over debug=True
    (None, True, True),  # None defers to the call's own debug
], ids=["on", "off", "defer"])
def test_torch_set_checkpoint_debug_enabled_overrides_debug_as_in_torch(switch, debug, listed):
    with torch.utils.checkpoint.set_checkpoint_debug_enabled(switch):
        out = ckptwrap.checkpoint(_mismatching, _input(), debug=debug)
    with pytest.raises(ckptwrap.CheckpointError) as info:
        out.sum().backward()
    assert ("rad2deg" in str(info.value)) is listed


def test_torch_debug_switch_leaves_the_reentrant_engine_alone():
    with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
        out = ckptwrap.checkpoint(torch.sin, _input(), use_reentrant=True)
    out.sum().backward()  # no error: the re-entrant engine has no operator log, as torch's


@pytest.mark.parametrize(
    "options, named",
    [
        ({"early_stop": "yes"}, "yes"),
        ({"use_reentrant": True, "context_fn": lambda: (None, None)}, "context_fn"),
        ({"use_reentrant": True, "debug": True}, "debug"),
    ],
    ids=["early_stop_not_bool", "reentrant_context_fn", "reentrant_debug"],
)
def test_bad_options_are_value_errors_naming_them(options, named):
    with pytest.raises(ValueError, match=named) as info:
        ckptwrap.checkpoint(torch.sin, _input(), **options)
    assert isinstance(info.value, ckptwrap.CheckpointError)


def test_set_checkpoint_early_stop_rejects_non_bool():
    with pytest.raises(ValueError, match="maybe") as info:
        with ckptwrap.set_checkpoint_early_stop("maybe"):
            pass
    assert isinstance(info.value, ckptwrap.CheckpointError)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("grad_on", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize(
    "fn, named",
    [(5, r"int.*\b5\b"), ("model", r"str.*'model'"), (torch.ones(2), r"Tensor.*tensor\(\[1\., 1\.\]\)")],
    ids=["int", "str", "tensor"],
)
def test_non_callable_function_names_what_was_passed(fn, named, grad_on, use_reentrant):
    x = _input()
    with torch.set_grad_enabled(grad_on), pytest.raises(ValueError, match=rf"(?s)first argument.*callable.*{named}") as info:
        ckptwrap.checkpoint(fn, x, use_reentrant=use_reentrant)
    assert isinstance(info.value, ckptwrap.CheckpointError)


def test_checkpoint_sequential_names_the_stages_that_are_not_callable():
    stages = [torch.nn.Linear(3, 3), 5, torch.nn.ReLU(), "relu"]
    with pytest.raises(ValueError, match=r"(?s)callable.*\b1\b.*int.*\b5\b.*\b3\b.*str.*'relu'") as info:
        ckptwrap.checkpoint_sequential(stages, 2, _input())
    assert isinstance(info.value, ckptwrap.CheckpointError)

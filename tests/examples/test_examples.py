"""Smoke tests: the demo and the engine benchmark run end to end at tiny sizes."""

from __future__ import annotations

import logging

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


def _load(relative_path: str, module_name: str):
    """Import a script that is not part of a package, by its path in the repository."""
    examples = str(_ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)  # the scripts import their sibling gpt.py
    spec = importlib.util.spec_from_file_location(module_name, _ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_gpt():
    return _load("examples/train_gpt.py", "_ckptwrap_example_train_gpt")


@pytest.fixture(scope="module")
def bench():
    return _load("benchmarks/engine.py", "_ckptwrap_benchmark_engine")


def test_demo_gradients_equal_the_uncheckpointed_run(train_gpt):
    config = train_gpt.GPTConfig(width=32, heads=2, layers=2, seq_len=16, vocab=64)
    results = train_gpt.run(config, steps=2, batch=2)
    assert [r.name for r in results] == list(train_gpt.demo_configurations(config.layers))
    reference = results[0]
    assert reference.wrapped == 0 and all(r.wrapped > 0 for r in results[1:])
    assert reference.first_grads and all(g.abs().sum() > 0 for g in reference.first_grads.values())
    for result in results[1:]:
        assert train_gpt.grads_equal(reference.first_grads, result.first_grads), result.name
        assert result.losses == reference.losses, result.name
        assert 0 < result.peak_bytes
    table = train_gpt.format_table(results)
    assert "NO" not in table.split() and table.count("yes") == len(results) - 1


def test_demo_detects_a_gradient_that_differs(train_gpt):
    config = train_gpt.GPTConfig(width=32, heads=2, layers=2, seq_len=16, vocab=64)
    results = train_gpt.run(config, steps=2, batch=2)
    name = next(iter(results[1].first_grads))
    results[1].first_grads[name] = results[1].first_grads[name] + 1
    assert not train_gpt.grads_equal(results[0].first_grads, results[1].first_grads)
    assert "NO" in train_gpt.format_table(results).split()


def test_demo_command_line_rejects_a_single_step(train_gpt, capsys):
    with pytest.raises(SystemExit):
        train_gpt.main(["--steps", "1"])
    assert "--steps must be at least 2" in capsys.readouterr().err


def test_benchmark_runs_and_checks_gradients(bench):
    config = bench.GPTConfig(width=32, heads=2, layers=2, seq_len=16, vocab=64)
    results = bench.run_benchmark(config, batch_size=2, steps=1, warmup=0)
    assert [r.contender.name for r in results] == [c.name for c in bench.CONTENDERS]
    assert all(len(r.step_ms) == 1 and r.peak_bytes > 0 for r in results)
    assert all(bench.grads_equal(results[0], r) for r in results[1:])
    assert set(bench.meets_targets(results)) == {c.name for c in bench.CONTENDERS if c.baseline}
    table = bench.format_table(results)
    for contender in bench.CONTENDERS:
        assert contender.name in table


def test_gpt_config_rejects_heads_that_do_not_divide_width(train_gpt):
    with pytest.raises(ValueError, match="width=30 and heads=4"):
        train_gpt.GPTConfig(width=30, heads=4)


def test_gpt_synthetic_batch_is_reproducible(train_gpt):
    config = train_gpt.GPTConfig(seq_len=8, vocab=16)
    first = train_gpt.synthetic_batch(config, 3, seed=5)
    second = train_gpt.synthetic_batch(config, 3, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    tokens, targets = first
    assert tokens.shape == targets.shape == (3, 8)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])


# --------------------------------------------------------------------------- --help of every script


def _scripts():
    """The example scripts: the files under examples/ that run as programs."""
    return sorted(
        path.name for path in (_ROOT / "examples").glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    )


def test_there_are_example_scripts():
    assert {"train_gpt.py", "train_ddp.py"} <= set(_scripts())


@pytest.mark.parametrize("script", _scripts())
def test_every_example_script_prints_its_help(script):
    done = subprocess.run(
        [sys.executable, str(_ROOT / "examples" / script), "--help"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--activation-checkpointing" in done.stdout and "budget:NN%" in done.stdout


# --------------------------------------------------------------------------- what the table counts


def test_a_budget_row_counts_the_modules_its_applied_plan_checkpoints(train_gpt, caplog):
    config = train_gpt.GPTConfig(width=32, heads=2, layers=6, seq_len=16, vocab=64)
    # Gradients count in the step's peak too: this model reaches about 66% of it at best.
    setting = train_gpt.ckptwrap.config.from_config({"policy": "budget:80%"})
    torch.manual_seed(0)
    trainer = train_gpt.Trainer("budget:80%", train_gpt.GPT(config), setting)
    tokens, targets = train_gpt.synthetic_batch(config, 2, seed=0)
    with caplog.at_level(logging.INFO, logger="ckptwrap"):
        trainer.step(tokens, targets, seed=0, measure=True)  # measured, as the plan of least memory
        assert trainer.result.wrapped == config.layers
        trainer.step(tokens, targets, seed=1, measure=False)  # the plan is applied here
    assert "ckptwrap applied 'budget:80%' for GPT's inputs" in caplog.text
    checkpointed = [name for name, m in trainer.model.named_modules() if "forward" in m.__dict__]
    assert 0 < len(checkpointed) < config.layers  # the budget leaves some blocks alone
    assert trainer.result.wrapped == len(checkpointed)


def test_the_command_line_labels_a_reentrant_row(train_gpt, capsys):
    argv = ["--steps", "2", "--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "8",
            "--batch", "2", "--activation-checkpointing", "every:2", "--ac-use-reentrant"]
    assert train_gpt.main(argv) == 0
    rows = {line.split("  ")[0].strip() for line in capsys.readouterr().out.splitlines()}
    assert "every:2 (re-entrant)" in rows


# --------------------------------------------------------------------------- train_ddp's verdict


@pytest.fixture(scope="module")
def train_ddp():
    return _load("examples/train_ddp.py", "_ckptwrap_example_train_ddp")


def test_the_ddp_verdict_says_within_which_tolerance(train_ddp):
    rtol, atol = train_ddp._RTOL, train_ddp._ATOL
    reference = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}

    def line_for(params):
        worst, close = train_ddp.compare(params, reference)
        return close, train_ddp.verdict(3, worst.item(), close)

    nudged = dict(reference, w=reference["w"] + torch.tensor([0.0, 2.0 ** -22]))
    worst = (nudged["w"] - reference["w"]).abs().max().item()
    assert worst > 0
    assert line_for(nudged) == (True, (
        f"parameters after 3 steps on every rank: match the one-process run within "
        f"rtol={rtol:g}, atol={atol:g} (max |difference| {worst:.2e})"
    ))
    same = {name: value.clone() for name, value in reference.items()}
    assert line_for(same) == (True, "parameters after 3 steps on every rank: equal the one-process run, bit for bit")
    far = dict(reference, b=reference["b"] + 1)
    assert line_for(far) == (False, (
        f"parameters after 3 steps on every rank: DIFFERENT from the one-process run beyond "
        f"rtol={rtol:g}, atol={atol:g} (max |difference| 1.00e+00)"
    ))

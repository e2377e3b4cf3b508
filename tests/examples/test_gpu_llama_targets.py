"""The GPU benchmark's targets and safeguards, at tiny sizes on the CPU: deterministic
kernels for the run only, the budget planned with the benchmark's loss, a failing row
reported while the others run, SDPA in the fallback model, and the offload arithmetic."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("_ckptwrap_benchmark_gpu_llama_targets", _ROOT / "benchmarks" / "gpu_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_cublas_workspace_is_set_when_the_benchmark_is_imported(bench):
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")


def test_kernels_are_deterministic_during_the_run_only(bench, monkeypatch):
    seen = []
    original = bench.Workload.runner

    def runner(self, name):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(self, name)

    monkeypatch.setattr(bench.Workload, "runner", runner)
    assert not torch.are_deterministic_algorithms_enabled()
    assert bench.main(["--device", "cpu", "--tiny", "--configs", "none,blocks"]) == 0
    assert seen and all(seen)
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_budget_row_plans_with_the_benchmarks_loss(bench, monkeypatch):
    calls = {}
    original = bench.ckptwrap.wrap_model

    def spy(model, policy, **options):
        calls[policy] = options
        return original(model, policy, **options)

    monkeypatch.setattr(bench.ckptwrap, "wrap_model", spy)
    assert bench.main(["--device", "cpu", "--tiny", "--configs", "none,budget:50%"]) == 0
    loss_fn = calls["budget:50%"]["loss_fn"]
    assert loss_fn is not None and loss_fn.__func__ is bench.Workload.loss_fn


def test_the_loss_takes_outputs_of_any_shape(bench):
    """The planner profiles smaller shapes: labels come from the logits' shape alone."""
    work = type("W", (), {"vocab": 11})()
    for shape in [(1, 5, 11), (2, 3, 11)]:
        logits = torch.randn(shape, requires_grad=True)
        loss = bench.Workload.loss_fn(work, logits)
        assert loss.shape == () and torch.isfinite(loss)


def test_a_row_that_runs_out_of_memory_is_reported_and_the_rest_go_on(bench, monkeypatch, capsys, tmp_path):
    original = bench.Workload.runner

    class OutOfMemory:
        def __init__(self, model):
            self.model = model

        def __call__(self, marks=None):
            raise bench._OOM("CUDA out of memory. Tried to allocate 2.00 GiB")

    def runner(self, name):
        step = original(self, name)
        return OutOfMemory(step.model) if name == "blocks" else step

    monkeypatch.setattr(bench.Workload, "runner", runner)
    report = tmp_path / "llama.json"
    argv = ["--device", "cpu", "--tiny", "--configs", "none,blocks,blocks;selective", "--json", str(report)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "blocks: out of memory: CUDA out of memory" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert rows["blocks"][-1] == "ERROR" and rows["blocks;selective"][-1] == "yes"
    checked = {t["name"]: t["passed"] for t in json.loads(report.read_text())["targets"]}
    assert checked["blocks: ran"] is False and checked["blocks;selective: ran"] is True
    assert bench.main(argv + ["--strict"]) == 1


def test_the_fallback_gpt_computes_attention_through_sdpa(bench, monkeypatch):
    """No causal mask buffer and one fused attention call per block: the (batch, heads,
    s, s) scores of the examples' written-out attention are never kept (on CUDA the fused
    kernels never make them at all)."""
    args = type("A", (), dict(vocab=64, hidden=32, heads=2, layers=3, seq=96))()
    model = bench._gpt_with_sdpa(args)
    assert not any("causal_mask" in name for name, _ in model.named_buffers())
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k.get("is_causal")) or sdpa(*a, **k))
    model(torch.randint(64, (1, 96))).sum().backward()
    assert calls == [True] * args.layers


def test_blocks_the_link_hides(bench):
    """The issue's numbers: 0.7 GB per block each way over 50 GB/s, a 140 ms plain step
    split 47 / 93 ms: three blocks fit behind the forward, not sixteen."""
    link = bench.Link(to_host=50e9, from_host=50e9)
    assert bench.blocks_hidden(link, 0.7e9, 0.047, 0.093) == 3
    assert bench.blocks_hidden(link, 0.7e9, 0.5, 0.093) == 6  # then the backward limits
    assert bench.blocks_hidden(link, 0.0, 0.047, 0.093) == 0


def test_the_offload_target_is_judged_on_the_partial_row(bench):
    none = bench.Result("none", [100.0])
    every = bench.Result("offload", [160.0])
    partial = bench.Result("first:3;offload", [104.0])
    assert bench.offload_verdict([none, every, partial], 8192) is True
    assert bench.offload_verdict([none, every], 8192) is False
    partial.error = "out of memory"
    assert bench.offload_verdict([none, every, partial], 8192) is False


def _issue_numbers(bench, **overrides):
    values = dict(link=bench.Link(to_host=50e9, from_host=50e9), blocks=16, forward_s=0.047, backward_s=0.093,
                  offload_to_host=int(16 * 0.7e9), offload_from_host=int(16 * 0.7e9))
    values.update(overrides)
    return bench.Arithmetic(**values)


def test_the_partial_offload_row_and_its_arithmetic(bench):
    arithmetic = _issue_numbers(bench)
    assert bench.partial_offload_policy(arithmetic, smoke_test=False) == "first:3;offload"
    text = "\n".join(bench.describe(arithmetic))
    assert "to host 50.0 GB/s" in text and "0.700 GB per block" in text
    assert "costs at least 1.60 x none" in text  # 11.2 GB at 50 GB/s over a 140 ms step
    assert "= 3 of 16" in text and "would say 10" in text


@pytest.mark.parametrize("forward_s, note", [(0.005, "hides no block"), (5.0, "hides every block")])
def test_no_partial_row_where_the_link_hides_none_or_all(bench, forward_s, note):
    arithmetic = _issue_numbers(bench, forward_s=forward_s, backward_s=forward_s * 2)
    assert bench.partial_offload_policy(arithmetic, smoke_test=False) is None
    assert note in arithmetic.note


def test_without_a_reference_no_row_claims_equal_gradients(bench, monkeypatch, capsys):
    original = bench.Workload.runner

    def runner(self, name):
        if name == "none":
            raise bench._OOM("CUDA out of memory")
        return original(self, name)

    monkeypatch.setattr(bench.Workload, "runner", runner)
    assert bench.main(["--device", "cpu", "--tiny", "--configs", "none,blocks"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()}
    assert rows["none"][-1] == "ERROR" and rows["blocks"][-1] == "no-ref"

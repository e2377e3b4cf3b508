"""Tests of ``python -m ckptwrap plan``: loading factories, inputs, output, errors, and the
memory/time frontier behind ``--pareto``.

The factories below are what the command loads, by this file's path.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import ckptwrap
from ckptwrap import cli
from ckptwrap._errors import CheckpointConfigError
from ckptwrap._frontier import frontier, pareto_points, reference_points
from ckptwrap.planner import CostItem, predicted_peak
from ckptwrap.planner._solver import smallest_reachable_peak

_HERE = Path(__file__).resolve()
_ROOT = _HERE.parents[1]
_LAYER_NAMES = [f"layers.{i}" for i in range(4)]

NOT_CALLABLE = 3


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


class _Stack(nn.Module):
    def __init__(self, width: int = 16, vocab: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width) if vocab else None
        self.layers = nn.ModuleList(_Layer(width) for _ in range(4))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tiny_stack(width: int = 16) -> nn.Module:
    return _Stack(width)


def tiny_embedding() -> nn.Module:
    return _Stack(vocab=10)


def not_a_module() -> int:
    return 42


def needs_arguments(width: int) -> nn.Module:
    return _Stack(width)


def _run(capsys, *argv: str):
    code = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- plans


def test_blocks_plan_lists_the_selected_names(capsys):
    code, out, err = _run(capsys, f"{_HERE}:tiny_stack", "--input-shape", "2,5,16")
    assert code == 0, err
    assert "'blocks'" in out
    assert all(name in out for name in _LAYER_NAMES)


def test_without_inputs_the_plan_is_not_measured(capsys):
    code, out, _ = _run(capsys, f"{_HERE}:tiny_stack", "--policy", "every:2")
    assert code == 0
    assert "layers.0" in out and "layers.2" in out and "layers.1" not in out


def test_json_parses_and_has_the_names(capsys):
    code, out, _ = _run(capsys, f"{_HERE}:tiny_stack", "--input-shape", "2,5,16", "--json")
    assert code == 0
    data = json.loads(out)
    assert [entry["name"] for entry in data["selected"]] == _LAYER_NAMES
    assert data["policy"] == "blocks"
    assert all(entry["saved_bytes"] is not None for entry in data["selected"])


def test_budget_plan_fits_its_budget(capsys):
    code, out, err = _run(
        capsys, f"{_HERE}:tiny_stack", "--input-shape", "4,32,16", "--policy", "budget:80%",
        "--json",
    )
    assert code == 0, err
    data = json.loads(out)
    # budget:80% is 80% of the un-checkpointed step's peak.
    assert data["predicted_peak"] <= data["budget"] == int(0.8 * data["plain_peak"])
    assert data["selected"]


def test_integer_inputs_are_drawn_below_the_vocabulary(capsys):
    code, out, err = _run(capsys, f"{_HERE}:tiny_embedding", "--input-shape", "2,7", "--vocab", "10")
    assert code == 0, err
    assert all(name in out for name in _LAYER_NAMES)


def test_a_module_path_loads_like_a_file(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_models_for_cli.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = _run(capsys, "my_models_for_cli:build", "--input-shape", "2,4")
    assert code == 0, err
    assert all(f"  {i}  " in out for i in range(3))


def test_engine_options_reach_the_plan(capsys):
    code, out, _ = _run(capsys, f"{_HERE}:tiny_stack", "--use-reentrant", "--json")
    assert code == 0
    assert json.loads(out)["options"]["use_reentrant"] is True


@pytest.mark.parametrize(
    "spec, shape, extra, blocks",
    [
        ("conv_pyramid", "1,3,16,16", [], 8),
        ("gpt_small", "1,8", ["--vocab", "512"], 8),
    ],
)
def test_the_example_factories_plan(capsys, spec, shape, extra, blocks):
    code, out, err = _run(
        capsys, f"{_ROOT / 'examples' / 'factories.py'}:{spec}", "--input-shape", shape, *extra,
        "--json",
    )
    assert code == 0, err
    assert len(json.loads(out)["selected"]) == blocks


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tiny_stack", "expected MODULE:FACTORY"),
        (f"{_HERE}:", "expected MODULE:FACTORY"),
        ("ckptwrap_no_such_module_xyz:build", "cannot import 'ckptwrap_no_such_module_xyz'"),
        ("no_such_dir/models.py:build", "no such file"),
        (f"{_HERE}:missing_factory", "has no 'missing_factory'.*tiny_stack"),
        (f"{_HERE}:NOT_CALLABLE", r"is not callable \(it is int 3\)"),
        (f"{_HERE}:not_a_module", "returned int, expected an nn.Module"),
        (f"{_HERE}:needs_arguments", "cannot be called with no arguments"),
    ],
)
def test_a_bad_factory_exits_2_with_one_line(capsys, spec, message):
    code, out, err = _run(capsys, spec)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


@pytest.mark.parametrize("shape", ["8,a", "8,,2", "0,16", "-1,16", "8x256", "²", ""])
def test_a_malformed_shape_exits_2(capsys, shape):
    code, _, err = _run(capsys, f"{_HERE}:tiny_stack", f"--input-shape={shape}")
    assert code == 2
    assert f"bad --input-shape {shape!r}" in err and "such as 8,256" in err
    assert len(err.strip().splitlines()) == 1


def test_a_shape_the_model_cannot_take_exits_2(capsys):
    code, _, err = _run(capsys, f"{_HERE}:tiny_stack", "--input-shape", "2,7")
    assert code == 2
    assert "failed on inputs (2, 7) float32" in err and "--input-shape" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--input-dtype", "long"], "needs --input-high N"),
        (["--input-dtype", "float32", "--vocab", "10"], "draws integer ids"),
        (["--vocab", "0"], "at least 1"),
        (["--device", "no-such-device"], "bad --device"),
    ],
)
def test_inconsistent_input_flags_exit_2(capsys, flags, message):
    code, _, err = _run(capsys, f"{_HERE}:tiny_stack", "--input-shape", "2,16", *flags)
    assert code == 2 and message in err


def test_a_bad_policy_exits_2_naming_it(capsys):
    code, _, err = _run(capsys, f"{_HERE}:tiny_stack", "--policy", "evry:2")
    assert code == 2 and "evry:2" in err and "every" in err


def test_an_unreachable_budget_exits_2(capsys):
    code, _, err = _run(
        capsys, f"{_HERE}:tiny_stack", "--input-shape", "2,5,16", "--policy", "budget:1%"
    )
    assert code == 2 and "smallest reachable peak" in err


def test_help_works(capsys):
    for argv in (["--help"], ["plan", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 0
    assert "MODULE:FACTORY" in capsys.readouterr().out


def test_python_dash_m_runs_the_command():
    done = subprocess.run(
        [sys.executable, "-m", "ckptwrap", "plan", f"{_HERE}:tiny_stack"],
        cwd=_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "layers.3" in done.stdout


# --------------------------------------------------------------------------- --pareto


def test_pareto_without_matplotlib_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    # A None entry makes `import matplotlib` raise ImportError, as if it were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, out, err = _run(
        capsys, f"{_HERE}:tiny_stack", "--input-shape", "2,16", "--pareto", str(tmp_path / "f.png")
    )
    assert code == 2 and not out
    assert "pip install -e '.[plot]'" in err
    assert not (tmp_path / "f.png").exists()


def test_pareto_needs_inputs(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, _, err = _run(capsys, f"{_HERE}:tiny_stack", "--pareto", str(tmp_path / "f.png"))
    assert code == 2 and "--input-shape" in err


def test_pareto_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "frontier.png"
    code, out, err = _run(
        capsys, f"{_HERE}:tiny_stack", "--input-shape", "4,32,16", "--policy", "budget:80%",
        "--pareto", str(path),
    )
    assert code == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"saved the memory/time frontier to {path}" in out


def test_pareto_into_a_missing_folder_exits_2_before_profiling(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, _, err = _run(
        capsys, f"{_HERE}:tiny_stack", "--input-shape", "2,16",
        "--pareto", str(tmp_path / "nowhere" / "f.png"),
    )
    assert code == 2 and "does not exist" in err


def test_pareto_candidates_come_from_the_set_terms():
    model = tiny_stack().train()
    inputs = (torch.randn(2, 16),)
    line, references = pareto_points(model, inputs, "name:layers.[12];budget:50%")
    assert {name for point in line + references for name in point.names} == {
        "layers.1",
        "layers.2",
    }
    assert references[0].label == "name:layers.[12] (all 2)"
    _, references = pareto_points(model, inputs, "last:1")
    assert references[0].label == "blocks (all 4)"


_costs = st.tuples(st.integers(0, 1 << 24), st.integers(0, 1 << 22), st.floats(0.0, 1.0))


@given(costs=st.lists(_costs, min_size=1, max_size=12), base=st.integers(0, 1 << 24))
def test_the_frontier_never_needs_more_time_for_more_memory(costs, base):
    items = [CostItem(f"layers.{i}", *cost) for i, cost in enumerate(costs)]
    points = frontier(items, base=base, points=9)
    peaks = [p.peak for p in points]
    times = [p.time for p in points]
    assert peaks == sorted(set(peaks))
    assert all(later < earlier for earlier, later in zip(times, times[1:]))
    assert peaks[0] == smallest_reachable_peak(items, base=base)
    # The largest budget needs no recomputation (zero-time candidates may still be taken).
    assert times[-1] == 0.0 and peaks[-1] <= predicted_peak(items, (), base=base)
    index = {item.name: i for i, item in enumerate(items)}
    for point in points:
        selected = [index[name] for name in point.names]
        assert point.peak == predicted_peak(items, selected, base=base)
        assert point.time == pytest.approx(math.fsum(items[i].time for i in selected))


def test_reference_points_model_the_fixed_policies():
    items = [CostItem(f"layers.{i}", kept=100, inputs=10, time=1.0) for i in range(9)]
    everything, every_other, sequential = reference_points(items, base=5, candidates="blocks")
    assert everything.label == "blocks (all 9)" and everything.time == 9.0
    assert every_other.names == tuple(f"layers.{i}" for i in (0, 2, 4, 6, 8))
    # sqrt(9) = 3 segments of 3; the last segment is not checkpointed.
    assert sequential.label == "checkpoint_sequential, 3 segments"
    assert sequential.names == tuple(f"layers.{i}" for i in range(6))
    assert sequential.time == 6.0
    # Two segments each keep one input and the last segment keeps its 300 bytes to the
    # end of the forward; by the time segment 1 (3 x 100) is recomputed, backward has
    # freed the last segment, so both moments peak alike.
    end_of_forward = 5 + 300 + 2 * 10
    recompute_segment_1 = 5 + 10 + 10 + 300
    assert sequential.peak == max(end_of_forward, recompute_segment_1) == 325


# --------------------------------------------------------------------------- help texts and layout


def test_every_parser_of_the_command_line_formats_its_help():
    from ckptwrap.diagnostics import _cli as doctor_cli

    parser = cli._build_parser()
    texts = [parser.format_help(), doctor_cli._build_parser().format_help()]
    commands = next(a for a in parser._actions if a.choices and "plan" in a.choices)
    texts += [sub.format_help() for sub in commands.choices.values()]
    assert all("%%" not in text for text in texts)
    assert any("budget:50%" in text for text in texts)


_PACKAGE = _ROOT / "ckptwrap"


def _imports_of(path: Path) -> set:
    """The ckptwrap modules ``path`` imports anywhere in it (deferred imports included)."""
    import ast

    module = ".".join(path.relative_to(_ROOT).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("ckptwrap"))
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if not target.startswith("ckptwrap"):
                continue
            # `from pkg import name` imports the submodule pkg.name when there is one.
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = any((_ROOT / Path(*sub.split("."))).with_suffix(s).exists() for s in (".py",))
                found.add(sub if is_module or (_ROOT / Path(*sub.split("."))).is_dir() else target)
    return found - {module}


def _reachable(start: str, graph: dict) -> set:
    seen, todo = set(), [start]
    while todo:
        for name in graph.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_the_command_line_modules_import_one_way():
    graph = {}
    for path in _PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(_ROOT).with_suffix("").parts)
        graph[name.removesuffix(".__init__")] = _imports_of(path)
    # The doctor's command line does not reach back into the plan command's module...
    assert "ckptwrap.cli" not in _reachable("ckptwrap.diagnostics._cli", graph)
    # ...and the shared helpers sit below both commands.
    assert "ckptwrap._cli_common" in graph["ckptwrap.cli"]
    assert "ckptwrap._cli_common" in graph["ckptwrap.diagnostics._cli"]
    below = _reachable("ckptwrap._cli_common", graph)
    assert not below & {"ckptwrap.cli", "ckptwrap.diagnostics", "ckptwrap.diagnostics._cli"}


@pytest.mark.parametrize(
    "first, second", [("ckptwrap.diagnostics._cli", "ckptwrap.cli"), ("ckptwrap.cli", "ckptwrap.diagnostics._cli")]
)
def test_the_command_line_modules_import_in_either_order(first, second):
    done = subprocess.run(
        [sys.executable, "-c", f"import {first}, {second}"],
        cwd=_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_pareto_profiles_the_model_once_and_draws_what_the_table_says(capsys, monkeypatch):
    from ckptwrap.measure import _metering

    calls = []
    original = _metering.measure_inputs

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    # measure_inputs is where every profile on given inputs goes, whoever asks for it.
    monkeypatch.setattr(_metering, "measure_inputs", counting)
    from ckptwrap.planner import _planner
    from ckptwrap.wrap import _planning

    monkeypatch.setattr(_planner, "measure_inputs", counting)
    monkeypatch.setattr(_planning, "measure_inputs", counting)
    drawn = []
    monkeypatch.setattr(cli, "_figure_module", lambda path: object())  # no matplotlib needed
    monkeypatch.setattr(cli, "_draw", lambda figure, path, line, references, title: drawn.append(references))
    code, out, err = _run(
        capsys, f"{_HERE}:tiny_stack", "--input-shape", "4,32,16", "--policy",
        "budget:80%;recompute", "--pareto", "f.png", "--json",
    )
    assert code == 0, err
    assert len(calls) == 1
    table = json.loads(out)
    chosen = [entry["name"] for entry in table["selected"]]
    # The plan's own point, or a reference point that is the very same (not drawn twice).
    own = next(
        point for point in drawn[0]
        if list(point.names) == chosen and point.peak == table["predicted_peak"]
    )
    assert own.peak == table["predicted_peak"]
    assert math.isclose(own.time, table["recompute_time"], rel_tol=1e-12)


def test_pareto_points_reuse_a_given_profile(monkeypatch):
    from ckptwrap import _frontier
    from ckptwrap.wrap import profile_modules

    model = tiny_stack().train()
    inputs = (torch.randn(2, 16),)
    profile = profile_modules(model, _LAYER_NAMES, inputs)
    monkeypatch.setattr(_frontier, "profile_modules", lambda *a, **k: pytest.fail("profiled again"))
    line, references = pareto_points(model, inputs, "blocks", profile=profile)
    assert line and references[0].label == "blocks (all 4)"
    with pytest.raises(CheckpointConfigError, match=r"lacks 2 of the 4 candidates of 'blocks' \(layers.2, layers.3\)"):
        pareto_points(model, inputs, "blocks", profile=profile_modules(model, _LAYER_NAMES[:2], inputs))


# --------------------------------------------------------------------------- without the hardware


def test_on_the_meta_device_the_plan_has_the_cpus_bytes_and_priced_times(capsys):
    argv = [f"{_HERE}:tiny_stack", "--input-shape", "4,32,16", "--policy", "budget:80%", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    on_cpu = json.loads(out)
    code, out, err = _run(capsys, *argv, "--device", "meta", "--device-rates", "h100-sxm")
    assert code == 0, err
    on_meta = json.loads(out)
    assert on_meta["plain_peak"] == on_cpu["plain_peak"] and on_meta["budget"] == on_cpu["budget"]
    assert on_meta["predicted_peak"] <= on_meta["budget"]
    assert (on_meta["priced_at"], on_cpu["priced_at"]) == ("h100-sxm", None)


def test_unknown_device_rates_exit_2_naming_the_known_ones(capsys):
    code, _, err = _run(
        capsys, f"{_HERE}:tiny_stack", "--input-shape", "4,32,16", "--device", "meta", "--device-rates", "tpu-v9"
    )
    assert code == 2 and "'h100-sxm'" in err and "'tpu-v9'" in err


# --------------------------------------------------------------------------- from a configuration

_LLAMA = [
    "hf:LlamaConfig", "--set", "hidden_size=64", "--set", "intermediate_size=128", "--set", "num_hidden_layers=2",
    "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", "--set", "vocab_size=128",
]


def _llama_in_python(dtype=None):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )
    model = transformers.LlamaForCausalLM(config)
    return (model if dtype is None else model.to(dtype)).train()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_transformers_configuration_with_keyword_inputs_plans_as_in_python(capsys, device):
    pytest.importorskip("transformers")
    code, out, err = _run(
        capsys, *_LLAMA, "--input", "input_ids=2,256", "--input", "attention_mask=2,256", "--labels",
        "--policy", "budget:80%", "--device", device, "--json",
    )
    assert code == 0, err
    planned = json.loads(out)
    ids = torch.randint(128, (2, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    expected = ckptwrap.plan(_llama_in_python(), "budget:80%", example_kwargs=batch)
    assert planned["plain_peak"] == expected.plain_peak and planned["budget"] == expected.budget
    assert planned["predicted_peak"] <= planned["budget"]
    assert planned["priced_at"] == ("cpu" if device == "meta" else None)


def test_a_configuration_file_and_a_dtype(capsys, tmp_path):
    model = _llama_in_python()
    model.config.to_json_file(tmp_path / "config.json")
    code, out, err = _run(
        capsys, f"hf:{tmp_path / 'config.json'}", "--input", "input_ids=1,128", "--labels", "--dtype", "bfloat16",
        "--device", "meta", "--json",
    )
    assert code == 0, err
    planned = json.loads(out)
    ids = torch.randint(128, (1, 128), generator=torch.Generator().manual_seed(0))
    expected = ckptwrap.plan(
        _llama_in_python(torch.bfloat16), "blocks", example_kwargs={"input_ids": ids, "labels": ids.clone()}
    )
    assert [entry["name"] for entry in planned["selected"]] == expected.names
    assert planned["plain_peak"] == expected.plain_peak


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*_LLAMA, "--set", "hiden_size=8"], "LlamaConfig has no such field; did you mean hidden_size"),
        ([*_LLAMA, "--set", "hidden_size"], "expected KEY=VALUE"),
        (["hf:LlamaConfg"], "not a transformers configuration class or a local .json file; did you mean LlamaConfig"),
        ([*_LLAMA, "--model-class", "LlamaForTeleportation"], "transformers has no such class"),
        ([*_LLAMA, "--input", "input_ids=2,x"], "expected NAME=N,N,..."),
        ([*_LLAMA, "--input", "input_ids=2,8", "--input", "input_ids=2,8"], "given twice"),
        ([*_LLAMA, "--labels"], "--labels copies input_ids"),
        ([*_LLAMA, "--policy", "budget:50%"], "give --input NAME=N,N"),
        ([f"{_HERE}:tiny_stack", "--set", "hidden_size=8"], "build a model from hf:CONFIG"),
        (["hf:missing/config.json"], "no such configuration file"),
    ],
)
def test_bad_configuration_flags_exit_2_naming_what_was_given(capsys, argv, message):
    pytest.importorskip("transformers")
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err, err


_T5 = ["hf:T5Config", "--set", "num_layers=2", "--set", "d_model=64", "--set", "d_ff=128", "--set", "num_heads=2",
       "--set", "d_kv=32", "--set", "vocab_size=128"]
_VIT = ["hf:ViTConfig", "--set", "num_hidden_layers=2", "--set", "hidden_size=32", "--set", "intermediate_size=64",
        "--set", "num_attention_heads=2", "--set", "image_size=32", "--set", "patch_size=8"]


@pytest.mark.parametrize(
    "argv, python",
    [
        ([*_T5, "--set", "decoder_start_token_id=0", "--input", "input_ids=2,16", "--labels"],
         lambda t: (t.T5ForConditionalGeneration(t.T5Config(
             num_layers=2, d_model=64, d_ff=128, num_heads=2, d_kv=32, vocab_size=128, decoder_start_token_id=0)),
             {"input_ids": (2, 16), "labels": (2, 16)})),
        ([*_VIT, "--set", "num_labels=10", "--input", "pixel_values=2,3,32,32"],
         lambda t: (t.ViTForImageClassification(t.ViTConfig(
             num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=32,
             patch_size=8, num_labels=10)), {"pixel_values": (2, 3, 32, 32)})),
    ],
    ids=["t5-decoder_start_token_id", "vit-num_labels"],
)
def test_set_takes_what_the_configurations_constructor_takes(capsys, argv, python):
    """Keys the constructor takes that a default configuration does not list
    (``decoder_start_token_id``, ``num_labels``) are given to it; with no architecture
    named, the first model class that takes the configuration is built."""
    transformers = pytest.importorskip("transformers")
    code, out, err = _run(capsys, *argv, "--device", "meta", "--json")
    assert code == 0, err
    planned = json.loads(out)
    with torch.device("meta"):
        model, shapes = python(transformers)
    generator = torch.Generator().manual_seed(0)
    batch = {name: (torch.randint(128, shape, generator=generator) if name != "pixel_values"
                    else torch.randn(shape, generator=generator)) for name, shape in shapes.items()}
    if "labels" in batch:
        batch["labels"] = batch["input_ids"].clone()
    expected = ckptwrap.plan(model, "blocks", example_kwargs={k: v.to("meta") for k, v in batch.items()})
    assert [entry["name"] for entry in planned["selected"]] == expected.names


def test_a_step_that_fails_in_the_models_own_code_says_so_not_fake_kernels(capsys):
    """T5 without ``decoder_start_token_id`` fails in its own code (shifting the labels):
    the message names where, not the fake tensors' kernels."""
    pytest.importorskip("transformers")
    code, _, err = _run(capsys, *_T5, "--input", "input_ids=2,16", "--labels", "--device", "meta")
    assert code == 2, err
    assert "decoder_start_token_id" in err and "in the model's own code" in err, err
    assert "fake kernel" not in err, err


def test_the_json_answer_always_says_whether_it_fits(capsys):
    pytest.importorskip("transformers")
    code, out, err = _run(capsys, *_LLAMA, "--input", "input_ids=2,64", "--labels", "--device-memory", "80GiB",
                          "--optimizer", "adamw", "--device", "meta", "--json")
    assert code == 0, err
    assert json.loads(out)["fits"] is True
    code, out, err = _run(capsys, *_LLAMA, "--input", "input_ids=2,64", "--labels", "--device", "meta", "--json")
    assert code == 0 and json.loads(out)["fits"] is None  # no device's memory to fit in


def test_the_doctor_says_configurations_are_the_plan_commands(capsys):
    assert cli.main(["doctor", "hf:LlamaConfig", "--input-shape", "2,8"]) == 2
    assert "built by the plan command only" in capsys.readouterr().err


# --------------------------------------------------------------------------- the device's memory


def test_device_memory_and_an_optimizer_answer_whether_it_fits_as_in_python(capsys):
    """``--device-memory`` is ``budget:total=SIZE`` among the policy's modules; the JSON
    carries each part and the device's peak, equal to the plan made in Python (on the meta
    device both, where times are priced, so that the plans are the same)."""
    pytest.importorskip("transformers")
    ids = torch.randint(128, (2, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    with torch.device("meta"):
        meta = _llama_in_python()
    blocks = ckptwrap.plan(meta, "blocks", example_kwargs=batch, optimizer="adamw")
    between = blocks.device_memory.whole_peak((blocks.predicted_peak + blocks.plain_peak) // 2)
    argv = [*_LLAMA, "--input", "input_ids=2,256", "--labels", "--device-memory", f"{between}B", "--optimizer", "adamw"]
    code, out, err = _run(capsys, *argv, "--device", "meta", "--json")
    assert code == 0, err
    planned = json.loads(out)
    expected = ckptwrap.plan(meta, f"blocks;budget:total={between}B", example_kwargs=batch, optimizer="adamw")
    assert planned["policy"] == expected.policy == f"blocks;budget:total={between}B"
    assert planned["device_peak"] == expected.device_peak <= between
    assert [entry["name"] for entry in planned["selected"]] == expected.names
    memory = planned["device_memory"]
    assert memory["optimizer"] == "AdamW" and memory["optimizer_state"] == 2 * memory["gradients"]
    assert memory["total"] == between
    code, out, err = _run(capsys, *argv)  # on the CPU, measured: it fits there too
    assert code == 0 and "fits in" in out and "optimizer state (AdamW)" in out, out


def test_accumulate_plans_the_micro_steps_that_start_with_the_gradients_held(capsys):
    pytest.importorskip("transformers")
    argv = [*_LLAMA, "--input", "input_ids=2,64", "--labels", "--device-memory", "80GiB", "--optimizer", "adamw", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    fresh = json.loads(out)
    code, out, err = _run(capsys, *argv, "--accumulate", "4")
    assert code == 0, err
    accumulating = json.loads(out)
    memory = accumulating["device_memory"]
    assert memory["held_gradients"] == memory["gradients"] > 0 == fresh["device_memory"]["held_gradients"]
    assert accumulating["device_peak"] == fresh["device_peak"] + memory["gradients"]
    code, out, err = _run(capsys, *argv[:-1], "--accumulate", "4")
    assert code == 0 and "gradients held from the micro-step before" in out, out
    code, out, err = _run(capsys, *argv, "--accumulate", "0")
    assert code == 2 and "accumulation must be" in err, (code, err)


def test_a_device_too_small_exits_1_saying_what_it_needs(capsys):
    pytest.importorskip("transformers")
    argv = [*_LLAMA, "--input", "input_ids=2,256", "--labels", "--device-memory", "1MiB", "--optimizer", "adamw"]
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 1, err
    answer = json.loads(out)
    assert answer["fits"] is False and "the device needs at least" in answer["why"]
    code, out, _ = _run(capsys, *argv, "--device-memory", f"{answer['needed_bytes']}B")
    assert code == 0 and "fits in" in out, out
    code, out, _ = _run(capsys, *argv)
    assert code == 1 and out.startswith("does NOT fit:"), out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--device-memory", "80 apples"], "budget:total=80 apples is malformed"),
        (["--device-memory", "80GiB", "--policy", "budget:50%"], "--device-memory 80GiB is a budget"),
    ],
)
def test_bad_device_memory_flags_exit_2_naming_what_was_given(capsys, extra, message):
    pytest.importorskip("transformers")
    code, _, err = _run(capsys, *_LLAMA, "--input", "input_ids=2,16", "--labels", *extra)
    assert code == 2 and message in err, err


def test_an_unknown_optimizer_is_a_usage_error_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", *_LLAMA, "--optimizer", "lion"])
    assert exited.value.code == 2
    assert "invalid choice: 'lion'" in capsys.readouterr().err


# --------------------------------------------------------------------------- a dtype per input


class _GraphConv(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        source, target = edge_index
        return torch.tanh(torch.zeros_like(x).index_add(0, target, self.fc(x)[source]))


class _Graph(nn.Module):
    """Float node features beside an integer edge_index: inputs of two dtypes."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.convs = nn.ModuleList(_GraphConv(width) for _ in range(3))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point() or edge_index.dtype != torch.long:
            raise TypeError(f"features must be floating-point and edge_index long, got {x.dtype}, {edge_index.dtype}")
        for conv in self.convs:
            x = conv(x, edge_index)
        return x


def tiny_graph() -> nn.Module:
    return _Graph()


_GRAPH = [f"{_HERE}:tiny_graph", "--input-shape", "20,16", "--input-shape", "2,40:long", "--input-high", "20"]


@pytest.mark.parametrize(
    "argv",
    [
        _GRAPH,
        [f"{_HERE}:tiny_graph", "--input-shape", "20,16:float32", "--input-shape", "2,40:int64", "--vocab", "20"],
        [f"{_HERE}:tiny_graph", "--input-dtype", "float32", "--input-shape", "20,16", "--input-shape", "2,40:long",
         "--input-high", "20"],
        [f"{_HERE}:tiny_graph", "--input", "x=20,16", "--input", "edge_index=2,40:long", "--vocab", "20"],
    ],
    ids=["shape-dtype", "both-named", "input-dtype-beside", "keyword-dtype"],
)
def test_each_input_takes_its_own_dtype(capsys, argv):
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    assert [entry["name"] for entry in json.loads(out)["selected"]] == [f"convs.{i}" for i in range(3)]
    # The doctor's command line takes the same inputs.
    assert cli.main(["doctor", *_GRAPH, "--policy", "blocks"]) == 0, capsys.readouterr()
    # The old flag, one dtype for every input, works as it did.
    code, _, err = _run(capsys, f"{_HERE}:tiny_graph", "--input-shape", "20,16", "--input-shape", "2,40",
                        "--input-dtype", "long", "--input-high", "20")
    assert code == 2 and "failed on inputs (20, 16) int64, (2, 40) int64" in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input-shape", "20,16", "--input-shape", "2,40:lng", "--input-high", "20"],
         "bad --input-shape '2,40:lng': the dtype after the colon must be one of"),
        (["--input-shape", "20,16", "--input-shape", "2,40:long"], "input 1 is of an integer dtype (int64), which needs --input-high N"),
        (["--input-shape", "20,16:float32", "--input-shape", "2,40:float32", "--input-high", "20"],
         "--input-high draws integer ids, but every input is floating-point"),
        (["--input", "x=20,16", "--input", "edge_index=2,40:long"], "--input edge_index: ids need --vocab N"),
        (["--input", "x=20,16", "--input", "edge_index=2,40:bool", "--vocab", "20"],
         "bad --input 'edge_index=2,40:bool': the dtype after the colon must be one of"),
    ],
)
def test_a_bad_input_dtype_exits_2_naming_it(capsys, argv, message):
    code, _, err = _run(capsys, f"{_HERE}:tiny_graph", *argv)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- per rank under FSDP2


def _per_rank_in_python(ranks: int, policy: str, batch, replicas: int = 1, **shard_options):
    """One rank of ``ranks`` planned as docs/capacity.md shows: built on fake tensors,
    each decoder layer and then the root sharded over a fake process group (with
    ``replicas``, HSDP's two-dimensional mesh)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook
    dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        if replicas == 1:
            mesh = init_device_mesh("cpu", (ranks,))
        else:
            mesh = init_device_mesh("cpu", (replicas, ranks // replicas), mesh_dim_names=("replicate", "shard"))
        with FakeTensorMode() as mode:
            model = _llama_in_python()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, **shard_options)
            fully_shard(model, mesh=mesh, **shard_options)
            fake = {name: mode.from_tensor(value) for name, value in batch.items()}
            return ckptwrap.plan(model, policy, example_kwargs=fake, optimizer="adamw")
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _batch(rows: int = 2, length: int = 256):
    ids = torch.randint(128, (rows, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


_RANKED = [*_LLAMA, "--input", "input_ids=2,256", "--labels", "--optimizer", "adamw"]


@pytest.mark.parametrize("sharding", ["default", "keep-gathered", "bf16-gathered"])
def test_ranks_plans_one_rank_under_fsdp2_as_in_python(capsys, sharding):
    pytest.importorskip("transformers")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    hook = sys.excepthook
    flags, options = {
        "default": ([], {}),
        "keep-gathered": (["--keep-gathered"], {"reshard_after_forward": False}),
        "bf16-gathered": (
            ["--gather-dtype", "bfloat16"],
            {"mp_policy": fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        ),
    }[sharding]
    code, out, err = _run(capsys, *_RANKED, "--ranks", "2", *flags, "--json")
    assert code == 0, err
    planned = json.loads(out)
    expected = _per_rank_in_python(2, "blocks", _batch(), **options)
    assert planned["ranks"] == 2
    assert planned["device_peak"] == expected.device_peak
    assert [entry["name"] for entry in planned["selected"]] == expected.names
    # One rank holds half of the parameters and of AdamW's state.
    whole = ckptwrap.plan(_llama_in_python(), "blocks", example_kwargs=_batch(), optimizer="adamw")
    memory = planned["device_memory"]
    assert abs(memory["parameters"] - whole.device_memory.parameters / 2) <= 0.01 * whole.device_memory.parameters
    assert memory["optimizer_state"] == 2 * memory["parameters"]
    # The process is left as it was: no process group, the same excepthook (which torch's
    # init_process_group wraps each time).
    assert not torch.distributed.is_initialized() and sys.excepthook is hook


def test_replicas_plan_one_rank_under_hsdp_as_in_python(capsys):
    """Two replicas of FSDP groups of two: a rank holds what one of an FSDP group of two
    holds, and its step all-reduces the reduce-scattered gradients across replicas."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch.distributed.fsdp")
    code, out, err = _run(capsys, *_RANKED, "--ranks", "4", "--replicas", "2", "--json")
    assert code == 0, err
    planned = json.loads(out)
    expected = _per_rank_in_python(4, "blocks", _batch(), replicas=2)
    assert (planned["ranks"], planned["replicas"]) == (4, 2)
    assert planned["device_peak"] == expected.device_peak
    sharded_over_two = _per_rank_in_python(2, "blocks", _batch())
    assert planned["device_memory"]["parameters"] == sharded_over_two.device_memory.parameters
    code, out, err = _run(capsys, *_RANKED, "--ranks", "4", "--replicas", "2")
    assert code == 0 and out.startswith("one rank of 4 under HSDP, 2 replicas of 2"), out


def test_ranks_plans_a_model_whose_initialisation_reads_values(capsys):
    """ViT's weights start from a truncated normal, which reads values: built on fake
    tensors it would fail, so the model is built on the meta device and each tensor made
    fake after (tied ones staying tied)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch.distributed.fsdp")
    fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    argv = ["hf:ViTConfig", *[f for key, value in fields.items() for f in ("--set", f"{key}={value}")],
            "--model-class", "ViTForImageClassification", "--input", "pixel_values=2,3,64,64", "--set", "image_size=64",
            "--optimizer", "adamw", "--ranks", "2", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    whole = transformers.ViTForImageClassification(transformers.ViTConfig(image_size=64, **fields))
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    held = json.loads(out)["device_memory"]["parameters"]
    assert whole_bytes / 2 <= held <= 0.51 * whole_bytes  # half of each parameter, padded


def test_ranks_finds_the_smallest_count_that_fits(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("torch.distributed.fsdp")
    need = {ranks: _per_rank_in_python(ranks, "blocks", _batch()).device_peak for ranks in (1, 2, 4)}
    assert need[1] > need[2] > need[4]
    size = (need[1] + need[2]) // 2
    code, out, err = _run(capsys, *_RANKED, "--ranks", "4,1,2", "--device-memory", f"{size}B", "--json")
    assert code == 0, err
    planned = json.loads(out)
    assert planned["ranks"] == 2 and planned["device_peak"] <= size
    assert planned["tried"][0] == {"ranks": 1, "fits": False, "needed_bytes": need[1]}
    code, out, err = _run(capsys, *_RANKED, "--ranks", "1,2,4", "--device-memory", f"{size}B")
    assert code == 0, err
    assert out.startswith(f"fits on 2 devices of {size}B: one rank of 2 under FSDP2 (2 blocks and the root sharded)")
    assert "1 rank: does not fit" in out and "fits in" in out


def test_ranks_says_when_no_count_fits_and_stops_early(capsys):
    """What a rank needs falls toward what FSDP2 does not shard: once that alone passes
    the device, ``auto`` stops instead of trying every power of two."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch.distributed.fsdp")
    code, out, err = _run(capsys, *_RANKED, "--ranks", "auto", "--device-memory", "1MiB", "--json")
    assert code == 1, err
    answer = json.loads(out)
    assert answer["fits"] is False and answer["least_needed_bytes"] > 1 << 20
    assert [each["ranks"] for each in answer["tried"]] == [1, 2, 4]
    needs = [each["needed_bytes"] for each in answer["tried"]]
    assert needs[0] > needs[1] > needs[2] >= answer["least_needed_bytes"]
    code, out, err = _run(capsys, *_RANKED, "--ranks", "auto", "--device-memory", "1MiB")
    assert code == 1 and out.startswith("does NOT fit on any number of devices of 1MiB under FSDP2"), out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ranks", "0"], "bad --ranks '0'"),
        (["--ranks", "two"], "bad --ranks 'two'"),
        (["--ranks", "1,2"], "needs the device's memory: give --device-memory"),
        (["--ranks", "auto"], "needs the device's memory: give --device-memory"),
        (["--keep-gathered"], "give --ranks N"),
        (["--gather-dtype", "bfloat16"], "give --ranks N"),
        (["--replicas", "2"], "give --ranks N"),
        (["--ranks", "3", "--replicas", "2"], "3 is not a multiple of it"),
        (["--ranks", "2", "--replicas", "0"], "bad --replicas 0"),
        (["--ranks", "2", "--device", "cuda"], "--device cuda has no use there"),
    ],
)
def test_bad_rank_flags_exit_2_naming_them(capsys, extra, message):
    pytest.importorskip("transformers")
    code, _, err = _run(capsys, *_RANKED, *extra)
    assert code == 2 and message in err, err
    assert not torch.distributed.is_initialized()


def test_ranks_without_inputs_exit_2(capsys):
    pytest.importorskip("transformers")
    code, _, err = _run(capsys, *_LLAMA, "--ranks", "2")
    assert code == 2 and "--ranks plans a training step: give --input" in err, err

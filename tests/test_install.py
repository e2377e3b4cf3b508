"""ckptwrap installs on a machine with no package registry: the command docs/gpu.md gives
and scripts/gpu_check.py runs (``pip install --no-index --no-deps --no-build-isolation
-e .``) builds with the setuptools already installed, so pip never looks for one. Each
test works on a copy of the sources, so the checkout gets no build files."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("_ckptwrap_gpu_check_install", _ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    copy = tmp_path / "src"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(_ROOT / name, copy / name)
    shutil.copytree(_ROOT / "ckptwrap", copy / "ckptwrap", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=180)


def test_the_editable_install_needs_no_registry(sources: Path, tmp_path: Path):
    install = _gpu_check().INSTALL
    assert install[-2:] == ["-e", "."] and {"--no-index", "--no-deps", "--no-build-isolation"} <= set(install)
    report = tmp_path / "report.json"
    done = _pip(*install[2:-1], str(sources), "--dry-run", "--report", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    (installed,) = json.loads(report.read_text())["install"]
    assert installed["metadata"]["name"] == "ckptwrap"
    assert installed["download_info"]["dir_info"].get("editable") is True


def test_a_wheel_builds_offline_with_the_installed_setuptools(sources: Path, tmp_path: Path):
    wheels = tmp_path / "wheels"
    done = _pip("wheel", "--no-index", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(wheels), str(sources))
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = wheels.glob("ckptwrap-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"ckptwrap/_torch_private.py", "ckptwrap/py.typed", "ckptwrap/engine/_nonreentrant.py"} <= names
    # The floor is the oldest torch whose missing private names all have fallbacks.
    assert "Requires-Dist: torch>=2.11" in metadata


def test_docs_give_the_command_the_check_runs():
    command = " ".join(["pip", *_gpu_check().INSTALL[2:]])
    assert command in (_ROOT / "docs" / "gpu.md").read_text()

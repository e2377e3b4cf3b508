"""The package's layout shows its architecture: subpackages import each other one way and
by their public names only, and modules inside a subpackage import each other one way.
(A module is as long as the one concept it holds needs: no line count is imposed.)"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import ckptwrap

_ROOT = Path(ckptwrap.__file__).parent
_MODULES = sorted(_ROOT.rglob("*.py"))


def _unit(path: Path) -> str:
    """A module's unit: its subpackage (``planner``), or the top-level module itself."""
    relative = path.relative_to(_ROOT)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: Path) -> Iterator[Tuple[str, List[str]]]:
    """Every relative import of the module, anywhere in its code: the module it names,
    resolved within the package (``planner._shapes``, ``measure``), and the names taken."""
    relative = path.relative_to(_ROOT)
    package = list(relative.parts[:-1])
    if relative.stem == "__init__":
        package = list(relative.parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            yield target, [alias.name for alias in node.names]


def _graph(edges: Dict[str, Set[str]]) -> None:
    """Fail on the first import circle in ``edges``."""
    state: Dict[str, str] = {}

    def visit(node: str, path: Tuple[str, ...]) -> None:
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                pytest.fail(f"import circle: {' -> '.join(path + (node, target))}")
            if target not in state:
                visit(target, path + (node,))
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, ())


def test_subpackages_import_each_other_one_way():
    edges: Dict[str, Set[str]] = {}
    for path in _MODULES:
        unit = _unit(path)
        for target, _ in _imports(path):
            other = target.split(".")[0]
            if other and other != unit:
                edges.setdefault(unit, set()).add(other)
    _graph(edges)
    # The engine knows nothing of the layers above it.
    assert not {"wrap", "policy", "planner", "diagnostics"} & edges.get("engine", set())


def test_subpackages_use_each_others_public_names_only():
    found = []
    for path in _MODULES:
        unit = _unit(path)
        for target, names in _imports(path):
            parts = target.split(".")
            if not parts[0] or parts[0] == unit or parts[0].startswith("_"):
                continue
            if len(parts) > 1:
                found.append(f"{path.relative_to(_ROOT)} imports {target}")
                continue
            public = getattr(__import__(f"ckptwrap.{parts[0]}", fromlist=["__all__"]), "__all__", [])
            found += [f"{path.relative_to(_ROOT)} imports {target}.{name}" for name in names if name not in public]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", sorted({_unit(p) for p in _MODULES if p.parent != _ROOT}))
def test_modules_of_a_subpackage_import_each_other_one_way(package):
    edges: Dict[str, Set[str]] = {}
    for path in (_ROOT / package).glob("*.py"):
        for target, names in _imports(path):
            parts = target.split(".")
            if parts[0] != package:
                continue
            if len(parts) > 1:
                edges.setdefault(path.stem, set()).add(parts[1])
            else:  # ``from . import _module``
                edges.setdefault(path.stem, set()).update(n for n in names if (_ROOT / package / f"{n}.py").exists())
    edges.pop("__init__", None)
    _graph(edges)


def test_the_planner_keeps_the_names_its_users_import():
    from ckptwrap import planner

    for name in (
        "BudgetSolution", "Choice", "CostItem", "Plan", "PlanEntry", "ShapePlanner",
        "format_bytes", "predicted_peak", "smallest_reachable_peak", "solve_budget",
    ):
        assert name in planner.__all__ and hasattr(planner, name), name
    # What a step costs, measured or on fake tensors, is measure's.
    from ckptwrap import measure

    for name in ("DEVICE_RATES", "DeviceRates", "ModelProfile", "ModuleCost", "StepPeaks", "measure_inputs"):
        assert name in measure.__all__ and hasattr(measure, name), name
    # A step measured on given inputs runs its regions through the marking layer's runner.
    from ckptwrap import wrap

    assert "profile_modules" in wrap.__all__ and hasattr(wrap, "profile_modules")


def _is_module(target: str, name: str) -> bool:
    folder = _ROOT.joinpath(*[p for p in target.split(".") if p])
    return (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists()


def test_no_module_imports_another_modules_private_names():
    # A name with a leading underscore is its module's own; what a neighbour uses is
    # named without one (and listed in that module's __all__). Private modules
    # (``from .. import _torch_private``) are imported whole.
    found = []
    for path in _MODULES:
        for target, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__") and not _is_module(target, n)]
            found += [f"{path.relative_to(_ROOT)} imports {target}.{name}" for name in private]
    assert not found, "\n".join(found)


def test_what_a_module_gives_its_neighbours_is_in_its_all():
    found = []
    for path in _MODULES:
        for target, names in _imports(path):
            parts = [p for p in target.split(".") if p]
            module = _ROOT.joinpath(*parts[:-1], f"{parts[-1]}.py") if parts else None
            if module is None or not module.exists() or module.stem == "__init__":
                continue
            exported = __import__(f"ckptwrap.{'.'.join(parts)}", fromlist=["__all__"]).__all__
            found += [f"{path.relative_to(_ROOT)} imports {target}.{n}" for n in names if n not in exported]
    assert not found, "\n".join(found)

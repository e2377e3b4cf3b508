"""The policy package's layout: its modules import each other one way only, stay small,
and keep the names other packages import from them."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set

import pytest

import ckptwrap.policy

_PACKAGE = Path(ckptwrap.policy.__file__).parent


def _imports_within_the_package() -> Dict[str, Set[str]]:
    """Per module, the sibling modules it imports anywhere in its code, deferred imports
    inside functions included."""
    modules = {path.stem for path in _PACKAGE.glob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for path in _PACKAGE.glob("*.py"):
        found: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names)
        graph[path.stem] = {name for name in found if name in modules} - {path.stem}
    return graph


def test_policy_modules_import_each_other_one_way():
    graph = _imports_within_the_package()
    state: Dict[str, str] = {}

    def visit(module: str, path: tuple) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                pytest.fail(f"import circle: {' -> '.join(path + (module, target))}")
            if target not in state:
                visit(target, path + (module,))
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, ())


@pytest.mark.parametrize("path", sorted(_PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_policy_modules_stay_under_400_lines(path):
    assert len(path.read_text().splitlines()) <= 400


def test_the_solver_keeps_the_names_its_users_import():
    from ckptwrap.planner import _solver

    for name in (
        "BudgetSolution",
        "CostItem",
        "format_bytes",
        "predicted_peak",
        "smallest_reachable_peak",
        "solve_budget",
    ):
        assert name in _solver.__all__ and hasattr(_solver, name), name


def test_operators_take_every_form_as_policy_takes():
    from torch import nn

    from ckptwrap.policy import Last, Type, as_policy

    assert Type("Linear") & "last:2" == as_policy("type:Linear;last:2")
    assert "type:Linear" & Last(2) == as_policy("type:Linear;last:2")
    union = Last(1) | nn.Linear
    assert union.parts == (Last(1), as_policy(nn.Linear))

"""Running the recipes of docs/recipes/ as printed, and what the tests observe of them.

A recipe is a fenced block preceded by ``<!-- recipe: NAME -->``; the tests run each
Python recipe in a fresh namespace, in a temporary working directory, and look at the
names it leaves behind (``model``, ``trainer``, ...).
"""

from __future__ import annotations

import collections
import contextlib
import re
import warnings
from pathlib import Path
from typing import Any, Counter, Dict, Iterator, List

import torch

import ckptwrap

PAGES = Path(__file__).resolve().parents[2] / "docs" / "recipes"
_RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```\w*\n(.*?)```", re.S)


def recipes(page: str) -> Dict[str, str]:
    """The recipes of ``docs/recipes/<page>``, by name."""
    return dict(_RECIPE.findall((PAGES / page).read_text()))


def run(page: str, name: str) -> Dict[str, Any]:
    """Run one Python recipe as printed; returns the names it defined."""
    namespace: Dict[str, Any] = {"__name__": "__main__"}
    exec(compile(recipes(page)[name], f"docs/recipes/{page} [{name}]", "exec"), namespace)
    return namespace


@contextlib.contextmanager
def runs_of(class_name: str) -> Iterator[Counter[str]]:
    """Count the forwards that modules of the class ``class_name`` start: ``"forward"`` in
    the model's forward, ``"recomputed"`` in ckptwrap's recomputation.

    Counted with a global forward pre-hook, since a hook on a checkpointed module itself
    does not run in its recomputation (which calls its ``forward``), while its submodules
    are called as modules; and a pre-hook, since an early-stopped recomputation never
    reaches its last submodules' forward hooks. A block checkpointed twice (by ckptwrap
    and by transformers) shows as more than one ``"forward"`` per step.
    """
    counts: Counter[str] = collections.Counter()

    def count(module: torch.nn.Module, args: Any) -> None:
        if type(module).__name__ == class_name:
            counts["recomputed" if ckptwrap.is_recomputing() else "forward"] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        yield counts
    finally:
        handle.remove()


@contextlib.contextmanager
def warnings_naming(word: str) -> Iterator[List[str]]:
    """Every warning raised inside whose message contains ``word``, each time it is raised."""
    named: List[str] = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield named
    named.extend(str(w.message) for w in record if word in str(w.message))


@contextlib.contextmanager
def never_wrapped() -> Iterator[None]:
    """Run a recipe un-checkpointed: ``ckptwrap.wrap_model`` leaves the model untouched and
    only attaches what it would have done (``ckptwrap.plan``), for the recipe to print."""
    real = ckptwrap.wrap_model

    def plan_only(model: torch.nn.Module, policy: Any = "blocks", **options: Any) -> torch.nn.Module:
        model.ckptwrap_plan = ckptwrap.plan(model, policy)
        return model

    ckptwrap.wrap_model = plan_only
    try:
        yield
    finally:
        ckptwrap.wrap_model = real


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the suite's autouse fixture sets for each test: a reference
    run made in a module-scoped fixture (before that fixture) must sum in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_same_weights(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    different = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not different, f"weights differ from the un-checkpointed run: {different}"

"""The recipe pages themselves: each indexed, each naming a test that exists, each recipe run.

A recipe added to a page without a test that runs it, or a page left out of the index,
fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ._recipe import PAGES, recipes

TESTS = Path(__file__).resolve().parent
PAGE_NAMES = sorted(path.name for path in PAGES.glob("*.md") if path.name != "README.md")


def test_the_index_links_every_page():
    index = (PAGES / "README.md").read_text()
    assert PAGE_NAMES == ["accelerate.md", "diffusers.md", "lightning.md", "peft.md", "timm.md", "trainer.md", "trl.md"]
    for name in PAGE_NAMES:
        assert f"]({name})" in index, name


@pytest.mark.parametrize("page", PAGE_NAMES)
def test_each_page_names_its_test_and_that_test_runs_every_recipe(page):
    text = (PAGES / page).read_text()
    command = re.search(r"`python -m pytest (tests/recipes/test_\w+\.py) -q`", text)
    assert command, f"{page} does not say which test runs it"
    test_source = (TESTS.parent.parent / command.group(1)).read_text()
    assert recipes(page), f"{page} has no recipe"
    for name in recipes(page):
        assert f'"{name}"' in test_source, f"recipe {name!r} of {page} is run by no test"

"""Property tests over randomly nested models and random policy strings.

Each selection is compared with a direct re-statement of the spec written here, and
checked to be a subset of ``named_modules()`` in model order, without the root, and the
same on every call and on a deep copy.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import math
import operator

from _policy_models import module_names
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

from ckptwrap._errors import CheckpointConfigError
from ckptwrap.policy import find_blocks, parse_policy


class CustomA(nn.Module):
    pass


class CustomB(nn.Module):
    pass


_LEAVES = {"Linear": lambda: nn.Linear(2, 2), "ReLU": nn.ReLU, "LayerNorm": lambda: nn.LayerNorm(2)}
_CONTAINERS = ["Sequential", "ModuleList", "ModuleDict", "CustomA", "CustomB"]
_CLASS_NAMES = sorted(_LEAVES) + _CONTAINERS + ["Missing"]
_GLOBS = ["*", "*.0", "0*", "1", "c0*", "*.c1", "k*.*", "*1.*", "nomatch*"]

# A node is ("Linear",) etc., or (container, children, share) where ``share`` appends the
# first child a second time, so that one module instance has two paths.
_trees = st.recursive(
    st.sampled_from(sorted(_LEAVES)).map(lambda kind: (kind,)),
    lambda children: st.tuples(
        st.sampled_from(_CONTAINERS), st.lists(children, max_size=4), st.booleans()
    ),
    max_leaves=24,
)

# The shared profile (tests/conftest.py) keeps the whole suite fast; these cheap tests take
# more examples than it gives, and as many as the thorough profile gives when it is on.
_EXAMPLES = max(settings().max_examples, 200)

_roots = st.tuples(
    st.sampled_from(_CONTAINERS), st.lists(_trees, min_size=1, max_size=5), st.booleans()
)


def terms_for(model: nn.Module):
    """Policy terms, whose class names and globs mostly come from ``model``."""
    names = module_names(model) or ["nomatch"]
    classes = sorted({type(m).__name__ for m in model.modules()})
    class_names = st.sampled_from(classes) | st.sampled_from(_CLASS_NAMES)
    globs = st.one_of(
        st.sampled_from(names),
        st.sampled_from(names).map(lambda n: n + "*"),
        st.sampled_from(_GLOBS),
    )
    return st.one_of(
        st.sampled_from(["none", "blocks", "all"]),
        st.lists(class_names, min_size=1, max_size=2).map(lambda n: "type:" + ",".join(n)),
        globs.map("name:{}".format),
        st.integers(1, 4).map("every:{}".format),
        st.integers(1, 5).map("first:{}".format),
        st.integers(1, 5).map("last:{}".format),
        st.sampled_from(["0.1", "0.25", "0.5", "0.75", "1"]).map("fraction:{}".format),
    )


def build(node) -> nn.Module:
    if len(node) == 1:
        return _LEAVES[node[0]]()
    kind, children, share = node
    modules = [build(child) for child in children]
    if share and modules:
        modules.append(modules[0])
    if kind == "Sequential":
        return nn.Sequential(*modules)
    if kind == "ModuleList":
        return nn.ModuleList(modules)
    if kind == "ModuleDict":
        return nn.ModuleDict({f"k{i}": m for i, m in enumerate(modules)})
    module = CustomA() if kind == "CustomA" else CustomB()
    for i, child in enumerate(modules):
        module.add_module(f"c{i}", child)
    return module


class _Expected(Exception):
    """The spec says this policy string is an error on this model."""


def expected_selection(model: nn.Module, terms):
    """The spec's selection, stated directly; raises _Expected where it says error."""
    names = module_names(model)
    modules = dict(model.named_modules())
    sets, pickers = [], []
    for term in terms:
        keyword, _, value = term.partition(":")
        if keyword == "none":
            sets.append(set())
        elif keyword == "blocks":
            sets.append(set(find_blocks(model)) or _fail())
        elif keyword == "all":
            children = {n for n, c in model.named_children() if n in modules}
            holding = {
                n for n in children if list(modules[n].parameters()) or list(modules[n].children())
            }
            sets.append(holding or _fail())
        elif keyword == "type":
            wanted = value.split(",")
            present = {type(modules[n]).__name__ for n in names}
            if not set(wanted) <= present:
                _fail()
            sets.append({n for n in names if type(modules[n]).__name__ in wanted})
        elif keyword == "name":
            sets.append({n for n in names if fnmatch.fnmatchcase(n, value)} or _fail())
        else:
            pickers.append((keyword, value))
    if sets:
        candidates = [n for n in names if all(n in s for s in sets)]
    else:
        candidates = find_blocks(model) or _fail()
    chosen = set(candidates)
    for keyword, value in pickers:
        chosen &= set(pick(keyword, value, candidates))
    return [n for n in names if n in chosen]


def pick(keyword, value, candidates):
    n = len(candidates)
    if keyword == "every":
        return [c for i, c in enumerate(candidates) if i % int(value) == 0]
    if keyword == "first":
        return candidates[: int(value)]
    if keyword == "last":
        return candidates[max(0, n - int(value)) :]
    k = round(float(value) * n)
    return [candidates[math.floor((j + 0.5) * n / k)] for j in range(k)]


def _fail():
    raise _Expected


@settings(max_examples=_EXAMPLES, deadline=None)
@given(tree=_roots, data=st.data())
def test_selection_follows_the_spec_and_is_pure(tree, data):
    model = build(tree)
    terms = data.draw(st.lists(terms_for(model), min_size=1, max_size=3), label="terms")
    spec = ";".join(terms)
    policy = parse_policy(spec)
    try:
        expected = expected_selection(model, terms)
    except _Expected:
        expected = None
    try:
        selected = policy.select(model)
    except CheckpointConfigError:
        assert expected is None, f"{spec} raised, the spec selects {expected}"
        event("error")
        return
    assert selected == expected
    event("selected nothing" if not selected else "selected some")

    names = module_names(model)
    assert "" not in selected
    assert set(selected) <= set(names)
    assert selected == sorted(set(selected), key=names.index)
    assert policy.select(model) == selected
    assert policy.select(copy.deepcopy(model)) == selected


@settings(max_examples=_EXAMPLES, deadline=None)
@given(terms=st.lists(terms_for(nn.Sequential(CustomA(), nn.Linear(2, 2))), min_size=1, max_size=4))
def test_string_form_equals_python_composition_and_round_trips(terms):
    policy = parse_policy(";".join(terms))
    assert policy == functools.reduce(operator.and_, (parse_policy(t) for t in terms))
    assert parse_policy(str(policy)) == policy


@settings(max_examples=_EXAMPLES, deadline=None)
@given(tree=_roots, data=st.data())
def test_complement_of_a_term_is_the_rest(tree, data):
    model = build(tree)
    term = data.draw(terms_for(model), label="term")
    policy = parse_policy(term)
    try:
        selected = policy.select(model)
    except CheckpointConfigError:
        return
    inverse = (~policy).select(model)
    if term.split(":")[0] in ("every", "first", "last", "fraction"):
        universe = find_blocks(model)
    else:
        universe = module_names(model)
    assert inverse == [n for n in universe if n not in selected]


@settings(max_examples=_EXAMPLES, deadline=None)
@given(tree=_trees | _roots)
def test_blocks_are_the_outermost_repeated_modules_with_submodules(tree):
    model = build(tree)
    blocks = find_blocks(model)
    names = module_names(model)
    assert blocks == [n for n in names if n in set(blocks)]
    assert find_blocks(copy.deepcopy(model)) == blocks
    modules = dict(model.named_modules())

    def repeated(name):
        parent_name, _, _ = name.rpartition(".")
        parent = modules[parent_name]
        prefix = parent_name + "." if parent_name else ""
        siblings = [
            key for key, child in parent.named_children()
            if type(child) is type(modules[name]) and prefix + key in modules
        ]
        return isinstance(parent, (nn.ModuleList, nn.Sequential)) and len(siblings) >= 2

    built_of_modules = [n for n in names if repeated(n) and list(modules[n].children())]
    outermost = [n for n in built_of_modules if not any(n.startswith(o + ".") for o in built_of_modules)]
    if outermost:
        assert blocks == outermost
    else:  # only modules without submodules repeat: those of one class stand in
        assert all(repeated(b) for b in blocks)
        assert len({type(modules[b]) for b in blocks}) <= 1

"""tests/conftest.py: the tiers ride as markers on the tests, never as lists of ids."""

import ast
import pathlib
import re

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")
#: A node id or a prefix of one: what a list of tests by name is made of.
_TEST_NAME = re.compile(r"::[Tt]est|^tests/")


def _node_id_uses(tree: ast.AST) -> list[str]:
    """Comparisons and prefix tests on ``item.nodeid``: selecting tests by name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Attribute) and p.attr == "nodeid" for p in parts):
                found.append(f"line {node.lineno}: compares a node id")
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("startswith", "endswith")
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "nodeid"
        ):
            found.append(f"line {node.lineno}: nodeid.{node.attr}")
    return found


def _test_names(tree: ast.AST) -> list[str]:
    return [
        f"line {node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and _TEST_NAME.search(node.value)
    ]


def test_conftest_selects_no_tests_by_name():
    """A tier kept as node ids changes silently when a test is renamed: mark the test
    (``@pytest.mark.slow``, ``@pytest.mark.heavy``, ``pytest.param(..., marks=...)``)."""
    tree = ast.parse(CONFTEST.read_text())
    assert _test_names(tree) == [], "tests named in conftest.py: mark them instead"
    assert _node_id_uses(tree) == [], "conftest.py selects by node id: use markers"


def test_the_checks_catch_a_node_id_list():
    tree = ast.parse(
        'SLOW = {"tests/test_x.py::test_y"}\n'
        "def f(item):\n"
        '    return item.nodeid in SLOW or item.nodeid.startswith("tests/cli")\n'
    )
    assert len(_test_names(tree)) == 2
    assert len(_node_id_uses(tree)) == 2


def test_the_tier_markers_are_registered(pytestconfig):
    names = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert {"slow", "heavy", "quick", "full", "full_sweep"} <= names


class _Item:
    """What ``_keep_slow_half`` reads of a collected test: its node id and marks."""

    def __init__(self, nodeid: str, *marks):
        self.nodeid = nodeid
        self.marks = {m.name: m for m in marks}

    def get_closest_marker(self, name):
        return self.marks.get(name)


class _Config:
    def __init__(self, half):
        self.half = half
        self.deselected: list = []
        self.hook = self

    def getoption(self, name):
        assert name == "--slow-half"
        return self.half

    def pytest_deselected(self, items):
        self.deselected.extend(items)


def test_the_slow_halves_split_only_slow_tests_and_keep_a_group_together():
    import pytest

    from tests.conftest import _keep_slow_half

    slow, group = pytest.mark.slow, pytest.mark.xdist_group("step-a")
    items = [_Item(f"tests/m.py::test_{i}", slow) for i in range(200)]
    items += [_Item(f"tests/m.py::test_fast_{i}") for i in range(20)]
    items += [_Item(f"tests/m.py::test_grouped_{i}", slow, group) for i in range(5)]
    kept = {}
    for half in ("0", "1"):
        config, run = _Config(half), list(items)
        _keep_slow_half(config, run)
        assert {i.nodeid for i in run} | {i.nodeid for i in config.deselected} == {
            i.nodeid for i in items
        }
        kept[half] = {i.nodeid for i in run}
    # every fast test in both, every slow one in exactly one, a group all in one
    assert kept["0"] & kept["1"] == {f"tests/m.py::test_fast_{i}" for i in range(20)}
    assert len(kept["0"] | kept["1"]) == len(items)
    assert sum(f"tests/m.py::test_grouped_{i}" in kept["0"] for i in range(5)) in (0, 5)
    assert 70 < len(kept["0"]) - 20 < 140  # about half of the 205 slow ones
    # without the option nothing is left out
    config, run = _Config(None), list(items)
    _keep_slow_half(config, run)
    assert run == items and config.deselected == []

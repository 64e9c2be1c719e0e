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

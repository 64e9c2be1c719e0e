"""``spmdkit/__init__.py``: its three lists of public names agree.

The package imports nothing until a name is read (PEP 562), so each public name
is written three times: in the ``TYPE_CHECKING`` imports (for type checkers and
IDEs), in ``_EXPORTS`` (what ``__getattr__`` imports) and in ``__all__``. A name
added to one list and not the others would be invisible to one of those readers.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import sys
import types

import pytest

import spmdkit


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(inspect.getsource(spmdkit))
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    return {
        alias.asname or alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_the_type_checking_imports_are_the_lazy_exports():
    assert _type_checking_imports() == spmdkit._EXPORTS


def test_all_names_every_export_and_each_resolves():
    assert set(spmdkit.__all__) == set(spmdkit._EXPORTS)
    assert len(spmdkit.__all__) == len(set(spmdkit.__all__))
    for name in spmdkit.__all__:
        assert getattr(spmdkit, name) is not None, name
    for name, module in spmdkit._LAZY_MODULES.items():  # submodules, not in __all__
        assert getattr(spmdkit, name).__name__ == module


# -- every dotted name the docs give imports as written --------------------------------

REPO = pathlib.Path(__file__).resolve().parents[1]
#: ``spmdkit.a.b.C`` in prose or code; not a file name (``api/spmdkit.md``).
DOTTED = re.compile(r"(?<![\w/.])spmdkit(?:\.[A-Za-z_]\w*)+")


def _documented_names() -> list[str]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = {m.group(0) for page in pages for m in DOTTED.finditer(page.read_text())}
    return sorted(found)


def test_the_docs_name_dotted_paths_and_the_run_time_modules():
    names = _documented_names()
    assert len(names) > 50
    assert "spmdkit.checkpoint.Manager" in names and "spmdkit.data.ShardedLoader" in names


@pytest.mark.parametrize("dotted", _documented_names())
def test_a_documented_dotted_name_imports_as_written(dotted):
    """``spmdkit.checkpoint.Manager`` in the docs: ``from spmdkit.checkpoint import
    Manager`` works, and gives ``sk.checkpoint.Manager``. Every module on the way is
    importable under the name the docs give it, as the same module object."""
    obj, name = spmdkit, "spmdkit"
    for part in dotted.split(".")[1:]:
        name += "." + part
        obj = getattr(obj, part)
        if isinstance(obj, types.ModuleType):
            assert importlib.import_module(name) is obj, name


def test_the_run_time_modules_import_by_their_short_names():
    from spmdkit.checkpoint import Manager
    from spmdkit.data import ShardedLoader
    from spmdkit.export import export_params
    from spmdkit.launch import launch
    from spmdkit.train import TrainError, train

    runtime = importlib.import_module("spmdkit.runtime")
    assert Manager is runtime.checkpoint.Manager and train is runtime.train.train
    assert ShardedLoader is runtime.data.ShardedLoader and launch is runtime.launch.launch
    assert export_params is runtime.export.export_params
    assert issubclass(TrainError, spmdkit.SpmdError)
    for short, real in spmdkit._LAZY_MODULES.items():
        module = importlib.import_module(f"spmdkit.{short}")
        assert module is sys.modules[real] and module.__spec__.name == real

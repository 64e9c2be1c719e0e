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
import sys

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


# -- the run-time modules by their short names -----------------------------------------


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

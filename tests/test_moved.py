"""spmdkit.moved: old flat module paths still import, or say where their names went."""

import importlib

import pytest

import spmdkit as sk
from spmdkit.errors import ModuleMovedError
from spmdkit.moved import GONE, MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_moved_module_itself(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_from_imports_and_lazy_attributes_see_one_module():
    from spmdkit.checkpoint import Manager
    from spmdkit.runtime.checkpoint import Manager as NewManager

    assert Manager is NewManager
    assert sk.checkpoint is importlib.import_module("spmdkit.runtime.checkpoint")
    assert sk.train.train is importlib.import_module("spmdkit.runtime.train").train


@pytest.mark.parametrize("old", sorted(GONE))
def test_a_gone_path_names_the_new_one_and_keeps_the_function(old):
    with pytest.raises(ModuleMovedError, match=GONE[old][1].split(" ")[0]):
        importlib.import_module(old)
    assert callable(sk.plan) and callable(sk.propagate) and callable(sk.report)


def test_every_new_path_exists():
    for new in MOVED.values():
        importlib.import_module(new)

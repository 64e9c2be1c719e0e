"""Old module paths: where each module went in the package-per-stage layout.

spmdkit's modules used to sit flat in ``spmdkit/``; they now live in one package
per pipeline stage (``docs/architecture.md``). Code written against the old paths
keeps working: :data:`MOVED` maps each old path to its new one, and a finder
installed by ``import spmdkit`` makes ``import spmdkit.checkpoint`` return
:mod:`spmdkit.runtime.checkpoint` itself (the same module object, so patches and
``isinstance`` checks see one thing). Two old names are now *functions* of
``spmdkit`` (``sk.plan``, ``sk.propagate``); making the old module importable
would overwrite the function with the module, so those raise
:class:`~spmdkit.errors.ModuleMovedError` naming the new path instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from spmdkit.errors import ModuleMovedError

__all__ = ["MOVED", "SHADOWED", "install"]

#: Old module path → new module path.
MOVED: dict[str, str] = {
    "spmdkit.checkpoint": "spmdkit.runtime.checkpoint",
    "spmdkit.data": "spmdkit.runtime.data",
    "spmdkit.demo": "spmdkit.cli.demo",
    "spmdkit.docgen": "spmdkit.cli.docgen",
    "spmdkit.enforce": "spmdkit.compile.enforce",
    "spmdkit.flaxlib": "spmdkit.flax",
    "spmdkit.hlo": "spmdkit.verification.hlo",
    "spmdkit.launch": "spmdkit.runtime.launch",
    "spmdkit.memory": "spmdkit.propagation.memory",
    "spmdkit.plan": "spmdkit.planner",
    "spmdkit.propagate": "spmdkit.propagation",
    "spmdkit.report": "spmdkit.verification.report",
    "spmdkit.train": "spmdkit.runtime.train",
}

#: Old paths that are also names of functions ``spmdkit`` exports: importing
#: them raises instead of replacing the function.
SHADOWED = frozenset({"spmdkit.plan", "spmdkit.propagate", "spmdkit.report"})


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module now at its new path."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        if old in SHADOWED:
            raise ModuleMovedError(
                op=f"import {old}",
                must=f"the module is imported from its new path {self.new}",
                given=f"the old path {old} (now the function sk.{old.rsplit('.', 1)[1]})",
                fix=f"write `from {self.new} import ...` (or call sk.{old.rsplit('.', 1)[1]})",
            )
        # importlib returns whatever sys.modules holds for the name once this
        # returns: the moved module itself, not a copy of its namespace.
        sys.modules[old] = importlib.import_module(self.new)


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds old module paths (after every real finder has said no)."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the old-path finder last on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())

"""Old module paths: where each module went in the package-per-stage layout.

spmdkit's modules used to sit flat in ``spmdkit/``; they now live in one package
per pipeline stage (``docs/architecture.md``). Code written against the old paths
keeps working: :data:`MOVED` maps each old path to its new one, and a finder
installed by ``import spmdkit`` makes ``import spmdkit.checkpoint`` return
:mod:`spmdkit.runtime.checkpoint` itself (the same module object, so patches and
``isinstance`` checks see one thing). Two old names are now *functions* of
``spmdkit`` (``sk.plan``, ``sk.propagate``, ``sk.report``); making the old module
importable would overwrite the function with the module, so those raise
:class:`~spmdkit.errors.ModuleMovedError` naming the new path instead, as does
``spmdkit.flaxlib``, which was split in two.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from spmdkit.errors import ModuleMovedError

__all__ = ["GONE", "MOVED", "install"]

#: Old module path → new module path.
MOVED: dict[str, str] = {
    "spmdkit.checkpoint": "spmdkit.runtime.checkpoint",
    "spmdkit.data": "spmdkit.runtime.data",
    "spmdkit.demo": "spmdkit.cli.demo",
    "spmdkit.docgen": "spmdkit.cli.docgen",
    "spmdkit.enforce": "spmdkit.compile.enforce",
    "spmdkit.hlo": "spmdkit.verification.hlo",
    "spmdkit.launch": "spmdkit.runtime.launch",
    "spmdkit.memory": "spmdkit.propagation.memory",
    "spmdkit.train": "spmdkit.runtime.train",
}

#: Old paths that raise :class:`~spmdkit.errors.ModuleMovedError`: old path →
#: (why, where its names are now). The others are names of functions their
#: package exports (importing the module would replace the function).
GONE: dict[str, tuple[str, str]] = {
    "spmdkit.flaxlib": (
        "split in two",
        "spmdkit.flax (describe, ModelInfo, path_str) and spmdkit.compile (init_sharded, shard)",
    ),
    "spmdkit.plan": ("now the function sk.plan", "spmdkit.planner"),
    "spmdkit.propagate": ("now the function sk.propagate", "spmdkit.propagation"),
    "spmdkit.report": ("now the function sk.report", "spmdkit.verification.compiled"),
    "spmdkit.ops.attention": ("now the function sk.ops.attention", "spmdkit.ops.sdpa"),
    "spmdkit.ops.index_put": ("now the function sk.ops.index_put", "spmdkit.ops.indexing"),
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module now at its new path, or raises where
    the old path is :data:`GONE`."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        if old in GONE:
            why, new = GONE[old]
            raise ModuleMovedError(
                op=f"import {old}",
                must=f"its names are imported from {new}",
                given=f"the old path {old} ({why})",
                fix=f"import from {new}",
            )
        # importlib returns whatever sys.modules holds for the name once this
        # returns: the moved module itself, not a copy of its namespace.
        sys.modules[old] = importlib.import_module(MOVED[old])


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds old module paths (after every real finder has said no)."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED and fullname not in GONE:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias())


def install() -> None:
    """Put the old-path finder last on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())

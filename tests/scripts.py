"""Loading a repository script (``benchmarks/*.py``) as a module for its tests."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def loaded_script(relpath: str) -> Iterator[ModuleType]:
    """The script at ``relpath`` (from the repository root) imported as a module
    named after its path (``benchmarks/ops.py`` → ``benchmarks_ops``), registered in
    ``sys.modules`` while the block runs (dataclasses and pickling need that)."""
    path = ROOT / relpath
    name = "_".join(path.relative_to(ROOT).with_suffix("").parts)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)

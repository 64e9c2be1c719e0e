"""``spmdkit/state.py``: every piece of state the package keeps is listed in one place.

The source is scanned (``ast``): a ``ContextVar``, a cached function, a
module-level memo (an empty dict, set, list, ``OrderedDict``...) or a name
assigned under ``global`` must be registered with :mod:`spmdkit.state`, and
everything registered must exist. ``sk.clear_caches()`` empties every cache,
and a plan made after it is the plan made before.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import textwrap

import pytest

import spmdkit as sk
from spmdkit import state
from spmdkit.cli.deps import source_files
from tests.plan_model import toy_batch, toy_init, toy_loss

REPO = pathlib.Path(__file__).resolve().parents[1]

#: decorators that cache without registering (write ``@cached(why=...)`` instead)
RAW_CACHES = {"functools.cache", "functools.lru_cache", "lru_cache", "cache"}
#: constructors of containers a module could use as a memo
CONTAINERS = {
    "dict",
    "set",
    "list",
    "OrderedDict",
    "collections.OrderedDict",
    "defaultdict",
    "collections.defaultdict",
    "Counter",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
    "weakref.WeakKeyDictionary",
    "weakref.WeakValueDictionary",
    "weakref.WeakSet",
}
REGISTERING = {"register_cache", "register_context", "state.register_cache"}


def _call_name(node: ast.AST) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


def _is_memo(value: ast.AST) -> bool:
    """An empty mutable container, or a call that makes one."""
    if isinstance(value, ast.Dict | ast.List | ast.Set):
        return not (getattr(value, "keys", None) or getattr(value, "elts", None))
    return _call_name(value) in CONTAINERS


def _scan_module(module: str, tree: ast.Module) -> tuple[set[str], list[str]]:
    """``(names that must be registered, problems)`` for one module."""
    found: set[str] = set()
    problems: list[str] = []

    def decorated(node: ast.FunctionDef, qual: str) -> None:
        for d in node.decorator_list:
            name = ast.unparse(d.func if isinstance(d, ast.Call) else d)
            if name in RAW_CACHES:
                problems.append(f"{module}.{qual}: @{name} (use spmdkit.state.cached)")
            if name in RAW_CACHES or name in {"cached", "state.cached"}:
                found.add(f"{module}.{qual}")

    def walk_scope(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                decorated(node, prefix + node.name)
            elif isinstance(node, ast.ClassDef):
                walk_scope(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                if prefix and isinstance(node, ast.AnnAssign):
                    continue  # a field's default (dataclass, NamedTuple), copied or immutable
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
                wrapped = _call_name(value) in REGISTERING
                inner = value.args[0] if wrapped and value.args else value
                if _is_memo(inner) or _call_name(inner).endswith("ContextVar"):
                    names = [f"{module}.{prefix}{ast.unparse(t)}" for t in targets]
                    if prefix:  # a class attribute is shared by every instance
                        problems.extend(f"{n}: a memo or ContextVar on a class" for n in names)
                    found.update(names)

    walk_scope(tree.body, "")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(f"{module}.{n}" for n in node.names)
        elif _call_name(node).endswith("ContextVar"):
            line = node.lineno
            at_top = any(
                isinstance(s, ast.Assign | ast.AnnAssign) and s.lineno <= line <= s.end_lineno
                for s in tree.body
            )
            if not at_top:
                problems.append(f"{module}:{line}: a ContextVar made outside the module's top")
    return found, problems


def scan(files: dict[str, pathlib.Path]) -> tuple[set[str], list[str]]:
    """Every ``module.name`` the source says holds state, and misuses found."""
    found: set[str] = set()
    problems: list[str] = []
    for module, path in files.items():
        if module == "spmdkit.state":
            continue
        f, p = _scan_module(module, ast.parse(path.read_text()))
        found |= f
        problems += p
    return found, problems


@pytest.fixture(scope="module")
def everything_imported() -> tuple[state.Held, ...]:
    for module in source_files():
        if module != "spmdkit.__main__":
            importlib.import_module(module)
    return state.held()


def test_every_piece_of_state_in_the_source_is_registered(everything_imported):
    found, problems = scan(source_files())
    assert problems == []
    registered = {h.where for h in everything_imported}
    assert sorted(found - registered) == [], "register these with spmdkit.state"
    assert sorted(registered - found) == [], "registered but not in the source"


def test_the_scan_catches_unregistered_state(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        textwrap.dedent(
            """\
            import contextvars, functools
            from spmdkit.state import cached, register_cache
            _VAR = contextvars.ContextVar("x", default=None)
            _MEMO = {}
            _KEPT = register_cache({}, module=__name__, name="_KEPT", why="y")
            _TABLE = {"a": 1}
            FLAG = False
            @functools.lru_cache(maxsize=8)
            def raw(x): return x
            @cached(why="z")
            def fine(x): return x
            def closure():
                @functools.cache
                def inner(): return 1  # one per call: not process state
                return inner
            def flip():
                global FLAG
                FLAG = True
            class C:
                shared = {}
                field: dict = {}
                @functools.cache
                def method(self): return 1
            """
        )
    )
    found, problems = scan({"pkg.m": path})
    assert found == {
        "pkg.m._VAR",
        "pkg.m._MEMO",
        "pkg.m._KEPT",
        "pkg.m.FLAG",
        "pkg.m.raw",
        "pkg.m.fine",
        "pkg.m.C.shared",
        "pkg.m.C.method",
    }
    assert problems == [
        "pkg.m.raw: @functools.lru_cache (use spmdkit.state.cached)",
        "pkg.m.C.shared: a memo or ContextVar on a class",
        "pkg.m.C.method: @functools.cache (use spmdkit.state.cached)",
    ]


def test_each_context_variable_says_who_sets_and_reads_it(everything_imported):
    contexts = [h for h in everything_imported if h.kind == "context"]
    assert len(contexts) == 10
    for h in contexts:
        assert h.set_by and h.read_by and h.clear is None
    assert all(h.clear is not None for h in everything_imported if h.kind == "cache")


@pytest.mark.filterwarnings("ignore::spmdkit.PlanNoteWarning")
def test_clear_caches_empties_them_and_a_plan_recomputes_the_same(everything_imported):
    from spmdkit.engine.inference import cache_info
    from spmdkit.resharding.plan import plan_reshard
    from spmdkit.spec import TensorSpec

    mesh = sk.abstract_mesh(data=2, model=2)

    def planned():
        return sk.plan(toy_init, mesh, "fsdp", loss=toy_loss, batch=toy_batch())

    first = planned()
    plan_reshard(TensorSpec((8, 8), ("data", None)), TensorSpec((8, 8)), mesh)
    assert cache_info()["size"] > 0
    assert sk.clear_caches() == len(state.held("cache"))
    assert cache_info()["size"] == 0
    again = planned()
    assert cache_info()["size"] > 0 and cache_info()["misses"] > 0
    assert again == first and again.cost == first.cost


def test_the_architecture_doc_lists_what_is_global(everything_imported):
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert state.table() in doc, (
        "regenerate docs/architecture.md's 'What is global' table: every module imported, "
        "print(spmdkit.state.table())"
    )


def test_held_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="cache"):
        state.held("caches")
    with pytest.raises(ValueError, match="why"):
        state.Held("m", "n", "cache", "")

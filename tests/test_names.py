"""Every spmdkit name the docs, docstrings and error messages tell a user to use resolves.

A reference is ``sk.X[.Y…]`` or ``spmdkit.X[.Y…]`` with ``sk``/``spmdkit`` a whole
word (``mask.sum`` and ``disk.read`` are not references). It is collected from
README.md, docs/*.md, the notebooks' cells, every string statement (docstrings,
attribute docstrings) of the modules under spmdkit/, rules/ and models/, and the
constant text of every ``op=``, ``must=`` and ``fix=`` keyword (what an error
names and tells the user to do). It resolves when the longest importable module
prefix, then ``getattr`` for the rest, finds an object, as ``import spmdkit as
sk; sk.X.Y`` would, and every module on the way imports under the name written
(``spmdkit.checkpoint.Manager`` is ``from spmdkit.checkpoint import Manager``). An
import shown (``from spmdkit.a import b``, ``import spmdkit.a``) must work as
written: ``sk.plan`` is a function, so ``import spmdkit.plan`` fails.
"""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import re
import types
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: ``sk``/``spmdkit`` as a whole word (not after a letter, ``.``, ``/`` or ``-``),
#: then dotted identifiers. Not a reference when followed by ``/`` or ``-``
#: (the ``spmdkit.checkpoint/1`` format tag, ``spmdkit.egg-info``), nor is any
#: prefix of one.
REFERENCE = re.compile(r"(?<![\w./-])(?:sk|spmdkit)(?:\.[A-Za-z_]\w*)+(?!\.?[\w/-])")

#: ``from spmdkit.a import b, c`` and ``import spmdkit.a.b`` (in prose, a doctest or
#: a notebook cell): the module must import as a module, which ``sk.a`` being an
#: attribute of ``spmdkit`` (``sk.train``) does not make it.
FROM_IMPORT = re.compile(r"(?<![\w.])from\s+(spmdkit(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n`;#]*)")
IMPORT = re.compile(r"(?<![\w.])import\s+(spmdkit(?:\.\w+)+)")

#: A component that is a single letter is a placeholder (``import spmdkit.X.Y as
#: m``, ``from spmdkit.x import _helper``), not a name.
PLACEHOLDER = re.compile(r"[A-Za-z]")

#: Keywords of an error's constructor whose text names spmdkit's API to the user.
ERROR_KEYWORDS = ("op", "must", "fix")

#: Replaces an f-string's formatted values, so text on either side never joins.
HOLE = "\0"

Source = tuple[str, int, str]  # (where, its first line, text)


def _placeholder(name: str) -> bool:
    return any(PLACEHOLDER.fullmatch(p) for p in re.split(r"[.:]", name)[1:])


def references(text: str) -> list[tuple[int, str]]:
    """``(line offset, name)`` of each reference in ``text``, ``sk`` spelled
    ``spmdkit``; an import is ``module:`` (the module itself) or ``module:name``."""
    found = []
    for m in REFERENCE.finditer(text):
        parts = m.group().split(".")
        if parts[-1] not in ("py", "md", "ipynb", "toml"):
            found.append((m.start(), ".".join(["spmdkit", *parts[1:]])))
    for m in IMPORT.finditer(text):
        found.append((m.start(1), f"{m.group(1)}:"))
    for m in FROM_IMPORT.finditer(text):
        names = re.sub(r"#[^\n]*", "", m.group(2)).strip("()")
        for item in names.split(","):  # "a as b", "\n...     c" in a doctest
            if word := re.search(r"\w+", item):
                found.append((m.start(1), f"{m.group(1)}:{word.group()}"))
    return [
        (text.count("\n", 0, at), name)
        for at, name in sorted(found, key=lambda f: f[0])
        if not _placeholder(name)
    ]


def _imports(module: str) -> object | None:
    """The module, or None when it (not something it imports) does not exist."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module or module.startswith(f"{e.name}."):
            return None
        raise


def resolves(name: str) -> bool:
    """Whether ``name`` resolves: ``spmdkit.a.b`` is an importable module or an
    attribute path under the longest importable module prefix, each module on it
    importable by its path (``spmdkit.checkpoint`` as ``sk.checkpoint``);
    ``module:`` is an importable module and ``module:b`` one with an attribute or
    submodule ``b``."""
    if ":" in name:
        module, attr = name.split(":")
        obj = _imports(module)
        return obj is not None and (
            not attr or hasattr(obj, attr) or _imports(f"{module}.{attr}") is not None
        )
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        obj = _imports(".".join(parts[:i]))
        if obj is None:
            continue
        for k in range(i + 1, len(parts) + 1):
            if not hasattr(obj, parts[k - 1]):
                return False
            obj = getattr(obj, parts[k - 1])
            if isinstance(obj, types.ModuleType) and _imports(".".join(parts[:k])) is not obj:
                return False
        return True
    return False


def _constant_text(node: ast.expr) -> str | None:
    """A string constant's text, or an f-string's constant parts joined by :data:`HOLE`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _constant_text(node.left), _constant_text(node.right)
        return (left or HOLE) + (right or HOLE)
    return None


def python_sources(path: pathlib.Path, rel: str) -> Iterator[Source]:
    """The string statements (docstrings) and :data:`ERROR_KEYWORDS` texts of one module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                yield rel, node.lineno, node.value.value
        elif isinstance(node, ast.keyword) and node.arg in ERROR_KEYWORDS:
            text = _constant_text(node.value)
            if text is not None:
                yield f"{rel} {node.arg}=", node.value.lineno, text


def notebook_sources(path: pathlib.Path, rel: str) -> Iterator[Source]:
    """Each cell's source of one notebook."""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        src = cell["source"]
        yield f"{rel} cell {i}", 1, src if isinstance(src, str) else "".join(src)


def sources() -> Iterator[Source]:
    """Every text a reference is collected from."""
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield str(md.relative_to(ROOT)), 1, md.read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        yield from notebook_sources(nb, str(nb.relative_to(ROOT)))
    for top in ("spmdkit", "rules", "models"):
        for py in sorted((ROOT / top).rglob("*.py")):
            yield from python_sources(py, str(py.relative_to(ROOT)))


def unresolved(texts: Iterator[Source]) -> list[str]:
    """``"name  (where line)"`` for each reference that does not resolve."""
    seen: dict[str, bool] = {}
    bad = []
    for where, line, text in texts:
        for offset, name in references(text):
            if name not in seen:
                seen[name] = resolves(name)
            if not seen[name]:
                bad.append(f"{name}  ({where} line {line + offset})")
    return bad


def test_references_are_whole_words_and_not_paths():
    text = (
        "sk.plan(m); mask.sum() disk.read spmdkit/planner/search.py\n"
        "`spmdkit.planner.search` and x.sk.foo, spmdkit.egg-info, spmdkit.checkpoint/1, "
        "spmdkit.cli.docgen/x, import spmdkit.X.Y as m; spmdkit.cli.docgen.py. See sk.jit.\n"
        ">>> from spmdkit.runtime import (data,\n...     train as t)  # from spmdkit.x import _h\n"
        "imported from spmdkit.introspect (describe)"
    )
    assert references(text) == [
        (0, "spmdkit.plan"),
        (1, "spmdkit.planner.search"),
        (1, "spmdkit.jit"),
        (2, "spmdkit.runtime"),
        (2, "spmdkit.runtime:data"),
        (2, "spmdkit.runtime:train"),
        (4, "spmdkit.introspect"),
    ]


def test_a_planted_bad_name_is_reported_where_it_was_found(tmp_path):
    mod = tmp_path / "mod.py"
    mod.write_text(
        '"""Use ``sk.plan`` and ``sk.no_such_name``."""\n'
        "def f():\n"
        '    raise E(op="sk.jitt", given="sk.given", fix=f"pass sk.Pipelin(stages={n})")\n'
    )
    texts = [
        ("README.md", 1, "ok: spmdkit.planner.search.plan\nbad: `spmdkit.planner.nope.thing`"),
        ("nb cell 0", 1, "import spmdkit as sk\nimport spmdkit.plan\nsk.train.train"),
        (
            "nb cell 1",
            1,
            "from spmdkit.runtime import data, nothing\nfrom spmdkit import plan, train",
        ),
        *python_sources(mod, "mod.py"),
    ]
    assert unresolved(iter(texts)) == [
        "spmdkit.planner.nope.thing  (README.md line 2)",
        "spmdkit.plan:  (nb cell 0 line 2)",
        "spmdkit.runtime:nothing  (nb cell 1 line 1)",
        "spmdkit.no_such_name  (mod.py line 1)",
        "spmdkit.jitt  (mod.py op= line 3)",
        "spmdkit.Pipelin  (mod.py fix= line 3)",
    ]


def test_every_documented_name_resolves():
    bad = unresolved(sources())
    assert not bad, f"{len(bad)} names do not resolve:\n" + "\n".join(bad)


def test_a_module_reached_only_as_an_attribute_does_not_resolve(monkeypatch):
    """``sk.X`` a module that ``import spmdkit.X`` cannot find: ``spmdkit.X.Y`` in a
    doc would fail as ``from spmdkit.X import Y``."""
    import spmdkit

    elsewhere = types.ModuleType("spmdkit.runtime.elsewhere")
    elsewhere.Thing = object()
    monkeypatch.setattr(spmdkit, "elsewhere", elsewhere, raising=False)
    assert not resolves("spmdkit.elsewhere.Thing")
    assert resolves("spmdkit.checkpoint.Manager") and resolves("spmdkit.train.train")

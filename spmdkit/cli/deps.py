"""spmdkit's own import graph: which module imports which, circles, private reach-ins.

The layout is one package per pipeline stage, and imports point one way
(``docs/architecture.md``). This module reads the source (``ast``, nothing is
imported) and answers three questions the test suite asks on every run:

* :func:`find_cycles`: is there an import circle, counting imports inside
  functions too (a lazy import hides a circle from Python, not from a reader)?
* :func:`private_imports`: does a module use an underscored name of another
  module (``from spmdkit.x import _helper``, ``x._cache``)?
* :func:`layer_violations`: does a module import a stage it must not
  (:data:`LAYERS`)?
* :func:`shadowed_submodules`: does a package export a name that is also one of
  its submodules (a function ``plan`` exported by ``spmdkit.planner`` next to a
  module ``planner/plan.py``: importing that module as ``m`` would give the
  function)?

``spmdkit deps`` prints the package graph; ``--mermaid`` prints the diagram that
``docs/architecture.md`` embeds, ``--map`` its map of the modules
(:func:`module_map`: one line per module, the first line of its docstring).
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from spmdkit.cli.command import Command

__all__ = [
    "LAYERS",
    "STAGES",
    "COMMANDS",
    "PrivateUse",
    "find_cycles",
    "layer_violations",
    "mermaid",
    "module_graph",
    "module_map",
    "package_graph",
    "private_imports",
    "shadowed_submodules",
    "source_files",
    "stage_of",
]

#: Stage name → module prefixes that belong to it (longest prefix wins). ``base``
#: is the vocabulary every stage shares; ``rule`` the rule machinery (registry,
#: inference) that prices reshards with ``resharding``.
STAGES: dict[str, tuple[str, ...]] = {
    "base": (
        "spmdkit.errors",
        "spmdkit.spec",
        "spmdkit.mesh",
        "spmdkit.topology",
        "spmdkit.util",
        "spmdkit.kernels",
        "spmdkit.engine.factor",
        "spmdkit.pipeline",
        "spmdkit.versions",
        "spmdkit.vma",
        "spmdkit.jaxprs",
        "spmdkit.batch",
        "spmdkit.context_parallel",
        "spmdkit.expert_shard",
        "spmdkit.strategies",
        "spmdkit.state",
    ),
    "step": ("spmdkit.step",),
    "rule": ("spmdkit.engine",),
    "rules": ("spmdkit.rules",),
    "resharding": ("spmdkit.resharding",),
    "propagation": ("spmdkit.propagation",),
    "describe": ("spmdkit.introspect",),
    "planner": ("spmdkit.planner",),
    "compile": ("spmdkit.compile",),
    "verification": ("spmdkit.verification",),
    "runtime": ("spmdkit.runtime",),
    "ops": ("spmdkit.ops",),
    "nn": ("spmdkit.nn",),
    "testing": ("spmdkit.testing",),
    "models": ("spmdkit.models",),
    "cli": ("spmdkit.cli", "spmdkit.__main__"),
    "api": ("spmdkit",),
}

_BELOW_API = frozenset(
    {
        "base",
        "step",
        "rule",
        "rules",
        "resharding",
        "propagation",
        "describe",
        "planner",
        "compile",
        "verification",
    }
)

#: Stage → the stages its modules may import (besides their own). ``api`` is
#: ``spmdkit/__init__.py``: the public names, re-exported once; stages above it
#: (ops, testing, models, cli) may use it.
LAYERS: dict[str, frozenset[str]] = {
    "base": frozenset(),
    # the training step: the recipe and its levers, over the pipeline executor
    "step": frozenset({"base"}),
    "resharding": frozenset({"base"}),
    "rule": frozenset({"base", "resharding"}),
    "rules": frozenset({"base", "rule"}),
    "propagation": frozenset({"base", "resharding", "rule"}),
    "describe": frozenset({"base", "step"}),
    "planner": frozenset({"base", "step", "resharding", "rule", "propagation", "describe"}),
    "verification": frozenset({"base", "rule", "resharding", "propagation", "planner"}),
    "compile": frozenset(
        {
            "base",
            "step",
            "resharding",
            "rule",
            "propagation",
            "describe",
            "planner",
            "verification",
        }
    ),
    "runtime": _BELOW_API,
    "api": _BELOW_API,
    "ops": frozenset({"base", "rule", "resharding", "api"}),
    "nn": frozenset({"base", "ops"}),
    "testing": frozenset({"base", "rule", "resharding", "verification", "api"}),
    # the reference models compute norms, lookup and loss with spmdkit.ops (regions)
    "models": frozenset({"base", "planner", "api", "ops", "nn"}),
    "cli": _BELOW_API | {"api", "runtime", "models", "rules", "ops", "nn", "testing"},
}


def source_files(root: Path | None = None) -> dict[str, Path]:
    """Module name → source file for every module of the installed ``spmdkit``.

    ``spmdkit.rules`` and ``spmdkit.models`` live in the repository's ``rules/``
    and ``models/`` folders (``package-dir``); they are found where Python finds
    them. ``root`` overrides the package folder (tests point it at a fixture).
    """
    import importlib.util

    if root is not None:
        bases = {root.name: root}
    else:
        bases = {}
        for name in ("spmdkit", "spmdkit.rules", "spmdkit.models"):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin is not None:
                bases[name] = Path(spec.origin).parent
    out: dict[str, Path] = {}
    for prefix, base in bases.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            if prefix == "spmdkit" and rel and rel[0] in ("rules", "models"):
                continue  # found through their own mapping above
            out[".".join((prefix, *rel))] = path
    return out


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _imports(module: str, tree: ast.AST, modules: Iterable[str], is_package: bool):
    """``(target module, names imported from it, line)`` for every import in a tree."""
    known = set(modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield sub, (), node.lineno
                else:
                    yield base, (alias.name,), node.lineno


def module_graph(files: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module → the ``spmdkit`` modules it imports (anywhere in its body).

    Example::

        >>> graph = module_graph(source_files())
        >>> "spmdkit.errors" in graph["spmdkit.spec"]
        True
    """
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = graph.setdefault(module, set())
        is_package = path.name == "__init__.py"
        for target, _, _ in _imports(module, tree, files, is_package):
            if target in files and target != module:
                edges.add(target)
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components with more than one
    module (or a module importing itself), each sorted, the list sorted.

    Example::

        >>> find_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
        [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm (recursion depth: the module count)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


@dataclass(frozen=True)
class PrivateUse:
    """One use of another module's underscored name."""

    module: str
    line: int
    target: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} uses {self.target}.{self.name}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(files: Mapping[str, Path], known: Iterable[str] = ()) -> list[PrivateUse]:
    """Uses of underscored names across modules: ``from m import _x``, ``m._x`` on a
    module imported as a name, and importing a module whose own name is private.

    ``files`` are the modules to check (the package, or test files); ``known``
    adds module names they may import (the package, when checking tests).
    """
    modules = set(files) | set(known)
    found: list[PrivateUse] = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        is_package = path.name == "__init__.py"
        for target, names, line in _imports(module, tree, modules, is_package):
            if not target.startswith("spmdkit") or target == module:
                continue
            if any(_private(p) for p in target.split(".")):
                found.append(PrivateUse(module, line, target.rsplit(".", 1)[0], target))
            found.extend(PrivateUse(module, line, target, n) for n in names if _private(n))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node, is_package)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
                and aliases[node.value.id] != module
            ):
                found.append(PrivateUse(module, node.lineno, aliases[node.value.id], node.attr))
    return sorted(found, key=lambda u: (u.module, u.line, u.name))


def shadowed_submodules(files: Mapping[str, Path]) -> list[str]:
    """``package.name`` for every name a package's ``__init__`` binds (imports,
    defines or assigns) that is also a submodule of that package, other than the
    submodule itself.

    Example::

        >>> shadowed_submodules(source_files())
        []
    """
    found = []
    for package, path in files.items():
        if path.name != "__init__.py":
            continue
        children = {m.rpartition(".")[2] for m in files if m.rpartition(".")[0] == package}
        tree = ast.parse(path.read_text(), str(path))
        bound: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                base = _resolve(package, node, True)
                bound.update(
                    a.asname or a.name
                    for a in node.names
                    if f"{base}.{a.name}" != f"{package}.{a.asname or a.name}"
                )
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                bound.add(node.name)
            elif isinstance(node, ast.Assign):
                bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
        found.extend(f"{package}.{name}" for name in sorted(bound & children))
    return sorted(found)


def stage_of(module: str) -> str:
    """The stage (a key of :data:`STAGES`) a module belongs to: the longest prefix.

    Example::

        >>> stage_of("spmdkit.compile.annotate"), stage_of("spmdkit.introspect.model")
        ('compile', 'describe')
    """
    best, best_len = "api", 0
    for stage, prefixes in STAGES.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = stage, len(p)
    return best


def layer_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Imports that point the wrong way under :data:`LAYERS`, one line each."""
    out = []
    for module in sorted(graph):
        stage = stage_of(module)
        for target in sorted(graph[module]):
            other = stage_of(target)
            if other != stage and other not in LAYERS[stage]:
                out.append(f"{module} ({stage}) imports {target} ({other})")
    return out


def package_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to stages: stage → the stages it imports."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        stage = stage_of(module)
        deps = out.setdefault(stage, set())
        deps.update(stage_of(t) for t in targets if stage_of(t) != stage)
    return out


#: Stages in pipeline order (the diagram's top-to-bottom order).
_ORDER = (
    "cli",
    "runtime",
    "testing",
    "models",
    "nn",
    "ops",
    "api",
    "compile",
    "verification",
    "planner",
    "propagation",
    "describe",
    "rules",
    "rule",
    "resharding",
    "step",
    "base",
)


def _reachable(stages: Mapping[str, Iterable[str]], start: str, skip: str) -> set[str]:
    """Stages reachable from ``start`` without taking the direct edge to ``skip``."""
    seen: set[str] = set()
    todo = [d for d in stages.get(start, ()) if d != skip]
    while todo:
        s = todo.pop()
        if s not in seen:
            seen.add(s)
            todo.extend(stages.get(s, ()))
    return seen


def mermaid(stages: Mapping[str, Iterable[str]]) -> str:
    """A Mermaid flowchart of the stage graph: an arrow means "imports"; an edge
    that a longer path already implies is left out, so the picture stays legible."""
    lines = ["flowchart TD"]
    for stage in _ORDER:
        for dep in sorted(stages.get(stage, ()), key=_ORDER.index):
            if dep not in _reachable(stages, stage, skip=dep):
                lines.append(f"  {stage} --> {dep}")
    return "\n".join(lines) + "\n"


def _repo_path(module: str, path: Path) -> str:
    """Where a module's source sits in the repository (``spmdkit.rules.matmul``:
    ``rules/matmul.py``, its ``package-dir``)."""
    parts = module.split(".")
    top, rest = ("spmdkit", parts[1:])
    if len(parts) > 1 and parts[1] in ("rules", "models"):
        top, rest = parts[1], parts[2:]
    tail = "/__init__.py" if path.name == "__init__.py" else ".py"
    return "/".join([top, *rest]) + tail if rest else f"{top}/__init__.py"


def module_map(files: Mapping[str, Path]) -> str:
    """The map of the code ``docs/architecture.md`` embeds: per stage (in
    :data:`STAGES`' order), one table row per module, its file and the first line
    sentence of its docstring (every module has one: its job).

    Example::

        >>> print(module_map(source_files()).splitlines()[2])
        | module | its job |
    """
    by_stage: dict[str, list[tuple[str, str]]] = {s: [] for s in STAGES}
    for module, path in sorted(files.items(), key=lambda kv: _repo_path(*kv)):
        doc = (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
        para = " ".join(line.strip() for line in doc.split("\n\n")[0].splitlines())
        first = re.split(r"(?<=[.?!])\s", para, maxsplit=1)[0]
        by_stage[stage_of(module)].append((_repo_path(module, path), first.replace("|", "\\|")))
    out = []
    for stage, rows in by_stage.items():
        if rows:
            out += [f"### {stage}", "", "| module | its job |", "|---|---|"]
            out += [f"| `{where}` | {job} |" for where, job in rows]
            out.append("")
    return "\n".join(out)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mermaid", action="store_true", help="print a Mermaid diagram")
    parser.add_argument(
        "--map", action="store_true", help="print the module map docs/architecture.md embeds"
    )


def _run(args: argparse.Namespace, out: TextIO) -> int:
    graph = module_graph(source_files())
    if args.mermaid:
        out.write(mermaid(package_graph(graph)))
        return 0
    if args.map:
        out.write(module_map(source_files()))
        return 0
    for stage, deps in sorted(package_graph(graph).items(), key=lambda kv: _ORDER.index(kv[0])):
        out.write(f"{stage:<13} -> {', '.join(sorted(deps, key=_ORDER.index)) or '-'}\n")
    problems = [f"circle: {' <-> '.join(c)}" for c in find_cycles(graph)]
    problems += [f"private: {u}" for u in private_imports(source_files())]
    problems += [f"layer: {v}" for v in layer_violations(graph)]
    problems += [f"shadowed: {s}" for s in shadowed_submodules(source_files())]
    for p in problems:
        out.write(p + "\n")
    return 1 if problems else 0


#: ``spmdkit deps``.
COMMANDS = [
    Command(
        "deps",
        "spmdkit's own package import graph; circles, private reach-ins, layer breaks",
        _configure,
        _run,
    )
]

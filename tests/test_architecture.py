"""The layout's rules, checked on the source: imports point one way with no circles,
no module reaches into another's underscored names, every module says its job,
functions stay short, and docs/architecture.md's diagram is the code's."""

import ast
import pathlib
import re
import textwrap

import pytest

from spmdkit.cli.deps import (
    find_cycles,
    layer_violations,
    mermaid,
    module_graph,
    module_map,
    package_graph,
    private_imports,
    shadowed_submodules,
    source_files,
    stage_of,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
#: The house limit on a function's length (lines of code, docstring excluded).
MAX_FUNCTION_LINES = 80
#: The house limit on a module's length: a reader can hold it. Catalogues of
#: independent items (one rule family per module in ``rules/``) may run longer.
MAX_MODULE_LINES = 1000
CATALOGUES = ("spmdkit.rules.",)
#: A class this long says what it is for in a docstring.
CLASS_DOC_LINES = 50


@pytest.fixture(scope="module")
def files():
    return source_files()


@pytest.fixture(scope="module")
def graph(files):
    return module_graph(files)


def test_the_package_is_found_whole(files):
    for name in ("spmdkit", "spmdkit.propagation", "spmdkit.rules.matmul", "spmdkit.models.gpt"):
        assert name in files


def test_modules_stay_short_except_catalogues(files):
    long = {
        name: n
        for name, path in files.items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
        and not name.startswith(CATALOGUES)
    }
    assert long == {}, f"split these (over {MAX_MODULE_LINES} lines): {long}"


def test_no_import_circles(graph):
    assert find_cycles(graph) == []


def test_imports_point_one_way(graph):
    assert layer_violations(graph) == []


def test_no_package_exports_a_name_that_hides_a_submodule(files):
    assert shadowed_submodules(files) == []


@pytest.mark.slow
def test_no_module_uses_another_modules_private_names(files):
    assert [str(u) for u in private_imports(files)] == []


def test_no_test_uses_private_names(files):
    tests = {
        ".".join(p.relative_to(REPO).with_suffix("").parts): p
        for p in sorted((REPO / "tests").rglob("*.py"))
    }
    assert [str(u) for u in private_imports(tests, known=files)] == []


def _body_lines(node: ast.AST) -> int:
    lines = node.end_lineno - node.lineno + 1
    doc = ast.get_docstring(node, clean=False)
    if doc is not None:
        first = node.body[0]
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_every_module_says_its_job(files):
    missing = [m for m, p in files.items() if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert missing == []


def test_long_classes_say_their_job_and_functions_stay_short(files):
    problems = []
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                long = node.end_lineno - node.lineno + 1 > CLASS_DOC_LINES
                if long and ast.get_docstring(node) is None:
                    problems.append(f"{module}.{node.name}: no docstring")
            elif (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and _body_lines(node) > MAX_FUNCTION_LINES
            ):
                problems.append(f"{module}.{node.name}: {_body_lines(node)} lines")
    assert problems == []


def test_docs_diagram_is_the_codes(graph):
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert mermaid(package_graph(graph)) in doc, "regenerate with `spmdkit deps --mermaid`"


def test_docs_map_is_the_codes(files):
    """docs/architecture.md's map lists every module, one line each, with the first
    sentence of its docstring."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert module_map(files) in doc, "regenerate with `spmdkit deps --map`"


def test_the_map_has_a_line_per_module(files):
    rows = [r for r in module_map(files).splitlines() if r.startswith("| `")]
    assert len(rows) == len(files)
    assert "| `spmdkit/planner/search.py` | The search: " in "\n".join(rows)


def _write(root: pathlib.Path, files: dict[str, str]) -> dict[str, pathlib.Path]:
    out = {}
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        out[".".join(pathlib.Path(rel).with_suffix("").parts).removesuffix(".__init__")] = path
    return out


def test_the_checks_catch_a_lazy_circle_and_private_reach_ins(tmp_path):
    fake = _write(
        tmp_path,
        {
            "spmdkit/__init__.py": '"""x"""\nfrom spmdkit.a import f as b\nfrom spmdkit import d\n',
            "spmdkit/a.py": """\
                '''a'''
                from spmdkit import b
                from spmdkit.b import _hidden
                def f():
                    return b._cache
                """,
            "spmdkit/b.py": """\
                '''b'''
                def g():
                    from spmdkit.a import f  # a lazy import still closes the circle
                    return f
                """,
            "spmdkit/_c.py": "'''c'''\n",
            "spmdkit/d.py": "'''d'''\nimport spmdkit._c\n",
        },
    )
    assert find_cycles(module_graph(fake)) == [["spmdkit.a", "spmdkit.b"]]
    assert shadowed_submodules(fake) == ["spmdkit.b"]
    found = sorted((u.module, u.name) for u in private_imports(fake))
    assert found == [
        ("spmdkit.a", "_cache"),
        ("spmdkit.a", "_hidden"),
        ("spmdkit.d", "spmdkit._c"),
    ]


def test_the_layer_check_catches_an_upward_import():
    graph = {"spmdkit.spec": {"spmdkit.planner.plans"}, "spmdkit.planner.plans": {"spmdkit.spec"}}
    assert layer_violations(graph) == [
        "spmdkit.spec (base) imports spmdkit.planner.plans (planner)"
    ]
    assert stage_of("spmdkit.compile.annotate") == "compile"
    assert stage_of("spmdkit.introspect.model") == "describe"
    assert stage_of("spmdkit.step.fp8") == "step"
    assert stage_of("spmdkit.pipeline.execute") == "base"


# -- the step: the plan reaches it typed, its levers one import from the order -------

#: The most modules following ``train``'s plan into the step may enter (issue 45:
#: it entered 12 when the levers were wired by hand in one hub function).
PLAN_WALK_LIMIT = 7


def _reads_the_plan(path: pathlib.Path) -> bool:
    """The module names the plan's type or reads a step's or a value's ``.plan``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and node.id == "StepPlan":
            return True
        if isinstance(node, ast.Attribute) and node.attr in ("plan", "StepPlan"):
            return True
    return False


def plan_walk(graph, files, start: str = "spmdkit.runtime.train") -> list[str]:
    """The modules of the step stage a reader enters following ``start``'s plan:
    from ``start`` along imports, into step modules that read the plan."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in sorted(graph[todo.pop()]):
            step = stage_of(target) == "step"
            if target not in seen and step and _reads_the_plan(files[target]):
                seen.add(target)
                todo.append(target)
    return sorted(seen)


def test_following_trains_plan_into_the_step_enters_few_modules(graph, files):
    walked = plan_walk(graph, files)
    assert "spmdkit.step.grad" in walked and "spmdkit.step.pipelined" in walked
    assert len(walked) <= PLAN_WALK_LIMIT, walked


def test_every_lever_is_one_import_from_the_order_train_runs(graph):
    from spmdkit.step.grad import ORDER

    levers = {p.apply.__module__ for p in ORDER}
    assert "spmdkit.step.grad" in graph["spmdkit.runtime.train"]
    assert levers - {"spmdkit.step.grad"} <= graph["spmdkit.step.grad"]
    assert {stage_of(m) for m in levers} == {"step"}


def test_the_plan_walk_counts_only_modules_that_read_the_plan(tmp_path):
    fake = _write(
        tmp_path,
        {
            "spmdkit/runtime/train.py": '"""t"""\nfrom spmdkit.step import grad\n',
            "spmdkit/step/grad.py": (
                '"""g"""\nfrom spmdkit.step import a, b\ndef f(s):\n    return s.plan\n'
            ),
            "spmdkit/step/a.py": '"""a"""\nfrom spmdkit.step import c\nStepPlan = None\n',
            "spmdkit/step/b.py": '"""b"""\n',
            "spmdkit/step/c.py": '"""c"""\ndef f(step):\n    return step.plan\n',
        },
    )
    walked = plan_walk(module_graph(fake), fake)
    assert walked == ["spmdkit.step.a", "spmdkit.step.c", "spmdkit.step.grad"]


# -- formatting and docstrings: no squeezing, no measurement logs ---------------------

#: A ``# fmt: skip`` (or ``# fmt: off``) keeps its place only with a reason, on a
#: comment line right above its statement: ``# unformatted: <why>`` (an aligned table).
UNFORMATTED_REASON = "# unformatted:"


def _unformatted_without_reason(path: pathlib.Path) -> list[int]:
    text = path.read_text()
    lines = text.splitlines()
    marked = [
        i + 1 for i, line in enumerate(lines) if "# fmt: skip" in line or "# fmt: off" in line
    ]
    if not marked:
        return []
    statements = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.stmt)]
    bad = []
    for line in marked:
        around = [n for n in statements if n.lineno <= line <= n.end_lineno]
        first = min(
            (
                min([n.lineno, *(d.lineno for d in getattr(n, "decorator_list", ()))])
                for n in around
                if n.end_lineno == max(m.end_lineno for m in around if m.lineno <= line)
            ),
            default=line,
        )
        if not lines[first - 2].strip().startswith(UNFORMATTED_REASON):
            bad.append(line)
    return bad


def test_no_formatter_skip_without_a_reason(files):
    """Modules are held under :data:`MAX_MODULE_LINES` by splitting them, never by
    squeezing lines past the formatter."""
    found = {m: bad for m, p in files.items() if (bad := _unformatted_without_reason(p))}
    assert found == {}, f"remove the `# fmt: skip`, or say why above it ({UNFORMATTED_REASON})"


def test_the_skip_check_wants_a_reason(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "x = [\n    1,  2,\n]  # fmt: skip\n\n# unformatted: aligned\ny = {1:  2}  # fmt: skip\n"
    )
    assert _unformatted_without_reason(path) == [3]


#: A figure with a unit of time, size, share or speed: a measurement, which belongs to
#: ``benchmarks/results`` and commit bodies, not to a module docstring that outlives it.
MEASURED = re.compile(
    r"(?<![\w.])\d[\d,_]*(?:\.\d+)?(?:\s?(?:ms|µs|us|ns|s|sec|seconds|min|minutes|GiB|MiB"
    r"|KiB|GB|MB|KB|TB|%|tok/s|tokens/s|[TGP]FLOP/s|[TGP]FLOPS|[TG]B/s)|[x×](?!\s*\d))(?![\w/])"
)
#: Figures in module docstrings that are not measurements: (file, figure) -> what it is.
NOT_MEASURED = {
    ("benchmarks/calibration.py", "80 GiB"): "an H100's memory, a hardware constant",
    ("benchmarks/planner.py", "80 GiB"): "an H100's memory, a hardware constant",
    ("benchmarks/planner.py", "10 s"): "the planner's time goal",
    ("benchmarks/checkpoint.py", "512 MB"): "the size of the state it saves, a setting",
    ("benchmarks/checkpoint.py", "5 ms"): "its memory sampling interval, a setting",
    ("benchmarks/overhead.py", "3 s"): "the target it reports against",
    ("benchmarks/overhead.py", "2 s"): "the target it reports against",
    ("benchmarks/prediction.py", "10%"): "plan.verify's tolerance",
    ("benchmarks/prediction.py", "20%"): "plan.verify's tolerance",
    ("benchmarks/rules.py", "5 µs"): "the target it reports against",
    ("benchmarks/rules.py", "200 µs"): "the target it reports against",
}


def _measured_figures(path: pathlib.Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    return [m.group(0) for m in MEASURED.finditer(doc)]


def test_no_measured_figures_in_module_docstrings(files):
    paths = [*files.values(), *sorted((REPO / "benchmarks").glob("*.py"))]
    found = []
    for path in paths:
        rel = path.resolve().relative_to(REPO).as_posix()
        found += [f"{rel}: {f!r}" for f in _measured_figures(path) if (rel, f) not in NOT_MEASURED]
    assert found == [], "move measurements to benchmarks/results and commit bodies"


def test_the_figure_check_tells_a_measurement_from_a_shape(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        '"""Took 2.5 s and 1.2 GiB, 3× faster (30%) on a 2 x 4 mesh, 8x7B, 2 × rows."""\n'
    )
    assert _measured_figures(path) == ["2.5 s", "1.2 GiB", "3×", "30%"]


#: Figures (:data:`MEASURED`) in the prose of README.md and the guides, fenced code
#: left out, per page: a ceiling that only goes down. Measurements belong to
#: ``benchmarks/results`` and the generated REPORT; these are what is left to move
#: (some are constants: an H100's 80 GiB, a tolerance). A page not listed has none.
FIGURES_IN_PROSE = {
    "README.md": 6,
    "docs/benchmarks.md": 1,
    "docs/cli.md": 1,
    "docs/context-parallel.md": 20,
    "docs/fp8.md": 13,
    "docs/moe.md": 2,
    "docs/planning.md": 3,
    "docs/recipes.md": 92,  # the calibration table's DeepSeek-V3 row (its auto cell)
    "docs/rules.md": 2,
    "docs/verify.md": 18,
}


def _prose_figures(path: pathlib.Path) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return [m.group(0) for m in MEASURED.finditer(prose)]


def test_guide_prose_gains_no_measured_figures():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    counts = {p.relative_to(REPO).as_posix(): len(_prose_figures(p)) for p in pages}
    over = {p: n for p, n in counts.items() if n > FIGURES_IN_PROSE.get(p, 0)}
    assert over == {}, "move measurements to benchmarks/results (the REPORT links them)"
    stale = {p: n for p, n in counts.items() if n < FIGURES_IN_PROSE.get(p, 0)}
    assert stale == {}, "lower FIGURES_IN_PROSE to these counts"


def test_the_prose_check_skips_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Took 2.5 s.\n\n```python\nx = 3  # 4 GiB\n```\n\nThen 30% less.\n")
    assert _prose_figures(page) == ["2.5 s", "30%"]


# -- collaborators are built whole (STYLE.md 17) -------------------------------------------

#: The packages whose objects get every field from their constructor.
BUILT_WHOLE = ("spmdkit/planner", "spmdkit/engine", "spmdkit/propagation")
#: ``path: target`` assignments allowed from outside an object's own methods, and why.
SET_OUTSIDE = {
    # a jax primitive is declared by setting its attributes (jax's own API)
    "spmdkit/engine/region.py: _forward_p.multiple_results",
    "spmdkit/engine/region.py: _grad_p.multiple_results",
    # the registry stamps a rule with the family it was registered from
    "spmdkit/engine/registry.py: rule.family",
    # the flattened program is an IR that its build and dead-code passes rewrite
    "spmdkit/propagation/graph.py: node.kind",
    "spmdkit/propagation/graph.py: node.subs",
    "spmdkit/propagation/graph.py: g.outs",
    "spmdkit/propagation/graph.py: graph.all_nodes",
    "spmdkit/propagation/graph.py: graph.nodes",
    "spmdkit/propagation/graph.py: graph._vids",
    "spmdkit/propagation/regions.py: graph.nodes",
}


def fields_set_outside(root: pathlib.Path, packages: tuple[str, ...]) -> set[str]:
    """``path: target`` of every attribute assignment (plain, augmented, annotated,
    unpacked) whose object is not ``self`` or ``cls``, in ``packages`` under ``root``."""
    found = set()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign):
                    targets = list(node.targets)
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                else:
                    continue
                while targets:
                    t = targets.pop()
                    if isinstance(t, ast.Tuple | ast.List | ast.Starred):
                        targets += t.elts if not isinstance(t, ast.Starred) else [t.value]
                    elif isinstance(t, ast.Attribute) and not (
                        isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")
                    ):
                        found.add(f"{path.relative_to(root).as_posix()}: {ast.unparse(t)}")
    return found


def test_no_planner_engine_or_propagation_field_is_set_from_outside():
    """A planner, engine or propagation object gets its fields when built
    (``planner_for``, ``Propagator(..., GraphFacts)``), never set by whoever built it;
    :data:`SET_OUTSIDE` lists the exceptions, each still present."""
    found = fields_set_outside(REPO, BUILT_WHOLE)
    assert sorted(found - SET_OUTSIDE) == []
    assert sorted(SET_OUTSIDE - found) == []  # a fixed exception leaves the list


def test_the_field_check_catches_a_collaborator_set_after_building(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        textwrap.dedent(
            """
            class A:
                def __init__(self):
                    self.x = 1
            def build():
                a = A()
                a.x, (a.y, b) = 2, (3, 4)
                a.engine.z += 1
                return a
            """
        )
    )
    assert fields_set_outside(tmp_path, ("pkg",)) == {
        "pkg/m.py: a.x",
        "pkg/m.py: a.y",
        "pkg/m.py: a.engine.z",
    }


def _declared(cls: ast.ClassDef) -> set[str]:
    """What a class declares for itself: its methods, fields and class attributes
    (annotated or assigned in its body), its ``__slots__``, and what its methods
    assign to ``self``."""
    out = set()
    for n in cls.body:
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    out.add(t.id)
                    if t.id == "__slots__":
                        out |= {c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant)}
    for n in ast.walk(cls):
        stored = isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        if stored and isinstance(n.value, ast.Name) and n.value.id == "self":
            out.add(n.attr)
    return out


def undeclared_reads(root: pathlib.Path, packages: tuple[str, ...]) -> set[str]:
    """``path: Class.name`` of every ``self.name`` a class without bases reads but
    never declares (:func:`_declared`): a mixin reading its host's fields."""
    found = set()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for cls in ast.walk(ast.parse(path.read_text())):
                if not isinstance(cls, ast.ClassDef) or cls.bases:
                    continue
                declared = _declared(cls)
                for n in ast.walk(cls):
                    if (
                        isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name)
                        and n.value.id == "self"
                        and n.attr not in declared
                        and not n.attr.startswith("__")
                    ):
                        found.add(f"{path.relative_to(root).as_posix()}: {cls.name}.{n.attr}")
    return found


def test_no_class_reads_fields_it_does_not_declare():
    """The planner's collaborators (the pipeline and expert-mesh planners) read what
    they are built with (a :class:`~spmdkit.planner.problem.Problem`), never a
    host's fields as a mixin would."""
    assert sorted(undeclared_reads(REPO, ("spmdkit",))) == []


def test_the_declared_check_catches_a_mixin(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass
            class Mixin:
                budget: float
                def fits(self, c):
                    return c.bytes <= self.budget and self.mesh and self.at(c)
            @dataclass
            class Built:
                budget: float
                def fits(self, c):
                    self.seen = c
                    return c.bytes <= self.budget and self.seen
            """
        )
    )
    assert undeclared_reads(tmp_path, ("pkg",)) == {"pkg/m.py: Mixin.at", "pkg/m.py: Mixin.mesh"}


#: ``sk.plan``'s body (docstring excluded) stays a page: the options are values
#: (``CostModel``, ``SearchOptions``) and each mode a call.
MAX_PLAN_BODY_LINES = 40


def test_plan_body_stays_short():
    tree = ast.parse((REPO / "spmdkit/planner/search.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "plan"]
    first = fn.body[1] if ast.get_docstring(fn) is not None else fn.body[0]
    assert fn.end_lineno - first.lineno + 1 <= MAX_PLAN_BODY_LINES

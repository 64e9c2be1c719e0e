"""mkdocs hooks (``mkdocs.yml``'s ``hooks:``): the pages the site builds from files
outside ``docs/``.

- ``index.md`` is README.md, its links rewritten for the site;
- ``api/*.md``: one page per public package, rendered from the docstrings by
  mkdocstrings (:data:`API`);
- ``notebooks/*.ipynb``: the notebooks with their outputs, rendered by mkdocs-jupyter.
  The executed copies ``tests/test_notebooks.py`` keeps (``SPMDKIT_EXECUTED_NOTEBOOKS``,
  default ``build/notebooks``) are used when they were made from the committed
  notebook as it is; otherwise the notebook is executed here (``notebooks/_build.py``);
- repository files the pages link to outside ``docs/`` (``benchmarks/results/REPORT.md``
  and its plots) are copied under ``repo/``, and the links rewritten to them.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: API page -> (title, what it documents, the modules rendered on it).
API: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "api/spmdkit.md": (
        "spmdkit",
        "The names `import spmdkit as sk` gives (re-exported from the packages below).",
        ("spmdkit",),
    ),
    "api/engine.md": (
        "Rules and inference",
        "Factor notation, rules, the registry and inference ([rules.md](../rules.md)).",
        (
            "spmdkit.engine.factor",
            "spmdkit.engine.rule",
            "spmdkit.engine.factor_rule",
            "spmdkit.engine.registry",
            "spmdkit.engine.inference",
        ),
    ),
    "api/spec.md": (
        "Specs, meshes, topology",
        "The vocabulary every stage shares.",
        ("spmdkit.spec", "spmdkit.mesh", "spmdkit.topology", "spmdkit.errors"),
    ),
    "api/resharding.md": (
        "Resharding",
        "Reshard plans and their executor.",
        ("spmdkit.resharding",),
    ),
    "api/propagation.md": (
        "Propagation",
        "Specs through a traced step.",
        ("spmdkit.propagation",),
    ),
    "api/planner.md": (
        "Planner",
        "Logical rules, presets, plans and the search ([planning.md](../planning.md)).",
        (
            "spmdkit.planner.logical",
            "spmdkit.planner.plans",
            "spmdkit.planner.notes",
            "spmdkit.planner.search",
            "spmdkit.planner.context_parallel",
        ),
    ),
    "api/recipe.md": (
        "Recipes",
        "Recompute, compute dtype, micro-batches, offload ([recipes.md](../recipes.md)).",
        ("spmdkit.step", "spmdkit.step.recipe", "spmdkit.step.grad", "spmdkit.step.passes"),
    ),
    "api/pipeline.md": (
        "Pipelines",
        "Pipeline parallelism ([pipelines.md](../pipelines.md)).",
        ("spmdkit.pipeline",),
    ),
    "api/compile.md": ("Compile", "`sk.jit` and parameters born sharded.", ("spmdkit.compile",)),
    "api/verification.md": (
        "Verification",
        "Compiled collectives and memory against the plan ([verify.md](../verify.md)).",
        ("spmdkit.verification",),
    ),
    "api/runtime.md": (
        "Training, checkpoints, data",
        "The run-time packages ([training.md](../training.md)).",
        (
            "spmdkit.runtime.train",
            "spmdkit.runtime.checkpoint",
            "spmdkit.runtime.data",
            "spmdkit.runtime.export",
            "spmdkit.runtime.launch",
        ),
    ),
    "api/ops.md": (
        "Ops and modules",
        "Rule-enforcing ops and flax modules.",
        ("spmdkit.ops", "spmdkit.nn"),
    ),
    "api/introspect.md": (
        "Describing models",
        "Reading NNX and linen models abstractly (`sk.describe`).",
        ("spmdkit.introspect",),
    ),
    "api/testing.md": (
        "Testing rules",
        "The rule-validation toolkit ([writing-rules.md](../writing-rules.md)).",
        ("spmdkit.testing",),
    ),
}

#: Where the executed notebooks are staged for the build (removed at exit).
_STAGING = tempfile.TemporaryDirectory(prefix="spmdkit-docs-")

LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def _load_notebook_builder() -> Any:
    spec = importlib.util.spec_from_file_location(
        "notebooks_build", ROOT / "notebooks" / "_build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _executed_notebooks() -> dict[str, pathlib.Path]:
    """Each notebook's executed copy, executing those with none current."""
    build = _load_notebook_builder()
    keep = pathlib.Path(os.environ.get("SPMDKIT_EXECUTED_NOTEBOOKS", ROOT / "build" / "notebooks"))
    out = {}
    for name in build.NOTEBOOKS:
        path = build.executed_copy(name, keep)
        if path is None:
            with tempfile.TemporaryDirectory() as work:
                build.execute(name, pathlib.Path(work), keep=keep)
            path = keep / f"{name}.ipynb"
        out[name] = path
    return out


def _outside_targets(text: str, base: pathlib.Path) -> set[pathlib.Path]:
    """Repository files outside docs/ that ``text`` (a page in ``base``) links to."""
    found = set()
    for m in LINK.finditer(text):
        target = (base / m.group(2)).resolve()
        if target.is_file() and DOCS not in target.parents and ROOT in target.parents:
            found.add(target)
    return found


def _site_path(target: pathlib.Path) -> str:
    """Where a linked repository file lies in the site, relative to docs/."""
    if DOCS in target.parents:
        return target.relative_to(DOCS).as_posix()
    if target.parent == ROOT / "notebooks" and target.suffix == ".ipynb":
        return f"notebooks/{target.name}"
    if target == ROOT / "README.md":
        return "index.md"
    return f"repo/{target.relative_to(ROOT).as_posix()}"


def _rewrite(text: str, base: pathlib.Path, page_dir: str) -> str:
    """Links of a page in ``base`` (a repository folder) as the site's page in
    ``page_dir`` (relative to docs/) must spell them."""

    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-z]+:", target):
            return m.group(0)
        path = (base / target).resolve()
        if path == ROOT / "notebooks":
            path = ROOT / "notebooks" / "layout_explorer.ipynb"
        if not path.exists() or (path.parent == DOCS and base == DOCS):
            return m.group(0)
        rel = os.path.relpath(_site_path(path), page_dir or ".")
        return f"{m.group(1)}{pathlib.PurePath(rel).as_posix()}{m.group(3) or ''}{m.group(4)}"

    return LINK.sub(fix, text)


@event_priority(100)  # before mkdocs-jupyter's on_files, which makes notebooks pages
def on_files(files: Files, config: Any) -> Files:
    """Add the home page, the API pages, the notebooks and linked repository files."""
    readme = (ROOT / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=_rewrite(readme, ROOT, "")))
    for page, (title, about, modules) in API.items():
        body = "\n\n".join(f"::: {m}" for m in modules)
        files.append(File.generated(config, page, content=f"# {title}\n\n{about}\n\n{body}\n"))
    # mkdocs-jupyter wraps plain files only (not File.generated): stage the executed
    # notebooks as docs/notebooks/ would hold them
    staging = pathlib.Path(_STAGING.name)
    (staging / "notebooks").mkdir(exist_ok=True)
    for name, path in _executed_notebooks().items():
        shutil.copyfile(path, staging / "notebooks" / f"{name}.ipynb")
        files.append(
            File(
                f"notebooks/{name}.ipynb",
                str(staging),
                config["site_dir"],
                config["use_directory_urls"],
            )
        )
    targets: set[pathlib.Path] = set()
    for md in DOCS.glob("*.md"):
        targets |= _outside_targets(md.read_text(), DOCS)
    for target in sorted(targets):
        if target.suffix == ".md":  # its images too
            targets_of = _outside_targets(target.read_text(), target.parent)
            for extra in sorted(targets_of | {target}):
                files.append(File.generated(config, _site_path(extra), abs_src_path=str(extra)))
        else:
            files.append(File.generated(config, _site_path(target), abs_src_path=str(target)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite a docs page's links that leave docs/ to the copies under ``repo/``."""
    src = page.file.abs_src_path
    if src is None or pathlib.Path(src).parent != DOCS:
        return markdown
    return _rewrite(markdown, DOCS, "")

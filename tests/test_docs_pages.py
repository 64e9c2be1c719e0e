"""README.md and docs/ agree with the repository: what they list, link and count.

The examples themselves run in tests/test_readme.py; names in tests/test_names.py.
These checks read files only (well under a second).
"""

from __future__ import annotations

import pathlib
import re

import pytest

from spmdkit.engine.rule import POLICIES

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

#: README's first lines: the two commands that work on a fresh machine.
COMMANDS = (
    "```bash",
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" '
    "&& python -m spmdkit demo",
    ". .venv/bin/activate && python -m pytest",
    "```",
)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _table_column(text: str, heading: str, column: int = 0) -> list[str]:
    """The cells of one column of the first table under ``heading``."""
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append(line.strip("|").split("|")[column].strip())
    return rows[1:]  # the header row


def _slug(heading: str) -> str:
    """A heading's anchor as mkdocs spells it (lower case, punctuation out, runs of
    spaces and dashes to one dash; GitHub agrees where a heading has no such run)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text)


def test_readme_starts_with_the_two_commands_and_stays_short():
    lines = README.read_text().splitlines()
    assert lines[0] == "# spmdkit"
    assert tuple(lines[2:6]) == COMMANDS
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; its limit is 250"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npython -m pytest\n" in ci, ".ci/run no longer runs README's test command"


def test_the_partial_algebra_table_names_every_policy():
    cells = _table_column((DOCS / "rules.md").read_text(), "## The partial algebra")
    named = {name.strip() for cell in cells for name in cell.split("/")}
    assert named == set(POLICIES)


def test_the_benchmarks_page_lists_every_script():
    cells = _table_column((DOCS / "benchmarks.md").read_text(), "# Benchmarks")
    listed = {c.strip("`") for c in cells}
    scripts = {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")}
    assert listed == scripts


def test_the_readme_maps_every_docs_page():
    text = README.read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"](docs/{page.name})" in text, f"README.md's map lacks docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text()
    for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.name}: no #{anchor}"


def test_the_api_reference_covers_every_package():
    """docs/_hooks.py's API pages render each of spmdkit's packages (the package or
    modules of it; the command line is documented in docs/cli.md)."""
    source = (DOCS / "_hooks.py").read_text()
    rendered = set(re.findall(r'"(spmdkit(?:\.\w+)*)"', source))
    for init in sorted((ROOT / "spmdkit").glob("*/__init__.py")):
        package = f"spmdkit.{init.parent.name}"
        if package != "spmdkit.cli":
            assert any(m == package or m.startswith(f"{package}.") for m in rendered), package


def test_slugs_follow_the_renderers():
    assert _slug("Teaching the planner a primitive: `register_primitive`") == (
        "teaching-the-planner-a-primitive-register_primitive"
    )
    assert _slug("Specs, rules and the partial algebra") == "specs-rules-and-the-partial-algebra"

"""docs/install.md's shell blocks name real extras, commands and dependencies.

The blocks install packages, so the suite does not run them (like README's shell
blocks); it checks what they name against pyproject.toml and the command line,
so that a renamed extra or a new dependency cannot leave the guide behind.
``spmdkit doctor`` itself runs in tests/cli/test_doctor.py.
"""

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from spmdkit.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "install.md"


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _commands() -> list[list[str]]:
    """Every command of the guide's ```bash blocks, split into words, comments dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    out = []
    for block in blocks:
        for line in block.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words: list[str] = []
            for token in [*lexer, "&&"]:
                if token in ("&&", "|"):
                    if words:
                        out.append(words)
                    words = []
                else:
                    words.append(token)
    return out


def test_every_block_is_a_known_command():
    known = {"python3", "pip", "spmdkit", "grep", "."}
    assert {words[0] for words in _commands()} <= known


def test_spmdkit_commands_exist():
    names = {cmd.name for cmd in COMMANDS}
    used = {words[1] for words in _commands() if words[0] == "spmdkit"}
    assert used == {"doctor"}
    assert used <= names


def test_extras_exist(project):
    extras = set(project["optional-dependencies"])
    named = set(re.findall(r'"\.\[(\w+)\]"', GUIDE.read_text()))
    assert named == {"test", "cuda12", "cuda13"}
    assert named <= extras


def test_preinstalled_jax_recipe_installs_every_other_dependency(project):
    (pinned,) = [w for w in _commands() if w[:3] == ["pip", "install", "-c"]]
    wanted = [d for d in project["dependencies"] if not d.startswith("jax")]
    assert sorted(pinned[4:]) == sorted(wanted)
    assert ["pip", "install", "-e", ".", "--no-deps"] in _commands()


def test_readme_links_the_guide():
    readme = (REPO / "README.md").read_text()
    assert "docs/install.md" in readme
    # what has run on GPUs, said plainly: one device, no multi-GPU run
    assert "One GPU has run spmdkit so far" in readme and "no multi-GPU run yet" in readme

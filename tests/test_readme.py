"""The Python examples of README.md and of every docs/ page run as written and print
what the page says.

Per page, every ```python block runs in order in one fresh process on 8 virtual CPU
devices (later blocks use earlier names, as a reader pasting them would). The
``# ...`` comment lines right under a ``print`` are its expected output; a line
``# ...`` alone stands for any number of lines (a long table shortened).

A block that cannot run on 8 CPU devices starts with a line ``# requires: gpu``
(an NVIDIA GPU) or ``# requires: hosts`` (several processes or machines): the
reader sees why, and the test leaves it out. Any other ``# requires:`` is an
error, so a typo cannot skip a block.

The printed figures are compared within :data:`FIGURE_RTOL` of each other, the
rest of a line exactly: the memory estimates of a verify table differ in their last
digits between jax versions (the traced programs differ a little).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
WILDCARD = "..."
#: How far a printed figure may be from the page's, relatively (jax versions).
FIGURE_RTOL = 0.03
_FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?")
#: What a block may require instead of 8 CPU devices (its first line says which).
REQUIREMENTS = ("gpu", "hosts")
REQUIRES = re.compile(r"\A# requires: *(\S*)")


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def requirement(block: str) -> str | None:
    """What a block needs beyond 8 CPU devices (its ``# requires:`` line), or None."""
    m = REQUIRES.match(block)
    if m is None:
        return None
    assert m.group(1) in REQUIREMENTS, f"unknown requirement {m.group(1)!r} in:\n{block}"
    return m.group(1)


def runnable_blocks(page: pathlib.Path) -> list[str]:
    """The page's python blocks that run on 8 CPU devices, in order."""
    return [b for b in python_blocks(page.read_text()) if requirement(b) is None]


def expected_output(block: str) -> list[str]:
    """The comment lines under each ``print(...)`` statement of a block."""
    out: list[str] = []
    depth, after_print = 0, False
    for line in block.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and depth == 0:
            if after_print:
                out.append(stripped[2:] if stripped.startswith("# ") else stripped[1:])
            continue
        code = line.split("  #", 1)[0]
        if depth == 0:
            after_print = "print(" in code
        depth += code.count("(") + code.count("[") - code.count(")") - code.count("]")
    return out


def matches(actual: list[str], expected: list[str]) -> bool:
    """``actual == expected``, where a :data:`WILDCARD` line matches any run of lines."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() == WILDCARD:
        return any(matches(actual[i:], rest) for i in range(len(actual) + 1))
    return bool(actual) and same_line(actual[0], head) and matches(actual[1:], rest)


def same_line(actual: str, expected: str) -> bool:
    """The two lines read alike: their text outside figures equal, each figure
    within :data:`FIGURE_RTOL` of the page's."""
    got, want = actual.rstrip(), expected.rstrip()
    if _FIGURE.sub("#", got) != _FIGURE.sub("#", want):
        return False
    pairs = zip(_FIGURE.findall(got), _FIGURE.findall(want), strict=True)
    return all(
        abs(float(a.replace(",", "")) - float(b.replace(",", "")))
        <= FIGURE_RTOL * abs(float(b.replace(",", "")))
        for a, b in pairs
    )


def test_expected_output_reads_prints_only():
    block = "x = f(\n    1,\n)  # not output\n# a remark, not output\nprint(x)\n# 1\n"
    assert expected_output(block) == ["1"]
    assert matches(["a", "b", "c", "d"], ["a", "...", "d"])
    assert not matches(["a", "b"], ["a", "c"])
    # figures within 3% (jax versions), the words exact
    assert matches(["peak 650.1 KiB - 820.9 KiB  ok"], ["peak 650.1 KiB - 821.9 KiB  ok"])
    assert not matches(["peak 650.1 KiB - 780.9 KiB  ok"], ["peak 650.1 KiB - 821.9 KiB  ok"])
    assert not matches(["peak 650.1 MiB"], ["peak 650.1 KiB"])
    assert matches(["loss 1,297 tok/s"], ["loss 1,300 tok/s"])


def test_requirements_are_read_from_the_first_line():
    assert requirement("# requires: gpu\nx = 1\n") == "gpu"
    assert requirement("x = 1\n# requires: gpu\n") is None
    with pytest.raises(AssertionError, match="unknown requirement"):
        requirement("# requires: tpu\n")


def test_every_block_states_a_known_requirement_or_none():
    for page in PAGES:
        for block in python_blocks(page.read_text()):
            requirement(block)
    assert runnable_blocks(README), "README.md lost its example"


#: A plan on the pages' 8 virtual CPU devices is priced on this host's CPU topology
#: (``Topology.cpu``: the devices share the cores this process may run on), so what
#: a page prints (an estimated step, auto's choice) depends on the host's cores. The
#: pages print what CI's 2-core machine prints: each page's process runs on that many
#: of the host's cores (a host with fewer prints other figures).
PAGE_CORES = 2

#: Runs the page's script (``argv[1]``) on the first :data:`PAGE_CORES` cores.
_ON_PAGE_CORES = (
    "import os, runpy, sys\n"
    "if hasattr(os, 'sched_setaffinity'):\n"
    f"    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:{PAGE_CORES}])\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [p for p in PAGES if runnable_blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_examples_print_what_the_page_says(page, tmp_path):
    blocks = runnable_blocks(page)
    script = tmp_path / "page.py"
    script.write_text("\n".join(blocks))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # a page's own process starts JAX afresh: 8 devices, and the suite's codegen level
    # (tests/conftest.py: LLVM -O0, half XLA:CPU's compile time, the same HLO, so the
    # same collectives, bytes and memory the pages print)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    # this checkout's spmdkit, whichever one the interpreter has installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", _ON_PAGE_CORES, str(script)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    actual = run.stdout.splitlines()
    expected = [line for b in blocks for line in expected_output(b)]
    assert matches(actual, expected), "\n".join(["--- expected", *expected, "--- printed", *actual])

"""README.md's Python examples run as written and print what the README says.

Every ```python block runs in order in one fresh process (later blocks use
earlier names, as a reader pasting them would). The ``# ...`` comment lines right
under a ``print`` are its expected output; a line ``# ...`` alone stands for any
number of lines (a long table shortened).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
WILDCARD = "..."


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


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
    return bool(actual) and actual[0].rstrip() == head.rstrip() and matches(actual[1:], rest)


def test_expected_output_reads_prints_only():
    block = "x = f(\n    1,\n)  # not output\n# a remark, not output\nprint(x)\n# 1\n"
    assert expected_output(block) == ["1"]
    assert matches(["a", "b", "c", "d"], ["a", "...", "d"])
    assert not matches(["a", "b"], ["a", "c"])


@pytest.mark.slow
def test_readme_examples_print_what_the_readme_says(tmp_path):
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 6
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    run = subprocess.run(
        [sys.executable, str(script)],
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

"""The tested range: one table (spmdkit/versions.py) that pyproject.toml states too."""

import re
import tomllib
from pathlib import Path

import pytest

from spmdkit import versions
from spmdkit.versions import TESTED, TestedRange, VersionCheck

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.fixture(scope="module")
def project():
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _minimums(requirements):
    """``{"jax": "0.10.2", ...}`` from ``["jax>=0.10.2", ...]`` (extras dropped)."""
    out = {}
    for req in requirements:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?>=([0-9.]+)", req)
        assert found, f"pyproject requirement {req!r} is not NAME>=MINIMUM"
        out[found.group(1)] = found.group(3)
    return out


def test_pyproject_states_the_tables_range(project):
    text = PYPROJECT.read_text()
    assert versions.range_line() in text.splitlines(), "update pyproject's # Tested: line"
    assert project["requires-python"] == f">={versions.check('python').tested.minimum}"
    listed = sorted(
        c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if re.search(r":: 3\.\d+$", c)
    )
    assert listed == versions.python_minors()
    # every tested dependency's minimum is pyproject's, and the reverse
    tested = {row.dist: row.minimum for row in TESTED if row.dist not in ("python", "jaxlib")}
    direct = _minimums(project["dependencies"])
    assert {d: direct[d] for d in tested} == tested
    # the CUDA extras ask for the same jax
    extras = project["optional-dependencies"]
    for name in ("cuda12", "cuda13"):
        assert _minimums(extras[name]) == {"jax": tested["jax"]}


def test_jaxlib_range_is_jaxs():
    rows = {row.dist: row for row in TESTED}
    assert (rows["jaxlib"].minimum, rows["jaxlib"].below) == (
        rows["jax"].minimum,
        rows["jax"].below,
    )


def test_range_bounds():
    jax_range = TestedRange("jax", "0.10.2", "0.13")
    assert jax_range.contains("0.10.2")
    assert jax_range.contains("0.12.0.1")
    assert not jax_range.contains("0.10.1")
    assert not jax_range.contains("0.13.0")
    assert not jax_range.contains("0.13.0.dev20260101")  # a pre-release of 0.13 is 0.13
    assert TestedRange("flax", "0.12.8").contains("9.0")
    assert str(jax_range) == ">=0.10.2,<0.13"
    with pytest.raises(ValueError, match="not above"):
        TestedRange("jax", "0.13", "0.13")
    with pytest.raises(ValueError, match="not a version"):
        versions.parse_version("dev")


def test_advice_names_the_package_and_the_fix():
    jax_range = TestedRange("jax", "0.10.2", "0.13")
    assert VersionCheck("jax", "0.12.0", jax_range).advice() == ""
    too_new = VersionCheck("jax", "0.13.1", jax_range).advice()
    assert too_new.startswith("jax 0.13.1 is outside the tested range >=0.10.2,<0.13")
    assert 'pip install "jax>=0.10.2,<0.13"' in too_new
    missing = VersionCheck("chex", None, TestedRange("chex", "0.1.90")).advice()
    assert missing == 'chex is not installed: pip install "chex>=0.1.90"'
    old_python = VersionCheck("python", "3.10.4", TestedRange("python", "3.11", "3.14"))
    assert "Python 3.11 or 3.12 or 3.13" in old_python.advice()


def test_installed_versions_are_read(monkeypatch):
    assert versions.installed_version("no-such-distribution") is None
    assert versions.installed_version("jax") is not None
    monkeypatch.setattr(versions, "installed_version", lambda dist: "0.13.1")
    assert not versions.check("jax").ok
    assert [c.dist for c in versions.check_all()] == [row.dist for row in TESTED]


def test_plugins_must_be_jaxlibs_release():
    plugins = {"jax-cuda13-pjrt": "0.11.2", "jax-cuda13-plugin": "0.11.1"}
    assert versions.plugin_advice(plugins, "0.11.2") == {
        "jax-cuda13-plugin": (
            'jax-cuda13-plugin 0.11.1 is not jaxlib 0.11.2: pip install "jax-cuda13-plugin==0.11.2"'
        )
    }
    assert versions.plugin_advice(plugins, None) == {}
    # this environment's plugins (none on a CPU machine) are all jaxlib's
    installed = versions.accelerator_plugins()
    assert versions.plugin_advice(installed, versions.installed_version("jaxlib")) == {}


def test_cse_through_barriers_is_what_the_installed_xla_cpu_compiles():
    """The gate the prediction reads, against the compiled program: one
    all-gather where XLA:CPU merges ``all_gather(x)`` with
    ``all_gather(optimization_barrier(x))``, two where it keeps them apart."""
    import jax
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("c",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x):
        a = jax.lax.all_gather(x, "c", tiled=True)
        b = jax.lax.all_gather(jax.lax.optimization_barrier(x), "c", tiled=True)
        return a[:2] + 2 * b[:2]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("c"), out_specs=P("c")))
    hlo = f.lower(jax.ShapeDtypeStruct((16,), "float32")).compile().as_text()
    gathers = len(re.findall(r"= \S+ all-gather(?:-start)?\(", hlo))
    assert gathers == (1 if versions.cse_merges_through_barriers("cpu") else 2), hlo
    assert not versions.cse_merges_through_barriers("gpu")
    assert versions.cse_merges_through_barriers("cpu", "0.10.2")
    assert not versions.cse_merges_through_barriers("cpu", "0.11.0")


def test_cpu_float8_held_as_is_the_dtype_the_installed_xla_cpu_runs_dots_in():
    """The gate held_on_cpu reads, against the compiled program: a bf16 matmul
    whose left operand contracts its last dim runs in float32 (operands
    converted) where the gate says float32, natively in 16 bits where it says
    float16."""
    import jax

    bf16 = jax.ShapeDtypeStruct((64, 32), "bfloat16"), jax.ShapeDtypeStruct((32, 48), "bfloat16")
    hlo = jax.jit(lambda a, b: a @ b).lower(*bf16).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    widened = bool(re.search(r"= f32\[64,48\]", entry))
    assert widened == (versions.cpu_float8_held_as() == "float32"), entry
    assert versions.cpu_float8_held_as("0.10.2") == "float32"
    assert versions.cpu_float8_held_as("0.11.0") == "float16"

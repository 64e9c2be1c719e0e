"""``python -m spmdkit demo`` in a fresh process: it picks its own devices and passes."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# a fresh process that compiles the demo's model: left out of ``--quick``
pytestmark = pytest.mark.heavy


def _clean_env() -> dict[str, str]:
    # conftest.py sets these for the test process; the demo must set up its devices
    # itself. Only the suite's codegen level is kept (LLVM -O0: half XLA:CPU's compile
    # time, the same HLO, so the same collectives and bytes the demo prints)
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    kept = [f for f in env.pop("XLA_FLAGS", "").split() if "xla_backend_optimization_level" in f]
    if kept:
        env["XLA_FLAGS"] = " ".join(kept)
    return env


def _run(cmd: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    res = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=_clean_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return res, time.perf_counter() - t0


@pytest.mark.slow
def test_demo_runs_and_its_checks_pass(tmp_path):
    """The README's first command end to end (about 30 s in a fresh process). Slow step:
    each of its parts (rule inference, reshards against the compiled HLO, plan, train,
    checkpoint and restore onto another mesh and plan) has its own tests in the
    default run; this checks the demo's own text and that they compose."""
    res, _ = _run([sys.executable, "-m", "spmdkit", "demo", "--cpu"], tmp_path)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert out.startswith("spmdkit demo: mesh data=2 x model=4 on 8 virtual CPU devices")
    # part 1: rule inference
    assert "matmul forward: f32[64@data,256@model], f32[256@model,128] -> " in out
    assert "-> f32[64@data,128]{sum:model}" in out
    assert "f32[256@model,128]{sum:data}" in out  # dW of the grad
    assert "all_gather(model) dim1" in out  # softmax gathers its axis
    assert (
        "slice(model) dim0 4\N{MULTIPLICATION SIGN}: local" in out
    )  # the broadcast bias is sliced
    # part 2: real arrays, plan next to the compiled HLO
    assert "reduce_scatter[sum](model) dim1 4\N{MULTIPLICATION SIGN}: 16.0 KiB" in out
    assert "reduce_scatter[sum] f32[32,32] 4\N{MULTIPLICATION SIGN}: 16384 B" in out
    # part 3: plan, train, checkpoint, restore on another mesh and plan, continue
    assert "Plan 'megatron' on mesh data=2" in out
    assert "restored step 3 onto data=4 x model=2 (fsdp), steps 4..6" in out
    assert "losses after the restore match the uninterrupted run (rtol 1e-4): ok" in out
    assert "all_gather f32[64,128] 4\N{MULTIPLICATION SIGN}: 32768 B" in out
    assert out.count("compiled collectives match the plan (kind, group, bytes): ok") == 2
    assert out.count("values equal numpy x @ w: ok") == 2
    assert "FAILED" not in out
    assert out.rstrip().splitlines()[-1].startswith("demo OK: ")


@pytest.mark.slow
def test_console_script_is_installed_and_dispatches(tmp_path):
    """The ``spmdkit`` entry point runs a command (the demo itself is run above, through
    ``python -m spmdkit``; both go through the same ``spmdkit.cli.app``)."""
    script = Path(sys.executable).parent / "spmdkit"
    if not script.exists():
        script = shutil.which("spmdkit")
    if script is None:
        pytest.skip("the spmdkit console script is not installed in this environment")
    res, _ = _run([str(script), "rules", "matmul"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "matmul" in res.stdout
    res, _ = _run([str(script), "demo", "--help"], tmp_path)
    assert res.returncode == 0 and "--cpu" in res.stdout, res.stdout + res.stderr

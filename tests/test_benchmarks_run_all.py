"""benchmarks/run_all.py regenerates the report from JSON; benchmarks/overhead.py runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# fresh processes that run the benchmark scripts: left out of ``--quick``
pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

SECTIONS = [
    "## Rule inference latency",
    "## Ops: bytes and memory vs XLA's own propagation",
    "## Propagation and planner time vs model and mesh size",
    "## Plan quality: auto vs presets",
    "## Prediction accuracy: predicted vs compiled",
    "## Measured beside predicted: step time and peak memory",
    "## Checkpoint throughput vs raw orbax and the disk",
    "## Runtime overhead: sk.jit vs jax.jit",
    "### GPU",
]


def _run_all_no_run(*args: str) -> subprocess.CompletedProcess:
    """``benchmarks/run_all.py --no-run`` with extra arguments (report only)."""
    return subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--no-run", *args],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_no_run_regenerates_every_section(tmp_path):
    proc = _run_all_no_run("--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "REPORT.md").read_text()
    for title in SECTIONS:
        assert title in report, title
    assert "Could not render" not in report
    assert "| sk.jit ms |" in report
    assert "| memory predicted KiB |" in report  # prediction accuracy, per case
    assert "Not run" in report  # no GPU JSON committed
    assert list(tmp_path.glob("*.png")), "no plots written"
    # --no-run leaves the committed results untouched
    assert not (tmp_path / "overhead.json").exists()


def test_no_run_reports_missing_json(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _run_all_no_run("--results", str(empty))
    assert proc.returncode == 0, proc.stderr
    report = (empty / "REPORT.md").read_text()
    assert report.count("the JSON is missing") >= 4


# CI's slow step leaves this out (SPMDKIT_FULL_SWEEP=1 runs it): overhead.py's quick run (a smoke
# of every section); measure.py's quick run likewise
@pytest.mark.full
@pytest.mark.slow
def test_overhead_quick_run(tmp_path):
    """benchmarks/overhead.py end to end in a fresh process (about 95 CPU s). Slow
    step: sk.jit's steps and losses are the default run's tests; this checks the
    script. Auto vs the presets is skipped: it compiles every preset's train step
    of each reference model (about 100 CPU s more for gpt tiny alone)."""
    out = tmp_path / "overhead.json"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "overhead.py"),
            "--quick",
            "--models",
            "gpt",
            "--iters",
            "2",
            "--startup-models",
            "convnet",
            "--compile-configs",
            "tiny",
            "--skip-auto",
            "--out",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    assert d["meta"]["devices"] == 8
    (row,) = d["rows"]
    assert row["model"] == "gpt" and row["iters"] == 2
    assert row["same_loss"]
    assert row["ratio_median"] > 0 and row["first_ratio"] > 0
    assert row["skjit_step_ms"] > 0 and row["jaxjit_step_ms"] > 0
    (start,) = d["startup"]  # the three start-up ratios of issue 35
    assert start["model"] == "convnet" and start["params"] < 10_000_000
    assert start["init_ratio"] > 0 and start["first_call_ratio"] > 0 and start["auto_s"] > 0
    assert "worst ratios (target): init" in proc.stdout
    (first,) = d["first_compile"]  # issue 43: sk.jit's first call vs jax.jit's
    assert (first["model"], first["config"]) == ("gpt", "tiny")
    assert first["ratio"] > 0 and first["cpu_ratio"] > 0 and first["skjit_first_s"] > 0
    assert "first compile, worst ratio" in proc.stdout
    assert d["auto_vs_presets"] is None  # --skip-auto
    cli = d["cli"]  # bad command lines, each timed in a fresh process
    assert len(cli["cases"]) == 3 and all(t > 0 for t in cli["cases"].values())
    assert cli["import_spmdkit_s"] > 0 and "fresh process: spmdkit train" in proc.stdout

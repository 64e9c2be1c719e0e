"""How long rule inference takes: median µs per call, cached and uncached.

One row per (op, kind) for the four rule families (elementwise: ``add`` with a
broadcast bias and ``exp`` of a sum-partial input; matmul: ``matmul`` 3-D x 2-D
and a batched ``dot_general``; reduction: ``reduce_sum`` and ``reduce_mean``;
``softmax``) and the three inferences (forward, backward, grad), on an abstract
``data=2, model=4`` mesh with transformer-sized activations (8, 1024, 4096).
Most cases are chosen so that some argument must move, which exercises the
reshard planner too.

* **cached**: the same call repeated; the result comes from the inference cache.
  Measured in batches of calls (median over batches of the mean per call) so
  that the clock's own cost does not dominate a few-µs call.
* **uncached**: ``spmdkit.engine.inference.clear_cache()`` (and the reshard planner's
  ``cache_clear()`` when it has one) before each call, outside the timed region.

The garbage collector is off while timing, as in ``timeit``. Targets (printed
as PASS/MISS, never failing the script): cached ≤ 5 µs for every row, uncached
≤ 200 µs for the matmul family. Results go to ``benchmarks/results/rules.json``.

Run: ``python benchmarks/rules.py`` (``--quick`` for a smoke run, ``--profile`` to
see where a cache hit spends its time).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import gc
import importlib.metadata
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine import inference

CACHED_TARGET_US = 5.0
UNCACHED_MATMUL_TARGET_US = 200.0
RESULTS = Path(__file__).resolve().parent / "results" / "rules.json"


class Case(NamedTuple):
    """One benchmarked call."""

    family: str
    op: str
    kind: str
    call: Callable[[], Any]
    what: str


def _cases(mesh: Any) -> list[Case]:
    """The benchmarked calls on ``mesh``; every spec is bf16 (what a model would use).

    Specs are built once, outside the calls, so that only inference is timed.
    """

    def t(shape: tuple[int, ...], spec: P, **kw: Any) -> sk.TensorSpec:
        return sk.TensorSpec(shape, spec, dtype="bfloat16", **kw)

    act = (8, 1024, 4096)
    x = t(act, P("data", None, "model"))
    x_rows = t(act, P("data", None, None))
    x_partial = t(act, P("data"), partial={"model": "sum"})
    bias = t((4096,), P(None))
    w = t((4096, 4096), P(None, "model"))
    y = t((8, 4096, 1024), P("data", "model", None))
    dn = (((2,), (1,)), ((0,), (0,)))
    scores_dm = t((8, 1024, 1024), P("data", "model"))
    scores_d = t((8, 1024, 1024), P("data"))
    sums_dm = t((8, 1024), P("data", "model"))
    sums_d = t((8, 1024), P("data"))
    means_d = t((8,), P("data"))
    means_r = t((8,), P(None))
    x_dm = t(act, P("data", "model"))

    fwd, bwd, grad = sk.infer_forward, sk.infer_backward, sk.infer_grad
    out: list[Case] = []

    def add(family: str, op: str, what: str, f: Callable, b: Callable, g: Callable) -> None:
        out.extend(
            [
                Case(family, op, "forward", f, what),
                Case(family, op, "backward", b, what),
                Case(family, op, "grad", g, what),
            ]
        )

    add(
        "elementwise",
        "add",
        "x[8@data,1024,4096@model] + bias[4096] (broadcast)",
        lambda: fwd("add", x, bias, mesh=mesh),
        lambda: bwd("add", x_rows, bias, outputs=(x,), mesh=mesh),
        lambda: grad("add", x, bias, out_grads=(x,), mesh=mesh),
    )
    add(
        "elementwise",
        "exp",
        "exp(x sum-partial over model): all-reduce first",
        lambda: fwd("exp", x_partial, mesh=mesh),
        lambda: bwd("exp", x_rows, outputs=(x,), mesh=mesh),
        lambda: grad("exp", x, out_grads=(x_rows,), mesh=mesh),
    )
    add(
        "matmul",
        "matmul",
        "x[8,1024,4096@model] @ w[4096,4096@model]: w must move",
        lambda: fwd("matmul", x, w, mesh=mesh),
        lambda: bwd("matmul", x_rows, w, outputs=(x,), mesh=mesh),
        lambda: grad("matmul", x, w, out_grads=(x_rows,), mesh=mesh),
    )
    add(
        "matmul",
        "dot_general",
        "batched [8,1024,4096] x [8,4096,1024], contraction sharded over model",
        lambda: fwd("dot_general", x, y, mesh=mesh, dimension_numbers=dn),
        lambda: bwd(
            "dot_general",
            x_rows,
            y,
            outputs=(scores_dm,),
            mesh=mesh,
            dimension_numbers=dn,
        ),
        lambda: grad(
            "dot_general",
            x,
            y,
            out_grads=(scores_d,),
            mesh=mesh,
            dimension_numbers=dn,
        ),
    )
    add(
        "reduction",
        "reduce_sum",
        "sum over the model-sharded last dim: sum-partial output",
        lambda: fwd("reduce_sum", x, mesh=mesh, axis=-1),
        lambda: bwd("reduce_sum", x_rows, outputs=(sums_dm,), mesh=mesh, axis=-1),
        lambda: grad("reduce_sum", x, out_grads=(sums_d,), mesh=mesh, axis=-1),
    )
    add(
        "reduction",
        "reduce_mean",
        "mean over dims (1, 2): avg-partial output",
        lambda: fwd("reduce_mean", x, mesh=mesh, axis=(1, 2)),
        lambda: bwd("reduce_mean", x_rows, outputs=(means_d,), mesh=mesh, axis=(1, 2)),
        lambda: grad("reduce_mean", x, out_grads=(means_r,), mesh=mesh, axis=(1, 2)),
    )
    add(
        "softmax",
        "softmax",
        "softmax over the model-sharded last dim: all-gather first",
        lambda: fwd("softmax", x, mesh=mesh, axis=-1),
        lambda: bwd("softmax", x_rows, outputs=(x_dm,), mesh=mesh, axis=-1),
        lambda: grad("softmax", x, out_grads=(x,), mesh=mesh, axis=-1),
    )
    return out


def _planner_cache_clear() -> tuple[Callable[[], None], str]:
    """The reshard planner's cache clear and its name."""
    from spmdkit import resharding

    return resharding.clear_cache, "spmdkit.resharding.clear_cache"


def _time_cached(call: Callable[[], Any], *, batches: int, per_batch: int) -> float:
    call()
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(per_batch):
            call()
        samples.append((time.perf_counter_ns() - t0) / per_batch)
    return statistics.median(samples) / 1e3


def _time_uncached(call: Callable[[], Any], clear: Callable[[], None], *, reps: int) -> float:
    samples = []
    for _ in range(reps):
        clear()
        t0 = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


def _git_commit() -> str | None:
    try:
        res = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None


def _meta(planner_clear: str) -> dict[str, Any]:
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "spmdkit_commit": _git_commit(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "mesh": {"data": 2, "model": 4, "kind": "AbstractMesh, Explicit axes"},
        "uncached_clears": [
            "spmdkit.engine.inference.clear_cache",
            *([planner_clear] if planner_clear else []),
        ],
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _verdict(value: float, target: float | None) -> str:
    if target is None:
        return "-"
    return "PASS" if value <= target else "MISS"


def run(*, quick: bool = False, out_path: Path = RESULTS) -> dict[str, Any]:
    """Measure every case, print the table, save the JSON; returns what was saved."""
    mesh = sk.abstract_mesh(data=2, model=4)
    cases = _cases(mesh)
    planner_clear, planner_clear_name = _planner_cache_clear()

    def clear() -> None:
        inference.clear_cache()
        if planner_clear is not None:
            planner_clear()

    batches, per_batch, reps = (20, 20, 30) if quick else (200, 50, 300)
    rows = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for case in cases:
            cached = _time_cached(case.call, batches=batches, per_batch=per_batch)
            uncached = _time_uncached(case.call, clear, reps=reps)
            result = case.call()
            unc_target = UNCACHED_MATMUL_TARGET_US if case.family == "matmul" else None
            rows.append(
                {
                    "family": case.family,
                    "op": case.op,
                    "kind": case.kind,
                    "case": case.what,
                    "cached_us": round(cached, 3),
                    "uncached_us": round(uncached, 3),
                    "cached_target_us": CACHED_TARGET_US,
                    "uncached_target_us": unc_target,
                    "cached_verdict": _verdict(cached, CACHED_TARGET_US),
                    "uncached_verdict": _verdict(uncached, unc_target),
                    "reshards": len(result.reshards),
                }
            )
    finally:
        if gc_was_enabled:
            gc.enable()

    notes = []
    notes.append(
        "'uncached' clears the inference and reshard-plan caches; each rule's memo of "
        "expanded notations (keyed by shapes and attrs) stays warm, as in a planner run"
    )
    report = {
        "meta": _meta(planner_clear_name),
        "settings": {
            "cached": f"median over {batches} batches of the mean of {per_batch} calls",
            "uncached": f"median of {reps} calls, caches cleared before each",
            "gc": "disabled while timing",
        },
        "notes": notes,
        "summary": _summary(rows),
        "rows": rows,
    }
    _print_table(rows, report)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out_path)
    print(f"\nsaved {out_path}")
    return report


def _print_table(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(
        f"rule inference, µs per call (median) — jax {meta['jax']}, Python {meta['python']}, "
        f"{meta['machine']}, {meta['cpu_count']} CPUs, {meta['date']}"
    )
    print("mesh: abstract data=2, model=4; activations bf16 (8, 1024, 4096)")
    print(
        f"targets: cached ≤ {CACHED_TARGET_US:g} µs (all rows), "
        f"uncached ≤ {UNCACHED_MATMUL_TARGET_US:g} µs (matmul family)\n"
    )
    header = ("family", "op", "kind", "cached µs", "target", "uncached µs", "target", "reshards")
    table = [
        (
            r["family"],
            r["op"],
            r["kind"],
            f"{r['cached_us']:.2f}",
            r["cached_verdict"],
            f"{r['uncached_us']:.1f}",
            r["uncached_verdict"],
            str(r["reshards"]),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    numeric = {3, 5, 7}

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    print(fmt(header))
    print("  ".join("-" * w for w in widths))
    for row in table:
        print(fmt(row))
    summary = report["summary"]
    print(
        f"\ncached: {summary['cached_pass']} PASS, {summary['cached_miss']} MISS; "
        f"uncached matmul family: {summary['uncached_pass']} PASS, "
        f"{summary['uncached_miss']} MISS"
    )
    for note in report["notes"]:
        print(f"note: {note}")


def _summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    def count(key: str, verdict: str) -> int:
        return sum(r[key] == verdict for r in rows)

    return {
        "cached_pass": count("cached_verdict", "PASS"),
        "cached_miss": count("cached_verdict", "MISS"),
        "uncached_pass": count("uncached_verdict", "PASS"),
        "uncached_miss": count("uncached_verdict", "MISS"),
    }


def profile_cached(report: dict[str, Any], *, calls: int = 20000, top: int = 12) -> None:
    """cProfile the slowest cached row: where a cache hit spends its time."""
    row = max(report["rows"], key=lambda r: r["cached_us"])
    mesh = sk.abstract_mesh(data=2, model=4)
    case = next(c for c in _cases(mesh) if (c.op, c.kind) == (row["op"], row["kind"]))
    case.call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        case.call()
    prof.disable()
    print(f"\ncProfile of {calls} cached {case.op} {case.kind} calls (tottime order):")
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(top)
    print("\n".join(line for line in stream.getvalue().splitlines() if line.strip())[:6000])


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python benchmarks/rules.py [--quick] [--profile] [--out PATH]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile the slowest cached row"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON path (default {RESULTS})")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    report = run(quick=args.quick, out_path=args.out)
    if args.profile:
        profile_cached(report)
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

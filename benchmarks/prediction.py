"""Prediction accuracy: what the planner predicts next to what XLA compiles.

For every reference model (tiny configs) × strategy (dp, fsdp, megatron,
megatron_sp, tp_fsdp, auto, and ep for the MoE) × mesh ((8,), (2, 4), (4, 2)) on 8
virtual CPU devices: plan, compile the training step (``sk.jit``), and run
``plan.verify`` on the compiled executable. Recorded per case: the predicted and
compiled collective bytes per device of each collective kind, the predicted peak
memory range and the compiled peak (``memory_analysis``), and whether verify is
within its tolerances (bytes ±10% per kind, memory ±20% of the range).

Prints a summary (cases within tolerance, the spread of the predicted/compiled
ratios) and the per-case table, and saves ``benchmarks/results/prediction.json``.

Run: ``python benchmarks/prediction.py [--quick]`` (``--quick``: the (2, 4) mesh only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import numpy as np

import spmdkit as sk
from spmdkit.compile import jit
from spmdkit.introspect import describe
from spmdkit.models import get_model
from spmdkit.planner import plan

MODELS = ("gpt", "llama", "moe", "convnet", "gpt_linen")
STRATEGIES = ("dp", "fsdp", "megatron", "megatron_sp", "tp_fsdp", "auto", "ep")
MESHES = ((8,), (2, 4), (4, 2))


def _case(info, batch, params, model: str, strategy: str, shape: tuple[int, ...]) -> dict:
    """Plan, compile and verify one case; the verify rows as plain data."""
    mesh = sk.make_mesh(**dict(zip(("data", "model"), shape, strict=False)))
    t0 = time.perf_counter()
    # auto's layouts with the plain step: prediction accuracy of layouts (CPU runs
    # bf16 compute in f32, so a bf16 recipe's memory is not comparable here)
    p = plan(
        info,
        mesh,
        strategy,
        estimator="propagate" if strategy == "auto" else "analytic",
        recipe=sk.Recipe() if strategy == "auto" else None,
    )
    t1 = time.perf_counter()
    step = jit(jax.value_and_grad(info.loss_fn), p)
    step.compile(params, batch)
    t2 = time.perf_counter()
    report = p.verify(step, params, batch)
    rows = {
        what: {"predicted": int(pred), "compiled": int(comp), "ok": bool(ok)}
        for what, pred, comp, ok in report.rows
    }
    for what, (low, high) in report.ranges.items():
        rows[what].update(predicted_low=int(low), predicted_high=int(high))
    extra = {}
    if strategy == "auto" and p.cost is not None:  # the candidates auto ranked, one estimator
        extra["est_step_s"] = p.cost.step_time_s
        extra["chosen"] = p.chosen
        extra["alternatives"] = {name: c.step_time_s for name, c in p.alternatives}
    return {
        "model": model,
        "strategy": strategy,
        "mesh": "x".join(map(str, shape)),
        **extra,
        "ok": report.ok,
        "mismatches": report.mismatches,
        "rows": rows,
        "plan_s": t1 - t0,
        "compile_s": t2 - t1,
    }


def _ratio(row: dict) -> float | None:
    if row["compiled"] == 0:
        return None if row["predicted"] == 0 else float("inf")
    return row["predicted"] / row["compiled"]


def _shown(row: dict) -> str:
    r = _ratio(row)
    return "0 = 0" if r is None else f"{r:.2f}"


def summarize(cases: list[dict]) -> dict:
    """Cases within tolerance, and the spread of predicted/compiled per quantity (rows
    where both are zero carry no ratio and are left out)."""
    quantities: dict[str, list[float]] = {}
    for c in cases:
        for what, row in c["rows"].items():
            r = _ratio(row)
            if r is not None and np.isfinite(r):
                key = (
                    "peak memory"
                    if "memory" in what
                    else "collective bytes, total"
                    if "total" in what
                    else "collective bytes, per kind"
                )
                quantities.setdefault(key, []).append(r)
    spread = {
        what: {
            "n": len(rs),
            "median": statistics.median(rs),
            "p10": float(np.percentile(rs, 10)),
            "p90": float(np.percentile(rs, 90)),
            "within_10pct": sum(abs(r - 1) <= 0.10 for r in rs),
            "within_20pct": sum(abs(r - 1) <= 0.20 for r in rs),
        }
        for what, rs in sorted(quantities.items())
    }
    return {
        "cases": len(cases),
        "verify_ok": sum(c["ok"] for c in cases),
        "ratios": spread,
        "auto_vs_presets": auto_vs_presets(cases),
    }


def _compiled_total(case: dict) -> int:
    row = case["rows"].get("collectives total")
    if row is not None:
        return row["compiled"]
    return sum(r["compiled"] for w, r in case["rows"].items() if "memory" not in w)


def auto_vs_presets(cases: list[dict]) -> list[dict]:
    """Per model and mesh: auto's estimated step time next to the best preset's
    (the presets auto re-costed with the same estimator), and auto's compiled
    collective bytes over the best preset's compiled bytes."""
    by = {(c["model"], c["mesh"], c["strategy"]): c for c in cases}
    rows = []
    for (model, mesh, strategy), c in by.items():
        if strategy != "auto" or "alternatives" not in c:
            continue
        presets = {n: t for n, t in c["alternatives"].items() if (model, mesh, n) in by}
        if not presets:
            continue
        best = min(presets, key=presets.get)
        best_bytes = _compiled_total(by[(model, mesh, best)])
        auto_bytes = _compiled_total(c)
        rows.append(
            {
                "model": model,
                "mesh": mesh,
                "chosen": c["chosen"],
                "best_preset": best,
                "auto_est_s": c["est_step_s"],
                "best_preset_est_s": presets[best],
                "auto_bytes": auto_bytes,
                "best_preset_bytes": best_bytes,
                "est_ok": c["est_step_s"] <= presets[best] * (1 + 1e-9),
                "bytes_ok": auto_bytes <= 1.1 * best_bytes,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the (2, 4) mesh only")
    parser.add_argument(
        "--out",
        default=str(Path(__file__).parent / "results" / "prediction.json"),
    )
    args = parser.parse_args()
    # many plans, whose notes are no figure: sk.plan's PlanNoteWarnings would bury the table
    warnings.filterwarnings("ignore", category=sk.PlanNoteWarning)
    meshes = ((2, 4),) if args.quick else MESHES
    cases = []
    t_start = time.perf_counter()
    for model in MODELS:
        spec = get_model(model)
        cfg = spec.config("tiny")
        batch = spec.batch(cfg, 8, np.random.default_rng(0))
        info = describe(spec, config=cfg, batch=batch)
        params = info.init_fn()
        for strategy in STRATEGIES:
            if strategy == "ep" and model != "moe":
                continue
            for shape in meshes:
                c = _case(info, batch, params, model, strategy, shape)
                cases.append(c)
                coll = [f"{w} {_shown(r)}" for w, r in c["rows"].items() if "memory" not in w]
                mem = next((r for w, r in c["rows"].items() if "memory" in w), None)
                mem_s = _shown(mem) if mem else "-"
                print(
                    f"{model:<10}{strategy:<12}{c['mesh']:<6}"
                    f"{'ok ' if c['ok'] else 'OFF'}  memory {mem_s}  " + ", ".join(coll),
                    flush=True,
                )
    summary = summarize(cases)
    print(f"\nverify within tolerance: {summary['verify_ok']} of {summary['cases']} cases")
    for what, s in summary["ratios"].items():
        print(
            f"{what}: predicted/compiled median {s['median']:.3f}, p10 {s['p10']:.3f}, "
            f"p90 {s['p90']:.3f}; within 10%: {s['within_10pct']}/{s['n']}, "
            f"within 20%: {s['within_20pct']}/{s['n']}"
        )
    rows = summary["auto_vs_presets"]
    print(
        f"\nauto vs the best preset: estimated step time <= on "
        f"{sum(r['est_ok'] for r in rows)} of {len(rows)}, compiled bytes <= 1.1x on "
        f"{sum(r['bytes_ok'] for r in rows)} of {len(rows)}"
    )
    for r in rows:
        print(
            f"  {r['model']:<10}{r['mesh']:<6}auto={r['chosen']:<12}best preset "
            f"{r['best_preset']:<12}est {r['auto_est_s'] * 1e3:.3f} / "
            f"{r['best_preset_est_s'] * 1e3:.3f} ms  bytes {r['auto_bytes']} / "
            f"{r['best_preset_bytes']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "backend": jax.default_backend(),
        "quick": args.quick,
        "seconds": time.perf_counter() - t_start,
    }
    out.write_text(json.dumps({"meta": meta, "summary": summary, "cases": cases}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

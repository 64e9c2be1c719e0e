"""Run every benchmark and write ``benchmarks/results/REPORT.md`` with plots.

Each benchmark script runs as a subprocess, with its full settings by default
(``--quick`` passes each script's smoke-run flags instead); its JSON goes to
``benchmarks/results/``. A failing script does not stop the others: the report
shows its error tail and this script exits non-zero at the end. Then every JSON
in the results folder is read and the report is written: one section per
benchmark, each with a Markdown table, the machine it ran on (jax version, CPU
count, load average, date) and PNG plots beside the report.

Flags:
  ``--quick``    smoke-run flags for every script.
  ``--no-run``   only regenerate the report from the JSON already there.
  ``--gpu``      on a machine with a GPU, also run ``overhead.py --gpu`` (GPT and
                 Llama, tiny and larger configs; device name and MFU recorded in
                 ``overhead_gpu.json``). Without a GPU the report says it was not run.
  ``--results``  folder with the JSON (default ``benchmarks/results``).
  ``--out-dir``  folder for REPORT.md and the PNGs (default: the results folder).

Run: ``python benchmarks/run_all.py [--quick] [--no-run] [--gpu]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _scripts(results: Path, quick: bool) -> list[tuple[str, list[str]]]:
    """(script, args) per benchmark; ``quick`` passes each script's smoke-run flags."""
    q = ["--quick"] if quick else []
    ckpt = ["--mb", "128", "--repeat", "2"] if quick else []
    return [
        ("rules.py", [*q, "--out", str(results / "rules.json")]),
        ("ops.py", [*q, "--out", str(results / "ops.json")]),
        ("propagate.py", []),
        ("planner.py", q),
        ("prediction.py", [*q, "--out", str(results / "prediction.json")]),
        ("measure.py", [*q, "--out", str(results / "measure.json")]),
        ("checkpoint.py", [*ckpt, "--out", str(results / "checkpoint.json")]),
        ("overhead.py", [*q, "--out", str(results / "overhead.json")]),
    ]


def run_scripts(results: Path, gpu: bool, quick: bool = False) -> list[dict[str, Any]]:
    """Run the benchmarks one after another; return one status dict per script."""
    jobs = _scripts(results, quick)
    if gpu:
        jobs.append(("overhead.py", ["--gpu", "--out", str(results / "overhead_gpu.json")]))
    status = []
    for script, args in jobs:
        cmd = [sys.executable, str(HERE / script), *args]
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=HERE.parent)
        secs = time.perf_counter() - t0
        tail = (proc.stdout + proc.stderr)[-2000:]
        status.append(
            {"script": script, "args": args, "rc": proc.returncode, "seconds": secs, "tail": tail}
        )
        print(f"  rc={proc.returncode} in {secs:.1f}s", flush=True)
        if proc.returncode:
            print(tail, flush=True)
    return status


# --------------------------------------------------------------------------- report helpers
def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.4g}"
        return "" if x is None else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _machine(d: dict[str, Any], path: Path) -> str:
    meta = d.get("meta", d)
    date = meta.get("date") or datetime.datetime.fromtimestamp(
        path.stat().st_mtime, datetime.UTC
    ).isoformat(timespec="seconds")
    bits = [
        f"date {date}",
        f"jax {meta.get('jax', '?')}",
        f"machine {meta.get('machine', '?')}",
        f"CPUs {meta.get('cpu_count', '?')}",
        f"load avg {meta['load_average_1m']:.2f}"
        if isinstance(meta.get("load_average_1m"), (int, float))
        else "load avg (not recorded)",
    ]
    for key in ("backend", "device_kind", "mesh"):
        if key in meta:
            bits.append(f"{key} {meta[key]}")
    return "_Ran on: " + ", ".join(str(b) for b in bits) + "._"


def _plot(path: Path, draw: Any) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"![{path.stem}]({path.name})"


MISSING = "_No results: the JSON is missing (run the script)._"


# --------------------------------------------------------------------------- sections
def sec_rules(results: Path, out: Path) -> str:
    d = _load(results, "rules.json")
    if d is None:
        return MISSING
    rows = [
        [
            r["family"],
            r["op"],
            r["kind"],
            r["case"],
            r.get("cached_us"),
            r.get("uncached_us"),
            r.get("cached_target_us"),
            r.get("cached_verdict"),
        ]
        for r in d["rows"]
    ]
    text = [
        _machine(d, results / "rules.json"),
        "",
        _table(
            ["family", "op", "kind", "case", "cached µs", "uncached µs", "target µs", "verdict"],
            rows,
        ),
        "",
        f"Summary: {d.get('summary')}",
    ]
    return "\n".join(text)


def sec_ops(results: Path, out: Path) -> str:
    d = _load(results, "ops.json")
    if d is None:
        return MISSING
    rows, labels, sk_b, xla_b = [], [], [], []
    for r in d["rows"]:
        s, p = r["spmdkit"], r["plain"]
        for phase in ("forward", "forward+backward"):
            if phase in s and phase in p:
                rows.append(
                    [
                        f"{r['op']} {r['variant']}",
                        phase,
                        s[phase]["bytes"],
                        p[phase]["bytes"],
                        s[phase]["peak_bytes"],
                        p[phase]["peak_bytes"],
                    ]
                )
        if "forward+backward" in s and "forward+backward" in p:
            labels.append(f"{r['op']} {r['variant']}")
            sk_b.append(s["forward+backward"]["bytes"] / 2**20)
            xla_b.append(p["forward+backward"]["bytes"] / 2**20)

    def draw(ax: Any) -> None:
        import numpy as np

        x = np.arange(len(labels))
        ax.bar(x - 0.2, sk_b, 0.4, label="spmdkit.ops")
        ax.bar(x + 0.2, xla_b, 0.4, label="plain jnp (XLA propagation)")
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("collective MiB / device (fwd+bwd)")
        ax.set_yscale("symlog")
        ax.legend(fontsize=8)

    img = _plot(out / "ops_bytes.png", draw) if labels else None
    meta = d.get("meta", {})
    return "\n".join(
        [
            _machine(d, results / "ops.json") + f" quick={meta.get('quick')}",
            "",
            "Collective bytes and peak memory per device; spmdkit = the rule-enforcing op, "
            "XLA = plain jnp/optax under XLA's own sharding propagation, same in_shardings.",
            "",
            _table(
                ["op", "phase", "bytes spmdkit", "bytes XLA", "peak spmdkit", "peak XLA"],
                rows,
            ),
            "",
            img or "",
            *_planned_ops(d),
        ]
    )


def _planned_ops(d: dict[str, Any]) -> list[str]:
    """The planned section of ops.json: forward+backward as sk.jit compiles it, the op
    as a region against the jnp decomposition."""
    rows = []
    for r in d["rows"]:
        planned = r.get("planned")
        if planned is None:
            continue
        reg, dec = planned["region"], planned["jnp"]

        def cells(side: dict[str, Any]) -> list[Any]:
            if "na" in side:
                return ["n/a", "n/a", "n/a"]
            return [side["bytes"], side["predicted_bytes"], side["peak_bytes"]]

        strategies = ", ".join(
            f"{op} {'/'.join(per)}" for op, per in reg.get("strategies", {}).items()
        )
        rows.append([f"{r['op']} {r['variant']}", *cells(reg), *cells(dec), strategies])
    if not rows:
        return []
    return [
        "",
        "Planned (forward+backward through spmdkit's propagation and the pinned replay, "
        "as `sk.jit` compiles it; same input layouts): the op called without `in_specs`, "
        "one region laid out by its rule, against the jnp decomposition. Bytes: compiled "
        "collective payload per device; predicted: the propagation's figure.",
        "",
        _table(
            [
                "op",
                "region bytes",
                "region predicted",
                "region peak",
                "jnp bytes",
                "jnp predicted",
                "jnp peak",
                "region strategies",
            ],
            rows,
        ),
    ]


def sec_propagate(results: Path, out: Path) -> str:
    d = _load(results, "propagate.json")
    p = _load(results, "planner.json")
    parts = []
    if d is not None:
        parts += [
            _machine(d, results / "propagate.json"),
            "",
            f"Model config {d.get('config')}, mesh {d.get('mesh')}, {d.get('equations')} "
            "equations.",
            "",
            _table(
                ["trace s", "propagate (first) s", "propagate (again) s", "with out specs s"],
                [
                    [
                        d.get("trace_s"),
                        d.get("propagate_first_s"),
                        d.get("propagate_again_s"),
                        d.get("propagate_out_specs_s"),
                    ]
                ],
            ),
        ]
    else:
        parts.append("propagate.json: " + MISSING)
    if p is not None:
        rows = [
            [
                r["model"],
                r["devices"],
                r["mesh"],
                r["describe_s"],
                r["plan_s"],
                r["total_s"],
                r["chosen"],
            ]
            for r in p["timing"]
        ]
        parts += [
            "",
            "Planning time (trace + propagate + auto search) vs model and mesh size:",
            "",
            _machine(p, results / "planner.json"),
            "",
            _table(["model", "devices", "mesh", "describe s", "plan s", "total s", "chosen"], rows),
        ]

        def draw(ax: Any) -> None:
            for model in dict.fromkeys(r["model"] for r in p["timing"]):
                pts = [(r["devices"], r["total_s"]) for r in p["timing"] if r["model"] == model]
                ax.plot(*zip(*pts, strict=True), marker="o", label=model)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("devices")
            ax.set_ylabel("planning time (s)")
            ax.legend(fontsize=8)

        img = _plot(out / "planner_time.png", draw)
        parts += ["", img or ""]
    return "\n".join(parts)


def sec_real_size(results: Path, out: Path) -> str:
    p = _load(results, "planner.json")
    if p is None or not p.get("real_size"):
        return MISSING
    rows = [
        [
            r["model"],
            r["devices"],
            r["mesh"],
            r["chosen"],
            r["recipe_text"],
            r["memory_bytes"] / 2**30,
            r["tok_s_gpu"],
            r["published_tok_s_gpu"] or "-",
            r["ratio"] if r["ratio"] is not None else "-",
            r["plan_s"],
        ]
        for r in p["real_size"]
    ]
    parts = [
        _machine(p, results / "planner.json"),
        "",
        "`auto` on Llama-3 at seq 8192, 2 sequences per GPU, 80 GiB per H100 (layout and "
        "recipe searched together; propagate estimator), beside torchtitan's published "
        "throughput where there is one.",
        "",
        _table(
            [
                "model",
                "devices",
                "mesh",
                "layout",
                "recipe",
                "memory GiB",
                "est. tok/s/GPU",
                "published",
                "est./published",
                "plan s",
            ],
            rows,
        ),
    ]
    cal = p.get("calibration")
    if cal:
        parts += [
            "",
            f"Calibration ({cal['recipe']}): matmul efficiency {cal['matmul_efficiency']:.2f} "
            f"in use ({cal['fitted_matmul_efficiency']:.3f} reproduces 8 GPUs exactly), "
            f"attention efficiency {cal['attention_efficiency']:.2f} (assumed), overlap "
            f"{cal['overlap']:.2f}: 8 GPUs {cal['estimate_8gpu']:.0f} tok/s/GPU "
            f"(published {cal['published_8gpu']}), 128 GPUs {cal['estimate_128gpu']:.0f} "
            f"(published {cal['published_128gpu']}, the hold-out).",
        ]
    return "\n".join(parts)


def sec_pipelines(results: Path, out: Path) -> str:
    p = _load(results, "planner.json")
    if p is None or not p.get("pipelines"):
        return MISSING
    rows = []
    for r in p["pipelines"]:
        for kind, text in (
            ("best_pipelined", "best pipelined"),
            ("best_non_pipelined", "best non-pipelined"),
            ("megatron_style", "Megatron-style (pp4×5 interleaved, mb 1)"),
        ):
            c = r.get(kind)
            if not c:
                continue
            rows.append(
                [
                    r["model"],
                    r["devices"],
                    text,
                    c["label"],
                    c["memory_bytes"] / 2**30,
                    f"{c['bubble_share']:.1%}",
                    c["tok_s_gpu"],
                    c["estimator"],
                ]
            )
    chosen = "; ".join(
        f"{r['model']} on {r['devices']}: {r['chosen']} (planned in {r['plan_s']:.1f} s wall, "
        f"{r['plan_cpu_s']:.1f} s CPU)"
        for r in p["pipelines"]
    )
    return "\n".join(
        [
            _machine(p, results / "planner.json"),
            "",
            '`auto` with `pipeline="auto"` on Llama-3 at seq 8192, 2 sequences per GPU, '
            "80 GiB per H100: the best pipelined and best non-pipelined plans it costed, and "
            "a Megatron-LM-style pipeline costed by the same model. Pipelined costs are "
            "analytic, calibrated by propagating the same layouts without the pipe axis "
            "(`analytic+propagate`).",
            "",
            _table(
                [
                    "model",
                    "devices",
                    "plan",
                    "layout + recipe + pipeline",
                    "memory GiB",
                    "bubble",
                    "est. tok/s/GPU",
                    "estimator",
                ],
                rows,
            ),
            "",
            f"auto chose: {chosen}.",
        ]
    )


def sec_quality(results: Path, out: Path) -> str:
    p = _load(results, "planner.json")
    if p is None or not p.get("quality"):
        return MISSING
    rows = [
        [
            r["model"],
            r["devices"],
            r["strategy"],
            r.get("chosen"),
            r["step_time_s"],
            r["comm_bytes"] / 2**30,
            r["memory_bytes"] / 2**30,
        ]
        for r in p["quality"]
    ]
    return "\n".join(
        [
            _machine(p, results / "planner.json"),
            "",
            "Estimated step time, communication and per-device memory of each plan "
            "(auto = spmdkit's search; `chosen` = the layout it picked).",
            "",
            _table(
                ["model", "devices", "strategy", "chosen", "step s", "comm GiB", "memory GiB"],
                rows,
            ),
        ]
    )


def sec_measure(results: Path, out: Path) -> str:
    """benchmarks/measure.py: predicted vs measured step time and peak memory."""
    d = _load(results, "measure.json")
    if d is None:
        return MISSING
    rows = [
        [c["model"], c["config"], c["strategy"], "error", "-", "-", "-", "-", "-", "-"]
        if "error" in c
        else [
            c["model"],
            c["config"],
            c["strategy"],
            c["chosen"],
            f"{c['predicted_step_s'] * 1e3:.2f}",
            f"{c['measured_step_s'] * 1e3:.2f}",
            f"{c['step_ratio']:.2f}",
            f"{c['predicted_peak_bytes'] / 2**20:.2f}",
            f"{c['compiled_peak_bytes'] / 2**20:.2f}",
            "ok" if c["verify_ok"] else "off",
        ]
        for c in d["cases"]
    ]
    cpu = " CPU figures (a CPU topology measured on the host), not a GPU's." * (
        d["platform"] == "cpu"
    )
    return "\n".join(
        [
            _machine(d, results / "measure.json") + f" {d['device_kind']} x{d['devices']}.",
            "",
            "Train steps (adam, plain recipe) compiled and timed on the devices present; "
            f"predicted with the {d['topology']['name']} topology.{cpu} Ratios are "
            "predicted / measured; memory per device (verify's range point vs "
            "`memory_analysis()`).",
            "",
            _table(
                [
                    "model",
                    "config",
                    "strategy",
                    "chosen",
                    "predicted ms",
                    "measured ms",
                    "ratio",
                    "predicted MiB",
                    "compiled MiB",
                    "verify",
                ],
                rows,
            ),
        ]
    )


def _undonated_note(cases: list[dict]) -> str:
    """What a run recorded before measure.py donated the state (its cases have no
    ``compiled_memory``) compared; empty for a donated run."""
    if all("compiled_memory" in c for c in cases if "error" not in c):
        return ""
    return (
        " These cases compiled the step undonated (measure.py before it donated the "
        "state): the compiled peak and verify's point (the propagation of that step) "
        "hold the updated parameters and optimizer state beside the state, while the "
        "plan's peak is for the donated step `sk.train` runs; planned and compiled "
        "compare only on a donated run."
    )


def sec_measure_gpu(results: Path, out: Path) -> str:
    """measure.py on a lent GPU (``measure_gpu.json``): the device named, each case's
    recipe and batch, predicted beside measured."""
    d = _load(results, "measure_gpu.json")
    if d is None:
        return "_Not run: no GPU has produced measure_gpu.json._"
    rows = [
        [
            f"{c['model']} {c['config']}",
            c["recipe"],
            c["batch"],
            f"{c['predicted_step_s'] * 1e3:.1f}",
            f"{c['measured_step_s'] * 1e3:.1f} "
            f"({c['measured_step_s_p25'] * 1e3:.1f}-{c['measured_step_s_p75'] * 1e3:.1f})",
            f"{c['step_ratio']:.2f}",
            f"{c['planned_peak_bytes'] / 2**30:.1f}",
            f"{c['predicted_peak_bytes'] / 2**30:.1f}",
            f"{c['compiled_peak_bytes'] / 2**30:.1f}",
            "ok" if c["verify_ok"] else "off",
        ]
        for c in d["cases"]
        if "error" not in c
    ]
    return "\n".join(
        [
            f"_Ran on: {d['device_kind']} x{d['devices']} ({d['platform']}), jax {d['jax']}, "
            f"{', '.join(r['date'] for r in d.get('runs', [{'date': d['date']}]))}._",
            "",
            f"One device; predicted with the {d['topology']['name']} topology "
            f"({d['topology']['source']}): an H200 has an H100's compute and 4.8 TB/s of "
            "HBM against 3.35, so memory-bound work runs faster here than priced. Step: "
            "median of the timed steps (p25-p75); memory in GiB per device: the plan's "
            "peak, verify's point for the compiling platform, and `memory_analysis()`."
            + _undonated_note(d["cases"]),
            "",
            _table(
                [
                    "model",
                    "recipe",
                    "batch",
                    "predicted ms",
                    "measured ms",
                    "ratio",
                    "planned GiB",
                    "verify GiB",
                    "compiled GiB",
                    "verify",
                ],
                rows,
            ),
        ]
    )


def sec_kernels_gpu(results: Path, out: Path) -> str:
    """kernels.py on a lent GPU (``kernels_gpu.json``): each kernel's price beside its
    timing."""
    d = _load(results, "kernels_gpu.json")
    if d is None:
        return "_Not run: no GPU has produced kernels_gpu.json._"
    rows = [
        [
            c["kind"],
            c["label"],
            f"{c['predicted_s'] * 1e3:.3f}",
            f"{c['measured_s'] * 1e3:.3f}",
            f"{c['ratio']:.2f}",
            f"{c['efficiency_predicted']:.3f}",
            f"{c['efficiency_measured']:.3f}",
        ]
        for c in d["cases"]
        if "error" not in c
    ]
    return "\n".join(
        [
            f"_Ran on: {d['device_kind']} ({d['platform']}), jax {d['jax']}, {d['date']}._",
            "",
            f"Each kernel alone, priced with the {d['topology']} topology: GEMMs by "
            "`Topology.matmul_time`, the elementwise pass by `memory_time`, causal attention "
            "(forward + backward, cuDNN) by its FLOPs over the peak x `attention_efficiency`. "
            "Efficiency: FLOP/s over the bf16 peak, or bytes/s over `hbm_bandwidth`.",
            "",
            _table(
                [
                    "kind",
                    "case",
                    "predicted ms",
                    "measured ms",
                    "ratio",
                    "eff. priced",
                    "eff. measured",
                ],
                rows,
            ),
        ]
    )


def sec_prediction(results: Path, out: Path) -> str:
    d = _load(results, "prediction.json")
    if d is None:
        return MISSING
    summary, cases = d["summary"], d["cases"]

    def ratio(row: dict[str, Any] | None) -> str:
        if row is None:
            return "-"
        if row["compiled"] == 0:
            return "0 = 0" if row["predicted"] == 0 else "compiled 0"
        return f"{row['predicted'] / row['compiled']:.2f}"

    rows = []
    for c in cases:
        coll = {w: r for w, r in c["rows"].items() if "memory" not in w}
        mem = next((r for w, r in c["rows"].items() if "memory" in w), None)
        rows.append(
            [
                c["model"],
                c["strategy"],
                c["mesh"],
                "ok" if c["ok"] else "off",
                ratio(coll.get("collectives total")),
                ", ".join(f"{w} {ratio(r)}" for w, r in coll.items() if w != "collectives total"),
                f"{mem['predicted_low'] / 2**10:.0f}–{mem['predicted_high'] / 2**10:.0f}"
                if mem and "predicted_low" in mem
                else "-",
                f"{mem['compiled'] / 2**10:.0f}" if mem else "-",
            ]
        )
    lines = [
        _machine(d, results / "prediction.json") + f" quick={d['meta'].get('quick')}",
        "",
        f"`plan.verify` on every reference model (tiny) × strategy × mesh: "
        f"**{summary['verify_ok']} of {summary['cases']} cases within tolerance** "
        "(collective bytes ±10% per kind, peak memory ±20% of the predicted range). "
        "Ratios are predicted / compiled.",
        "",
        _table(
            ["quantity", "n", "median", "p10", "p90", "within 10%", "within 20%"],
            [
                [w, s["n"], s["median"], s["p10"], s["p90"], s["within_10pct"], s["within_20pct"]]
                for w, s in summary["ratios"].items()
            ],
        ),
        "",
        _table(
            [
                "model",
                "strategy",
                "mesh",
                "verify",
                "bytes total",
                "per kind",
                "memory predicted KiB",
                "compiled KiB",
            ],
            rows,
        ),
    ]
    auto = summary.get("auto_vs_presets") or []
    if auto:
        lines += [
            "",
            f"Auto against the best preset (lowest estimated step time among the presets "
            f"auto re-costed with its own estimator): estimated step time ≤ on "
            f"**{sum(r['est_ok'] for r in auto)} of {len(auto)}**, compiled collective bytes "
            f"≤ 1.1× on **{sum(r['bytes_ok'] for r in auto)} of {len(auto)}**.",
            "",
            _table(
                [
                    "model",
                    "mesh",
                    "auto chose",
                    "best preset",
                    "est. ms auto / preset",
                    "compiled bytes auto / preset",
                ],
                [
                    [
                        r["model"],
                        r["mesh"],
                        r["chosen"],
                        r["best_preset"],
                        f"{r['auto_est_s'] * 1e3:.3f} / {r['best_preset_est_s'] * 1e3:.3f}",
                        f"{r['auto_bytes']} / {r['best_preset_bytes']}",
                    ]
                    for r in auto
                ],
            ),
        ]
    return "\n".join(lines)


def _export_import_lines(r: dict[str, Any] | None) -> list[str]:
    """The export → import table: peak host memory of each import vs its largest tensor."""
    if not r:
        return []
    rows = [
        [
            name,
            v["seconds"],
            v["result_MB"],
            v["peak_anon_MB"],
            v["transient_MB"],
            v["transient_MB"] / r["largest_tensor_MB"],
            v["mapped_file_MB"],
            v["bit_exact"],
        ]
        for name, v in r["imports"].items()
    ]
    return [
        f"Export → import (safetensors): {r['state_MB']:.0f} MB in {r['tensors']} tensors, "
        f"largest {r['largest_tensor_MB']:.0f} MB, exported from {r['from']} in "
        f"{r['export_seconds']:.2f} s, each import in a fresh process (ran {r.get('date', '?')}, "
        f"load avg {r.get('load_average_1m', float('nan')):.2f}). Transient = peak "
        "anonymous RSS above the start minus the imported arrays' own bytes; mapped file = "
        "page cache the reader maps (reclaimable).",
        "",
        _table(
            [
                "import onto",
                "seconds",
                "result MB",
                "peak anon +MB",
                "transient MB",
                "transient / largest tensor",
                "mapped file MB",
                "bit-exact",
            ],
            rows,
        ),
        "",
    ]


def sec_checkpoint(results: Path, out: Path) -> str:
    d = _load(results, "checkpoint.json")
    if d is None:
        return MISSING
    rows = [[k, v["seconds"], v["MB_per_s"], v.get("peak_rss_MB")] for k, v in d["rows"].items()]

    def draw(ax: Any) -> None:
        names = list(d["rows"])
        ax.barh(names, [d["rows"][k]["MB_per_s"] for k in names])
        ax.set_xlabel("MB/s")
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()

    img = _plot(out / "checkpoint_mbps.png", draw)
    return "\n".join(
        [
            _machine(d, results / "checkpoint.json")
            + f" state {d.get('state_MB')} MB in {d.get('arrays')} arrays, mesh {d.get('mesh')}, "
            f"repeat {d.get('repeat')}, orbax {d.get('orbax')}",
            "",
            _table(["operation", "seconds", "MB/s", "peak RSS MB"], rows),
            "",
            "Ratios: " + ", ".join(f"{k} = {v:.3g}" for k, v in d.get("ratios", {}).items()),
            "",
            img or "",
            "",
            *_export_import_lines(d.get("export_import")),
        ]
    )


def _overhead_table(d: dict[str, Any]) -> str:
    rows = [
        [
            r["model"],
            r["config"],
            r["strategy"],
            r["mesh"],
            r["skjit_step_ms"],
            r["jaxjit_step_ms"],
            r["skjit_step_ms"] - r["jaxjit_step_ms"],
            r["ratio_median"],
            f"{r['ratio_p25']:.3f}–{r['ratio_p75']:.3f}",
            r.get("ratio_unenforced"),
            r.get("ratio_enforced_vs_unenforced"),
            r["skjit_first_s"],
            r["jaxjit_first_s"],
            r["first_ratio"],
            r.get("mfu"),
        ]
        for r in d["rows"]
    ]
    return _table(
        [
            "model",
            "config",
            "plan",
            "mesh",
            "sk.jit ms",
            "jax.jit ms",
            "difference ms",
            "ratio (median)",
            "ratio p25–p75",
            "enforce=False / jax.jit",
            "enforced / enforce=False",
            "sk.jit first s",
            "jax.jit first s",
            "first ratio",
            "MFU",
        ],
        rows,
    )


def _startup_table(d: dict[str, Any]) -> str:
    """The start-up ratios (issue 35's targets: init ≤ 1.5, first call ≤ 1.3, auto ≤ 3 s)."""
    rows = [
        [
            r["model"],
            r["params"],
            r["init_sharded_s"],
            r["jax_init_s"],
            r["init_ratio"],
            r["skjit_first_s"],
            r["jaxjit_first_s"],
            r["first_call_ratio"],
            r["auto_s"],
            r["preset_s"],
        ]
        for r in d.get("startup", [])
    ]
    return _table(
        [
            "model (tiny)",
            "params",
            "sk.init_sharded s",
            "jax.jit(init) s",
            "init ratio (≤ 1.5)",
            "first sk.jit s",
            "first jax.jit s",
            "first-call ratio (≤ 1.3)",
            "auto s (≤ 3)",
            "fsdp preset s",
        ],
        rows,
    )


def _auto_spread(r: dict[str, Any]) -> str:
    """A row's spread of auto / fastest: its passes' ratios (min–max), or the
    percentiles of the per-step ratios of earlier tables."""
    if "ratio_to_fastest_per_pass" in r:
        xs = r["ratio_to_fastest_per_pass"]
        return f"{min(xs):.3f}–{max(xs):.3f} (passes)"
    return f"{r['ratio_to_fastest_p25']:.3f}–{r['ratio_to_fastest_p75']:.3f} (p25–p75)"


def _auto_vs_presets_table(section: dict[str, Any]) -> str:
    """Auto's measured train step against every preset's on 8 CPU devices (issue 43)."""
    rows = [
        [
            r["model"],
            r["config"],
            " × ".join(f"{k}={v}" for k, v in r["mesh"].items()),
            r["auto_chose"],
            r["auto_step_ms"],
            r["fastest_preset"],
            r["presets"][r["fastest_preset"]]["step_ms"],
            r["ratio_to_fastest"],
            _auto_spread(r),
            r.get("cpu_ratio_to_fastest"),
            r.get("tuned_chose", "—"),
            r.get("tuned_ratio_to_fastest"),
            r.get("tuned_cpu_ratio_to_fastest"),
        ]
        for r in section.get("rows", [])
    ]
    return _table(
        [
            "model",
            "config",
            "mesh",
            "auto chose",
            "auto ms",
            "fastest preset",
            "preset ms",
            f"auto / fastest (≤ {section.get('target')})",
            "spread",
            "CPU-seconds ratio",
            "sk.tune chose",
            "tuned / fastest",
            "tuned CPU-seconds ratio",
        ],
        rows,
    )


def sec_overhead(results: Path, out: Path, gpu_note: str) -> str:
    d = _load(results, "overhead.json")
    parts = []
    if d is None:
        parts.append(MISSING)
    else:
        parts += [
            _machine(d, results / "overhead.json") + f" devices {d['meta'].get('devices')}",
            "",
            "A train step (`jax.value_and_grad(loss)`) compiled by `sk.jit(step, plan)` vs the "
            "same step by hand with `jax.jit(in_shardings=..., out_shardings=...)` and the "
            "plan's shardings; step times measured alternately in one run; ratio = sk.jit / "
            "jax.jit per pair. `sk.jit(enforce=False)` (XLA picks the layouts between the same "
            "in/out shardings) is timed in the same rotation: enforce=False / jax.jit is "
            "sk.jit's own per-call work, enforced / enforce=False what the pinned replay's "
            "program costs. First call = trace + compile + run after `jax.clear_caches()`.",
            "",
            _overhead_table(d),
        ]
        # a --startup-only run writes overhead_startup.json (the step times stay)
        start = _load(results, "overhead_startup.json") if not d.get("startup") else d
        if start and start.get("startup"):
            if start is not d:
                parts += ["", _machine(start, results / "overhead_startup.json")]
            parts += [
                "",
                "Start-up on 8 CPU devices (data=2 × model=4), each side from cold jax and "
                "spmdkit caches, sides alternated: `sk.init_sharded` vs `jax.jit(init, "
                "out_shardings=...)`, the first `sk.jit` call vs the first `jax.jit` call with "
                "the same shardings, `sk.plan(..., 'auto')` on a freshly described model.",
                "",
                _startup_table(start),
            ]
    auto = d.get("auto_vs_presets") if d is not None else None
    if auto and auto.get("rows"):
        timing = {r.get("timing") for r in auto["rows"]}
        how = (
            "timed by `time_plans` (what `sk.tune` times with): three passes, the order "
            "reversed each pass, each plan in its own block with only its own arrays alive "
            "(state donated, as `train` runs it); a plan's step = the least of its passes' "
            "median steps; ratio = auto's (or `sk.tune`'s) / the fastest preset's"
            if timing == {"time_plans_passes"}
            else "timed in its own block with only its own arrays alive (state donated, as "
            "`train` runs it); ratio = median of the ratios of the i-th steps of auto's block "
            "and the fastest preset's"
            if timing == {"own_arrays_alone"}
            else "timed in rounds (every plan once a round, the order rotated, every plan's "
            "arrays alive at once); ratio = median of the per-round ratios auto / the fastest "
            "preset"
        )
        parts += [
            "",
            _machine(auto, results / "overhead.json"),
            "",
            "Auto's plan against every preset on 8 CPU devices: each distinct plan's "
            f"`sk.jit(sk.train_step(...))` step {how} (wall clock), and the same of the "
            "process's CPU seconds.",
            "",
            _auto_vs_presets_table(auto),
        ]
    g = _load(results, "overhead_gpu.json")
    parts += ["", "### GPU", ""]
    if g is not None:
        parts += [_machine(g, results / "overhead_gpu.json"), "", _overhead_table(g)]
    else:
        parts.append(gpu_note)
    return "\n".join(parts)


SECTIONS = [
    ("Rule inference latency", "rules"),
    ("Ops: bytes and memory vs XLA's own propagation", "ops"),
    ("Propagation and planner time vs model and mesh size", "propagate"),
    ("Real-size plans vs published throughput", "real_size"),
    ("Pipelines: best pipelined vs best non-pipelined plan", "pipelines"),
    ("Plan quality: auto vs presets", "quality"),
    ("Prediction accuracy: predicted vs compiled", "prediction"),
    ("Measured beside predicted: step time and peak memory", "measure"),
    ("Measured on a GPU: step time and peak memory", "measure_gpu"),
    ("Kernels on a GPU: prices beside timings", "kernels_gpu"),
    ("Checkpoint throughput vs raw orbax and the disk", "checkpoint"),
    ("Runtime overhead: sk.jit vs jax.jit", "overhead"),
]


def write_report(
    results: Path, out: Path, status: list[dict[str, Any]] | None, gpu_note: str
) -> Path:
    """Write REPORT.md (and PNGs) into ``out`` from the JSON in ``results``."""
    out.mkdir(parents=True, exist_ok=True)
    funcs = {
        "rules": sec_rules,
        "ops": sec_ops,
        "propagate": sec_propagate,
        "real_size": sec_real_size,
        "pipelines": sec_pipelines,
        "quality": sec_quality,
        "prediction": sec_prediction,
        "measure": sec_measure,
        "measure_gpu": sec_measure_gpu,
        "kernels_gpu": sec_kernels_gpu,
        "checkpoint": sec_checkpoint,
    }
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    lines = [
        "# spmdkit benchmark report",
        "",
        f"Generated {now} by `benchmarks/run_all.py` on {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}. Each section says "
        "where its figures were measured. Machines are shared and noisy; ratios within one "
        "run are more reliable than absolute times.",
        "",
    ]
    if status is not None:
        lines += ["## Runs", ""]
        lines.append(
            _table(
                ["script", "args", "exit", "seconds"],
                [[s["script"], " ".join(s["args"]), s["rc"], s["seconds"]] for s in status],
            )
        )
        for s in status:
            if s["rc"]:
                lines += ["", f"**{s['script']} failed** (exit {s['rc']}); output tail:", ""]
                lines += ["```", s["tail"].rstrip(), "```"]
        lines.append("")
    for title, key in SECTIONS:
        lines += [f"## {title}", ""]
        try:
            if key == "overhead":
                body = sec_overhead(results, out, gpu_note)
            else:
                body = funcs[key](results, out)
        except Exception as e:
            body = f"_Could not render this section: {type(e).__name__}: {e}_"
        lines += [body, ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def _has_gpu() -> bool:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import jax; print(jax.default_backend())"],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.stdout.strip().endswith("gpu")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks (unless ``--no-run``) and write the report."""
    ap = argparse.ArgumentParser(description="Run all benchmarks and write REPORT.md.")
    ap.add_argument("--no-run", action="store_true", help="only regenerate REPORT.md from JSON")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="also run overhead.py on the GPU (tiny and larger GPT/Llama; device name, MFU)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke-run flags for every script (about 2 min)"
    )
    ap.add_argument("--results", default=str(RESULTS), help="folder with the JSON")
    ap.add_argument("--out-dir", default=None, help="folder for REPORT.md and PNGs")
    args = ap.parse_args(argv)
    results = Path(args.results)
    out = Path(args.out_dir) if args.out_dir else results
    gpu_note = "_Not run: no `--gpu` run on a machine with a GPU has produced overhead_gpu.json._"
    gpu = False
    if args.gpu and not args.no_run:
        gpu = _has_gpu()
        if not gpu:
            gpu_note = "_Not run: `--gpu` was given but this machine has no GPU backend._"
    status = None
    t0 = time.perf_counter()
    if not args.no_run:
        results.mkdir(parents=True, exist_ok=True)
        status = run_scripts(results, gpu, args.quick)
    path = write_report(results, out, status, gpu_note)
    print(f"wrote {path} ({time.perf_counter() - t0:.1f}s)")
    failed = [s["script"] for s in status or [] if s["rc"]]
    if failed:
        print("failed:", ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

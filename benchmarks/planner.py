"""How long planning takes, and how good the plans are (no devices needed).

1. Planning time for Llama-3 8B and 70B (stacked layers, one 8192-token sequence
   per device, Adam) on abstract meshes of 8, 64, 512 and 4096 devices
   (``data × model`` with 8-way model axes): ``describe`` (abstract build), then
   ``plan(strategy="auto")``: trace the train step, analytic search, and
   propagation of the presets and the best searched candidates through the step.
2. Plan quality (again one sequence per device): for each model and mesh, the
   estimated step time, communication bytes per device and memory per device of
   every preset and of ``auto`` (propagate estimator).

Prints both tables and saves ``benchmarks/results/planner.json``.

Run: ``python benchmarks/planner.py [--quick]`` (``--quick``: 8B only, two meshes).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import spmdkit as sk
from spmdkit.flax import describe
from spmdkit.models import get_model
from spmdkit.planner import PRESETS, plan

MESHES = {8: (1, 8), 64: (8, 8), 512: (64, 8), 4096: (512, 8)}
QUALITY = [
    ("gpt", "124m", (8, 64)),
    ("llama", "8b", (64, 512)),
    ("llama", "70b", (512, 4096)),
    ("moe", "mixtral_8x7b", (64, 512)),
]


def _mesh(n: int):
    data, model = MESHES[n]
    return sk.abstract_mesh(data=data, model=model)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def timing(models: list[str], meshes: list[int]) -> list[dict]:
    """Planning time per model and mesh."""
    rows = []
    for size in models:
        spec = get_model("llama")
        first = True
        for n in meshes:
            t0 = time.perf_counter()
            info = describe(spec, config=size, batch_size=n)
            t_describe = time.perf_counter() - t0
            t1 = time.perf_counter()
            p = plan(info, _mesh(n), "auto")
            t_plan = time.perf_counter() - t1
            rows.append(
                {
                    "model": f"llama-{size}",
                    "devices": n,
                    "mesh": dict(zip(("data", "model"), MESHES[n], strict=True)),
                    "describe_s": t_describe,
                    "plan_s": t_plan,
                    "total_s": t_plan + t_describe,
                    "chosen": p.chosen,
                    "step_time_s": p.cost.step_time_s,
                }
            )
            print(
                f"llama-{size:<4} {n:>5} devices: describe {t_describe:.2f} s, "
                f"trace + search {t_plan:.2f} s{' (first: jax warm-up)' if first else ''} "
                f"→ {p.chosen}",
                flush=True,
            )
            first = False
    return rows


def quality(cases: list) -> list[dict]:
    """Preset and auto costs per model and mesh."""
    rows = []
    for name, size, meshes in cases:
        for n in meshes:
            info = describe(get_model(name), config=size, batch_size=n)
            mesh = _mesh(n)
            for strategy in (*PRESETS, "auto"):
                try:
                    p = plan(info, mesh, strategy)
                except sk.SpmdError as e:
                    print(f"  {name}-{size} {n} {strategy}: {e}")
                    continue
                c = p.cost
                rows.append(
                    {
                        "model": f"{name}-{size}",
                        "devices": n,
                        "strategy": strategy,
                        "chosen": p.chosen,
                        "step_time_s": c.step_time_s,
                        "compute_s": c.compute_time_s,
                        "comm_s": c.comm_time_s,
                        "comm_bytes": c.total_comm_bytes,
                        "memory_bytes": c.peak_bytes,
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    models = ["8b"] if args.quick else ["8b", "70b"]
    meshes = [8, 512] if args.quick else [8, 64, 512, 4096]
    print("== planning time (describe + trace + auto search) ==")
    t_rows = timing(models, meshes)
    print("\n== plan quality (estimated, per device; 80 GiB budget) ==")
    q_rows = quality(QUALITY[:2] if args.quick else QUALITY)
    print(f"{'model':<20}{'dev':>6}  {'strategy':<12}{'step ms':>10}{'comm GiB':>10}{'mem GiB':>9}")
    for r in q_rows:
        label = r["strategy"] + (f"={r['chosen']}" if r["strategy"] == "auto" else "")
        print(
            f"{r['model']:<20}{r['devices']:>6}  {label[:30]:<12}{r['step_time_s'] * 1e3:>10.1f}"
            f"{_gib(r['comm_bytes']):>10}{_gib(r['memory_bytes']):>9}"
        )
    out = Path(__file__).parent / "results" / "planner.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()} {platform.processor()}".strip(),
                "timing": t_rows,
                "quality": q_rows,
            },
            indent=1,
        )
    )
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()

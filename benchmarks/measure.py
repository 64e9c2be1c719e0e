"""Measured beside predicted: the reference models' train steps timed on the devices present.

For each reference model (``spmdkit.models.get_model``) and strategy (dp, fsdp,
megatron, auto) on a ``data x model`` mesh of the devices present: plan the step
(adam, the plain recipe), compile it with ``sk.jit(sk.train_step(...), plan,
donate_state=True)`` (the step ``sk.train`` runs: parameters and optimizer state are
updated in their own buffers, as the plan's peak assumes), run warm-up steps, then
time ``--steps`` steps by wall clock (each ended with ``jax.block_until_ready``),
and print the plan's predicted step time and peak memory beside the measured median
step and the compiled peak (``memory_analysis()``: arguments + outputs - aliased +
temporaries, per device). ``plan.verify`` on the
same executable adds the collective bytes and verify's verdict.

What the prediction is for:
  GPU      the device's own :class:`~spmdkit.topology.Topology` (H100 SXM figures
           for an H100 or H200, A100 SXM for an A100), bf16 compute with fp32
           master weights; the batch doubles until dp's predicted peak fills about
           half the device's memory (``--batch`` sets it instead), at the model's
           :data:`GPU_CONFIG` size with :data:`GPU_OVERRIDES` (Llama 3 8B's layer
           and vocabulary, two layers; Qwen3-30B-A3B's and the 16B DeepSeek's
           widths, experts and vocabulary with one or two MoE layers), so the step
           is compute-bound as in training.
  CPU      a CPU topology measured here before the cases: the f32 matmul FLOP/s one
           virtual device gets while all run at once (``peak_flops``, efficiencies 1,
           no GEMM tiles), the bus bandwidth of an all-reduce over all of them (every
           mesh axis's link) and an elementwise pass's bytes/s (``hbm_bandwidth``).
           The CPU numbers are printed as such: they check the model's terms on
           this host, not a GPU's step time. Tiny configs, a small batch.

Saved as JSON (``benchmarks/results/measure.json``, or ``--out``)::

    {"benchmark": "measure", "date", "jax", "platform": "cpu"|"gpu"|...,
     "device_kind", "devices", "cpu_count", "machine", "load_average_1m",
     "quick": bool,
     "topology": {"name", "peak_flops", "link_bandwidth", "memory_bandwidth", "source"},
     "cases": [{"model", "config", "strategy", "recipe", "chosen", "mesh", "batch",
                "steps", "predicted_step_s", "measured_step_s",
                "measured_step_s_p25", "measured_step_s_p75", "step_ratio",
                "planned_peak_bytes", "planned_ratio", "predicted_peak_bytes",
                "predicted_peak_low", "predicted_peak_high",
                "compiled_peak_bytes", "memory_ratio", "compiled_memory": {"arguments",
                "outputs", "aliased", "temporaries"}, "collective_bytes":
                {kind: {"predicted", "compiled"}}, "verify_ok", "compile_s"}]}

``step_ratio`` is predicted / measured. ``planned_peak_bytes`` is the plan's
``cost.peak_bytes`` (for the planned device); ``predicted_peak_low``/``high`` is
``plan.verify``'s range for the platform that compiled (on CPU it adds what XLA:CPU
allocates there), ``predicted_peak_bytes`` its point nearest the compiled peak, and
``memory_ratio`` that point / compiled; ``planned_ratio`` is ``planned_peak_bytes`` /
compiled, and ``compiled_memory`` ``memory_analysis()``'s parts (per device).
``chosen`` is what auto picked (the preset's name otherwise). A case that fails
records ``"error"`` instead of the figures.

Run: ``python benchmarks/measure.py [--quick] [--models gpt,llama]
[--strategies dp,fsdp,megatron,auto] [--steps N] [--batch gpt=16,llama=2]
[--remat POLICY] [--master optimizer] [--out PATH]``
(``--quick``: tiny GPT only, 3 timed steps; a smoke run of the slow test step).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform as platform_module
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

# 8 virtual devices when the host's CPU is what runs (no effect on a GPU's platform)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spmdkit as sk
from spmdkit.step.master import opt_init
from spmdkit.topology import Topology

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGIES = ("dp", "fsdp", "megatron", "auto")
#: Config per model on a GPU (the batch then fills the device) and on CPU.
GPU_CONFIG = {
    "gpt": "350m",
    "llama": "8b",
    "moe": "tiny",
    "convnet": "tiny",
    "qwen3_moe": "30b_a3b",
    "deepseek": "16b",
}
#: Config fields replaced on a GPU: Llama 3 8B's layer and vocabulary, two layers;
#: Qwen3-30B-A3B's two MoE layers; the 16B DeepSeek's dense first layer and one MoE
#: layer (the step of one device fits; the shapes are the real model's).
GPU_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"n_layers": 2},
    "qwen3_moe": {"n_layers": 2},
    "deepseek": {"n_layers": 2},
}
CPU_CONFIG = {
    "gpt": "tiny",
    "llama": "tiny",
    "moe": "tiny",
    "convnet": "tiny",
    "qwen3_moe": "tiny",
    "deepseek": "tiny",
}
CPU_BATCH = 16


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Predicted vs measured step time and memory.")
    ap.add_argument("--quick", action="store_true", help="tiny GPT only, few steps")
    ap.add_argument("--models", default="gpt,llama", help="comma-separated model names")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    ap.add_argument("--out", default=str(RESULTS / "measure.json"), help="JSON path")
    ap.add_argument("--remat", default="none", help="recompute policy on an accelerator")
    ap.add_argument(
        "--master",
        default="params",
        choices=("params", "optimizer"),
        help="where the fp32 master weights live on an accelerator (Recipe.master_weights)",
    )
    ap.add_argument(
        "--batch",
        default="",
        help="model=N,... batch sizes on an accelerator instead of filling half the memory",
    )
    return ap.parse_args(argv)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _mesh_shape(n: int) -> tuple[int, int]:
    """``(data, model)`` for ``n`` devices: a model axis of up to 4, the rest data."""
    model = max(d for d in (1, 2, 4) if n % d == 0 and d <= max(1, n // 2))
    return n // model, model


def _timed(fn: Any, repeat: int) -> float:
    """Median wall-clock seconds of ``fn()`` (blocked until ready) over ``repeat`` runs."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_topology(mesh: jax.sharding.Mesh, quick: bool) -> tuple[Topology, dict]:
    """A :class:`Topology` of this host's virtual devices, measured: the f32 matmul
    rate each device gets while all run one at once, and the bus bandwidth of an
    all-reduce over every device (``2 (n-1)/n`` bytes moved per byte reduced)."""
    n = mesh.size
    size = 256 if quick else 512
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    a = jax.device_put(jnp.ones((n, size, size), jnp.float32), spec)
    matmul = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), out_shardings=spec)
    flops = 2 * size**3 / _timed(lambda: matmul(a), 3 if quick else 5)
    elems = (1 << 18) if quick else (1 << 20)
    row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    x = jax.device_put(jnp.ones((n, elems), jnp.float32), row)
    reduce = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, mesh.axis_names),
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec(mesh.axis_names),
            out_specs=jax.sharding.PartitionSpec(mesh.axis_names),
        )
    )
    seconds = _timed(lambda: reduce(x), 3 if quick else 5)
    bandwidth = 2 * (n - 1) / n * elems * 4 / seconds
    scale = jax.jit(lambda v: v * 1.5 + 1.0, out_shardings=row)
    memory = 2 * elems * 4 / _timed(lambda: scale(x), 3 if quick else 5)  # read + write
    topo = Topology(
        default_bandwidth=bandwidth,
        default_latency=0.0,
        gpus_per_node=None,
        peak_flops={"float32": flops, "tfloat32": flops, "bfloat16": flops},
        matmul_efficiency=1.0,
        attention_efficiency=1.0,
        hbm_bandwidth=memory,
        sm_count=1,  # a core runs a GEMM: no waves, no tiles to quantize
        gemm_tile=(1, 1),
        k_ramp=0,
    )
    facts = {
        "name": "cpu (measured here)",
        "peak_flops": flops,
        "link_bandwidth": bandwidth,
        "memory_bandwidth": memory,
        "source": f"{size}^3 f32 matmul per device, all {n} at once; all-reduce of "
        f"{elems * 4 >> 10} KiB per device; an elementwise pass over it",
    }
    return topo, facts


def gpu_topology(kind: str) -> tuple[Topology, dict]:
    """The planner's topology for a GPU by its device kind (H100 figures by default)."""
    if "A100" in kind:
        return Topology.a100(), {"name": "a100", "source": "Topology.a100()"}
    topo = Topology.h100()
    return topo, {
        "name": "h100",
        "peak_flops": topo.peak("bfloat16"),
        "source": "Topology.h100()" + ("" if "H100" in kind else f" (planned for {kind})"),
    }


def _setup(
    model: str, config: str, batch_size: int, overrides: dict | None = None
) -> tuple[Any, dict]:
    spec = sk.models.get_model(model)
    cfg = dataclasses.replace(spec.configs[config](), **(overrides or {}))
    batch = spec.batch(cfg, batch_size, np.random.default_rng(0))
    return sk.describe(spec, config=cfg, batch=batch), batch


def _recipe(platform: str, remat: str, master: str) -> Any:
    """The plain step on CPU; bf16 compute (fp32 master weights: in the parameters,
    or with ``--master optimizer`` in the optimizer state beside bf16 parameters)
    on an accelerator, as training runs there, with ``--remat``'s policy."""
    if platform == "cpu":
        return sk.Recipe()
    return sk.Recipe(compute_dtype="bfloat16", remat=remat, master_weights=master)


def _plan(info: Any, mesh: Any, strategy: str, topo: Topology, opt: Any, recipe: Any) -> Any:
    kw: dict[str, Any] = {"topology": topo, "optimizer": opt}
    if strategy == "auto" or not recipe.is_default:
        kw["recipe"] = recipe  # auto searches the layout only, for the same step
    return sk.plan(info, mesh, strategy, **kw)


def _fill_batch(
    model: str,
    config: str,
    mesh: Any,
    topo: Topology,
    opt: Any,
    recipe: Any,
    overrides: dict | None = None,
) -> int:
    """The largest power-of-two batch whose dp plan's predicted peak is at most half
    the device's memory (at least the data axis; at most 256)."""
    limit = jax.devices()[0].memory_stats() or {}
    budget = 0.5 * limit.get("bytes_limit", 16 << 30)
    batch = mesh.shape["data"]
    while batch < 256:
        info, _ = _setup(model, config, 2 * batch, overrides)
        if _plan(info, mesh, "dp", topo, opt, recipe).cost.peak_bytes > budget:
            break
        batch *= 2
    return batch


def measure_case(
    model: str,
    config: str,
    batch_size: int,
    strategy: str,
    mesh: Any,
    topo: Topology,
    args: Any,
    overrides: dict | None = None,
) -> dict:
    """Plan, compile, run and time one case; the figures as a JSON-ready dict."""
    info, batch = _setup(model, config, batch_size, overrides)
    opt = optax.adam(1e-3)
    p = _plan(info, mesh, strategy, topo, opt, args.recipe)
    params = sk.init_sharded(info, p)
    init = opt_init(opt, p.recipe)  # the fp32 master inside under --master optimizer
    opt_state = jax.jit(init, out_shardings=p.opt_shardings(jax.eval_shape(init, params)))(params)
    # the state donated, as sk.train runs it: the plan's peak reuses the parameters'
    # and optimizer state's buffers for their updates (cost.memory's outputs are
    # the loss alone), so an undonated step would hold both copies beside it
    step = sk.jit(sk.train_step(info, opt, p), p, donate_state=True)
    t0 = time.perf_counter()
    mem = step.compile(params, opt_state, batch).memory_analysis()
    compile_s = time.perf_counter() - t0
    report = p.verify(step, params, opt_state, batch)
    carried = [params, opt_state]
    for _ in range(args.warmup):
        carried[0], carried[1], _ = step(carried[0], carried[1], batch)
    jax.block_until_ready(carried)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        carried[0], carried[1], loss = step(carried[0], carried[1], batch)
        jax.block_until_ready((carried, loss))
        times.append(time.perf_counter() - t0)
    rows = {what: (int(pred), int(comp)) for what, pred, comp, _ in report.rows}
    low, high = report.ranges.get("peak memory", (0, 0))
    measured = statistics.median(times)
    compiled_peak = rows["peak memory"][1]
    return {
        "model": model,
        "config": config + "".join(f",{k}={v}" for k, v in (overrides or {}).items()),
        "strategy": strategy,
        "recipe": p.recipe.short(),
        "chosen": getattr(p, "chosen", None) or strategy,
        "mesh": "x".join(str(s) for s in mesh.shape.values()),
        "batch": batch_size,
        "steps": len(times),
        "predicted_step_s": p.cost.step_time_s,
        "measured_step_s": measured,
        "measured_step_s_p25": _pct(times, 0.25),
        "measured_step_s_p75": _pct(times, 0.75),
        "step_ratio": p.cost.step_time_s / measured,
        "planned_peak_bytes": int(p.cost.peak_bytes),
        "planned_ratio": p.cost.peak_bytes / compiled_peak,
        "predicted_peak_bytes": rows["peak memory"][0],
        "predicted_peak_low": int(low),
        "predicted_peak_high": int(high),
        "compiled_peak_bytes": compiled_peak,
        "memory_ratio": rows["peak memory"][0] / compiled_peak,
        "compiled_memory": {
            "arguments": int(mem.argument_size_in_bytes),
            "outputs": int(mem.output_size_in_bytes),
            "aliased": int(mem.alias_size_in_bytes),
            "temporaries": int(mem.temp_size_in_bytes),
        },
        "collective_bytes": {
            what: {"predicted": pred, "compiled": comp}
            for what, (pred, comp) in rows.items()
            if what not in ("peak memory", "collectives total")
        },
        "verify_ok": bool(report.ok),
        "compile_s": compile_s,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:9.2f}"


def table(result: dict) -> str:
    """The cases as a printed table (step times in ms, memory in MiB per device)."""
    platform = result["platform"]
    head = (
        f"{result['device_kind']} x{result['devices']} ({platform}); predicted with the "
        f"{result['topology']['name']} topology"
        + (" - CPU figures, not a GPU's" if platform == "cpu" else "")
    )
    cols = (
        f"{'model':<10}{'config':<20}{'strategy':<10}{'chosen':<12}{'mesh':<6}{'batch':>6}"
        f"{'pred ms':>10}{'meas ms':>10}{'ratio':>7}{'plan MiB':>10}{'pred MiB':>10}"
        f"{'comp MiB':>10}{'ratio':>7}  verify"
    )
    lines = [head, cols]
    for c in result["cases"]:
        who = f"{c['model']:<10}{str(c['config'])[:19]:<20}{c['strategy']:<10}"
        if "error" in c:
            lines.append(f"{who}error: {c['error'][:100]}")
            continue
        lines.append(
            f"{who}{str(c['chosen'])[:11]:<12}{c['mesh']:<6}{c['batch']:>6}"
            f"{_ms(c['predicted_step_s']):>10}{_ms(c['measured_step_s']):>10}"
            f"{c['step_ratio']:7.2f}{c['planned_peak_bytes'] / 2**20:10.2f}"
            f"{c['predicted_peak_bytes'] / 2**20:10.2f}"
            f"{c['compiled_peak_bytes'] / 2**20:10.2f}{c['memory_ratio']:7.2f}  "
            + ("ok" if c["verify_ok"] else "MISMATCH")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the table, write the JSON; 1 if a case failed."""
    args = _parse(argv)
    # many plans, whose notes are no figure: sk.plan's PlanNoteWarnings would bury the table
    warnings.filterwarnings("ignore", category=sk.PlanNoteWarning)
    models = ["gpt"] if args.quick else args.models.split(",")
    strategies = args.strategies.split(",")
    args.steps = args.steps or (3 if args.quick else 10)
    devices = jax.devices()
    platform = devices[0].platform
    args.recipe = _recipe(platform, args.remat, args.master)
    data, model_axis = _mesh_shape(len(devices))
    mesh = sk.make_mesh(data=data, model=model_axis)
    if platform == "cpu":
        topo, facts = cpu_topology(mesh, args.quick)
    else:
        topo, facts = gpu_topology(devices[0].device_kind)
    cases = []
    for name in models:
        config = (CPU_CONFIG if platform == "cpu" else GPU_CONFIG)[name]
        over = None if platform == "cpu" else GPU_OVERRIDES.get(name)
        fixed = dict(kv.split("=") for kv in args.batch.split(",") if kv)
        if platform == "cpu":
            batch = CPU_BATCH
        elif name in fixed:
            batch = int(fixed[name])
        else:
            batch = _fill_batch(name, config, mesh, topo, optax.adam(1e-3), args.recipe, over)
        for strategy in strategies:
            try:
                cases.append(measure_case(name, config, batch, strategy, mesh, topo, args, over))
            except Exception as e:  # a failing case is recorded, the others still run
                cases.append(
                    {"model": name, "config": config, "strategy": strategy, "error": repr(e)}
                )
    result = {
        "benchmark": "measure",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "platform": platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "cpu_count": os.cpu_count(),
        "machine": platform_module.machine(),
        "load_average_1m": os.getloadavg()[0],
        "quick": bool(args.quick),
        "topology": facts,
        "cases": cases,
    }
    print(table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {out}")
    return int(any("error" in c for c in cases))


if __name__ == "__main__":
    raise SystemExit(main())

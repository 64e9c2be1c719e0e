"""The step-time model's kernel prices beside the kernels timed on the device present.

The planner prices a step per equation (``spmdkit.topology.Topology``): weight
matmuls by :meth:`~spmdkit.topology.Topology.matmul_time` (the peak for the dtype x
a GEMM-shape efficiency, against streaming the operands through HBM), memory-bound
work by :meth:`~spmdkit.topology.Topology.memory_time` (bytes over HBM bandwidth),
fused causal attention by its matmul FLOPs x the kernel's causal share over the peak
x ``attention_efficiency``. This script times each kind of kernel alone on the first
device and prints the price beside the time:

* **GEMMs** ``m x k @ k x n`` in bf16 at the shapes of Llama 3 8B / 70B layers
  (``m`` tokens per device, under FSDP and under tensor-parallel splits) and small
  ones, with ``jnp.dot`` under ``jax.jit``;
* **elementwise**: one fused pass ``y = 1.5 x + 1`` (read + write);
* **attention**: causal GQA attention forward + backward
  (``jax.nn.dot_product_attention``; ``implementation="cudnn"`` on a GPU: the fused
  kernel the calibration rows ran);
* **grouped GEMMs** (``jax.lax.ragged_dot``): one device's routed experts at
  DeepSeek-V3's and Qwen3-MoE's shapes under their published expert-parallel
  degrees, 128 to 8,192 rows per expert, priced as the planner prices them (the
  GEMM roofline at the rows per local expert), beside the same FLOPs as a dense
  batched GEMM.

Each case: the median of ``--repeat`` timings, each of ``--calls`` calls dispatched
back to back and blocked once (so dispatch overhead hides behind the kernels), with
three rotating input sets (so no case runs out of the L2 cache alone). On a GPU the
prices are the device's own topology's (``Topology.h100()`` for an H100/H200,
``Topology.a100()`` for an A100); on CPU the shapes are small and the prices use the
H100 constants, printed as such: the CPU run checks the script, not the model.

Saved as JSON (``benchmarks/results/kernels.json``, or ``--out``)::

    {"benchmark": "kernels", "date", "jax", "platform", "device_kind", "topology",
     "cases": [{"kind": "gemm"|"elementwise"|"attention"|"ragged", "label", "shape",
                "flops", "bytes", "predicted_s", "measured_s", "ratio",
                "measured_tflops", "measured_gbps", "efficiency_predicted",
                "efficiency_measured"}]}

A grouped GEMM's ``shape`` is ``[experts, rows per expert, k, n]``. ``ratio`` is
predicted / measured; ``efficiency_*`` is FLOP/s over the dtype's peak
(GEMMs and attention) or bytes/s over ``hbm_bandwidth`` (elementwise).

Run: ``python benchmarks/kernels.py [--out PATH] [--repeat N] [--calls N]
[--kinds gemm,elementwise,attention,ragged]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from spmdkit.topology import Topology

RESULTS = Path(__file__).resolve().parent / "results"

#: (label, m, k, n) on a GPU: tokens per device x the layer's weight.
GPU_GEMMS = (
    ("8B qkv, 16k tokens", 16384, 4096, 6144),
    ("8B out, 16k tokens", 16384, 4096, 4096),
    ("8B mlp up, 16k tokens", 16384, 4096, 14336),
    ("8B mlp down, 16k tokens", 16384, 14336, 4096),
    ("70B mlp up, 8k tokens", 8192, 8192, 28672),
    ("70B mlp down, 8k tokens", 8192, 28672, 8192),
    ("70B mlp up / TP 8, 8k", 8192, 8192, 3584),
    ("70B out / TP 8, 8k", 8192, 1024, 8192),
    ("70B mlp up / TP 4, 1 seq 8k / CP 2", 4096, 8192, 7168),
    ("350M mlp up, 8k tokens", 8192, 1024, 4096),
    ("square 8192", 8192, 8192, 8192),
    ("square 2048", 2048, 2048, 2048),
    ("decode-like 64 rows", 64, 8192, 8192),
)
CPU_GEMMS = (("square 256", 256, 256, 256), ("narrow 64 rows", 64, 512, 256))
#: (label, batch, seq, q heads, kv heads, head dim)
GPU_ATTENTION = (
    ("8B layer, 2 x 8k", 2, 8192, 32, 8, 128),
    ("70B layer / TP 8, 1 x 8k", 1, 8192, 8, 1, 128),
    ("GPT 350M, 8 x 1k", 8, 1024, 16, 16, 64),
)
CPU_ATTENTION = (("tiny", 1, 256, 4, 2, 32),)
#: (label, local experts, model width, expert hidden width): one device's experts
#: under the published expert-parallel degrees.
GPU_RAGGED = (
    ("DeepSeek-V3, EP 64", 4, 7168, 2048),
    ("Qwen3-30B-A3B, EP 16", 8, 2048, 768),
    ("Qwen3-235B-A22B, EP 16", 8, 4096, 1536),
)
#: rows each local expert multiplies per call (tokens per expert)
GPU_RAGGED_ROWS = (128, 512, 2048, 8192)
CPU_RAGGED = (("tiny", 4, 128, 64),)
CPU_RAGGED_ROWS = (32, 128)
KINDS = ("gemm", "elementwise", "attention", "ragged")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Kernel prices beside kernel timings.")
    ap.add_argument("--out", default=str(RESULTS / "kernels.json"), help="JSON path")
    ap.add_argument("--repeat", type=int, default=5, help="timings per case (median)")
    ap.add_argument("--calls", type=int, default=10, help="calls per timing")
    ap.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}"
    )
    return ap.parse_args(argv)


def timed(fn: Any, inputs: list[tuple], repeat: int, calls: int) -> float:
    """Median seconds of one ``fn(*inputs[i])`` call: ``calls`` calls rotating over
    ``inputs``, dispatched back to back and blocked once, timed ``repeat`` times after
    a warm-up."""
    jax.block_until_ready([fn(*args) for args in inputs])
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = [fn(*inputs[i % len(inputs)]) for i in range(calls)]
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


def _rand(key: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def gemm_case(topo: Topology, label: str, m: int, k: int, n: int, args: Any) -> dict:
    """One bf16 GEMM timed beside :meth:`Topology.matmul_time`."""
    dt = jnp.bfloat16
    inputs = [(_rand(3 * i, (m, k), dt), _rand(3 * i + 1, (k, n), dt)) for i in range(3)]
    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=dt))
    measured = timed(fn, inputs, args.repeat, args.calls)
    flops = 2.0 * m * k * n
    predicted = topo.matmul_time(flops, m, k, n, "bfloat16", itemsize=2)
    peak = topo.peak("bfloat16")
    return _row("gemm", label, (m, k, n), flops, 2.0 * (m * k + k * n + m * n), predicted,
                measured, flops / predicted / peak, flops / measured / peak)  # fmt: skip


def elementwise_case(topo: Topology, n: int, args: Any) -> dict:
    """One fused elementwise pass over ``n`` bf16 values (read + write)."""
    inputs = [(_rand(i, (n,), jnp.bfloat16),) for i in range(3)]
    fn = jax.jit(lambda x: x * 1.5 + 1.0)
    measured = timed(fn, inputs, args.repeat, args.calls)
    nbytes = 2.0 * n * 2
    predicted = topo.memory_time(nbytes)
    bw = topo.hbm_bandwidth
    label = f"y = 1.5 x + 1, {n * 2 >> 20} MiB bf16"
    return _row("elementwise", label, (n,), 0.0, nbytes, predicted, measured,
                nbytes / predicted / bw, nbytes / measured / bw)  # fmt: skip


def attention_case(topo: Topology, label: str, shape: tuple[int, ...], args: Any) -> dict:
    """Causal GQA attention, forward + backward, beside the planner's price of a fused
    kernel: 7 score/value matmuls of ``2 b h s^2 d`` (forward 2, backward 5) x the
    causal share, over the bf16 peak x ``attention_efficiency``."""
    b, s, h, kvh, d = shape
    impl = "cudnn" if jax.devices()[0].platform == "gpu" else None
    dt = jnp.bfloat16

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    inputs = [
        (_rand(i, (b, s, h, d), dt), _rand(i + 7, (b, s, kvh, d), dt),
         _rand(i + 9, (b, s, kvh, d), dt))
        for i in range(3)
    ]  # fmt: skip
    measured = timed(fn, inputs, args.repeat, args.calls)
    flops = 7 * 2.0 * b * h * s * s * d * topo.causal_share(s)
    peak = topo.peak("bfloat16")
    predicted = flops / (peak * topo.attention_efficiency)
    nbytes = 2.0 * b * s * d * (2 * h + 2 * kvh) * 2  # q, o, k, v and their gradients
    return _row("attention", f"{label} ({impl or 'xla'})", shape, flops, nbytes, predicted,
                measured, flops / predicted / peak, flops / measured / peak)  # fmt: skip


def ragged_cases(topo: Topology, label: str, shape: tuple[int, int, int, int], args: Any
                 ) -> list[dict]:  # fmt: skip
    """One device's grouped GEMMs (``jax.lax.ragged_dot``, bf16) at ``shape`` =
    ``(local experts E, rows per expert r, model width D, hidden width F)``, each
    group ``r`` rows (balanced routing), beside the planner's price of them: the
    GEMM roofline at ``m = r`` (:func:`spmdkit.planner.experts.rows_per_expert`),
    ``k x n`` the weight's. Four cases: the up projection ``[E r, D] x [E, D, F]``
    forward, its backward (the rows' and the weights' cotangents, priced as two
    GEMMs of the forward's shape, as the planner prices a weight's backward), the
    down projection ``[E r, F] x [E, F, D]`` forward, and the up projection as a
    dense batched GEMM ``[E, r, D] x [E, D, F]`` (what the grouped form would run at
    without its ragged bookkeeping)."""
    e, r, d, f = shape
    dt = jnp.bfloat16
    sizes = jnp.full((e,), r, jnp.int32)

    def ragged(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=dt)

    def backward(x: jax.Array, w: jax.Array, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jax.vjp(ragged, x, w)[1](ct)

    up = [(_rand(5 * i, (e * r, d), dt), _rand(5 * i + 1, (e, d, f), dt)) for i in range(3)]
    down = [(_rand(5 * i + 2, (e * r, f), dt), _rand(5 * i + 3, (e, f, d), dt)) for i in range(3)]
    back = [(x, w, _rand(5 * i + 4, (e * r, f), dt)) for i, (x, w) in enumerate(up)]
    dense = [(x.reshape(e, r, d), w) for x, w in up]
    peak = topo.peak("bfloat16")
    flops = 2.0 * e * r * d * f
    nbytes = 2.0 * (e * r * d + e * d * f + e * r * f)
    specs = (
        ("up", jax.jit(ragged), up, (r, d, f), 1),
        ("up backward", jax.jit(backward), back, (r, d, f), 2),
        ("down", jax.jit(ragged), down, (r, f, d), 1),
        ("up as batched dense", jax.jit(lambda x, w: jnp.einsum(
            "erd,edf->erf", x, w, preferred_element_type=dt)), dense, (r, d, f), 1),
    )  # fmt: skip
    rows = []
    for part, fn, inputs, (m, k, n), gemms in specs:
        measured = timed(fn, inputs, args.repeat, args.calls)
        predicted = topo.matmul_time(gemms * flops, m, k, n, "bfloat16", itemsize=2)
        work = gemms * flops
        rows.append(_row("ragged", f"{label}, {r} rows/expert, {part}", (e, r, k, n), work,
                         gemms * nbytes, predicted, measured, work / predicted / peak,
                         work / measured / peak))  # fmt: skip
    return rows


def _row(kind: str, label: str, shape: tuple, flops: float, nbytes: float, predicted: float,
         measured: float, eff_pred: float, eff_meas: float) -> dict:  # fmt: skip
    return {
        "kind": kind,
        "label": label,
        "shape": list(shape),
        "flops": flops,
        "bytes": nbytes,
        "predicted_s": predicted,
        "measured_s": measured,
        "ratio": predicted / measured,
        "measured_tflops": flops / measured / 1e12,
        "measured_gbps": nbytes / measured / 1e9,
        "efficiency_predicted": eff_pred,
        "efficiency_measured": eff_meas,
    }


def table(result: dict) -> str:
    """The cases as a printed table (times in ms)."""
    head = f"{result['device_kind']} ({result['platform']}, jax {result['jax']}); " + (
        f"priced with the {result['topology']} topology"
        + (" - CPU timings, not a GPU's" if result["platform"] == "cpu" else "")
    )
    cols = (
        f"{'kind':<12}{'case':<62}{'pred ms':>10}{'meas ms':>10}{'ratio':>7}"
        f"{'TFLOP/s':>9}{'GB/s':>8}{'eff pred':>9}{'eff meas':>9}"
    )
    lines = [head, cols]
    for c in result["cases"]:
        if "error" in c:
            lines.append(f"{c['kind']:<12}{c['label'][:61]:<62}error: {c['error'][:80]}")
            continue
        lines.append(
            f"{c['kind']:<12}{c['label'][:61]:<62}{c['predicted_s'] * 1e3:10.3f}"
            f"{c['measured_s'] * 1e3:10.3f}{c['ratio']:7.2f}{c['measured_tflops']:9.1f}"
            f"{c['measured_gbps']:8.0f}{c['efficiency_predicted']:9.3f}"
            f"{c['efficiency_measured']:9.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Time the cases, print the table, write the JSON; 1 if a case failed."""
    args = _parse(argv)
    device = jax.devices()[0]
    gpu = device.platform == "gpu"
    a100 = "A100" in device.device_kind
    topo = Topology.a100() if a100 else Topology.h100()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"kernels.py: --kinds {','.join(unknown)}: not one of {', '.join(KINDS)}")
    cases: list[dict] = []
    runs: list[tuple[str, str, Any]] = [
        ("gemm", label, lambda m=m, k=k, n=n, label=label: gemm_case(topo, label, m, k, n, args))
        for label, m, k, n in (GPU_GEMMS if gpu else CPU_GEMMS)
    ]
    n = (1 << 29) if gpu else (1 << 20)
    runs.append(("elementwise", "pass", lambda: elementwise_case(topo, n, args)))
    runs += [
        ("attention", label, lambda label=label, s=s: attention_case(topo, label, s, args))
        for label, *s in (GPU_ATTENTION if gpu else CPU_ATTENTION)
    ]
    runs += [
        ("ragged", f"{label}, {r} rows/expert",
         lambda label=label, s=(e, r, d, f): ragged_cases(topo, label, s, args))
        for label, e, d, f in (GPU_RAGGED if gpu else CPU_RAGGED)
        for r in (GPU_RAGGED_ROWS if gpu else CPU_RAGGED_ROWS)
    ]  # fmt: skip
    for kind, label, run in runs:
        if kind not in kinds:
            continue
        try:
            got = run()
            cases += got if isinstance(got, list) else [got]
        except Exception as e:  # a failing case is recorded, the others still run
            cases.append({"kind": kind, "label": label, "error": repr(e)})
        print(f"{kind}: {label} done", flush=True)
    result = {
        "benchmark": "kernels",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "topology": "a100" if a100 else "h100",
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

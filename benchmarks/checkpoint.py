"""Checkpoint throughput: spmdkit.runtime.checkpoint.Manager vs raw orbax vs a plain file write.

A ~512 MB state (8 float32 arrays, sharded over a 2x4 mesh of virtual CPU
devices) is saved and restored by

* ``spmdkit``   — :class:`spmdkit.runtime.checkpoint.Manager`: its defaults (checksums, no
  zstd), with zstd as orbax does by default, and without checksums,
* ``orbax``     — raw ``orbax.checkpoint.StandardCheckpointer`` on the same arrays
  (its defaults: zstd compression, no checksums),
* ``file``      — one sequential ``write`` + ``fsync`` of the same bytes (the disk's limit),

and restored onto the same mesh and onto a different mesh and specs (8x1,
transposed specs). Each figure is the median of ``--repeat`` runs, the variants
taking turns; restores read from the page cache after the first run, as they
would right after a save. Ratios are medians of per-round ratios. Peak host RSS
above the starting RSS is sampled every 5 ms during each phase.

Export/import (``--only export``, or part of a full run): a megatron-laid-out
state (column/row-parallel weight pairs, 2x4 mesh) is exported as safetensors
(:mod:`spmdkit.runtime.export`) and imported onto one device and onto a 4x2
FSDP layout, checked bit-exact. During each import the anonymous host memory
(``RssAnon``: numpy buffers and, on CPU, the device buffers) is sampled every
millisecond; *transient* is its peak above the start minus the bytes of the
imported arrays themselves, to compare with the largest tensor. File pages the
reader maps (``RssFile``, reclaimable page cache) are reported apart.

Run: ``python benchmarks/checkpoint.py [--mb 512] [--repeat 5] [--dir /tmp/x]
[--only all|export]``; prints a table and writes ``benchmarks/results/checkpoint.json``
(``--only export`` updates only its ``export_import`` entry).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import orbax.checkpoint as ocp
import psutil
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.runtime.checkpoint import Manager, abstract_target
from spmdkit.runtime.checksums import checksums
from spmdkit.runtime.export import export_params, import_params


class PeakRSS:
    """Samples this process's RSS in a thread; ``peak_mb`` is the peak above the start."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")


class PeakStatus:
    """Samples ``RssAnon`` and ``RssFile`` from /proc/self/status every millisecond;
    peaks above the values at the start, in bytes."""

    def __init__(self) -> None:
        self.base = self.read()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self.read()
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}
            time.sleep(0.001)

    def __enter__(self) -> PeakStatus:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def above(self, key: str) -> int:
        return self.peak[key] - self.base[key]


def export_import(root: str, mb: int) -> dict:
    """Export a megatron-laid-out state, import it onto one device and a 4x2 FSDP
    layout; peak host memory of each import against its largest tensor."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(1)
    # column-parallel (d, 4d) / row-parallel (4d, d) pairs of decreasing size, + biases
    d0 = int((mb * 2**20 / 4 / 8 / 1.9) ** 0.5) // 64 * 64
    params = {}
    for i, d in enumerate([d0, d0 // 2, d0 // 4]):
        specs = {"up": (d, 4 * d, P(None, "model")), "down": (4 * d, d, P("model", None))}
        for name, (a, b, spec) in specs.items():
            params[f"layer{i}/{name}"] = jax.device_put(
                rng.standard_normal((a, b), dtype=np.float32), NamedSharding(mesh, spec)
            )
        params[f"layer{i}/bias"] = jax.device_put(
            rng.standard_normal(4 * d, dtype=np.float32), NamedSharding(mesh, P("model"))
        )
    jax.block_until_ready(params)
    total = sum(x.nbytes for x in params.values())
    largest = max(x.nbytes for x in params.values())
    want = checksums(params)
    out = os.path.join(root, "export")
    t0 = time.perf_counter()
    export_params(params, out, max_file_bytes=largest * 2)
    export_s = time.perf_counter() - t0
    rows = {}
    for name in IMPORT_TARGETS:
        # a fresh process per import: the allocator of an earlier one would hide its peak
        proc = subprocess.run(
            [sys.executable, __file__, "--import-into", name, "--export-dir", out],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        rows[name]["bit_exact"] = rows[name].pop("checksums") == want
    return {
        "date": _utc(time.time()),
        "load_average_1m": os.getloadavg()[0],
        "state_MB": total / 2**20,
        "tensors": len(params),
        "largest_tensor_MB": largest / 2**20,
        "from": "2x4 megatron (column/row-parallel pairs)",
        "export_seconds": export_s,
        "imports": rows,
    }


def _import_shardings(name: str, abstract: dict) -> dict:
    if name == "1 device":
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: one, abstract)
    mesh42 = jax.make_mesh((4, 2), ("fsdp", "model"))

    def fsdp(x: jax.ShapeDtypeStruct) -> NamedSharding:
        spec = P(("fsdp", "model")) if x.ndim == 1 else P(("fsdp", "model"), None)
        return NamedSharding(mesh42, spec)

    return jax.tree.map(fsdp, abstract)


#: The layouts an export is imported onto, one fresh process each.
IMPORT_TARGETS = ("1 device", "4x2 fsdp")


def import_once(name: str, directory: str) -> dict:
    """One import of ``directory`` onto layout ``name``, with its host-memory peaks
    (JSON on stdout: the parent compares the checksums)."""
    from spmdkit.runtime.export import exported_shapes

    abstract = {
        p: jax.ShapeDtypeStruct(s.shape, s.dtype) for p, s in exported_shapes(directory).items()
    }
    target = abstract_target(abstract, _import_shardings(name, abstract))
    jax.block_until_ready(jax.device_put(np.ones(8), jax.devices()[0]))  # backends up
    with PeakStatus() as mem:
        t0 = time.perf_counter()
        got = jax.block_until_ready(import_params(directory, target, verify=False))
        seconds = time.perf_counter() - t0
    resident = sum(s.data.nbytes for x in got.values() for s in x.addressable_shards)
    return {
        "seconds": seconds,
        "result_MB": resident / 2**20,
        "peak_anon_MB": mem.above("RssAnon") / 2**20,
        "transient_MB": (mem.above("RssAnon") - resident) / 2**20,
        "mapped_file_MB": mem.above("RssFile") / 2**20,
        "checksums": checksums(got),
    }


def print_export_import(r: dict) -> None:
    print(
        f"export/import: {r['state_MB']:.0f} MB in {r['tensors']} tensors, largest "
        f"{r['largest_tensor_MB']:.0f} MB, from {r['from']}; export {r['export_seconds']:.2f} s"
    )
    print(
        f"{'import onto':<10}  {'seconds':>8}  {'result MB':>9}  {'peak anon +MB':>13}  "
        f"{'transient MB':>12}  {'mapped file MB':>14}  bit-exact"
    )
    for name, v in r["imports"].items():
        print(
            f"{name:<10}  {v['seconds']:8.3f}  {v['result_MB']:9.0f}  {v['peak_anon_MB']:13.0f}  "
            f"{v['transient_MB']:12.0f}  {v['mapped_file_MB']:14.0f}  {v['bit_exact']}"
        )


def make_state(mb: int) -> tuple[dict, jax.sharding.Mesh]:
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    n = 8
    side = int((mb * 2**20 / n / 4) ** 0.5) // 8 * 8
    rng = np.random.default_rng(0)
    specs = [P("a", "b"), P("b", "a"), P(None, "b"), P("a", None)] * 2
    state = {
        f"w{i}": jax.device_put(
            rng.standard_normal((side, side), dtype=np.float32), NamedSharding(mesh, specs[i])
        )
        for i in range(n)
    }
    return state, mesh


def nbytes(state: dict) -> int:
    return sum(x.nbytes for x in state.values())


def timed_alternately(fns: dict, repeat: int) -> dict[str, tuple[list[float], float]]:
    """Seconds of every round and peak RSS (MB above start) per variant. After one untimed
    warm-up run of each (compilation, page cache), the variants take turns, the
    order rotating every round, so that drift in this shared machine's load hits them
    all alike; each run starts after ``os.sync()``, so none pays for the write-back
    of the one before."""
    names = list(fns)
    for name in names:
        fns[name](repeat)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeat):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            os.sync()  # flush earlier runs' dirty pages, so no run pays for another's
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                fns[name](i)
                times[name].append(time.perf_counter() - t0)
            peaks[name].append(rss.peak_mb)
    return {n: (times[n], max(peaks[n])) for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "results", "checkpoint.json"),
    )
    parser.add_argument("--only", choices=["all", "export"], default="all")
    parser.add_argument("--import-into", choices=IMPORT_TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("--export-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.import_into:
        print(json.dumps(import_once(args.import_into, args.export_dir)))
        return

    root = tempfile.mkdtemp(dir=args.dir, prefix="spmdkit-ckpt-bench-")
    exported = export_import(root, args.mb)
    print_export_import(exported)
    if args.only == "export":
        previous = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                previous = json.load(f)
            # the throughput rows keep the date they were measured on
            previous.setdefault("date", _utc(os.stat(args.out).st_mtime))
        previous["export_import"] = exported
        with open(args.out, "w") as f:
            json.dump(previous, f, indent=2)
        shutil.rmtree(root, ignore_errors=True)
        return
    state, _ = make_state(args.mb)
    size = nbytes(state)
    mb = size / 2**20
    jax.block_until_ready(state)
    rows: dict[str, dict[str, float]] = {}

    rounds: dict[str, list[float]] = {}

    def record(name: str, times: list[float], peak: float) -> None:
        seconds = statistics.median(times)
        rounds[name] = times
        rows[name] = {"seconds": seconds, "MB_per_s": mb / seconds, "peak_rss_MB": peak}

    def speed_ratio(a: str, b: str) -> float:
        # throughput of a over b within each round (same load, same write-back), median
        return statistics.median(tb / ta for ta, tb in zip(rounds[a], rounds[b], strict=True))

    # -- saves
    def save_spmdkit(verify: bool, compress: bool = False):
        def run(i: int) -> None:
            d = os.path.join(root, f"spmdkit-{verify}-{compress}-{i}")
            with Manager(d, verify=verify, compress=compress) as mgr:
                mgr.save(1, state)
                mgr.wait()

        return run

    def save_orbax(i: int) -> None:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(root, f"orbax-{i}"), state)
        ckptr.wait_until_finished()
        ckptr.close()

    host = {k: np.asarray(v) for k, v in state.items()}

    def save_file(i: int) -> None:
        with open(os.path.join(root, f"raw-{i}.bin"), "wb") as f:
            for v in host.values():
                f.write(memoryview(v).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    for name, (times, peak) in timed_alternately(
        {
            "save spmdkit (checksums)": save_spmdkit(True),
            "save spmdkit (checksums, zstd as orbax)": save_spmdkit(True, compress=True),
            "save spmdkit (no checksums)": save_spmdkit(False),
            "save orbax StandardCheckpointer": save_orbax,
            "save plain file write+fsync": save_file,
        },
        args.repeat,
    ).items():
        record(name, times, peak)

    # -- restores
    same = abstract_target(state)
    mesh8 = jax.make_mesh((8,), ("x",))
    other_specs = [P("x", None), P(None, "x")] * 4
    other = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh8, other_specs[i]))
        for i, (k, v) in enumerate(state.items())
    }

    def restore_spmdkit(target, verify: bool, compressed: bool = False):
        def run(i: int) -> None:
            mgr = Manager(os.path.join(root, f"spmdkit-True-{compressed}-0"), verify=verify)
            jax.block_until_ready(mgr.restore(target=target).state)
            mgr.close()

        return run

    def restore_orbax(target):
        def run(i: int) -> None:
            ckptr = ocp.StandardCheckpointer()
            jax.block_until_ready(ckptr.restore(os.path.join(root, "orbax-0"), target))
            ckptr.close()

        return run

    def restore_file(i: int) -> None:
        with open(os.path.join(root, "raw-0.bin"), "rb") as f:
            data = f.read()
        del data

    for name, (times, peak) in timed_alternately(
        {
            "restore spmdkit same mesh (checksums)": restore_spmdkit(same, True),
            "restore spmdkit same mesh (checksums, zstd as orbax)": restore_spmdkit(
                same, True, compressed=True
            ),
            "restore spmdkit same mesh (no checksums)": restore_spmdkit(same, False),
            "restore orbax same mesh": restore_orbax(same),
            "restore spmdkit 2x4 -> 8x1 reshard (checksums)": restore_spmdkit(other, True),
            "restore orbax 2x4 -> 8x1 reshard": restore_orbax(other),
            "restore plain file read": restore_file,
        },
        args.repeat,
    ).items():
        record(name, times, peak)

    ratios = {
        "save spmdkit/orbax (checksums)": speed_ratio(
            "save spmdkit (checksums)", "save orbax StandardCheckpointer"
        ),
        "save spmdkit/orbax (both zstd)": speed_ratio(
            "save spmdkit (checksums, zstd as orbax)", "save orbax StandardCheckpointer"
        ),
        "save spmdkit/orbax (no checksums)": speed_ratio(
            "save spmdkit (no checksums)", "save orbax StandardCheckpointer"
        ),
        "save spmdkit/plain file": speed_ratio(
            "save spmdkit (checksums)", "save plain file write+fsync"
        ),
        "restore spmdkit/orbax same mesh (checksums)": speed_ratio(
            "restore spmdkit same mesh (checksums)", "restore orbax same mesh"
        ),
        "restore spmdkit/orbax same mesh (both zstd)": speed_ratio(
            "restore spmdkit same mesh (checksums, zstd as orbax)", "restore orbax same mesh"
        ),
        "restore spmdkit/orbax same mesh (no checksums)": speed_ratio(
            "restore spmdkit same mesh (no checksums)", "restore orbax same mesh"
        ),
        "restore spmdkit/orbax 2x4 -> 8x1 (checksums)": speed_ratio(
            "restore spmdkit 2x4 -> 8x1 reshard (checksums)", "restore orbax 2x4 -> 8x1 reshard"
        ),
        "reshard/same-mesh restore time (spmdkit)": 1
        / speed_ratio(
            "restore spmdkit 2x4 -> 8x1 reshard (checksums)",
            "restore spmdkit same mesh (checksums)",
        ),
    }

    width = max(len(k) for k in rows)
    print(f"state: {mb:.0f} MB in {len(state)} arrays on a 2x4 mesh; median of {args.repeat}")
    print(f"{'phase':<{width}}  {'seconds':>8}  {'MB/s':>8}  {'peak RSS +MB':>12}")
    for name, r in rows.items():
        print(
            f"{name:<{width}}  {r['seconds']:8.3f}  {r['MB_per_s']:8.1f}  {r['peak_rss_MB']:12.0f}"
        )
    for name, v in ratios.items():
        print(f"{name}: {v:.2f}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "state_MB": mb,
                "arrays": len(state),
                "mesh": "2x4 virtual CPU devices",
                "repeat": args.repeat,
                "cpu_count": os.cpu_count(),
                "load_average_1m": os.getloadavg()[0],
                "rows": rows,
                "rounds_seconds": rounds,
                "ratios": ratios,
                "jax": jax.__version__,
                "orbax": ocp.__version__ if hasattr(ocp, "__version__") else None,
                "date": _utc(time.time()),
                "export_import": exported,
            },
            f,
            indent=2,
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

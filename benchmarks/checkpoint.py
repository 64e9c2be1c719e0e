"""Checkpoint throughput: spmdkit.checkpoint.Manager vs raw orbax vs a plain file write.

A ~512 MB state (8 float32 arrays, sharded over a 2x4 mesh of virtual CPU
devices) is saved and restored by

* ``spmdkit``   — :class:`spmdkit.checkpoint.Manager` (with and without checksums),
* ``orbax``     — raw ``orbax.checkpoint.StandardCheckpointer`` on the same arrays,
* ``file``      — one sequential ``write`` + ``fsync`` of the same bytes (the disk's limit),

and restored onto the same mesh and onto a different mesh and specs (8x1,
transposed specs). Each figure is the median of ``--repeat`` runs; restores read
from the page cache after the first run, as they would right after a save. Peak
host RSS above the starting RSS is sampled every 5 ms during each phase.

Run: ``python benchmarks/checkpoint.py [--mb 512] [--repeat 3] [--dir /tmp/x]``;
prints a table and writes ``benchmarks/results/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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

from spmdkit.checkpoint import Manager, abstract_target


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


def timed(fn, repeat: int) -> tuple[float, float]:
    """Median seconds over ``repeat`` runs (after one untimed warm-up run: compilation,
    page cache) and the peak RSS (MB above start) of the timed runs."""
    fn(repeat)
    times, peaks = [], []
    for i in range(repeat):
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        peaks.append(rss.peak_mb)
    return statistics.median(times), max(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "results", "checkpoint.json"),
    )
    args = parser.parse_args()

    root = tempfile.mkdtemp(dir=args.dir, prefix="spmdkit-ckpt-bench-")
    state, _ = make_state(args.mb)
    size = nbytes(state)
    mb = size / 2**20
    jax.block_until_ready(state)
    rows: dict[str, dict[str, float]] = {}

    def record(name: str, seconds: float, peak: float) -> None:
        rows[name] = {"seconds": seconds, "MB_per_s": mb / seconds, "peak_rss_MB": peak}

    # -- saves
    def save_spmdkit(verify: bool):
        def run(i: int) -> None:
            d = os.path.join(root, f"spmdkit-{verify}-{i}")
            with Manager(d, verify=verify) as mgr:
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

    record("save spmdkit (checksums)", *timed(save_spmdkit(True), args.repeat))
    record("save spmdkit (no checksums)", *timed(save_spmdkit(False), args.repeat))
    record("save orbax StandardCheckpointer", *timed(save_orbax, args.repeat))
    record("save plain file write+fsync", *timed(save_file, args.repeat))

    # -- restores
    same = abstract_target(state)
    mesh8 = jax.make_mesh((8,), ("x",))
    other_specs = [P("x", None), P(None, "x")] * 4
    other = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh8, other_specs[i]))
        for i, (k, v) in enumerate(state.items())
    }

    def restore_spmdkit(target, verify: bool):
        def run(i: int) -> None:
            mgr = Manager(os.path.join(root, "spmdkit-True-0"), verify=verify)
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

    record(
        "restore spmdkit same mesh (checksums)", *timed(restore_spmdkit(same, True), args.repeat)
    )
    record(
        "restore spmdkit same mesh (no checksums)",
        *timed(restore_spmdkit(same, False), args.repeat),
    )
    record("restore orbax same mesh", *timed(restore_orbax(same), args.repeat))
    record(
        "restore spmdkit 2x4 -> 8x1 reshard (checksums)",
        *timed(restore_spmdkit(other, True), args.repeat),
    )
    record(
        "restore spmdkit 2x4 -> 8x1 reshard (no checksums)",
        *timed(restore_spmdkit(other, False), args.repeat),
    )
    record("restore orbax 2x4 -> 8x1 reshard", *timed(restore_orbax(other), args.repeat))
    record("restore plain file read", *timed(restore_file, args.repeat))

    ratios = {
        "save spmdkit/orbax (checksums)": rows["save spmdkit (checksums)"]["MB_per_s"]
        / rows["save orbax StandardCheckpointer"]["MB_per_s"],
        "save spmdkit/orbax (no checksums)": rows["save spmdkit (no checksums)"]["MB_per_s"]
        / rows["save orbax StandardCheckpointer"]["MB_per_s"],
        "save spmdkit/plain file": rows["save spmdkit (checksums)"]["MB_per_s"]
        / rows["save plain file write+fsync"]["MB_per_s"],
        "restore spmdkit/orbax same mesh (checksums)": rows[
            "restore spmdkit same mesh (checksums)"
        ]["MB_per_s"]
        / rows["restore orbax same mesh"]["MB_per_s"],
        "restore spmdkit/orbax same mesh (no checksums)": rows[
            "restore spmdkit same mesh (no checksums)"
        ]["MB_per_s"]
        / rows["restore orbax same mesh"]["MB_per_s"],
        "reshard/same-mesh restore time (spmdkit)": rows[
            "restore spmdkit 2x4 -> 8x1 reshard (checksums)"
        ]["seconds"]
        / rows["restore spmdkit same mesh (checksums)"]["seconds"],
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
                "ratios": ratios,
                "jax": jax.__version__,
                "orbax": ocp.__version__ if hasattr(ocp, "__version__") else None,
            },
            f,
            indent=2,
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""How long XLA takes to compile a model's initialisers, with and without constant
folding (``spmdkit.compile.annotate.INIT_COMPILER_OPTIONS``).

``sk.init_sharded`` compiles the initialisers, which take no arguments, with XLA's
constant folding off. This script times both compiles for one reference model on
the devices present (the folding one under ``--limit`` seconds: it runs in a child
process that is stopped there) and prints the two times.

Run: ``python benchmarks/init_compile.py [--model llama] [--config 8b] [--layers 2]
[--limit 60]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import time

LIMIT_S = 60.0


def _compile(model: str, config: str, layers: int, folding: bool) -> None:
    import jax

    import spmdkit as sk
    from spmdkit.compile.annotate import INIT_COMPILER_OPTIONS

    spec = sk.models.get_model(model)
    cfg = dataclasses.replace(spec.configs[config](), n_layers=layers)
    info = sk.describe(spec, config=cfg)
    mesh = sk.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    plan = sk.plan(info, mesh, "dp")
    lowered = jax.jit(
        info.init_fn, out_shardings=plan.param_shardings(info.abstract_params)
    ).lower()
    t0 = time.perf_counter()
    lowered.compile({} if folding else INIT_COMPILER_OPTIONS)
    print(f"constant folding {'on ' if folding else 'off'}: compiled in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Time both compiles; 0 when the compile without folding finished."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--config", default="8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--limit", type=float, default=LIMIT_S)
    args = ap.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    for folding in (False, True):
        p = ctx.Process(target=_compile, args=(args.model, args.config, args.layers, folding))
        t0 = time.perf_counter()
        p.start()
        p.join(args.limit)
        if p.is_alive():
            p.kill()
            print(f"constant folding {'on ' if folding else 'off'}: not compiled after "
                  f"{time.perf_counter() - t0:.0f} s (stopped)", flush=True)  # fmt: skip
        elif p.exitcode:
            return p.exitcode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

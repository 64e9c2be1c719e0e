"""Fingerprints of what the planner and ``sk.jit`` produce, to show a refactor changes neither.

Two kinds of fingerprint, each a SHA-256 of a canonical text:

1. **Plans.** The JSON (``Plan.to_json()``, keys sorted) of a fixed set of
   reference plans (source locations in their provenance masked: they move
   with the checkout and every edit of a model), all on abstract meshes (no
   devices, no compilation): each
   reference model (``gpt``, ``llama``, ``moe``, ``convnet``, ``gpt_linen`` at
   ``tiny``) under every preset and ``auto`` with the analytic estimator on
   ``data=2 × model=4``; a few presets and ``auto`` with the propagate
   estimator; a fixed recipe; ``auto`` with the optional levers
   (``allow_master_weights``, ``aliases``); a preset pipelined and ``auto``
   with pipelines searched. A plan that raises is fingerprinted by its error
   class and message (refusing is behaviour too).
2. **Compiled steps.** The optimized HLO text (``Compiled.as_text()``, its
   ``metadata={...}`` and the header's source tables stripped: file paths and
   line numbers move with every edit and checkout) of three
   train steps on 8 virtual CPU devices: a plain ``sk.jit`` step (the
   ``megatron`` plan, enforced replay), a recipe step (``fsdp`` with
   ``remat="full"``, bf16 compute and 2 micro-batches) and a pipelined step
   (``fsdp`` on ``pipe=2 × data=2 × model=2``, 1F1B over 4 micro-batches).

Both depend on the jax version (the propagate estimator reads the traced
jaxpr; XLA compiles), so they are kept per jax version. The compiled steps also
depend on the cores the process may use (XLA:CPU splits its work by them), so the
baseline records that count (``cpus``) and a run on another count compares the
plans only.

Run ``python benchmarks/fingerprints.py`` to print the fingerprints and compare
them with ``benchmarks/results/fingerprints.json`` (exit status 1 on a
difference, naming the cases); ``--write`` stores this run's instead, under
this jax version. A refactor must leave them identical
(``tests/test_benchmarks_fingerprints.py``, slow tier, runs the comparison). A
change *meant* to alter plans or steps (a new cost term, a new rule)
regenerates the baseline from main once it has landed there:
``python benchmarks/fingerprints.py --write`` in both venvs, committed with the
change that moved them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import spmdkit as sk

RESULTS = Path(__file__).resolve().parent / "results" / "fingerprints.json"
MODELS = ("gpt", "llama", "moe", "convnet", "gpt_linen")
#: (model, strategy) planned with the propagate estimator too.
#: A source location in a plan's provenance (``/any/path/file.py:LINE[:COL]``): it
#: moves with the checkout and with every edit of the model, so it is not fingerprinted.
SOURCE = re.compile(r"[^\s\"\\]*\.py:\d+(?::\d+)?")
PROPAGATED = (("gpt", "fsdp"), ("gpt", "megatron"), ("llama", "tp_fsdp"), ("gpt", "auto"))


def digest(text: str) -> str:
    """The first 16 hex digits of the text's SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_fingerprint(make: Callable[[], sk.Plan]) -> str:
    """The digest of the plan ``make`` returns (its JSON, keys sorted), or of the
    error it raises (class and message)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = make()
    except Exception as err:  # a refusal is part of the behaviour fingerprinted
        return "raises " + type(err).__name__ + " " + digest(str(err))
    return digest(SOURCE.sub("<source>", json.dumps(out.to_json(), sort_keys=True, default=repr)))


def plan_cases() -> dict[str, Callable[[], sk.Plan]]:
    """The reference plans, by name (module docstring)."""
    from spmdkit.models import get_model
    from spmdkit.planner import PRESETS

    mesh = sk.abstract_mesh(data=2, model=4)
    cases: dict[str, Callable[[], sk.Plan]] = {}
    for name in MODELS:
        for strategy in (*PRESETS, "auto"):
            cases[f"{name}/{strategy}/analytic"] = lambda n=name, s=strategy: sk.plan(
                get_model(n), mesh, s, config="tiny", estimator="analytic"
            )
    for name, strategy in PROPAGATED:
        cases[f"{name}/{strategy}/propagate"] = lambda n=name, s=strategy: sk.plan(
            get_model(n), mesh, s, config="tiny"
        )
    recipe = sk.Recipe(remat="full", compute_dtype="bfloat16", microbatches=2)
    cases["llama/fsdp/recipe"] = lambda: sk.plan(
        get_model("llama"), mesh, "fsdp", config="tiny_scan", recipe=recipe
    )
    cases["llama/auto/levers"] = lambda: sk.plan(
        get_model("llama"),
        mesh,
        "auto",
        config="tiny",
        estimator="analytic",
        allow_master_weights=True,
        aliases={"q_heads": "heads"},
    )
    pipe_mesh = sk.abstract_mesh(pipe=2, data=2, model=2)
    pipeline = sk.Pipeline(stages=2, microbatches=4, schedule="1f1b")
    cases["llama/fsdp/pipelined"] = lambda: sk.plan(
        get_model("llama"), pipe_mesh, "fsdp", config="tiny_pipe", batch_size=16, pipeline=pipeline
    )
    cases["llama/auto/pipelines"] = lambda: sk.plan(
        get_model("llama"),
        sk.abstract_mesh(data=8),
        "auto",
        config="tiny_pipe",
        batch_size=16,
        estimator="analytic",
        pipeline="auto",
    )
    return cases


_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")
#: The module header's tables of source files, functions, lines and stack frames.
_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def hlo_fingerprint(compiled: object) -> str:
    """The digest of a compiled step's HLO text without where it came from: each
    instruction's ``metadata={...}`` and the header's source tables (file paths
    and line numbers move with every edit and checkout)."""
    kept, skipping = [], False
    for line in compiled.as_text().splitlines():
        if line.strip() in _SOURCE_TABLES:
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            kept.append(_METADATA.sub("", line))
    return digest("\n".join(kept))


def step_cases() -> dict[str, Callable[[], str]]:
    """The compiled train steps, by name (module docstring); each returns its digest."""
    import numpy as np
    import optax

    from spmdkit.models import get_model

    optimizer = optax.adam(1e-3)

    def step(model: str, config: str, axes: dict, strategy: str, batch: int, **kw) -> str:
        spec = get_model(model)
        cfg = spec.config(config)
        data = spec.batch(cfg, batch, np.random.default_rng(0))
        info = sk.describe(spec, config=cfg, batch=data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = sk.plan(info, sk.make_mesh(**axes), strategy, **kw)
            params = sk.init_sharded(info, p)
            fn = sk.jit(sk.train_step(info, optimizer, p), p)
            opt_state = optimizer.init(params)
            return hlo_fingerprint(fn.compile(params, opt_state, data))

    recipe = sk.Recipe(remat="full", compute_dtype="bfloat16", microbatches=2)
    pipeline = sk.Pipeline(stages=2, microbatches=4, schedule="1f1b")
    return {
        "plain": lambda: step("gpt", "tiny", {"data": 2, "model": 4}, "megatron", 8),
        "recipe": lambda: step(
            "llama", "tiny_scan", {"data": 4, "model": 2}, "fsdp", 8, recipe=recipe
        ),
        "pipelined": lambda: step(
            "llama", "tiny_pipe", {"pipe": 2, "data": 2, "model": 2}, "fsdp", 16, pipeline=pipeline
        ),
    }


def usable_cpus() -> int:
    """The cores this process may run on (what XLA:CPU sizes its thread pool by)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def compute(*, steps: bool = True) -> dict:
    """This run's fingerprints: ``{"plans": {...}, "steps": {...}, "cpus": n}``."""
    out: dict = {"plans": {k: plan_fingerprint(f) for k, f in plan_cases().items()}}
    if steps:
        out["steps"] = {k: f() for k, f in step_cases().items()}
        out["cpus"] = usable_cpus()
    return out


def differences(baseline: dict, now: dict) -> list[str]:
    """The cases whose fingerprint differs from (or is missing in) the baseline
    (both for one jax version)."""
    out = []
    for kind in ("plans", "steps"):
        old, new = baseline.get(kind, {}), now.get(kind)
        if new is None:
            continue
        out += [f"{kind} {k}: {old.get(k)} -> {v}" for k, v in new.items() if old.get(k) != v]
        out += [f"{kind} {k}: gone" for k in old if k not in new]
    return out


def comparable(base: dict, now: dict) -> tuple[dict, str | None]:
    """``now`` as it compares with ``base``: without its compiled steps when they were
    compiled on another core count than the baseline's (XLA:CPU splits a step's work
    by the cores), with why; unchanged when it has no steps (``--plans-only``)."""
    if "steps" not in now or base.get("cpus", now["cpus"]) == now["cpus"]:
        return now, None
    why = (
        f"steps compiled on {now['cpus']} cores, the baseline's on {base['cpus']}: "
        "comparing the plans only"
    )
    return {k: v for k, v in now.items() if k != "steps"}, why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="store this run as the baseline")
    parser.add_argument("--plans-only", action="store_true", help="skip the compiled steps")
    args = parser.parse_args()
    sk.use_virtual_cpu_devices(8)
    import jax

    now = compute(steps=not args.plans_only)
    print(json.dumps(now, indent=1, sort_keys=True))
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.write:
        stored[jax.__version__] = {**stored.get(jax.__version__, {}), **now}
        RESULTS.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        print(f"wrote jax {jax.__version__}'s to {RESULTS}")
        return
    base = stored.get(jax.__version__, {})
    now, why = comparable(base, now)
    if why:
        print(why)
    diff = differences(base, now)
    print("\n".join(diff) or f"identical to {RESULTS.name} ({len(now['plans'])} plans)")
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()

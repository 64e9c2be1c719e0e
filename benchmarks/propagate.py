"""How long propagation takes on a Llama-shaped train step (scanned layers).

Traces forward + grad + Adam of a decoder (RMSNorm, attention with RoPE-free
causal softmax, SwiGLU MLP, layers under ``lax.scan``) from abstract inputs and
propagates fsdp × tensor-parallel specs on an abstract 64×8 mesh. Prints the
jaxpr size, trace and propagation times (first call and cached), predicted
communication and memory. No devices are needed.

Run: ``python benchmarks/propagate.py [--layers 80 --dim 8192 --heads 64 --ffn 28672]``;
the figures are saved to ``benchmarks/results/propagate.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import propagate, trace_with_tree

S = jax.ShapeDtypeStruct


def _rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _layer(h, p, heads):
    b, s, d = h.shape
    x = _rms(h, p["ln1"])
    q = (x @ p["wq"]).reshape(b, s, heads, d // heads)
    k = (x @ p["wk"]).reshape(b, s, heads, d // heads)
    v = (x @ p["wv"]).reshape(b, s, heads, d // heads)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads).astype(h.dtype)
    mask = jnp.tril(jnp.ones((s, s), bool))
    logits = jnp.where(mask, logits, jnp.finfo(h.dtype).min)
    att = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(h.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
    h = h + o @ p["wo"]
    x = _rms(h, p["ln2"])
    return h + (jax.nn.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]


def _model(params, tokens, heads):
    h = params["embed"][tokens]

    def body(h, p):
        return _layer(h, p, heads), None

    h, _ = jax.lax.scan(jax.checkpoint(body), h, params["layers"])
    return _rms(h, params["ln_f"]) @ params["head"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=28672)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    n_layers, d, f, v = args.layers, args.dim, args.ffn, args.vocab
    bf = "bfloat16"
    layer = {
        "ln1": S((n_layers, d), bf), "ln2": S((n_layers, d), bf),
        "wq": S((n_layers, d, d), bf), "wk": S((n_layers, d, d), bf), "wv": S((n_layers, d, d), bf),
        "wo": S((n_layers, d, d), bf), "w1": S((n_layers, d, f), bf), "w3": S((n_layers, d, f), bf),
        "w2": S((n_layers, f, d), bf),
    }  # fmt: skip
    params = {"embed": S((v, d), bf), "layers": layer, "ln_f": S((d,), bf), "head": S((d, v), bf)}
    tokens = S((args.batch, args.seq), "int32")
    labels = S((args.batch, args.seq), "int32")
    opt = optax.adamw(1e-4)
    state = jax.eval_shape(opt.init, params)

    def loss(p, t, y):
        logits = _model(p, t, args.heads).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(p, o, t, y):
        g = jax.grad(loss)(p, t, y)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o

    mesh = sk.abstract_mesh(fsdp=64, tp=8)
    col, row = P(None, "fsdp", "tp"), P(None, "tp", "fsdp")
    pspec = {
        "embed": P("fsdp", "tp"),
        "layers": {
            "ln1": P(), "ln2": P(), "wq": col, "wk": col, "wv": col, "wo": row,
            "w1": col, "w3": col, "w2": row,
        },
        "ln_f": P(),
        "head": P("fsdp", "tp"),
    }  # fmt: skip
    state_spec = _like_params(state, pspec)
    t0 = time.perf_counter()
    closed, out_tree = trace_with_tree(step, params, state, tokens, labels)
    t1 = time.perf_counter()
    n_eqns = sum(1 for _ in _all_eqns(closed.jaxpr))
    specs = (pspec, state_spec, P("fsdp"), P("fsdp"))
    prop = propagate(closed, params, state, tokens, labels, in_specs=specs, mesh=mesh)
    t2 = time.perf_counter()
    propagate(closed, params, state, tokens, labels, in_specs=specs, mesh=mesh)
    t3 = time.perf_counter()
    kept = propagate(
        closed, params, state, tokens, labels, in_specs=specs, mesh=mesh,
        out_specs=(pspec, state_spec), out_tree=out_tree,
    )  # fmt: skip
    t4 = time.perf_counter()
    print(f"jaxpr: {n_eqns} equations (all levels); trace {t1 - t0:.2f} s")
    print(f"propagate: first {t2 - t1:.2f} s, again {t3 - t2:.2f} s")
    print(prop)
    print(f"\nwith out_specs = the parameter specs ({t4 - t3:.2f} s):")
    print(kept)
    figures = {
        "machine": platform.machine(),
        "config": vars(args),
        "mesh": {"fsdp": 64, "tp": 8},
        "equations": n_eqns,
        "trace_s": t1 - t0,
        "propagate_first_s": t2 - t1,
        "propagate_again_s": t3 - t2,
        "propagate_out_specs_s": t4 - t3,
        "comm_bytes_by_kind": prop.comm_bytes_by_kind,
        "step_time_s": prop.step_time_s,
        "peak_bytes": prop.memory.peak_bytes,
        "unknown": dict(prop.unknown),
    }
    out = Path(__file__).parent / "results" / "propagate.json"
    out.write_text(json.dumps(figures, indent=4) + "\n")


def _like_params(state, pspec):
    """Specs for optimizer state: a leaf whose key path ends like a parameter's
    takes that parameter's spec (Adam's mu and nu); the rest are replicated."""
    by_path = {
        tuple(str(k) for k in path): spec
        for path, spec in jax.tree_util.tree_flatten_with_path(
            pspec, is_leaf=lambda x: isinstance(x, P)
        )[0]
    }
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    out = []
    for path, _ in leaves:
        keys = tuple(str(k) for k in path)
        out.append(next((s for p, s in by_path.items() if keys[-len(p) :] == p), P()))
    return jax.tree_util.tree_unflatten(treedef, out)


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


if __name__ == "__main__":
    main()

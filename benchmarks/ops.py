"""What the rule-enforcing ops cost: bytes moved and peak memory per device.

For every op in :mod:`spmdkit.ops` that enforces a rule (``rms_norm`` and
``layer_norm`` with both strategies, ``group_norm``, ``batch_norm``,
``sync_batch_norm``, vocab-parallel ``softmax_cross_entropy``, ``index_put``
with ``strategy="local_update"``, vocab-parallel ``embedding_lookup``, and
``attention`` head-parallel and with ``strategy="gather_kv"``, each with the op's own
local algorithm and with ``implementation="blockwise"``, the reference models'
flash-style kernel, against that kernel written in jnp) the op is compiled
next to the plain jnp/optax version of the same computation, with the same input
shardings (``jax.jit(..., in_shardings=...)``) on a mesh with Auto axes
(``jax.sharding.Mesh(devices, ("data", "model"))``, data=2, model=4 over 8
virtual CPU devices), so that the plain version is partitioned by XLA's own
sharding propagation. One more cross-entropy row uses Explicit axes, where
plain optax raises ``ShardingTypeError`` and the op works.

Each side is compiled three ways (nothing is executed; the inputs are
``jax.ShapeDtypeStruct``):

* **forward**: the op alone;
* **forward+backward**: ``jax.grad`` of ``½·Σ y²`` of the output ``y`` with
  respect to the floating-point inputs, one program (a plain ``Σ y`` would hand
  XLA an all-ones cotangent and let it fold work that a real downstream
  gradient needs, e.g. the gather behind ``index_put``'s value gradient);
* **backward alone**: the pullback of ``jax.vjp`` compiled on its own, its
  residuals laid out as the forward program (compiled alone, returning them)
  leaves them. XLA may return a residual sharded and gather it again in the
  backward, which the fused program avoids: the fused column is the one to
  compare, this one shows what the backward itself moves.

Measured per program:

* **bytes**: the per-device payload of the collectives in the compiled (post
  partitioning) HLO, read with :func:`spmdkit.verification.hlo.parse_collectives` and
  :func:`spmdkit.verification.hlo.summarize` (the all-gather output, the all-reduce operand,
  the reduce-scatter input, the all-to-all operand, the collective-permute
  operand; see :mod:`spmdkit.verification.hlo`).
* **peak**: ``compiled.memory_analysis()`` of the per-device program:
  temp + argument + output − alias bytes.

An op that is missing or raises (on either side) is reported as ``n/a (reason)``
rather than stopping the run. CPU caveat: XLA's CPU pipeline partitions like
the GPU/TPU ones, but its collective combiners and memory scheduler differ, so
counts (not bytes) and peaks may differ on accelerators. Results go to
``benchmarks/results/ops.json``.

A **planned** section compiles ``forward+backward`` the way ``sk.jit`` does —
spmdkit's propagation from the same input layouts, then the replay that pins
every equation — twice: with the op called without ``in_specs`` (one region
equation, laid out by its rule with the case's strategy) and with the jnp
decomposition; per side the compiled bytes and peak, the propagation's
prediction and the region strategies chosen.

Run: ``python benchmarks/ops.py`` (``--quick`` for tiny shapes, ``--only NAME``
to keep the cases whose op or variant contains NAME, ``--check``/``--no-check``
to run both sides on random inputs and record how far apart their outputs and
gradients are — on by default with ``--quick`` only; ``--no-planned`` skips the
planned section).

A separate section, run alone with ``python benchmarks/ops.py --attention-memory``
(a minute on this CPU), compares the compiled peak memory of value-and-grad of
the reference models' attention, plain (``implementation="xla"``, S×S scores)
vs blockwise (flash-style), on one device for Llama-3-8B-like shapes scaled
down; results go to ``benchmarks/results/ops_attention.json`` (see
:func:`attention_memory`).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # must precede the first jax import; a no-op when jax is already initialized
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import datetime as dt
import importlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.verification.hlo import parse_collectives, summarize

RESULTS = Path(__file__).resolve().parent / "results" / "ops.json"
MESH_AXES = {"data": 2, "model": 4}
_KIND_SHORT = {
    "all_gather": "AG",
    "all_reduce": "AR",
    "reduce_scatter": "RS",
    "all_to_all": "A2A",
    "collective_permute": "CP",
}


class Arg(NamedTuple):
    """One input: global shape, dtype, layout, whether gradients flow to it, and
    for integer inputs the value range ``[0, high)`` (``unique``: no repeats)."""

    shape: tuple[int, ...]
    dtype: Any
    spec: P
    diff: bool = False
    high: int = 0
    unique: bool = False


class Case(NamedTuple):
    """One op configuration: the spmdkit op and the plain version on the same inputs.

    ``spmdkit(mesh)`` and ``plain(mesh)`` build the functions (building may raise
    when the op is missing); both take the arrays of ``args`` in order. ``pick``
    selects the array the loss is taken of (e.g. ``y`` of batch norm);
    ``explicit`` runs the case on the mesh with Explicit axes.
    """

    op: str
    variant: str
    what: str
    args: tuple[Arg, ...]
    spmdkit: Callable[[Mesh], Callable[..., Any]]
    plain: Callable[[Mesh], Callable[..., Any]]
    pick: Callable[[Any], Any] = lambda out: out
    explicit: bool = False


class Shapes(NamedTuple):
    """Sizes of the benchmarked inputs."""

    tokens: int
    hidden: int
    vocab: int
    image: tuple[int, int, int, int]  # group_norm NCHW
    groups: int
    bn: tuple[int, int, int, int]  # batch_norm NHWC
    batch: int
    seq: int
    heads: int
    head_dim: int
    updates: int


FULL = Shapes(
    tokens=4096,
    hidden=1024,
    vocab=32768,
    image=(16, 128, 32, 32),
    groups=32,
    bn=(64, 16, 16, 256),
    batch=8,
    seq=1024,
    heads=16,
    head_dim=64,
    updates=4096,
)
QUICK = Shapes(
    tokens=32,
    hidden=16,
    vocab=64,
    image=(4, 8, 4, 4),
    groups=4,
    bn=(4, 2, 2, 8),
    batch=2,
    seq=16,
    heads=4,
    head_dim=8,
    updates=8,
)


# -- the plain versions: what a user writes without spmdkit ------------------


def _plain_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def _plain_rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6) * scale


def _plain_group_norm(groups: int) -> Callable[..., jax.Array]:
    def f(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
        n, c = x.shape[:2]
        g = x.reshape(n, groups, c // groups, *x.shape[2:])
        dims = tuple(range(2, g.ndim))
        mean = jnp.mean(g, axis=dims, keepdims=True)
        var = jnp.mean(jnp.square(g - mean), axis=dims, keepdims=True)
        y = ((g - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(x.shape)
        bshape = (1, c) + (1,) * (x.ndim - 2)
        return y * scale.reshape(bshape) + bias.reshape(bshape)

    return f


def _plain_batch_norm(
    x: jax.Array, mean_r: jax.Array, var_r: jax.Array, scale: jax.Array, bias: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    dims = tuple(range(x.ndim - 1))  # NHWC: every dim but C
    mean = jnp.mean(x, axis=dims)
    var = jnp.mean(jnp.square(x - mean), axis=dims)
    y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias
    return y, 0.9 * mean_r + 0.1 * mean, 0.9 * var_r + 0.1 * var


def _op(name: str) -> Callable[..., Any]:
    """``spmdkit.ops.<name>``; raises (ImportError/AttributeError) when it is missing.

    Read from the defining module: once ``spmdkit.ops.sdpa`` (the module) is
    imported, the package attribute of that name is the module, not the function.
    """
    found = getattr(importlib.import_module("spmdkit.ops"), name)
    if isinstance(found, types.ModuleType):
        found = getattr(found, name)
    if not callable(found):
        raise TypeError(f"spmdkit.ops.{name} is not callable")

    def call(*args: Any, **kwargs: Any) -> Any:
        if _AS_REGION:  # the planned section: no layout given, the op is a region
            kwargs.pop("mesh", None)
            kwargs.pop("in_specs", None)
        return found(*args, **kwargs)

    return call


#: Set while the planned section traces the ops: they are called without ``mesh=`` and
#: ``in_specs=``, so each is one region equation the propagation lays out.
_AS_REGION: list[bool] = []


# -- the cases ----------------------------------------------------------------


def _cases(s: Shapes) -> list[Case]:
    f32, i32 = jnp.float32, jnp.int32
    rows = P("data", "model")
    x_tok = Arg((s.tokens, s.hidden), f32, rows, True)
    vec = Arg((s.hidden,), f32, P(None), True)
    out: list[Case] = []

    def specs(args: Sequence[Arg]) -> tuple[P, ...]:
        return tuple(a.spec for a in args)

    # rms_norm / layer_norm: tokens on data, hidden on model
    for strategy in ("default", "sharded_stats"):
        args = (x_tok, vec)
        out.append(
            Case(
                "rms_norm",
                strategy,
                f"x[{s.tokens}@data,{s.hidden}@model] f32, scale replicated",
                args,
                lambda m, st=strategy, a=args: (
                    lambda x, w: _op("rms_norm")(x, w, strategy=st, mesh=m, in_specs=specs(a))
                ),
                lambda m: _plain_rms_norm,
            )
        )
    for strategy in ("default", "sharded_stats"):
        args = (x_tok, vec, vec)
        out.append(
            Case(
                "layer_norm",
                strategy,
                f"x[{s.tokens}@data,{s.hidden}@model] f32, scale/bias replicated",
                args,
                lambda m, st=strategy, a=args: (
                    lambda x, w, b: _op("layer_norm")(
                        x, w, b, strategy=st, mesh=m, in_specs=specs(a)
                    )
                ),
                lambda m: _plain_layer_norm,
            )
        )

    # group_norm: NCHW, N on data, C on model
    n, c, h, w = s.image
    cvec = Arg((c,), f32, P(None), True)
    args = (Arg(s.image, f32, P("data", "model"), True), cvec, cvec)
    out.append(
        Case(
            "group_norm",
            "default",
            f"x[{n}@data,{c}@model,{h},{w}] NCHW f32, {s.groups} groups",
            args,
            lambda m, a=args: (
                lambda x, sc, b: _op("group_norm")(
                    x, sc, b, num_groups=s.groups, mesh=m, in_specs=specs(a)
                )
            ),
            lambda m: _plain_group_norm(s.groups),
        )
    )

    # batch_norm / sync_batch_norm: NHWC, N on data, C on model, training
    n, h, w, c = s.bn
    cvec = Arg((c,), f32, P(None), True)
    stat = Arg((c,), f32, P(None), False)
    args = (Arg(s.bn, f32, P("data", None, None, "model"), True), stat, stat, cvec, cvec)
    for op in ("batch_norm", "sync_batch_norm"):
        out.append(
            Case(
                op,
                "default",
                f"x[{n}@data,{h},{w},{c}@model] NHWC f32, training",
                args,
                lambda m, op=op, a=args: (
                    lambda x, rm, rv, sc, b: _op(op)(
                        x, rm, rv, sc, b, data_format="NHWC", mesh=m, in_specs=specs(a)
                    )
                ),
                lambda m: _plain_batch_norm,
                pick=lambda out: out[0],
            )
        )

    # softmax cross-entropy: vocab-parallel logits, integer labels, mean
    args = (
        Arg((s.tokens, s.vocab), f32, P("data", "model"), True),
        Arg((s.tokens,), i32, P("data"), high=s.vocab),
    )
    out.append(
        Case(
            "softmax_cross_entropy",
            "vocab_parallel",
            f"logits[{s.tokens}@data,{s.vocab}@model] f32, int labels, mean "
            "(plain: optax ..._with_integer_labels)",
            args,
            lambda m, a=args: (
                lambda z, y: _op("softmax_cross_entropy")(
                    z, y, ignore_index=None, reduction="mean", mesh=m, in_specs=specs(a)
                )
            ),
            lambda m: _plain_cross_entropy,
        )
    )
    # the same under Explicit axes, where the layout is part of the type: optax's
    # gather along the vocab-sharded class dim is ambiguous and raises
    out.append(
        out[-1]._replace(
            variant="vocab_parallel explicit",
            what=out[-1].what + ", Explicit axes",
            spmdkit=lambda m: (
                lambda z, y: _op("softmax_cross_entropy")(
                    z, y, ignore_index=None, reduction="mean", mesh=m
                )
            ),
            explicit=True,
        )
    )

    # index_put local update: row-sharded x, replicated unique indices and values
    args = (
        Arg((s.vocab, s.hidden), f32, P("model", None), True),
        Arg((s.updates,), i32, P(None), high=s.vocab, unique=True),
        Arg((s.updates, s.hidden), f32, P(None), True),
    )
    out.append(
        Case(
            "index_put",
            "local_update",
            f"x[{s.vocab}@model,{s.hidden}].at[idx[{s.updates}]].set(v) f32, idx/v replicated",
            args,
            lambda m, a=args: (
                lambda x, i, v: _op("index_put")(
                    x, i, v, strategy="local_update", mesh=m, in_specs=specs(a)
                )
            ),
            lambda m: lambda x, i, v: x.at[i].set(v),
        )
    )

    # embedding lookup: vocab-parallel table, batch-sharded ids
    args = (
        Arg((s.vocab, s.hidden), f32, P("model", None), True),
        Arg((s.batch, s.tokens // s.batch), i32, P("data", None), high=s.vocab),
    )
    out.append(
        Case(
            "embedding_lookup",
            "vocab_parallel",
            f"table[{s.vocab}@model,{s.hidden}] f32, ids[{s.batch}@data,"
            f"{s.tokens // s.batch}] (plain: jnp.take)",
            args,
            lambda m, a=args: lambda t, i: _op("embedding_lookup")(t, i, mesh=m, in_specs=specs(a)),
            lambda m: lambda t, i: jnp.take(t, i, axis=0),
        )
    )

    # attention: causal, [B, S, H, D]
    qkv = (s.batch, s.seq, s.heads, s.head_dim)
    for strategy, spec, where in (
        ("heads", P("data", None, "model", None), f"[{s.batch}@data,{s.seq},{s.heads}@model,"),
        ("gather_kv", P("data", "model", None, None), f"[{s.batch}@data,{s.seq}@model,{s.heads},"),
    ):
        args = (Arg(qkv, f32, spec, True),) * 3
        rule_strategy = None if strategy == "heads" else strategy  # None: the rule's default
        out.append(
            Case(
                "attention",
                strategy,
                f"q,k,v{where}{s.head_dim}] f32, causal (plain: jax.nn.dot_product_attention)",
                args,
                lambda m, st=rule_strategy, a=args: (
                    lambda q, k, v: _op("attention")(
                        q, k, v, causal=True, strategy=st, mesh=m, in_specs=specs(a)
                    )
                ),
                lambda m: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
            )
        )
        # the reference models' attention: the op running the blockwise kernel (a region
        # whose backward recomputes the kernel's forward) vs the kernel written in jnp
        # (its custom_vjp keeping O(S) residuals), as the models called it before
        out.append(
            Case(
                "attention",
                f"{strategy} blockwise",
                f"q,k,v{where}{s.head_dim}] f32, causal, implementation='blockwise' "
                "(plain: spmdkit.kernels.blockwise_attention)",
                args,
                lambda m, st=rule_strategy, a=args: (
                    lambda q, k, v: _op("attention")(
                        q,
                        k,
                        v,
                        causal=True,
                        strategy=st,
                        implementation="blockwise",
                        mesh=m,
                        in_specs=specs(a),
                    )
                ),
                lambda m: _blockwise_kernel,
            )
        )
    return out


def _blockwise_kernel(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    from spmdkit.kernels import blockwise_attention

    return blockwise_attention(q, k, v, causal=True)


def _plain_cross_entropy(z: jax.Array, y: jax.Array) -> jax.Array:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()


# -- measuring ----------------------------------------------------------------


def _short(reason: BaseException) -> str:
    text = str(reason).strip().splitlines()
    first = text[0] if text else ""
    msg = f"{type(reason).__name__}: {first}" if first else type(reason).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."


def _loss(case: Case, fn: Callable[..., Any]) -> Callable[..., jax.Array]:
    def loss(*xs: Any) -> jax.Array:
        y = case.pick(fn(*xs))
        return 0.5 * jnp.sum(y * y)

    return loss


def _structs(args: Sequence[Arg], mesh: Mesh) -> tuple[tuple[NamedSharding, ...], tuple]:
    shardings = tuple(NamedSharding(mesh, a.spec) for a in args)
    structs = tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
        for a, sh in zip(args, shardings, strict=True)
    )
    return shardings, structs


def _cost(compiled: Any, compile_s: float) -> dict[str, Any]:
    cols = [c for c in parse_collectives(compiled.as_text()) if _moves(c)]
    mem = compiled.memory_analysis()
    parts = {
        "temp": int(mem.temp_size_in_bytes),
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
    }
    return {
        "bytes": sum(c.payload_bytes for c in cols),
        "collectives": summarize(cols),
        "peak_bytes": parts["temp"] + parts["argument"] + parts["output"] - parts["alias"],
        "memory": parts,
        "compile_s": round(compile_s, 3),
    }


def _compile(fn: Callable[..., Any], *structs: Any, **jit_kwargs: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    compiled = jax.jit(fn, **jit_kwargs).lower(*structs).compile()
    return _cost(compiled, time.perf_counter() - t0)


def measure(case: Case, fn: Callable[..., Any], mesh: Mesh) -> dict[str, Any]:
    """Compile ``fn`` three ways for ``case.args`` (laid out by their specs) and read the costs.

    Returns:
      ``{"forward": ..., "forward+backward": ..., "backward": ...}``, each with
      ``bytes`` (per-device collective payload), ``collectives`` (per kind: count
      and payload bytes), ``peak_bytes`` and its parts, and ``compile_s``.
      ``forward+backward`` is ``jax.grad`` of ``½·Σ y²`` (one program);
      ``backward`` is the pullback of ``jax.vjp`` compiled on its own, its
      residuals laid out as the forward (compiled alone, returning them) leaves them.
    """
    shardings, structs = _structs(case.args, mesh)
    diff = tuple(i for i, a in enumerate(case.args) if a.diff)
    loss = _loss(case, fn)
    out = {
        "forward": _compile(fn, *structs, in_shardings=shardings),
        "forward+backward": _compile(
            jax.grad(loss, argnums=diff), *structs, in_shardings=shardings
        ),
    }

    def pullback(*xs: Any) -> Any:
        def of_diff(*d: Any) -> jax.Array:
            full = list(xs)
            for i, v in zip(diff, d, strict=True):
                full[i] = v
            return loss(*full)

        return jax.vjp(of_diff, *(xs[i] for i in diff))[1]

    fwd = jax.jit(pullback, in_shardings=shardings).lower(*structs).compile()
    res_shapes = jax.eval_shape(pullback, *structs)
    residuals = jax.tree.map(
        lambda st, sh: jax.ShapeDtypeStruct(st.shape, st.dtype, sharding=sh),
        res_shapes,
        fwd.output_shardings,
    )
    out["backward"] = _compile(lambda vjp_fn: vjp_fn(jnp.ones((), jnp.float32)), residuals)
    return out


def measure_planned(case: Case, fn: Callable[..., Any], mesh: Mesh) -> dict[str, Any]:
    """``forward+backward`` through spmdkit's propagation and enforced replay (what
    ``sk.jit`` compiles): the step is propagated from the case's input layouts, every
    equation pinned, and compiled. For the op side the op is traced as a region (no
    ``in_specs``). Returns the compiled costs plus the propagation's ``predicted_bytes``
    and the region strategies it chose."""
    from spmdkit.compile.enforce import enforced
    from spmdkit.propagation import propagate

    shardings, structs = _structs(case.args, mesh)
    diff = tuple(i for i, a in enumerate(case.args) if a.diff)
    step = jax.grad(_loss(case, fn), argnums=diff)
    abstract = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in case.args)
    specs = tuple(a.spec for a in case.args)
    with jax.set_mesh(mesh):
        prop = propagate(step, *abstract, in_specs=specs, mesh=mesh)
        t0 = time.perf_counter()
        compiled = jax.jit(enforced(prop), in_shardings=shardings).lower(*structs).compile()
    cost = _cost(compiled, time.perf_counter() - t0)
    cost["predicted_bytes"] = int(prop.comm_bytes)
    cost["strategies"] = prop.region_strategies()
    return cost


def _planned(case: Case, which: str, mesh: Mesh) -> dict[str, Any]:
    try:
        if which == "region":
            _AS_REGION.append(True)
            try:
                return measure_planned(case, case.spmdkit(mesh), mesh)
            finally:
                _AS_REGION.pop()
        return measure_planned(case, case.plain(mesh), mesh)
    except Exception as e:
        return {"na": _short(e)}


def _moves(c: Any) -> bool:
    """Collectives over a group of one device move nothing."""
    return c.group_size > 1 or (c.kind == "collective_permute" and c.source_target_pairs != ())


def _case_mesh(case: Case, mesh: Mesh) -> Mesh:
    if not case.explicit:
        return mesh
    explicit = (AxisType.Explicit,) * len(mesh.axis_names)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=explicit)


def _values(args: Sequence[Arg], mesh: Mesh, seed: int = 0) -> list[jax.Array]:
    """Random inputs for ``args``, placed by their specs."""
    rng = np.random.default_rng(seed)
    out = []
    for a in args:
        if jnp.issubdtype(a.dtype, jnp.integer):
            size = int(np.prod(a.shape))
            if a.unique:
                v = rng.permutation(a.high)[:size].reshape(a.shape)
            else:
                v = rng.integers(0, a.high, a.shape)
        else:
            v = rng.standard_normal(a.shape)
        out.append(jax.device_put(np.asarray(v, a.dtype), NamedSharding(mesh, a.spec)))
    return out


def agreement(case: Case, mesh: Mesh) -> dict[str, Any]:
    """Run both sides on random inputs and compare the outputs and the
    ``forward+backward`` gradients: per array ``max|spmdkit − plain| / max|plain|``,
    the largest over the arrays (``{"na": reason}`` when a side cannot run). A
    cost comparison means something only where this is small."""
    mesh = _case_mesh(case, mesh)
    try:
        sides = [case.spmdkit(mesh), case.plain(mesh)]
        shardings, _ = _structs(case.args, mesh)
        values = _values(case.args, mesh)
        diff = tuple(i for i, a in enumerate(case.args) if a.diff)
        out = {}
        for name, wrap in (
            ("forward_rel_err", lambda f: f),
            ("grad_rel_err", lambda f: jax.grad(_loss(case, f), argnums=diff)),
        ):
            got, want = (jax.jit(wrap(f), in_shardings=shardings)(*values) for f in sides)
            leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
            out[name] = max(_rel_err(g, w) for g, w in leaves)
        return out
    except Exception as e:
        return {"na": _short(e)}


def _rel_err(got: jax.Array, want: jax.Array) -> float:
    scale = float(jnp.max(jnp.abs(want)))
    err = float(jnp.max(jnp.abs(got - want)))
    return err / scale if scale > 0 else err


def _side(case: Case, which: str, mesh: Mesh) -> dict[str, Any]:
    mesh = _case_mesh(case, mesh)
    try:
        fn = (case.spmdkit if which == "spmdkit" else case.plain)(mesh)
        return measure(case, fn, mesh)
    except Exception as e:
        return {"na": _short(e)}


def run(
    *,
    quick: bool = False,
    out_path: Path = RESULTS,
    only: Sequence[str] = (),
    check: bool | None = None,
    planned: bool = True,
) -> dict[str, Any]:
    """Compile every case both ways, print the table, save the JSON; returns what was saved.

    Args:
      quick: tiny shapes.
      out_path: where the JSON goes.
      only: keep the cases whose ``"op variant"`` contains one of these.
      check: also run both sides and record their :func:`agreement`
        (default: with ``quick`` only; the full shapes take minutes on CPU).
      planned: also compile ``forward+backward`` through spmdkit's propagation and
        enforced replay, the op as a region against the jnp decomposition
        (:func:`measure_planned`; the row's ``planned``).
    """
    check = quick if check is None else check
    shapes = QUICK if quick else FULL
    devices = np.array(jax.devices("cpu")[:8])
    if devices.size < 8:
        raise SystemExit(
            f"needs 8 devices, found {devices.size}: set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before jax starts"
        )
    mesh = Mesh(devices.reshape(tuple(MESH_AXES.values())), tuple(MESH_AXES))
    cases = [c for c in _cases(shapes) if not only or any(k in f"{c.op} {c.variant}" for k in only)]
    rows = [
        {
            "op": case.op,
            "variant": case.variant,
            "case": case.what,
            "spmdkit": _side(case, "spmdkit", mesh),
            "plain": _side(case, "plain", mesh),
            **({"agreement": agreement(case, mesh)} if check else {}),
            **(
                {}
                if case.explicit or not planned
                else {
                    "planned": {
                        "region": _planned(case, "region", mesh),
                        "jnp": _planned(case, "plain", mesh),
                    }
                }
            ),
        }
        for case in cases
    ]
    report = {
        "meta": _meta(shapes, quick),
        "definitions": {
            "bytes": "per-device payload of the compiled HLO collectives (spmdkit.verification.hlo "
            "convention: all-gather output, all-reduce operand, reduce-scatter input, "
            "all-to-all operand, collective-permute operand)",
            "peak_bytes": "memory_analysis(): temp + argument + output - alias, per device",
            "forward": "the op alone",
            "forward+backward": "jax.grad of 0.5 * sum(y**2) of the output y w.r.t. the "
            "float inputs, one program",
            "backward": "jax.vjp's pullback compiled alone; residuals laid out as the "
            "forward program (compiled alone) returns them, so XLA may re-gather a residual "
            "it chose to return sharded",
            "plain": "the jnp/optax version under XLA's sharding propagation, same "
            "in_shardings, Auto-axes mesh",
            "agreement": "max |spmdkit - plain| / max |plain| over the outputs and over "
            "the forward+backward gradients, on random inputs (only with --check / --quick)",
            "planned": "forward+backward as sk.jit compiles it: propagated from the same "
            "input layouts and replayed with every equation pinned; region = the op called "
            "without in_specs (one region equation, laid out by its rule, strategy as the "
            "case fixes it), jnp = the plain decomposition; predicted_bytes = the "
            "propagation's figure",
        },
        "rows": rows,
    }
    _print_table(report)
    _print_planned(report)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out_path)
    print(f"\nsaved {out_path}")
    return report


# -- attention memory: plain vs blockwise, one device ---------------------------

ATTENTION_RESULTS = RESULTS.with_name("ops_attention.json")


class AttnShape(NamedTuple):
    """Attention inputs: q ``[batch, seq, heads, head_dim]``, k/v with ``kv_heads``."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str


#: Llama-3 8B's attention (32 heads, 8 kv heads, head_dim 128) scaled down to a
#: quarter of the heads, at two sequence lengths, in float32 and bfloat16.
ATTENTION_FULL = (
    AttnShape(1, 2048, 8, 2, 128, "float32"),
    AttnShape(1, 2048, 8, 2, 128, "bfloat16"),
    AttnShape(1, 8192, 8, 2, 128, "bfloat16"),
)
ATTENTION_QUICK = (AttnShape(1, 256, 4, 2, 16, "float32"),)


def _attention_cost(shape: AttnShape, implementation: str, block_size: int) -> dict[str, Any]:
    # the kernel itself (what each device runs); the models call it through the
    # attention op, whose region saves q, k, v and recomputes the kernel's forward
    from spmdkit.kernels import attention_kernel as attention

    dtype = jnp.dtype(shape.dtype)
    q = jax.ShapeDtypeStruct((shape.batch, shape.seq, shape.heads, shape.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((shape.batch, shape.seq, shape.kv_heads, shape.head_dim), dtype)

    def fn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attention(q, k, v, causal=True, implementation=implementation, block_size=block_size)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        y = fn(q, k, v).astype(jnp.float32)
        return 0.5 * jnp.sum(y * y)

    cost = _compile(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    residuals = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], q, kv, kv)
    cost["residual_bytes"] = sum(
        int(np.prod(r.shape)) * r.dtype.itemsize for r in jax.tree.leaves(residuals)
    )
    del cost["bytes"], cost["collectives"]
    return cost


def attention_memory(
    *, quick: bool = False, out_path: Path = ATTENTION_RESULTS, block_size: int = 512
) -> dict[str, Any]:
    """Compiled peak memory of value-and-grad of causal attention, plain vs blockwise.

    One device (no mesh): ``jax.value_and_grad`` of ``½·Σ y²`` of
    ``spmdkit.kernels.attention_kernel(q, k, v, implementation=...)`` (the reference
    models' kernel, as each device runs it inside the attention op) with respect to
    q, k and v, compiled for ``jax.ShapeDtypeStruct`` inputs (nothing runs), its
    ``memory_analysis()`` peak (temp + argument + output − alias), and the bytes of
    the vjp residuals (``jax.eval_shape`` of the pullback): S×S for ``"xla"``, O(S)
    for ``"blockwise"``. Prints a table and saves the JSON at ``out_path``.

    The blockwise peak is O(S·block): on CPU its backward keeps four to five
    ``[b, kv, group, S, block]`` float32 buffers live (scores, probabilities,
    dP, dS and the transposed copies XLA:CPU's dot wants), so a smaller
    ``block_size`` lowers it further (fp32, S=2048: 181 MiB at block 512, 92 MiB at 128).

    Args:
      quick: one tiny shape (a smoke run).
      out_path: where the JSON goes.
      block_size: the blockwise version's key/value block.
    """
    block = min(block_size, 64) if quick else block_size
    rows = []
    for shape in ATTENTION_QUICK if quick else ATTENTION_FULL:
        row: dict[str, Any] = {"shape": shape._asdict(), "block_size": block}
        for impl in ("xla", "blockwise"):
            row[impl] = _attention_cost(shape, impl, block)
        row["peak_ratio"] = row["xla"]["peak_bytes"] / row["blockwise"]["peak_bytes"]
        rows.append(row)
    meta = {
        k: v
        for k, v in _meta(ATTENTION_QUICK[0] if quick else ATTENTION_FULL[0], quick).items()
        if k not in ("mesh", "shapes")
    }
    report = {
        "meta": {**meta, "backend": f"{jax.default_backend()} (one device)"},
        "definitions": {
            "peak_bytes": "memory_analysis() of jax.value_and_grad(0.5*sum(y**2)) w.r.t. "
            "q, k, v: temp + argument + output - alias",
            "residual_bytes": "bytes of the leaves of jax.vjp's pullback (eval_shape)",
            "xla": "plain attention (materializes [b, kv, group, S, S] scores)",
            "blockwise": "flash-style blockwise attention (custom_vjp, lax.scan over "
            "key/value blocks)",
        },
        "rows": rows,
    }
    _print_attention(report)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nsaved {out_path}")
    return report


def _print_attention(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(
        f"attention value-and-grad memory, plain vs blockwise — jax {meta['jax']}, "
        f"{meta['backend']}, {meta['date']}"
    )
    header = (
        "b×S×h/kv×d",
        "dtype",
        "block",
        "impl",
        "peak",
        "temp",
        "residuals",
        "plain/blockwise",
    )
    table = []
    for r in report["rows"]:
        s = r["shape"]
        dims = f"{s['batch']}×{s['seq']}×{s['heads']}/{s['kv_heads']}×{s['head_dim']}"
        for impl in ("xla", "blockwise"):
            c = r[impl]
            ratio = f"{r['peak_ratio']:.1f}×" if impl == "blockwise" else ""
            table.append(
                (
                    dims if impl == "xla" else "",
                    s["dtype"] if impl == "xla" else "",
                    str(r["block_size"]) if impl == "blockwise" else "",
                    impl,
                    _fmt_bytes(c["peak_bytes"]),
                    _fmt_bytes(c["memory"]["temp"]),
                    _fmt_bytes(c["residual_bytes"]),
                    ratio,
                )
            )
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in table:
        cells = zip(row, widths, strict=True)
        print("  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(cells)))


def _git_commit() -> str | None:
    try:
        res = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _meta(shapes: Shapes, quick: bool) -> dict[str, Any]:
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "optax": _version("optax"),
        "spmdkit_commit": _git_commit(),
        "backend": "cpu (8 virtual devices)",
        "machine": platform.machine(),
        "mesh": {
            **MESH_AXES,
            "kind": "jax.sharding.Mesh, Auto axes (Explicit where the variant says so)",
        },
        "quick": quick,
        "shapes": shapes._asdict(),
    }


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.1f} MiB"


def _fmt_kinds(side: dict[str, Any]) -> str:
    kinds = side["collectives"]
    if not kinds:
        return "none"
    return " ".join(f"{_KIND_SHORT.get(k, k)}×{v['count']}" for k, v in kinds.items())


def _cells(side: dict[str, Any], notes: list[str]) -> tuple[str, ...]:
    if "na" in side:
        if side["na"] not in notes:
            notes.append(side["na"])
        return (f"n/a [{notes.index(side['na']) + 1}]", "", "", "", "", "")
    f, fb, b = side["forward"], side["forward+backward"], side["backward"]
    return (
        _fmt_bytes(f["bytes"]),
        _fmt_bytes(fb["bytes"]),
        _fmt_bytes(b["bytes"]),
        _fmt_bytes(f["peak_bytes"]),
        _fmt_bytes(fb["peak_bytes"]),
        f"{_fmt_kinds(f)} | {_fmt_kinds(fb)}",
    )


def _print_table(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(
        f"spmdkit.ops vs plain jnp/optax under XLA propagation — jax {meta['jax']}, "
        f"{meta['backend']}, mesh data=2 x model=4 (Auto axes), {meta['date']}"
        + (" [quick: tiny shapes]" if meta["quick"] else "")
    )
    print(
        "bytes: collective payload per device; peak: temp+arg+out-alias per device;\n"
        "fwd+bwd: jax.grad of ½·Σy² (one program); bwd alone: the vjp pullback "
        "compiled on its own\n"
    )
    header = (
        "op",
        "variant",
        "impl",
        "fwd bytes",
        "fwd+bwd bytes",
        "bwd alone",
        "fwd peak",
        "fwd+bwd peak",
        "collectives fwd | fwd+bwd",
    )
    notes: list[str] = []
    table = []
    for r in report["rows"]:
        table.append((r["op"], r["variant"], "spmdkit", *_cells(r["spmdkit"], notes)))
        table.append(("", "", "xla", *_cells(r["plain"], notes)))
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    numeric = {3, 4, 5, 6, 7}

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    print(fmt(header))
    print("  ".join("-" * w for w in widths))
    for row in table:
        print(fmt(row))
    for k, reason in enumerate(notes, 1):
        print(f"[{k}] n/a ({reason})")
    print()
    for r in report["rows"]:
        line = f"{r['op']} [{r['variant']}]: {r['case']}"
        agree = r.get("agreement")
        if agree is not None:
            if "na" in agree:
                line += f"; agreement n/a ({agree['na']})"
            else:
                line += (
                    f"; rel. err. vs plain: fwd {agree['forward_rel_err']:.1e}, "
                    f"grad {agree['grad_rel_err']:.1e}"
                )
        print(line)


def _print_planned(report: dict[str, Any]) -> None:
    rows = [r for r in report["rows"] if "planned" in r]
    if not rows:
        return
    print(
        "\nplanned (sk.jit's propagation + pinned replay), forward+backward: "
        "the op as a region vs the jnp decomposition, same input layouts"
    )
    header = ("op", "variant", "region bytes", "jnp bytes", "region peak", "jnp peak")
    table = []
    for r in rows:
        reg, jnp_ = r["planned"]["region"], r["planned"]["jnp"]

        def cell(side: dict[str, Any], key: str) -> str:
            return "n/a" if "na" in side else _fmt_bytes(side[key])

        table.append(
            (
                r["op"],
                r["variant"],
                cell(reg, "bytes"),
                cell(jnp_, "bytes"),
                cell(reg, "peak_bytes"),
                cell(jnp_, "peak_bytes"),
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    for row in (header, tuple("-" * w for w in widths), *table):
        print(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
    for r in rows:
        for side in ("region", "jnp"):
            if "na" in r["planned"][side]:
                print(f"{r['op']} [{r['variant']}] {side}: n/a ({r['planned'][side]['na']})")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python benchmarks/ops.py [--quick] [--only NAME ...] [--[no-]check]
    [--out PATH] [--attention-memory]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument(
        "--only", action="append", default=[], help="keep cases whose 'op variant' contains this"
    )
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run both sides on random inputs and record how far apart they are "
        "(default: on with --quick)",
    )
    parser.add_argument(
        "--planned",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compile forward+backward through spmdkit's propagation and pinned "
        "replay, the op as a region vs the jnp decomposition (default: on)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON path (default {RESULTS})")
    parser.add_argument(
        "--attention-memory",
        action="store_true",
        help="only the plain vs blockwise attention memory section "
        f"(JSON to --out, default {ATTENTION_RESULTS})",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    if args.attention_memory:
        out = ATTENTION_RESULTS if args.out == RESULTS else args.out
        attention_memory(quick=args.quick, out_path=out)
    else:
        run(
            quick=args.quick,
            out_path=args.out,
            only=args.only,
            check=args.check,
            planned=args.planned,
        )
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""spmdkit.engine.region: ops traced without a layout are one named equation each, compute the
op's unsharded reference under plain jit (values and grads), and run as the rule's
shard_map program with planned layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.region import FORWARD, GRAD, region_call, region_program
from spmdkit.verification.hlo import compiled_collectives


def _prims(closed):
    out = []
    for e in closed.jaxpr.eqns:
        body = e.params.get("call_jaxpr")
        out += _prims(body) if body is not None else [e.primitive.name]
    return out


def _ln(x, s, b):
    m = x.mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * s + b


def test_a_region_is_one_equation_forward_and_one_backward():
    x = jax.ShapeDtypeStruct((8, 16), "float32")
    w = jax.ShapeDtypeStruct((16,), "float32")

    def loss(x, w):
        return region_call("layer_norm", (x, w, w), {}).sum()

    assert _prims(jax.make_jaxpr(loss)(x, w)) == [FORWARD, "reduce_sum"]
    back = _prims(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
    assert back.count(FORWARD) == 1 and back.count(GRAD) == 1


def test_plain_jit_computes_the_reference_values_and_grads():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    s, b = (rng.standard_normal(16).astype(np.float32) for _ in range(2))

    def loss(x, s, b):
        return (region_call("layer_norm", (x, s, b), {"strategy": "sharded_stats"}) ** 2).sum()

    def ref(x, s, b):
        return (_ln(x, s, b) ** 2).sum()

    np.testing.assert_allclose(jax.jit(loss)(x, s, b), ref(x, s, b), rtol=1e-5)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, s, b)
    want = jax.grad(ref, argnums=(0, 1, 2))(x, s, b)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_integer_operands_get_no_cotangent_and_vmap_falls_back():
    rng = np.random.default_rng(1)
    z = rng.standard_normal((4, 8, 10)).astype(np.float32)
    labels = rng.integers(0, 10, (4, 8)).astype(np.int32)

    def ce(z, y):
        return region_call("softmax_cross_entropy", (z, y), {"reduction": "mean"})

    def ref(z, y):
        logp = jax.nn.log_softmax(z, -1)
        return -jnp.take_along_axis(logp, y[..., None], -1).mean()

    got = jax.jit(jax.grad(ce))(z, labels)
    np.testing.assert_allclose(got, jax.grad(ref)(z, labels), rtol=1e-5)
    per = jax.jit(jax.vmap(ce))(z, labels)  # batched: the unsharded computation
    np.testing.assert_allclose(per, jax.vmap(ref)(z, labels), rtol=1e-5)


def test_a_grad_region_types_its_results_as_its_vjp_without_tracing_it(monkeypatch):
    # mixed dtypes and an integer operand: the grad region's results are the
    # differentiable operands' cotangents, typed as jax.eval_shape of its VJP
    # says, and read off the operands: with the VJP made to fail, the grad still
    # traces
    from spmdkit.engine import region as reg

    z = jax.ShapeDtypeStruct((4, 8, 10), "bfloat16")
    y = jax.ShapeDtypeStruct((4, 8), "int32")
    x, w = jax.ShapeDtypeStruct((8, 16), "float32"), jax.ShapeDtypeStruct((16,), "bfloat16")
    cases = [
        ("softmax_cross_entropy", (z, y), {"reduction": "mean"}, (0,)),
        ("layer_norm", (x, w, w), {}, (0, 1, 2)),
    ]
    wanted = []
    for op, args, attrs, _ in cases:
        diff = tuple(bool(jnp.issubdtype(a.dtype, jnp.inexact)) for a in args)
        outs = jax.eval_shape(reg.forward_fn(op, attrs), *args)
        want = jax.eval_shape(reg.grad_fn(op, attrs, diff), *args, *outs)
        wanted.append([(w_.shape, w_.dtype) for w_ in want])

    def untraced(*a, **k):
        raise AssertionError("the grad region's VJP was traced to type its results")

    monkeypatch.setattr(reg, "grad_fn", untraced)
    for (op, args, attrs, argnums), want in zip(cases, wanted, strict=True):
        fn = getattr(sk.ops, op)

        def loss(*a, fn=fn, attrs=attrs):
            return jnp.sum(jnp.asarray(fn(*a, **attrs), jnp.float32))

        closed = jax.make_jaxpr(jax.grad(loss, argnums=argnums))(*args)
        eqns = [e for e in closed.jaxpr.eqns if e.primitive.name == GRAD]
        assert len(eqns) == 1, op
        got = [(tuple(v.aval.shape), v.aval.dtype) for v in eqns[0].outvars]
        assert got == want, op


def test_ops_trace_a_region_with_no_mesh_and_raise_typed_errors():
    x = jax.ShapeDtypeStruct((8, 16), "float32")
    got = _prims(jax.make_jaxpr(sk.ops.rms_norm)(x))
    assert got == [FORWARD]
    with pytest.raises(sk.ShardingConflictError, match="begin_norm_axis"):
        jax.make_jaxpr(lambda x: sk.ops.rms_norm(x, begin_norm_axis=5))(x)


def test_region_program_runs_the_rule_with_its_collectives(mesh2d):
    mesh = Mesh(mesh2d.devices, mesh2d.axis_names)  # Auto axes, as sk.jit's replay
    xs = sk.TensorSpec((8, 16), P("a", "b"), dtype="float32")
    ws = sk.TensorSpec((16,), P("b"), dtype="float32")
    attrs = {"strategy": "sharded_stats"}
    params = {"op": "rms_norm", "attrs": tuple(attrs.items())}
    run = region_program(FORWARD, params, attrs, (xs, ws), (xs,), mesh)
    rng = np.random.default_rng(2)
    x = jax.device_put(
        rng.standard_normal((8, 16)).astype(np.float32), NamedSharding(mesh, P("a", "b"))
    )
    w = jax.device_put(np.ones(16, np.float32), NamedSharding(mesh, P("b")))
    with jax.set_mesh(mesh):
        (y,) = jax.jit(run)(x, w)
        (stat,) = compiled_collectives(jax.jit(run), x, w)
    xv = np.asarray(x)
    np.testing.assert_allclose(y, xv / np.sqrt((xv * xv).mean(-1, keepdims=True) + 1e-6), rtol=1e-5)
    assert (stat.kind, stat.group_size, stat.payload_bytes) == ("all_reduce", 4, 4 * 4)
    # uneven or partial layouts cannot run under shard_map: the caller binds the region
    odd = sk.TensorSpec((6, 16), P("b"), dtype="float32")
    assert region_program(FORWARD, params, attrs, (odd, ws), (odd,), mesh) is None


def test_a_program_traced_while_recording_visits_is_traced_for_that_block():
    """``region_jaxpr`` memoizes a region's program, but inside ``record_visits``
    the attention kernels' callbacks append to that block's list: each block gets
    a program traced for it (before, the second block ran the first's and
    recorded nothing: the ring context-parallel Llama test when another test had
    traced its attention first); outside, the program is traced once."""
    from jax.extend.core import jaxpr_as_fun

    from spmdkit.engine.region import region_jaxpr
    from spmdkit.kernels import record_visits

    mesh = Mesh(np.array(jax.devices()[:4]), ("c",))
    qs = sk.TensorSpec((1, 32, 2, 8), P(None, "c"), dtype="float32")
    kv = sk.TensorSpec((1, 32, 1, 8), P(None, "c"), dtype="float32")
    attrs = {"causal": True, "strategy": "ring", "implementation": "blockwise", "block_size": 4}
    params = {"op": "attention", "attrs": tuple(attrs.items())}
    rng = np.random.default_rng(3)
    q, k = (
        jax.device_put(rng.standard_normal(s.shape).astype(np.float32), NamedSharding(mesh, spec))
        for s, spec in ((qs, P(None, "c")), (kv, P(None, "c")))
    )
    counts = []
    for _ in range(2):
        with record_visits() as visits:
            closed = region_jaxpr(FORWARD, params, attrs, (qs, kv, kv), (qs,), mesh)
            with jax.set_mesh(mesh):
                jax.block_until_ready(jax.jit(jaxpr_as_fun(closed))(q, k, k))
        counts.append(len(visits))
    assert counts[0] == counts[1] > 0, counts
    once = region_jaxpr(FORWARD, params, attrs, (qs, kv, kv), (qs,), mesh)
    assert once is region_jaxpr(FORWARD, params, attrs, (qs, kv, kv), (qs,), mesh)


@pytest.mark.parametrize(
    ("hidden", "strategy", "barrier"), [(None, None, False), ("b", "sharded_stats", True)]
)
def test_a_grad_region_fences_its_recomputed_forward_only_where_it_talks(
    mesh2d, hidden, strategy, barrier
):
    """A grad region recomputes the forward behind an optimization barrier only
    where that forward runs collectives (the sharded statistic's all-reduce), so
    XLA keeps them the grad region's own; a forward that runs none is left for XLA
    to merge with the forward region's computation, as in the unsharded region,
    and the gradients are the same either way."""
    from spmdkit.engine.region import region_jaxpr
    from spmdkit.jaxprs import walk_eqns

    mesh = Mesh(mesh2d.devices, mesh2d.axis_names)
    xs = sk.TensorSpec((8, 16), P(None, hidden), dtype="float32")
    ws = sk.TensorSpec((16,), P(hidden), dtype="float32")
    attrs = {} if strategy is None else {"strategy": strategy}
    params = {"op": "rms_norm", "attrs": tuple(attrs.items()), "diff": (True, True)}
    closed = region_jaxpr(GRAD, params, attrs, (xs, ws, xs), (xs, ws), mesh)
    prims = {e.primitive.name for e, _ in walk_eqns(closed)}
    assert ("optimization_barrier" in prims) is barrier, prims
    assert ("psum" in prims or "psum_invariant" in prims) is barrier, prims
    rng = np.random.default_rng(4)
    x, ct = (rng.standard_normal((8, 16)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(16).astype(np.float32)

    def ref(x, w):
        return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w

    want = jax.vjp(ref, x, w)[1](ct)
    run = region_program(GRAD, params, attrs, (xs, ws, xs), (xs, ws), mesh)
    with jax.set_mesh(mesh):
        got = jax.jit(run)(x, w, ct)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def _moe_layout(mesh, experts):
    """kept_layout of a moe_experts grad region: tokens over ``(a, b)``, the experts
    over ``experts``."""
    from spmdkit.engine.region import kept_layout

    t, d, k, e, f = 32, 8, 2, 8, 8
    tok = P(("a", "b"))
    shapes = ((t, d), (t, k), (t, k), (e, d, f), (e, d, f), (e, f, d))
    specs = [
        sk.TensorSpec(s, tok if i < 3 else P(experts), dtype="int32" if i == 1 else "float32")
        for i, s in enumerate(shapes)
    ]
    stand_ins = [sk.TensorSpec((0,), dtype=dt) for dt in ("float32", "int32", "float32")]
    ct = sk.TensorSpec((t, d), tok, dtype="float32")
    required = (*specs, *stand_ins, ct)
    params = {"op": "moe_experts", "diff": (True, False, True, True, True, True)}
    g = sk.infer_grad("moe_experts", *specs, out_grads=(ct,), mesh=mesh, strategy="all_to_all")
    diff = params["diff"]
    produced = tuple(o.without_partial() for o, on in zip(g.outputs, diff, strict=True) if on)
    attrs = {"strategy": "all_to_all"}
    return kept_layout(GRAD, params, attrs, required, produced, mesh)


def test_check_kept_refuses_residuals_made_under_another_layout():
    """A grad region reads kept residuals only on the layout they were kept under:
    another layout (equal shapes, other expert axes), a forward that kept none, or,
    where the pairing is unknown, other shapes are typed errors; a grad region that
    reads none takes anything."""
    from spmdkit.engine.region import KEPT_NOTHING, check_kept

    mesh = sk.make_mesh(a=2, b=4)
    mine, other = _moe_layout(mesh, ("a", "b")), _moe_layout(mesh, ("b", "a"))
    assert mine is not None and other is not None
    assert mine.shapes == other.shapes and mine != other
    check_kept("moe_experts", mine, mine, mine.shapes)
    check_kept("moe_experts", None, mine, mine.shapes)  # unpaired: the shapes agree
    check_kept("moe_experts", KEPT_NOTHING, None, [(0,)] * 3)  # reads none
    with pytest.raises(sk.ShardingConflictError, match=r"expert axes \('b', 'a'\)"):
        check_kept("moe_experts", other, mine, mine.shapes)
    with pytest.raises(sk.ShardingConflictError, match="the forward region kept none"):
        check_kept("moe_experts", KEPT_NOTHING, mine, [(0,)] * 3)
    with pytest.raises(sk.ShardingConflictError, match=r"residuals of shapes \[\(0,\)"):
        check_kept("moe_experts", None, mine, [(0,)] * 3)
    narrow = _moe_layout(mesh, ("b",))  # four expert shards: other buffer shapes
    assert narrow is not None and narrow.shapes != mine.shapes
    with pytest.raises(sk.ShardingConflictError, match="kept under"):
        check_kept("moe_experts", narrow, mine, narrow.shapes)

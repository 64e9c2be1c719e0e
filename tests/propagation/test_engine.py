"""Propagation over traced train steps, checked against compiled HLO."""

import warnings

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import EqnRecord, Propagation, propagate, register_primitive, trace

S = jax.ShapeDtypeStruct
F32 = "float32"


def _loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    o = h @ p["w2"]
    return jnp.mean((o - y) ** 2)


def _step(p, x, y):
    g = jax.grad(_loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def _forward(p, x):
    return jax.nn.relu(x @ p["w1"]) @ p["w2"]


PARAMS = {"w1": S((64, 128), F32), "b1": S((128,), F32), "w2": S((128, 32), F32)}
X = S((64, 64), F32)
Y = S((64, 32), F32)


def _auto(mesh):
    return Mesh(mesh.devices, mesh.axis_names)


def _sharded(tree, specs, mesh):
    """ShapeDtypeStructs with NamedShardings on an Auto mesh (what jit compiles for)."""
    return jax.tree.map(
        lambda a, s: S(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )


def _all_reduce_bytes(fn, args, specs, mesh):
    cols = sk.compiled_collectives(fn, *_sharded(args, specs, _auto(mesh)))
    return sk.summarize(cols).get("all_reduce", {}).get("payload_bytes", 0)


def test_trace_is_abstract():
    closed = trace(_step, PARAMS, X, Y)
    names = [e.primitive.name for e in closed.jaxpr.eqns]
    assert "dot_general" in names
    assert len(closed.jaxpr.invars) == 5


def test_dp_train_step_grad_all_reduce_matches_hlo(mesh2d):
    dp = P(("a", "b"))
    prop = propagate(_step, PARAMS, X, Y, in_specs=(None, dp, dp), mesh=mesh2d)
    assert isinstance(prop, Propagation)
    assert not prop.unknown
    grads = sum(math_prod(a.shape) * 4 for a in jax.tree.leaves(PARAMS))
    assert prop.comm_bytes_by_kind == {"all_reduce": grads}
    pspecs = (jax.tree.map(lambda _: P(), PARAMS), dp, dp)
    compiled = _all_reduce_bytes(_step, (PARAMS, X, Y), pspecs, mesh2d)
    assert abs(prop.comm_bytes - compiled) <= 0.10 * compiled
    # the outputs are reduced; the parameters stay replicated
    assert all(s.is_replicated for s in prop.out_specs)
    assert all(isinstance(r, EqnRecord) for r in prop.records)
    assert any(r.backward for r in prop.records)


def math_prod(shape):
    out = 1
    for s in shape:
        out *= s
    return out


def test_megatron_mlp_forward_has_one_activation_all_reduce(mesh2d):
    params = {"w1": PARAMS["w1"], "w2": PARAMS["w2"]}
    specs = ({"w1": P(None, "b"), "w2": P("b", None)}, P("a"))
    prop = propagate(_forward, params, X, in_specs=specs, mesh=mesh2d)
    cols = prop.collectives()
    assert [c.kind for c in cols] == ["all_reduce"]
    assert cols[0].axes == ("b",)
    assert cols[0].payload_bytes == 32 * 32 * 4  # [64/2, 32] f32, the activation
    assert prop.out_specs[0] == sk.TensorSpec((64, 32), P("a"), dtype=F32)
    compiled = _all_reduce_bytes(_forward, (params, X), specs, mesh2d)
    assert compiled == prop.comm_bytes


def test_megatron_train_step_matches_hlo(mesh2d):
    specs = ({"w1": P(None, "b"), "b1": P("b"), "w2": P("b", None)}, P("a"), P("a"))
    prop = propagate(_step, PARAMS, X, Y, in_specs=specs, mesh=mesh2d)
    fwd = [c for r in prop.records if not r.backward for c in r.collectives()]
    assert fwd, "the forward all-reduce of the row-parallel output"
    rep = sk_report(_step, _sharded((PARAMS, X, Y), specs, _auto(mesh2d)))
    assert abs(prop.comm_bytes - rep.comm_bytes) <= 0.10 * rep.comm_bytes


def sk_report(fn, args):
    from spmdkit.verification.report import report

    return report(fn, *args)


def test_unknown_primitive_warns_counts_and_replicates(mesh1d):
    prim = jax.extend.core.Primitive("spmdkit_test_mystery")
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))

    def f(x):
        return jnp.sin(prim.bind(x * 2.0))

    x = S((32, 8), F32)
    with pytest.warns(UserWarning, match="spmdkit_test_mystery"):
        prop = propagate(f, x, in_specs=(P("x"),), mesh=mesh1d)
    assert prop.unknown["spmdkit_test_mystery"] == 1
    rec = next(r for r in prop.records if r.primitive == "spmdkit_test_mystery")
    assert rec.op is None
    assert rec.outputs[0].is_replicated
    assert [c.kind for c in rec.collectives()] == ["all_gather"]
    assert rec.comm_bytes == 32 * 8 * 4
    # warned once per primitive, counted every time
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = propagate(lambda x: prim.bind(prim.bind(x)), x, in_specs=(P("x"),), mesh=mesh1d)
    assert again.unknown["spmdkit_test_mystery"] == 2


def test_register_primitive_maps_to_a_rule(mesh1d):
    prim = jax.extend.core.Primitive("spmdkit_test_tanhish")
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    register_primitive("spmdkit_test_tanhish", lambda eqn: ("tanh", {}))
    prop = propagate(prim.bind, S((32, 8), F32), in_specs=(P("x"),), mesh=mesh1d)
    assert not prop.unknown
    assert prop.out_specs[0].dims == (("x",), ())
    assert prop.comm_bytes == 0


def _scan_model(w, x):
    def body(h, wl):
        return jnp.tanh(h @ wl), None

    h, _ = jax.lax.scan(body, x, w)
    return h


def test_scan_body_row_parallel_counts_every_iteration(mesh1d):
    layers, b, h = 3, 16, 32
    w = S((layers, h, h), F32)
    x = S((b, h), F32)
    prop = propagate(_scan_model, w, x, in_specs=(P(None, "x", None), P(None, "x")), mesh=mesh1d)
    rec = next(r for r in prop.records if r.primitive == "scan")
    assert rec.repeat == layers
    # each layer: x @ W row-parallel is sum-partial over x; tanh needs it reduced
    per_layer = b * h * 4
    assert prop.comm_bytes_by_kind["all_reduce"] == layers * per_layer
    assert prop.out_specs[0].shape == (b, h)


def test_scan_dp_carry_keeps_batch_sharding(mesh2d):
    w = S((4, 32, 32), F32)
    x = S((16, 32), F32)
    prop = propagate(_scan_model, w, x, in_specs=(None, P("a")), mesh=mesh2d)
    assert prop.comm_bytes == 0
    assert prop.out_specs[0].dims == (("a",), ())


def test_scan_stacked_dim_is_gathered(mesh1d):
    w = S((4, 32, 32), F32)
    x = S((16, 32), F32)
    prop = propagate(_scan_model, w, x, in_specs=(P("x"), None), mesh=mesh1d)
    # the stacked (layer) dim may not stay sharded: one all-gather of the weights
    assert prop.comm_bytes_by_kind == {"all_gather": 4 * 32 * 32 * 4}


def test_grad_through_scan_and_remat(mesh2d):
    def loss(w, x):
        return jnp.sum(jax.checkpoint(_scan_model)(w, x) ** 2)

    w = S((2, 32, 32), F32)
    x = S((16, 32), F32)
    prop = propagate(jax.grad(loss), w, x, in_specs=(None, P("a")), mesh=mesh2d)
    assert not prop.unknown
    # dW is summed over the batch: one all-reduce over 'a' of the stacked weights' size
    assert prop.comm_bytes_by_kind.get("all_reduce", 0) >= 2 * 32 * 32 * 4


def test_out_specs_pull_sharding_upstream(mesh1d):
    def f(x, w):
        return jnp.tanh(x @ w)

    x, w = S((64, 32), F32), S((32, 16), F32)
    free = propagate(f, x, w, in_specs=(None, None), mesh=mesh1d)
    want = propagate(f, x, w, in_specs=(None, None), out_specs=P("x"), mesh=mesh1d)
    assert want.out_specs[0].dims == (("x",), ())
    assert want.flops < free.flops
    assert want.comm_bytes == 0
    dot = next(r for r in want.records if r.primitive == "dot_general")
    assert dot.outputs[0].dims == (("x",), ())


def test_out_specs_constraint_costs_a_reshard(mesh1d):
    x = S((64, 32), F32)
    prop = propagate(lambda x: x * 2.0, x, in_specs=(P("x"),), out_specs=P(), mesh=mesh1d)
    assert prop.out_specs[0].is_replicated
    assert prop.comm_bytes_by_kind == {"all_gather": 64 * 32 * 4}


def test_abstract_mesh_needs_no_devices():
    mesh = sk.abstract_mesh(data=64, model=8)
    params = {"w1": S((4096, 16384), "bfloat16"), "w2": S((16384, 4096), "bfloat16")}
    x = S((512, 4096), "bfloat16")
    prop = propagate(
        _forward,
        params,
        x,
        in_specs=({"w1": P(None, "model"), "w2": P("model", None)}, P("data")),
        mesh=mesh,
    )
    assert prop.comm_bytes_by_kind == {"all_reduce": 512 // 64 * 4096 * 2}
    assert prop.flops == pytest.approx(2 * 2 * 8 * 4096 * 16384 / 8 + 8 * 16384 / 8)
    assert prop.step_time_s > prop.compute_time_s > 0
    assert "all_reduce" in str(prop)


def test_strategies_are_checked(mesh1d):
    x = S((8, 8), F32)
    with pytest.raises(sk.ShardingConflictError, match="strategy"):
        propagate(jnp.tanh, x, in_specs=(P("x"),), mesh=mesh1d, strategies={"tanh": "fast"})
    with pytest.raises(sk.NoRuleError):
        propagate(jnp.tanh, x, in_specs=(P("x"),), mesh=mesh1d, strategies={"tanhh": "x"})
    prop = propagate(jnp.tanh, x, in_specs=(P("x"),), mesh=mesh1d, strategies={"tanh": "default"})
    assert prop.records[0].strategy == "default"
    assert not prop.unknown


def test_bad_in_specs_raise(mesh1d):
    with pytest.raises(sk.SpecError):
        propagate(jnp.tanh, S((8, 8), F32), in_specs=(P("x"), P("x")), mesh=mesh1d)
    with pytest.raises(sk.SpmdError):
        propagate(jnp.tanh, S((8, 8), F32), in_specs=(P("nope"),), mesh=mesh1d)


def test_table_lists_costly_equations(mesh2d):
    dp = P(("a", "b"))
    prop = propagate(_step, PARAMS, X, Y, in_specs=(None, dp, dp), mesh=mesh2d)
    text = prop.table(limit=2)
    assert len(text.splitlines()) == 3
    assert "all_reduce" in text


@pytest.mark.parametrize(
    ("table", "expected"),
    [(P(), {"all_reduce": 100 * 16 * 4}), (P(None, "x"), {"all_gather": 8 * 5 * 4})],
    ids=["replicated-table", "dim-sharded-table"],
)
def test_embedding_grad_scatter_add_matches_hlo(mesh1d, table, expected):
    def f(t, i):
        return jax.grad(lambda t: jnp.sum(t[i] ** 2))(t)

    t, i = S((100, 16), F32), S((8, 5), "int32")
    prop = propagate(f, t, i, in_specs=(table, P("x")), mesh=mesh1d)
    assert not prop.unknown
    assert prop.comm_bytes_by_kind == expected
    auto = _auto(mesh1d)
    rep = sk_report(
        f,
        (
            S(t.shape, F32, sharding=NamedSharding(auto, table)),
            S(i.shape, "int32", sharding=NamedSharding(auto, P("x"))),
        ),
    )
    assert rep.bytes_by_kind() == expected


def test_cond_merges_branches(mesh1d):
    def f(p, x, w):
        return jax.lax.cond(p > 0, lambda x: jnp.tanh(x @ w), lambda x: x @ w, x)

    prop = propagate(
        f, S((), "int32"), S((16, 32), F32), S((32, 32), F32),
        in_specs=(None, P(None, "x"), P("x")), mesh=mesh1d,
    )  # fmt: skip
    assert not prop.unknown
    # row-parallel in both branches: one all-reduce of the [16, 32] result
    assert prop.comm_bytes_by_kind == {"all_reduce": 16 * 32 * 4}
    assert prop.out_specs[0].is_replicated


def test_while_keeps_the_carry_layout(mesh1d):
    def f(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))

    prop = propagate(f, S((16, 32), F32), in_specs=(P("x"),), mesh=mesh1d)
    assert not prop.unknown
    assert prop.comm_bytes == 0
    assert prop.out_specs[1].dims == (("x",), ())
    assert [r.primitive for r in prop.records] == ["while"]


def test_shard_map_specs_and_body_collectives_match_hlo(mesh1d):
    mesh = _auto(mesh1d)

    def f(x):
        body = lambda b: jax.lax.psum(jnp.tanh(b), "x")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(x)

    prop = propagate(f, S((16, 32), F32), in_specs=(P(None, "x"),), mesh=mesh)
    # the operand moves to the shard_map's in_specs, then the body's psum
    assert prop.comm_bytes_by_kind == {"all_reduce": 4 * 32 * 4, "all_to_all": 4 * 32 * 4}
    rep = sk_report(f, (S((16, 32), F32, sharding=NamedSharding(mesh, P(None, "x"))),))
    assert rep.bytes_by_kind() == prop.comm_bytes_by_kind


@pytest.mark.parametrize(
    "logits", [P("a"), P("a", None, "b")], ids=["batch-sharded", "vocab-parallel"]
)
def test_integer_label_cross_entropy_grad_matches_hlo(mesh2d, logits):
    import optax

    def f(lg, y):
        return jax.grad(lambda lg: optax.softmax_cross_entropy_with_integer_labels(lg, y).mean())(
            lg
        )

    lg, y = S((8, 16, 32), F32), S((8, 16), "int32")
    prop = propagate(f, lg, y, in_specs=(logits, P("a")), mesh=mesh2d)
    assert not prop.unknown  # take_along_axis's batched gather/scatter-add have rules
    assert prop.out_specs[0].dims[0] == ("a",)
    auto = _auto(mesh2d)
    rep = sk_report(
        f,
        (
            S(lg.shape, F32, sharding=NamedSharding(auto, logits)),
            S(y.shape, "int32", sharding=NamedSharding(auto, P("a"))),
        ),
    )
    assert rep.bytes_by_kind() == prop.comm_bytes_by_kind


def test_sharding_constraints_and_reshards_set_layouts(mesh1d):
    auto = _auto(mesh1d)
    x = S((16, 8), F32)
    explicit = propagate(
        lambda x: jax.sharding.reshard(x, NamedSharding(mesh1d, P("x"))) * 2.0,
        x, in_specs=(None,), mesh=mesh1d,
    )  # fmt: skip
    constrained = propagate(
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(auto, P(None, "x"))) * 2.0,
        x, in_specs=(P("x"),), mesh=auto,
    )  # fmt: skip
    assert explicit.out_specs[0].dims == (("x",), ())
    assert explicit.comm_bytes == 0  # replicated -> sharded is a local slice
    assert constrained.out_specs[0].dims == ((), ("x",))
    assert constrained.comm_bytes_by_kind == {"all_to_all": 16 * 8 * 4 // 4}


def test_optimization_barrier_keeps_layouts(mesh1d):
    def f(x, y):
        a, b = jax.lax.optimization_barrier((x, y))
        return a + 1.0, b * 2.0

    prop = propagate(f, S((16, 8), F32), S((8,), F32), in_specs=(P("x"), None), mesh=mesh1d)
    assert not prop.unknown
    assert prop.out_specs[0].dims == (("x",), ())
    assert prop.comm_bytes == 0


def test_random_generators_need_no_rule(mesh1d):
    def f(x, key):
        keep = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.9, x.shape)
        return jnp.where(keep, x / 0.9, 0.0)

    key = jax.eval_shape(lambda: jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prop = propagate(f, S((16, 8), F32), key, in_specs=(P("x"), None), mesh=mesh1d)
    assert not prop.unknown
    assert prop.out_specs[0].dims == (("x",), ())
    assert prop.comm_bytes == 0


@pytest.mark.parametrize(
    ("kernel", "images", "expected"),
    [
        (P(), P(("a", "b")), 3 * 3 * 8 * 16 * 4),
        (P(None, None, None, "b"), P("a"), 3 * 3 * 8 * 4 * 4),
    ],
    ids=["data-parallel", "output-channels-sharded"],
)
def test_conv_train_step_matches_hlo(mesh2d, kernel, images, expected):
    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(conv(x, w))))(w)

    w, x = S((3, 3, 8, 16), F32), S((16, 12, 12, 8), F32)
    prop = propagate(step, w, x, in_specs=(kernel, images), mesh=mesh2d)
    assert not prop.unknown
    assert prop.comm_bytes_by_kind == {"all_reduce": expected}  # the kernel grad, batch-summed
    auto = _auto(mesh2d)
    rep = sk_report(
        step,
        (
            S(w.shape, F32, sharding=NamedSharding(auto, kernel)),
            S(x.shape, F32, sharding=NamedSharding(auto, images)),
        ),
    )
    assert rep.bytes_by_kind() == prop.comm_bytes_by_kind


def _mlp2_loss(ws, x):
    h = x
    for w1, w2 in ws:
        h = h + jax.nn.relu(h @ w1) @ w2
    return jnp.mean(h * h)


@pytest.mark.parametrize("axes", [{"data": 8}, {"data": 2, "model": 4}])
def test_fsdp_gathers_weights_and_reduce_scatters_grads(axes):
    """FSDP: every weight is all-gathered once (the backward reuses the forward's
    gathered copy, as XLA does), every weight grad is reduce-scattered, and the
    batch-sharded activations never move."""
    d, f, b = 32, 64, 16
    mesh = sk.abstract_mesh(**axes)
    every = tuple(axes)
    ws = [(S((d, f), F32), S((f, d), F32)) for _ in range(2)]
    specs = [(P(every), P(every)) for _ in range(2)]
    prop = propagate(
        jax.grad(_mlp2_loss),
        ws,
        S((b, d), F32),
        mesh=mesh,
        in_specs=(specs, P(every)),
        out_specs=specs,
        arg_roles=("params", "batch"),
    )
    weight_bytes = 4 * d * f * 4
    assert prop.comm_bytes_by_kind == {
        "all_gather": weight_bytes,
        "reduce_scatter": weight_bytes,
    }
    gathers = [c for c in prop.collectives() if c.kind == "all_gather"]
    assert len(gathers) == 4 and all(c.group_size == 8 for c in gathers)


@pytest.mark.parametrize(
    ("spec", "flipped"),
    [(P("x"), (("x",), ())), (P(None, "x"), ((), ()))],
    ids=["rows-sharded", "axis-sharded"],
)
def test_top_k_and_rev_have_rules_that_match_the_hlo(mesh1d, spec, flipped):
    """top_k (MoE routing) and rev (flip) have rules. rev keeps every dim but the
    reversed one; top_k gathers its whole operand, as XLA partitions its TopK custom
    call. Predicted bytes equal the pinned program's HLO and its values equal the
    unsharded function."""
    import numpy as np

    from spmdkit.compile.enforce import enforced

    def f(x):
        values, idx = jax.lax.top_k(x, 2)
        return values * 2.0, idx, jnp.flip(x, 1)

    x = S((16, 32), F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no rule" warning
        prop = propagate(f, x, in_specs=(spec,), mesh=_auto(mesh1d))
    assert not prop.unknown
    assert [o.shape for o in prop.out_specs] == [(16, 2), (16, 2), (16, 32)]
    assert prop.out_specs[2].dims == flipped
    assert prop.comm_bytes_by_kind == {"all_gather": 16 * 32 * 4}  # one gather of x, reused
    value = jax.random.normal(jax.random.key(0), (16, 32))
    with jax.set_mesh(_auto(mesh1d)):  # the program as sk.jit runs it: pinned
        cols = sk.compiled_collectives(enforced(prop), _sharded(x, spec, _auto(mesh1d)))
        got = jax.jit(enforced(prop))(value)
    compiled = sk.summarize(cols)
    assert prop.comm_bytes == sum(v["payload_bytes"] for v in compiled.values())
    for g, w in zip(got, f(value), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_take_along_axis_grad_scatters_where_the_labels_are():
    """The cross-entropy label pick's gradient is a scatter-add into zeros of
    broadcast fill values, indexed by the labels. With the labels sharded over
    the batch, the scatter runs there: the zeros, the fill and the result are
    born batch-sharded, nothing is gathered, and the [batch, seq, vocab]
    gradient never exists whole on one device (at Llama-3 8B size and 512
    devices, the replicated scatter was 2 TiB of the per-device estimate)."""
    mesh = sk.make_mesh(data=2, model=4)

    def loss(logits, labels):
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)
        return -jnp.mean(picked)

    logits = jax.ShapeDtypeStruct((16, 8, 64), jnp.float32)
    labels = jax.ShapeDtypeStruct((16, 8), jnp.int32)
    batch = P(("data", "model"))
    prop = propagate(
        jax.grad(loss), logits, labels, mesh=mesh, in_specs=(batch, batch), out_specs=batch
    )
    assert "all_gather" not in prop.comm_bytes_by_kind, prop.collectives()
    scatters = [r for r in prop.records if r.primitive == "scatter-add"]
    assert scatters
    for r in scatters:
        assert r.outputs[0].dims[0] == ("data", "model"), r

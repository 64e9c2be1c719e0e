"""Primitive → rule: unknown and registered primitives, the built-in fallbacks
(scatter, conv, top_k, rev, generators), checked against compiled HLO."""

import warnings

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.compile.enforce import enforced
from spmdkit.engine.registry import register_primitive
from spmdkit.propagation import propagate
from spmdkit.propagation.primitives import grouped_partial
from spmdkit.spec import TensorSpec
from tests.propagation.programs import (
    F32,
    S,
    as_auto,
    compiled_report,
    sharded,
)


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
    auto = as_auto(mesh1d)
    rep = compiled_report(
        f,
        (
            S(t.shape, F32, sharding=NamedSharding(auto, table)),
            S(i.shape, "int32", sharding=NamedSharding(auto, P("x"))),
        ),
    )
    assert rep.bytes_by_kind() == expected


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
    auto = as_auto(mesh2d)
    rep = compiled_report(
        f,
        (
            S(lg.shape, F32, sharding=NamedSharding(auto, logits)),
            S(y.shape, "int32", sharding=NamedSharding(auto, P("a"))),
        ),
    )
    assert rep.bytes_by_kind() == prop.comm_bytes_by_kind


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


def _flax_dropout(x, key):
    """Dropout as flax writes it: the mask drawn with ``out_sharding=`` the input's
    type's sharding (for an input typed on an Auto mesh, as ``sk.jit`` traces: a
    ``reshard`` to ``P(None, None)`` that lowers to nothing)."""
    keep = jax.random.bernoulli(key, 0.5, x.shape, out_sharding=jax.typeof(x).sharding)
    return jnp.where(keep, x / 0.5, 0.0)


@pytest.mark.parametrize("partitionable", [True, False])
def test_dropout_bits_are_made_where_the_compiled_step_makes_them(mesh1d, partitionable):
    """With partitionable threefry the mask's random bits are made sharded like the
    activations (XLA computes each device's block alone, no collective, no whole
    copy), without it replicated and sliced (sharded, XLA would move them); the
    ``reshard`` before the consumer passes the layout through. The values do not
    depend on the layout."""
    auto = as_auto(mesh1d)
    x = S((64, 32), F32, sharding=NamedSharding(auto, P("x")))
    key = jax.eval_shape(lambda: jax.random.key(0))
    with jax.threefry_partitionable(partitionable):
        closed = jax.make_jaxpr(_flax_dropout)(x, key)  # traced as sk.jit traces
        prop = propagate(closed, x, key, in_specs=(P("x"), None), mesh=auto)
        assert any(r.primitive == "reshard" for r in prop.records)
        bits = next(r for r in prop.records if r.primitive == "random_bits")
        assert bits.outputs[0].dims == ((("x",), ()) if partitionable else ((), ()))
        assert prop.comm_bytes == 0
        fn = jax.jit(enforced(prop))
        xs = jnp.arange(64 * 32, dtype=F32).reshape(64, 32)
        (got,) = fn(jax.device_put(xs, x.sharding), jax.random.key(3))
        assert (got == jax.jit(_flax_dropout)(xs, jax.random.key(3))).all()
        text = fn.lower(x, key).compile().as_text()
    assert ("u32[64,32]" not in text) == partitionable  # made whole only when it must be
    assert not [line for line in text.splitlines() if "all-gather(" in line]


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
    auto = as_auto(mesh2d)
    rep = compiled_report(
        step,
        (
            S(w.shape, F32, sharding=NamedSharding(auto, kernel)),
            S(x.shape, F32, sharding=NamedSharding(auto, images)),
        ),
    )
    assert rep.bytes_by_kind() == prop.comm_bytes_by_kind


@pytest.mark.parametrize(
    ("spec", "flipped", "gathered"),
    [(P("x"), (("x",), ()), {}), (P(None, "x"), ((), ()), {"all_gather": 16 * 32 * 4})],
    ids=["rows-sharded", "axis-sharded"],
)
def test_top_k_and_rev_have_rules_that_match_the_hlo(mesh1d, spec, flipped, gathered):
    """top_k (MoE routing) and rev (flip) have rules. rev keeps every dim but the
    reversed one; top_k keeps its rows where they are (each device takes the top k of
    its own rows: the replay runs it under shard_map, where XLA's partitioner would
    gather the TopK custom call's whole operand) and gathers only the dim it selects
    along (one gather of x, reused by the flip). Predicted bytes equal the pinned
    program's HLO and its values equal the unsharded function."""
    import numpy as np

    from spmdkit.compile.enforce import enforced

    def f(x):
        values, idx = jax.lax.top_k(x, 2)
        return values * 2.0, idx, jnp.flip(x, 1)

    x = S((16, 32), F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no rule" warning
        prop = propagate(f, x, in_specs=(spec,), mesh=as_auto(mesh1d))
    assert not prop.unknown
    assert [o.shape for o in prop.out_specs] == [(16, 2), (16, 2), (16, 32)]
    assert prop.out_specs[2].dims == flipped
    assert prop.comm_bytes_by_kind == gathered
    assert prop.out_specs[0].dims == flipped  # top_k's values: rows as x's
    value = jax.random.normal(jax.random.key(0), (16, 32))
    with jax.set_mesh(as_auto(mesh1d)):  # the program as sk.jit runs it: pinned
        cols = sk.compiled_collectives(enforced(prop), sharded(x, spec, as_auto(mesh1d)))
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


def _custom_rule_program(name):
    prim = jax.extend.core.Primitive(name)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    register_primitive(name, lambda eqn: (name, {}))
    return prim


@pytest.mark.parametrize(
    ("error", "surfaces"),
    [(NotImplementedError, False), (sk.ShardingConflictError, False), (AttributeError, True)],
    ids=["not-implemented", "spmd-error", "bug"],
)
def test_a_rule_that_does_not_fit_falls_back_and_a_bug_surfaces(mesh1d, error, surfaces):
    """A rule saying it does not fit an equation (SpmdError, NotImplementedError)
    leaves it replicated, warned and counted; any other exception is a bug in the
    rule and is raised (a notation's TypeError, ValueError, IndexError or
    KeyError is the FactorRule's own "does not fit" error)."""
    name = f"spmdkit_test_raises_{error.__name__}"

    def notation(shapes, **_):
        if error is sk.ShardingConflictError:
            raise error(op=name, must="fit", given="no", fix="none")
        raise error("does not fit")

    sk.register_rule(sk.FactorRule(name, notation, impl=lambda x, **_: x))
    try:
        prim = _custom_rule_program(name)
        x = S((32, 8), F32)
        if surfaces:
            with pytest.raises(error):
                propagate(prim.bind, x, in_specs=(P("x"),), mesh=mesh1d)
            return
        with pytest.warns(UserWarning, match=name):
            prop = propagate(prim.bind, x, in_specs=(P("x"),), mesh=mesh1d)
        assert prop.unknown[name] == 1
        assert prop.out_specs[0].is_replicated
    finally:
        sk.unregister_rule(name)


def test_a_converter_bug_surfaces(mesh1d):
    prim = jax.extend.core.Primitive("spmdkit_test_bad_converter")
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    register_primitive("spmdkit_test_bad_converter", lambda eqn: ("tanh", eqn.params["missing"]))
    with pytest.raises(KeyError, match="missing"):
        propagate(prim.bind, S((32, 8), F32), in_specs=(P("x"),), mesh=mesh1d)


def test_atan2_propagates_with_its_registered_rule(mesh1d):
    prop = propagate(
        jnp.arctan2, S((32, 8), F32), S((32, 8), F32), in_specs=(P("x"), P("x")), mesh=mesh1d
    )
    assert not prop.unknown
    assert [r.op for r in prop.records if r.op == "atan2"] == ["atan2"]
    assert prop.out_specs[0].dims == (("x",), ())


def test_device_put_between_memory_kinds_keeps_each_layout(mesh2d):
    """Optimizer offload moves state to host memory and back inside the step: the
    values keep their layouts, nothing moves between devices."""

    def step(a, b):
        a, b = (jax.device_put(x, jax.memory.Space.Device) for x in (a, b))
        return a * 2, b + 1

    args = (jnp.ones((8, 16)), jnp.ones((16,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prop = propagate(step, *args, in_specs=(P("a", "b"), P("b")), mesh=mesh2d)
    outs = [r for r in prop.records if r.op != "device_put"][-2:]
    assert [o.outputs[0].dims for o in outs] == [(("a",), ("b",)), (("b",),)]
    assert prop.comm_bytes == 0


def _every_former_builtin(x, w, i):
    """One step through each primitive the propagator once laid out with an unchecked
    built-in (now each a registered rule of its own name)."""
    lax = jax.lax
    y = jnp.cumsum(x, 0) + jnp.cumprod(x, 1) + lax.cummax(x, 0) + lax.cummin(x, 1)
    y = y + lax.cumlogsumexp(x, 0) + jnp.flip(x, 1) + jnp.sort(x, 0)
    y = y + jnp.floor(x) + jnp.ceil(x) + jnp.round(x) + jnp.clip(x, 0.0, 1.0)
    y = y + jnp.exp2(x) + jnp.sinh(x) + jnp.cosh(x) + jnp.tan(x) + jnp.arcsinh(x)
    y = y + jnp.arctan(x) + jnp.cbrt(x) + jnp.fmod(x, 3.0) + lax.clamp(0.0, x, 1.0)
    y = y + lax.erf_inv(jnp.tanh(x)) + lax.erfc(x) + lax.lgamma(x) + lax.digamma(x)
    y = y + lax.reduce_precision(x, 5, 10) + lax.stop_gradient(x) + jnp.copy(x)
    y = y + jnp.where(jnp.isfinite(x), x, 0.0) + lax.nextafter(x, y)
    y = y + (lax.shift_left(i, i) ^ lax.population_count(i)).astype(F32)
    y = y + lax.argmax(x, 1, "int32")[:, None] + lax.argmin(x, 0, "int32")[None, :]
    y = y + jnp.argsort(x, 1) + lax.top_k(x, 2)[0].sum() + jax.device_put(x)
    img = lax.conv_general_dilated(
        y[None, None], w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    return lax.optimization_barrier(img)


def test_every_op_the_propagator_applies_is_a_registered_rule(mesh1d):
    """What the propagator can apply: a registered rule of the primitive's name, or
    one of the propagator's structural layouts (STRUCTURAL_OPS: constraints, generators,
    shard_map, the built-in scatter). Traced through every primitive that used to have
    an unchecked built-in fallback, no step names anything else and none is unknown."""
    from spmdkit.propagation.propagator import STRUCTURAL_OPS

    ops = set(sk.registered_ops())
    assert not (STRUCTURAL_OPS - {"optimization_barrier"}) & ops  # no shadowed rule
    args = (S((16, 8), F32), S((4, 1, 3, 3), F32), S((16, 8), "int32"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no rule registered" warning
        prop = propagate(_every_former_builtin, *args, in_specs=(P("x"), None, P("x")), mesh=mesh1d)
    assert not prop.unknown
    used = {r.op for r in prop.records if r.op is not None}
    assert used <= ops | STRUCTURAL_OPS, sorted(used - ops - STRUCTURAL_OPS)
    former = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "rev", "sort"}
    former |= {"top_k", "argmax", "argmin", "conv_general_dilated", "reduce_precision"}
    former |= {"floor", "ceil", "round", "clamp", "rem", "is_finite", "population_count"}
    assert former <= used & ops, sorted(former - used)


def test_a_grouped_gemm_partial_over_its_groups_axes_is_told_apart():
    """grouped_partial: a grouped GEMM's result partial over the axes that split its
    groups, alone or with others (the replay runs the rule's local computation and
    reduces it itself); partial over a contracted dim only, not partial, or another
    primitive: XLA's."""
    jaxpr = jax.make_jaxpr(jax.lax.ragged_dot)(
        S((64, 32), F32), S((4, 32, 16), F32), S((4,), jnp.int32)
    )
    (eqn,) = jaxpr.eqns
    rhs = TensorSpec((4, 32, 16), ["data", "model", None])
    out = TensorSpec((64, 16), [None, None])
    both = out.replace(partial={"data": "sum", "model": "sum"})
    assert grouped_partial(eqn, rhs, both)
    assert grouped_partial(eqn, rhs, out.replace(partial={"data": "sum"}))
    assert not grouped_partial(eqn, rhs, out.replace(partial={"model": "sum"}))
    assert not grouped_partial(eqn, rhs, out)
    (dot,) = jax.make_jaxpr(jnp.matmul)(S((64, 32), F32), S((32, 16), F32)).eqns
    assert not grouped_partial(dot, rhs, both)

"""apply_rule: reading layouts, resharding, running the rule, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.ops.base import apply_rule
from spmdkit.verification.hlo import compiled_collectives
from spmdkit.versions import parse_version


def _x(mesh, spec=None):
    v = np.arange(64, dtype=np.float32).reshape(8, 8) / 10
    return v, jax.device_put(v, NamedSharding(mesh, spec or P("a", "b")))


def test_eager_explicit_follows_the_rule(mesh2d):
    v, x = _x(mesh2d)
    y, res = apply_rule("softmax", x, axis=-1, return_result=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.nn.softmax(v, -1)), rtol=1e-6)
    assert sk.TensorSpec.from_value(y) == res.outputs[0].replace(dtype=y.dtype)
    assert res.outputs[0].dims == (("a",), ())


def test_jit_and_grad_under_explicit_axes(mesh2d):
    v, x = _x(mesh2d)

    def loss(x):
        return (apply_rule("softmax", x, axis=-1) ** 2).sum()

    with jax.set_mesh(mesh2d):
        g = jax.jit(jax.grad(loss))(x)
    want = jax.grad(lambda x: (jax.nn.softmax(x, -1) ** 2).sum())(v)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_collectives_are_the_planned_reshard(mesh2d):
    _, x = _x(mesh2d)
    f = jax.jit(lambda x: apply_rule("softmax", x, axis=-1))
    res = sk.infer_forward("softmax", sk.TensorSpec.from_value(x), mesh=mesh2d, axis=-1)
    planned = [c for r in res.reshards for c in r.plan.collectives]
    assert sk.check_plan(planned, compiled_collectives(f, x)) == []


def test_auto_axes_without_specs_trace_a_region(mesh2d):
    amesh = Mesh(mesh2d.devices, mesh2d.axis_names)
    v, x = _x(amesh)
    y = apply_rule("softmax", x, axis=-1)  # concrete: layout read from the array
    assert sk.TensorSpec.from_value(y).dims == (("a",), ())
    f = jax.jit(lambda x: apply_rule("softmax", x, axis=-1, in_specs=[P("a", "b")]))
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(jax.nn.softmax(v, -1)), rtol=1e-6)
    # no in_specs: the op is one region equation, which plain jit compiles (XLA partitions)
    g = jax.jit(lambda x: apply_rule("softmax", x, axis=-1))
    np.testing.assert_allclose(np.asarray(g(x)), np.asarray(jax.nn.softmax(v, -1)), rtol=1e-6)
    jaxpr = jax.make_jaxpr(lambda x: apply_rule("softmax", x, axis=-1))(x)
    inner = jaxpr.jaxpr.eqns[0].params["call_jaxpr"].jaxpr.eqns
    assert [e.primitive.name for e in inner] == ["spmdkit_op"]
    assert inner[0].params["op"] == "softmax"
    with pytest.raises(sk.SpecError, match="in_specs"):  # a spec left out of in_specs
        jax.jit(lambda x: apply_rule("softmax", x, axis=-1, in_specs=[None]))(x)
    with pytest.raises(sk.ShardingConflictError, match="strategy"):  # checked as a region too
        jax.jit(lambda x: apply_rule("softmax", x, axis=-1, strategy="nope"))(x)


def test_errors_name_the_fix(mesh1d, mesh2d):
    with pytest.raises(sk.SpecError, match="mesh"):
        apply_rule("exp", jnp.ones((4,)))
    _, x = _x(mesh2d)
    y = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh1d, P("x")))
    with pytest.raises(sk.SpecError, match="one mesh"):
        apply_rule("add", x, y)
    with pytest.raises(sk.SpecError, match="one in_specs entry"):
        apply_rule("exp", x, in_specs=[None, None])
    with pytest.raises(sk.ShardingConflictError, match="strategy"):
        apply_rule("exp", x, strategy="nope")


def _zero_cases():
    """(name, op, [(shape, dtype, spec)], attrs): an empty operand in every op family."""
    f32, i32 = jnp.float32, jnp.int32
    x08 = ((0, 8), f32, P("a", "b"))
    vec = ((8,), f32, P())
    return [
        ("layer_norm", sk.ops.layer_norm, [x08, vec, vec], {}),
        ("rms_norm", sk.ops.rms_norm, [((0, 8), f32, P("a")), vec], {}),
        ("group_norm", sk.ops.group_norm, [((0, 8, 4), f32, P("a"))], {"num_groups": 2}),
        ("instance_norm", sk.ops.instance_norm, [((0, 8, 4), f32, P(None, "b"))], {}),
        pytest.param(
            ("batch_norm", sk.ops.batch_norm, [x08, ((8,), f32, P("b")), ((8,), f32, P("b"))], {}),
            marks=pytest.mark.skipif(
                parse_version(jax.__version__)[:2] == (0, 11),
                reason="jaxlib 0.11.x crashes (segmentation fault) compiling batch_norm's "
                "statistics over an empty batch; 0.10.2 and 0.12 run it",
            ),
        ),
        (
            "xent_mean",
            sk.ops.softmax_cross_entropy,
            [((0, 16), f32, P("a", "b")), ((0,), i32, P("a"))],
            {},
        ),
        (
            "xent_none",
            sk.ops.softmax_cross_entropy,
            [((0, 16), f32, P(None, "b")), ((0,), i32, P())],
            {"reduction": "none"},
        ),
        (
            "embedding_ids",
            sk.ops.embedding_lookup,
            [((16, 8), f32, P("b")), ((0, 4), i32, P("a"))],
            {},
        ),
        (
            "embedding_width",
            sk.ops.embedding_lookup,
            [((16, 0), f32, P("b")), ((4,), i32, P("a"))],
            {},
        ),
        ("attention", sk.ops.attention, [((2, 0, 4, 8), f32, P("a", None, "b"))] * 3, {}),
        (
            "index_put",
            sk.ops.index_put,
            [((8, 4), f32, P("a", "b")), ((0,), i32, P()), ((0, 4), f32, P(None, "b"))],
            {},
        ),
    ]


@pytest.mark.parametrize(
    "case", _zero_cases(), ids=lambda c: (c.values[0] if hasattr(c, "values") else c)[0]
)
def test_zero_size_operands_give_the_unsharded_result_without_collectives(mesh2d, case):
    _, op, operands, attrs = case
    rs = np.random.RandomState(0)
    host = [
        rs.randn(*shape).astype(dtype) if dtype == jnp.float32 else np.zeros(shape, dtype)
        for shape, dtype, _ in operands
    ]
    specs = [spec for _, _, spec in operands]
    args = [jax.device_put(h, NamedSharding(mesh2d, s)) for h, s in zip(host, specs, strict=True)]
    got = op(*args, **attrs)
    want = op(*[jax.device_put(h, NamedSharding(mesh2d, P())) for h in host], **attrs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))  # shards read back
    if any(0 in shape for shape, _, _ in operands) and all(
        0 in g.shape for g in jax.tree.leaves(got)
    ):
        assert compiled_collectives(lambda *a: op(*a, **attrs), *args) == []

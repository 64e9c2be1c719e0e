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

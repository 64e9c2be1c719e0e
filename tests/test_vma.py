"""spmdkit's ``shard_map``: jax 0.12's ``polynomial`` (``erf``'s derivative, exact GELU,
``sinc``) inside checked ``shard_map`` bodies, rule programs and planned models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.ops.base import apply_rule
from spmdkit.vma import shard_map, vary_polynomial_operands, varying_axes

#: Functions of one array whose trace reaches ``lax.polynomial`` on jax 0.12 (with a
#: varying x and constant coefficients), and what a device computes of them.
_BODIES = {
    "erf grad": jax.grad(lambda x: jax.scipy.special.erf(x).sum()),
    "erfc grad": jax.grad(lambda x: jax.lax.erfc(x).sum()),
    "exact gelu grad": jax.grad(lambda x: jax.nn.gelu(x, approximate=False).sum()),
    "sinc": jnp.sinc,
    "sinc grad": jax.grad(lambda x: jnp.sinc(x).sum()),
}


@pytest.mark.parametrize("name", list(_BODIES))
def test_bodies_through_polynomial_equal_the_unsharded_function(name):
    """Each device's piece equals the unsharded function's (a Trace of ``erf``'s
    derivative inside a checked ``shard_map`` failed on jax 0.12: ``Primitive
    polynomial requires varying manual axes to match``)."""
    mesh = sk.make_mesh(x=8)
    fn = _BODIES[name]
    x = np.linspace(-3.0, 3.0, 64, dtype=np.float32)
    placed = jax.device_put(x, NamedSharding(mesh, P("x")))
    got = jax.jit(shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(placed)
    # the bodies are elementwise: the pieces' results are the whole one's
    np.testing.assert_allclose(np.asarray(got), np.asarray(fn(jnp.asarray(x))), rtol=1e-6)


def test_the_gelu_rule_op_differentiates_the_exact_form(mesh1d):
    """``jax.grad`` through the rule-enforcing op (engine/local.py's program, autodiffed
    from outside) equals ``jax.grad`` of ``jax.nn.gelu``."""
    x = np.linspace(-4.0, 4.0, 32, dtype=np.float32).reshape(4, 8)
    placed = jax.device_put(x, NamedSharding(mesh1d, P("x", None)))

    def loss(v):
        return (apply_rule("gelu", v, approximate=False) ** 2).sum()

    got = jax.jit(jax.grad(loss))(placed)
    want = jax.grad(lambda v: (jax.nn.gelu(v, approximate=False) ** 2).sum())(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert got.sharding.spec == P("x", None)


def test_varying_axes_follow_the_type(mesh2d):
    assert varying_axes(jnp.ones(3)) == frozenset()

    def body(v):
        before = varying_axes(v)
        after = varying_axes(jax.lax.psum(v, "a"))
        assert (before, after) == (frozenset({"a", "b"}), frozenset({"b"}))
        return v

    placed = jax.device_put(np.ones((2, 4), np.float32), NamedSharding(mesh2d, P("a", "b")))
    jax.jit(shard_map(body, mesh=mesh2d, in_specs=P("a", "b"), out_specs=P("a", "b")))(placed)


def test_the_cast_is_installed_once_where_jax_has_the_primitive():
    prim = getattr(jax.lax, "polynomial_p", None)
    assert vary_polynomial_operands() is (prim is not None)
    if prim is not None:
        bind = prim.bind
        assert vary_polynomial_operands() and prim.bind is bind  # not wrapped twice
        # outside shard_map nothing varies: the values are lax.polynomial's
        np.testing.assert_allclose(np.asarray(jax.lax.polynomial(3.0, [1.0, 5.0, 2.0])), 34.0)


# -- an exact-GELU model, planned (slow: each case compiles a GPT step) ---------------


def _exact_gelu_gpt(monkeypatch):
    """The ``tiny_pipe`` GPT (4 scanned layers) whose MLP computes the exact, erf-form
    GELU as spmdkit's ``gelu`` op: a region the planner lays out and ``sk.jit``'s
    replay runs as the rule's ``shard_map`` programs (forward and grad)."""
    import spmdkit.models.layers as lyr
    from spmdkit.introspect.model import describe
    from spmdkit.models import get_model

    monkeypatch.setattr(
        lyr, "gelu", lambda x, approximate=True: apply_rule("gelu", x, approximate=False)
    )
    info = describe(get_model("gpt"), config="tiny_pipe", batch_size=16)
    rng = np.random.default_rng(0)
    batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, 200, s.shape), s.dtype), info.batch)
    return info, batch


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pipe=2 x data=4", "data=2 x context=4"])
def test_an_exact_gelu_model_equals_one_device(monkeypatch, layout):
    """Pipelined (1F1B, 2 micro-batches) and context-parallel (ring attention, the
    sequence over 4 devices) plans of the exact-GELU GPT on 8 CPU devices: loss and
    grads equal the one-device step's. On jax 0.12 without spmdkit.vma's cast the
    context-parallel step failed to trace (the gelu region's grad program)."""
    from spmdkit.pipeline import Pipeline

    info, batch = _exact_gelu_gpt(monkeypatch)
    params = info.init_fn()
    assert "op=gelu" in str(jax.make_jaxpr(info.loss_fn)(params, batch)).replace("'", "")
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(info.loss_fn))(params, batch)
    if layout.startswith("pipe"):
        pipe = Pipeline(stages=2, microbatches=2, schedule="1f1b")
        plan = sk.plan(info, sk.make_mesh(pipe=2, data=4), "dp", pipeline=pipe)
        assert plan.pipeline == pipe
    else:
        mesh = sk.make_mesh(data=2, context=4, axis_types="auto")
        plan = sk.plan(info, mesh, "dp", rules={"seq": "context"})
        assert plan.context is not None and plan.context.degree == 4
    step = sk.jit(sk.value_and_grad(info.train_loss, plan), plan)
    placed = jax.device_put(params, plan.param_shardings(info.abstract_params))
    loss, grads = step(placed, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(ref_grads))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)

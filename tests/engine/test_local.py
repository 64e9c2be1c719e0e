"""shard_program: the rule's local computation as one shard_map program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.local import resolve_partials, shard_program
from spmdkit.verification.hlo import compiled_collectives, summarize


def test_partial_output_is_all_reduced_inside_the_program(mesh2d):
    x = sk.TensorSpec((8, 16), P("a", "b"), dtype="float32")
    w = sk.TensorSpec((16, 4), P("b", None), dtype="float32")
    res = sk.infer_forward("matmul", x, w, mesh=mesh2d)
    assert res.outputs[0].partial == (("b", "sum"),)
    program = shard_program(sk.get_rule("matmul"), res, {}, mesh2d)
    rng = np.random.default_rng(0)
    xv, wv = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 4), np.float32)
    args = [
        jax.device_put(v, s.to_named_sharding(mesh2d))
        for v, s in zip((xv, wv), res.inputs, strict=True)
    ]
    (y,) = jax.jit(program)(*args)
    np.testing.assert_allclose(np.asarray(y), xv @ wv, rtol=1e-5, atol=1e-5)
    assert y.sharding.spec == P("a", None)
    colls = summarize(compiled_collectives(program, *args))
    assert colls == {"all_reduce": {"count": 1, "payload_bytes": 4 * 4 * 4}}


def test_resolve_partials_groups_axes_of_one_op(mesh2d):
    spec = sk.TensorSpec((4,), partial={"a": "sum", "b": "sum"})

    def body(v):
        return resolve_partials(v, spec)

    f = jax.shard_map(body, mesh=mesh2d, in_specs=P(), out_specs=P())
    hlo = compiled_collectives(f, jnp.ones((4,)))
    assert len(hlo) == 1 and hlo[0].group_size == 8


def test_uneven_and_partial_inputs_are_rejected(mesh1d):
    rule = sk.get_rule("exp")
    uneven = sk.infer_forward("exp", sk.TensorSpec((6,), P("x"), dtype="float32"), mesh=mesh1d)
    with pytest.raises(sk.ShardingConflictError, match="divides"):
        shard_program(rule, uneven, {}, mesh1d)
    neg = sk.infer_forward(
        "neg", sk.TensorSpec((8,), partial={"x": "sum"}, dtype="float32"), mesh=mesh1d
    )
    assert neg.inputs[0].partial
    with pytest.raises(sk.ShardingConflictError, match="pending reduction"):
        shard_program(sk.get_rule("neg"), neg, {}, mesh1d)


def test_local_context_offsets(mesh2d):
    from spmdkit.engine.rule import LocalContext

    spec = sk.TensorSpec((16, 6), P(("a", "b"), None))
    lctx = LocalContext("t", {}, (spec,), (), {"a": 2, "b": 4})
    assert lctx.block(spec, 0) == 2 and lctx.local_shape(spec) == (2, 6)

    def body(v):
        return (v * 0 + lctx.offset(spec, 0)).astype(jnp.int32)

    f = jax.shard_map(body, mesh=mesh2d, in_specs=P(("a", "b")), out_specs=P(("a", "b")))
    x = jax.device_put(jnp.zeros((16,)), NamedSharding(mesh2d, P(("a", "b"))))
    got = np.asarray(jax.jit(f)(x))
    np.testing.assert_array_equal(got, np.repeat(np.arange(8) * 2, 2))

"""embedding rule: layouts (vocab-parallel, column, replicated), grads, errors, HLO budgets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import ShardingConflictError
from spmdkit.ops.embedding import embedding_lookup
from spmdkit.rules.embedding import embedding_reference
from spmdkit.testing import check_forward_case
from spmdkit.verification.hlo import compiled_collectives

OP = "embedding"


def W(spec=None, shape=(16, 8), **kw):
    return sk.TensorSpec(shape, spec, dtype="float32", **kw)


def ids(spec=None, shape=(4, 6)):
    return sk.TensorSpec(shape, spec, dtype="int32")


def out(spec=None, shape=(4, 6, 8), **kw):
    return sk.TensorSpec(shape, spec, dtype="float32", **kw)


# -- layouts -------------------------------------------------------------------


def test_vocab_parallel_table_gives_a_sum_partial_output(mesh2d):
    r = sk.infer_forward(OP, W(P("b", None)), ids(P("a", None)), mesh=mesh2d)
    assert r.inputs == (W(P("b", None)), ids(P("a", None)))
    assert r.outputs == (out(P("a", None, None), partial={"b": "sum"}),)
    assert not r.reshards and not r.collectives


def test_column_sharded_table_gives_a_feature_sharded_output(mesh2d):
    r = sk.infer_forward(OP, W(P(None, "b")), ids(P(None, "a")), mesh=mesh2d)
    assert r.outputs == (out(P(None, "a", "b")),)
    assert not r.reshards


def test_replicated_table_follows_the_ids(mesh2d):
    r = sk.infer_forward(OP, W(), ids(P("a", "b")), mesh=mesh2d)
    assert r.outputs == (out(P("a", "b", None)),)


def test_the_table_wins_an_axis_both_name(mesh1d):
    r = sk.infer_forward(OP, W(P("x", None)), ids(P("x", None)), mesh=mesh1d)
    assert r.inputs == (W(P("x", None)), ids())
    assert r.outputs == (out(partial={"x": "sum"}),)


def test_table_partials(mesh2d):
    # a gather is linear: sum passes, and commutes with the vocab-parallel sum
    r = sk.infer_forward(OP, W(P("b", None), partial={"a": "sum"}), ids(), mesh=mesh2d)
    assert r.outputs[0].partial_ops == {"a": "sum", "b": "sum"}
    # max passes only when V is not sharded
    r = sk.infer_forward(OP, W(partial={"a": "max"}), ids(), mesh=mesh2d)
    assert r.outputs[0].partial_ops == {"a": "max"}
    r = sk.infer_forward(OP, W(P("b", None), partial={"a": "max"}), ids(), mesh=mesh2d)
    assert r.inputs[0] == W(P("b", None)) and r.outputs[0].partial_ops == {"b": "sum"}
    # a partial axis the ids shard is resolved
    r = sk.infer_forward(OP, W(partial={"a": "sum"}), ids(P("a", None)), mesh=mesh2d)
    assert r.inputs[0] == W() and not r.outputs[0].partial


def test_grad_table_is_partial_over_the_ids_axes(mesh2d):
    r = sk.infer_grad(OP, W(P("b", None)), ids(P("a", None)), out_grads=(out(P("a")),), mesh=mesh2d)
    assert r.outputs[0] == W(P("b", None), partial={"a": "sum"})  # rows stay sharded
    assert r.out_grads == (out(P("a")),)
    assert r.forward_outputs == (out(P("a"), partial={"b": "sum"}),)
    # a cotangent sharded where the forward left the ids free moves the ids instead
    r = sk.infer_grad(OP, W(), ids(), out_grads=(out(P(None, "b", "a")),), mesh=mesh2d)
    assert r.inputs == (W(P(None, "a")), ids(P(None, "b")))
    assert r.outputs[0] == W(P(None, "a"), partial={"b": "sum"})
    # a sum-partial cotangent over an unused axis passes to the table grad
    r = sk.infer_grad(OP, W(), ids(P("a")), out_grads=(out(partial={"b": "sum"}),), mesh=mesh2d)
    assert r.outputs[0] == W(partial={"a": "sum", "b": "sum"})


def test_backward_from_the_output(mesh2d):
    r = sk.infer_backward(OP, W(), ids(), outputs=(out(P("a", None, "b")),), mesh=mesh2d)
    assert r.inputs == (W(P(None, "b")), ids(P("a", None)))
    r = sk.infer_backward(OP, W(), ids(), outputs=(out(partial={"b": "sum"}),), mesh=mesh2d)
    assert r.inputs == (W(P("b", None)), ids())
    assert r.outputs == (out(partial={"b": "sum"}),)


# -- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "idx", "match"),
    [
        (sk.TensorSpec((16, 8, 2), dtype="float32"), ids(), r"the table is \[V, D\]"),
        (sk.TensorSpec((16, 8), dtype="int32"), ids(), "the table is floating point"),
        (W(), sk.TensorSpec((4, 6), dtype="float32"), "ids are integers"),
    ],
)
def test_bad_operands_raise_typed_errors(mesh1d, table, idx, match):
    with pytest.raises(ShardingConflictError, match=match):
        sk.infer_forward(OP, table, idx, mesh=mesh1d)


def test_bad_out_grads_and_strategy_raise(mesh1d):
    with pytest.raises(ShardingConflictError, match="out_grads are one tensor"):
        sk.infer_grad(OP, W(), ids(), out_grads=(out(shape=(4, 6)),), mesh=mesh1d)
    with pytest.raises(ShardingConflictError, match="strategy is one of"):
        sk.infer_forward(OP, W(), ids(), mesh=mesh1d, strategy="ring")
    with pytest.raises(ShardingConflictError, match="no attributes besides strategy"):
        sk.infer_forward(OP, W(), ids(), mesh=mesh1d, axis=1)


# -- semantics -----------------------------------------------------------------


def test_out_of_range_ids_give_nan_rows_on_every_layout(mesh1d):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((16, 8)).astype(np.float32)
    idx = np.array([[0, 15, 16, -1], [3, 4, 5, 6]], np.int32)
    ref = np.asarray(embedding_reference(table, idx))
    assert np.isnan(ref[0, 2]).all() and np.isnan(ref[0, 3]).all()
    np.testing.assert_array_equal(ref[1], table[idx[1]])
    lookup = jax.jit(embedding_lookup)
    for spec in (P("x", None), P(None, "x"), P()):
        t = jax.device_put(table, NamedSharding(mesh1d, spec))
        got = np.asarray(lookup(t, jax.device_put(idx, NamedSharding(mesh1d, P()))))
        np.testing.assert_array_equal(got, ref)
    g = jax.grad(lambda t: jnp.nansum(embedding_reference(t, idx)))(table)
    assert np.asarray(g).sum() == 6 * 8  # only the six valid ids get a gradient


def test_uneven_vocab_and_ids(mesh2d):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((6, 4)).astype(np.float32)
    values = [table, rng.integers(0, 6, 3).astype(np.int32)]
    specs = (W(P("b", None), shape=(6, 4)), ids(P("a"), shape=(3,)))  # 6 over 4, 3 over 2
    failure, res = check_forward_case(OP, specs, mesh2d, values=values)
    assert failure is None, str(failure)
    assert res.inputs == specs
    assert res.outputs[0] == out(P("a", None), shape=(3, 4), partial={"b": "sum"})


# -- collective budgets from the compiled HLO ---------------------------------------


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(2)
    return (
        rng.standard_normal((64, 8)).astype(np.float32),
        rng.integers(0, 64, (4, 6)).astype(np.int32),
    )


def test_vocab_parallel_forward_is_one_all_reduce_of_the_output(mesh2d, arrays):
    table, idx = arrays
    t, i = _put(table, mesh2d, P("b", None)), _put(idx, mesh2d, P("a", None))
    fwd = compiled_collectives(embedding_lookup, t, i)
    assert [(c.kind, c.reduce_op, c.group_size) for c in fwd] == [("all_reduce", "sum", 4)]
    assert fwd[0].payload_bytes == 2 * 6 * 8 * 4  # the local output block
    # the table grad keeps its rows sharded; only the data-parallel sum over the ids' axis
    loss = jax.grad(lambda a, b: jnp.sum(embedding_lookup(a, b) ** 2))
    grad = compiled_collectives(loss, t, i)
    back = [c for c in grad if c.is_backward]
    assert [(c.kind, c.group_size, c.payload_bytes) for c in back] == [
        ("all_reduce", 2, 16 * 8 * 4)
    ]


def test_column_sharded_and_replicated_ids_move_nothing(mesh1d, arrays):
    table, idx = arrays
    t, i = _put(table, mesh1d, P(None, "x")), _put(idx, mesh1d, P())
    assert compiled_collectives(embedding_lookup, t, i) == []
    loss = jax.grad(lambda a, b: jnp.sum(embedding_lookup(a, b) ** 2))
    assert compiled_collectives(loss, t, i) == []


def test_vocab_parallel_backward_with_replicated_ids_moves_nothing(mesh1d, arrays):
    table, idx = arrays
    t, i = _put(table, mesh1d, P("x", None)), _put(idx, mesh1d, P())
    loss = jax.grad(lambda a, b: jnp.sum(embedding_lookup(a, b) ** 2))
    grad = compiled_collectives(loss, t, i)
    assert not [c for c in grad if c.is_backward]
    assert len(grad) == 1  # the forward's all-reduce of the output

"""softmax_cross_entropy rule: layouts, strategies, errors, semantics, collective budgets."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.engine.rule import Example
from spmdkit.errors import ShardingConflictError
from spmdkit.ops.cross_entropy import softmax_cross_entropy
from spmdkit.rules.cross_entropy import softmax_cross_entropy_reference
from spmdkit.testing import check_forward_case, check_jit
from spmdkit.verification.hlo import compiled_collectives

OP = "softmax_cross_entropy"

# the reference, compiled once per attribute set (eager dispatch is slow here)
ce_ref = jax.jit(
    softmax_cross_entropy_reference,
    static_argnames=("axis", "soft_label", "ignore_index", "reduction", "label_smoothing"),
)


def T(shape, spec=None, dtype="float32", **kw):
    return sk.TensorSpec(shape, spec, dtype=dtype, **kw)


def I(shape, spec=None):  # noqa: E743 - integer labels
    return sk.TensorSpec(shape, spec, dtype="int32")


# -- layouts -------------------------------------------------------------------


def test_vocab_parallel_hard_labels_keep_the_class_dim_sharded(mesh1d):
    r = sk.infer_forward(OP, T((8, 16), P(None, "x")), I((8,)), mesh=mesh1d)
    assert r.inputs == (T((8, 16), P(None, "x")), I((8,)))
    assert r.outputs == (T(()),)
    assert not r.reshards
    kinds = [(c.kind, c.reduce_op, c.axes, c.payload_bytes) for c in r.collectives]
    # one max and one sum of 2 stacked scalars (sum-exp, target logit) per row
    assert kinds == [("all_reduce", "max", ("x",), 8 * 4), ("all_reduce", "sum", ("x",), 8 * 2 * 4)]


def test_default_strategy_replicates_the_class_dim_for_soft_labels(mesh1d):
    logits, soft = T((8, 16), P(None, "x")), T((8, 16), P(None, "x"))
    r = sk.infer_forward(OP, logits, soft, mesh=mesh1d)
    assert r.inputs == (T((8, 16)), T((8, 16)))
    assert not r.collectives
    v = sk.infer_forward(OP, logits, soft, mesh=mesh1d, strategy="vocab_parallel")
    assert v.inputs == (logits, soft)
    assert [c.payload_bytes for c in v.collectives] == [8 * 4, 8 * 3 * 4]  # sum-exp, Σqz, Σq


def test_default_strategy_replicates_a_class_dim_that_is_not_last(mesh1d):
    logits, labels = T((16, 8), P("x", None)), I((8,))
    r = sk.infer_forward(OP, logits, labels, mesh=mesh1d, axis=0, reduction="none")
    assert r.inputs[0] == T((16, 8)) and r.outputs == (T((8,)),)
    v = sk.infer_forward(
        OP, logits, labels, mesh=mesh1d, axis=0, reduction="none", strategy="vocab_parallel"
    )
    assert v.inputs[0] == logits and v.outputs == (T((8,)),)


def test_rows_follow_the_logits_then_the_labels(mesh2d):
    r = sk.infer_forward(OP, T((8, 16), P("a", "b")), I((8,), P("b")), mesh=mesh2d)
    assert r.inputs == (T((8, 16), P("a", "b")), I((8,), P("a")))
    assert r.outputs == (T((), partial={"a": "sum"}),)  # mean over a-sharded rows
    r = sk.infer_forward(OP, T((8, 16)), I((8,), P("b")), mesh=mesh2d, reduction="none")
    assert r.inputs == (T((8, 16), P("b", None)), I((8,), P("b")))
    assert r.outputs == (T((8,), P("b")),)
    # mean with hard labels: the count of kept rows is one scalar all-reduce over the row axes
    r = sk.infer_forward(OP, T((8, 16), P("a", "b")), I((8,)), mesh=mesh2d)
    assert [(c.axes, c.payload_bytes) for c in r.collectives][-1] == (("a",), 4)


def test_partial_logits_are_resolved(mesh1d):
    r = sk.infer_forward(OP, T((8, 16), partial={"x": "sum"}), I((8,)), mesh=mesh1d)
    assert r.inputs[0] == T((8, 16))
    assert r.reshards and r.reshards[0].arg == "input 0"


def test_grad_follows_the_labels_and_moves_nothing(mesh2d):
    logits, labels = T((8, 16), P(None, "b")), I((8,), P("a"))
    r = sk.infer_grad(OP, logits, labels, out_grads=(T(()),), mesh=mesh2d)
    assert r.inputs == (T((8, 16), P("a", "b")), labels)
    assert r.outputs[0] == T((8, 16), P("a", "b"))
    assert r.forward_outputs == (T((), partial={"a": "sum"}),)
    assert not r.collectives
    # a sum-partial cotangent over an unused axis passes; over a used one it is resolved
    g = T((8,), partial={"b": "sum"})
    r = sk.infer_grad(
        OP, T((8, 16)), I((8,), P("a")), out_grads=(g,), mesh=mesh2d, reduction="none"
    )
    assert r.out_grads == (T((8,), P("a"), partial={"b": "sum"}),)
    assert r.outputs[0] == T((8, 16), P("a", None), partial={"b": "sum"})
    r = sk.infer_grad(
        OP, T((8, 16), P(None, "b")), I((8,)), out_grads=(g,), mesh=mesh2d, reduction="none"
    )
    assert r.out_grads == (T((8,)),)


def test_cotangent_layout_fills_rows_the_forward_left_free(mesh1d):
    g = T((8,), P("x"))
    r = sk.infer_grad(OP, T((8, 16)), I((8,)), out_grads=(g,), mesh=mesh1d, reduction="none")
    assert r.inputs == (T((8, 16), P("x", None)), I((8,), P("x")))
    assert r.outputs[0] == T((8, 16), P("x", None))


def test_backward_traces_rows_from_the_loss(mesh2d):
    r = sk.infer_backward(
        OP, T((8, 16)), I((8,)), outputs=(T((8,), P("b")),), mesh=mesh2d, reduction="none"
    )
    assert r.inputs == (T((8, 16), P("b", None)), I((8,), P("b")))
    r = sk.infer_backward(
        OP, T((8, 16)), I((8,)), outputs=(T((), partial={"a": "sum"}),), mesh=mesh2d
    )
    assert r.inputs == (T((8, 16), P("a", None)), I((8,), P("a")))
    assert r.outputs == (T((), partial={"a": "sum"}),)


# -- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "attrs", "match"),
    [
        (I((7,)), {}, "hard labels have the logits' shape without the class dim"),
        (T((8, 15)), {}, "soft labels have the logits' shape"),
        (I((8, 16)), {}, "soft labels are floating point"),
        (T((8,)), {}, "hard labels are integers"),
        (I((8, 16, 1)), {}, "one less"),
        (I((8,)), {"reduction": "avg"}, "reduction is one of"),
        (I((8,)), {"label_smoothing": 1.5}, "label_smoothing"),
        (I((8,)), {"axis": 2}, "axis is a dim"),
        (I((8,)), {"strategy": "ring"}, "strategy is one of"),
        (I((8,)), {"soft_label": True}, "soft labels have the logits' shape"),
        (I((8,)), {"smoothing": 0.1}, "attributes are among"),
    ],
)
def test_bad_calls_raise_typed_errors(mesh1d, labels, attrs, match):
    with pytest.raises(ShardingConflictError, match=match):
        sk.infer_forward(OP, T((8, 16)), labels, mesh=mesh1d, **attrs)


def test_out_grads_of_the_wrong_shape_raise(mesh1d):
    with pytest.raises(ShardingConflictError, match="out_grads are one tensor of shape"):
        sk.infer_grad(OP, T((8, 16)), I((8,)), out_grads=(T((8,)),), mesh=mesh1d)


# -- semantics (the reference against optax) ------------------------------------


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((8, 16)).astype(np.float32) * 3
    y = rng.integers(0, 16, 8).astype(np.int32)
    q = rng.dirichlet(np.ones(16), 8).astype(np.float32)
    return z, y, q


def test_hard_labels_match_optax_with_and_without_smoothing(data):
    z, y, _ = data
    per_row = jax.jit(optax.softmax_cross_entropy_with_integer_labels)(z, y)
    np.testing.assert_allclose(ce_ref(z, y, reduction="none"), per_row, rtol=1e-6)
    np.testing.assert_allclose(ce_ref(z, y), per_row.mean(), rtol=1e-6)
    np.testing.assert_allclose(ce_ref(z, y, reduction="sum"), per_row.sum(), rtol=1e-6)
    smoothed = optax.smooth_labels(jax.nn.one_hot(y, 16), 0.1)
    want = jax.jit(optax.softmax_cross_entropy)(z, smoothed)
    np.testing.assert_allclose(ce_ref(z, y, reduction="none", label_smoothing=0.1), want, rtol=1e-5)


def test_soft_labels_match_optax(data):
    z, _, q = data
    want = optax.softmax_cross_entropy(z, optax.smooth_labels(q, 0.2))
    got = ce_ref(z, q, reduction="none", label_smoothing=0.2)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_ignore_index_drops_rows_from_the_mean(data):
    z, y, _ = data
    y = y.copy()
    y[[1, 5]] = -100
    per_row = ce_ref(z, y, reduction="none")
    assert per_row[1] == 0 and per_row[5] == 0
    keep = np.ones(8, bool)
    keep[[1, 5]] = False
    want = optax.softmax_cross_entropy_with_integer_labels(z[keep], y[keep]).mean()
    np.testing.assert_allclose(ce_ref(z, y), want, rtol=1e-6)
    assert float(ce_ref(z, np.full(8, -100, np.int32))) == 0.0  # every row ignored


def test_out_of_range_labels_give_nan_rows_and_no_grad(data):
    z, y, _ = data
    y = y.copy()
    y[2] = 16
    per_row = np.asarray(ce_ref(z, y, reduction="none"))
    assert np.isnan(per_row[2]) and np.isfinite(np.delete(per_row, 2)).all()
    g = jax.jit(jax.grad(lambda a: jnp.nansum(ce_ref(a, y, reduction="none"))))(z)
    assert np.all(np.asarray(g)[2] == 0)


def test_class_axis_zero_equals_moving_the_axis(data):
    z, y, q = data
    np.testing.assert_allclose(ce_ref(z.T, y, axis=0), ce_ref(z, y), rtol=1e-6)
    np.testing.assert_allclose(ce_ref(z.T, q.T, axis=0), ce_ref(z, q), rtol=1e-6)


# -- numeric cases beyond the shared sweep's examples ------------------------------


def _hard(rng):
    z = rng.standard_normal((2, 6, 4)).astype(np.float32)
    y = rng.integers(0, 6, (2, 4)).astype(np.int32)
    y[0, 1] = -100
    return [z, y]


@pytest.mark.parametrize(
    ("specs", "attrs"),
    [
        # class dim (1 of 3) sharded, rows on the other axis: vocab_parallel, uneven classes
        ((T((2, 6, 4), P("a", "b", None)), I((2, 4))), {"reduction": "mean"}),
        ((T((2, 6, 4), P(None, "b", "a")), I((2, 4))), {"reduction": "none"}),
        ((T((2, 6, 4), P(None, ("a", "b"), None)), I((2, 4))), {"reduction": "sum"}),
    ],
)
def test_vocab_parallel_middle_class_axis(mesh2d, specs, attrs):
    attrs = {**attrs, "axis": 1, "strategy": "vocab_parallel", "label_smoothing": 0.1}
    values = _hard(np.random.default_rng(1))
    failure, res = check_forward_case(OP, specs, mesh2d, values=values, attrs=attrs)
    assert failure is None, str(failure)
    assert res.inputs[0].dims[1]  # the class dim stayed sharded


def test_jit_collectives_match_the_prediction_for_extra_cases(mesh2d):
    ex = Example(
        ((2, 8, 4), (2, 8, 4)),
        attrs={"axis": 1, "strategy": "vocab_parallel", "reduction": "mean"},
        values=lambda rng: [
            rng.standard_normal((2, 8, 4)).astype(np.float32),
            rng.dirichlet(np.ones(8), (2, 4)).transpose(0, 2, 1).astype(np.float32),
        ],
    )
    report = check_jit(OP, mesh=mesh2d, examples=[ex], max_cases=4)
    assert report.ok, str(report)


# -- collective budgets from the compiled HLO ---------------------------------------


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_forward_moves_only_row_scalars_and_backward_nothing(mesh2d, smoothing):
    rows, classes = 16, 64
    rng = np.random.default_rng(2)
    z = _put(rng.standard_normal((rows, classes)).astype(np.float32), mesh2d, P("a", "b"))
    y = _put(rng.integers(0, classes, rows).astype(np.int32), mesh2d, P("a"))

    def loss(a, b):
        return softmax_cross_entropy(a, b, label_smoothing=smoothing)

    fwd = compiled_collectives(loss, z, y)
    local_rows = rows // 2
    k = 2 if smoothing else 1  # scalars per row besides max, sum-exp, target logit: Σz
    assert all(c.kind == "all_reduce" for c in fwd)
    # per row: the max, then sum-exp / target logit (/ Σz) stacked; + the count and the loss
    assert sum(c.payload_bytes for c in fwd) <= (2 + k) * local_rows * 4 + 2 * 4
    assert max(c.payload_bytes for c in fwd) <= (1 + k) * local_rows * 4
    grad = compiled_collectives(jax.grad(loss), z, y)
    assert not [c for c in grad if c.is_backward]
    # the grad program recomputes the forward's statistics (and the kept-row count that
    # scales the mean) and nothing else: a sub-multiset of the forward's collectives
    key = [(c.kind, c.reduce_op, c.group_size, c.payload_bytes) for c in grad]
    assert not Counter(key) - Counter(
        (c.kind, c.reduce_op, c.group_size, c.payload_bytes) for c in fwd
    )
    assert any(c.group_size == 4 and c.reduce_op == "max" for c in grad)


def test_vocab_parallel_grad_keeps_no_logits_sized_temporary(mesh1d):
    rows, classes = 256, 4096
    z = jax.ShapeDtypeStruct(
        (rows, classes), jnp.float32, sharding=NamedSharding(mesh1d, P(None, "x"))
    )
    y = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=NamedSharding(mesh1d, P()))
    step = jax.jit(
        jax.value_and_grad(lambda a, b: softmax_cross_entropy(a, b, label_smoothing=0.1))
    )
    temp = step.lower(z, y).compile().memory_analysis().temp_size_in_bytes
    assert temp < rows * (classes // 4) * 4 // 4  # well under one local logits block

"""The balanced sequence order of context parallelism (:mod:`spmdkit.sequence`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from spmdkit.sequence import (
    BalancedOrder,
    SequenceOrderError,
    balance_batch,
    context_parallel,
    current_attention,
    current_order,
    plan_context,
)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_shard_i_holds_chunks_i_and_its_mirror(n):
    s = 8 * n
    order = BalancedOrder(n)
    perm = order.permutation(s)
    assert sorted(perm.tolist()) == list(range(s))
    c = s // (2 * n)
    for i, shard in enumerate(np.split(perm, n)):  # contiguous shards of the balanced order
        chunks = sorted({int(p) // c for p in shard})
        assert chunks == sorted({i, 2 * n - 1 - i})
        # causal work of the shard's queries (keys up to each position) is the same
        assert sum(int(p) + 1 for p in shard) == sum(range(1, s + 1)) // n


def test_apply_restore_and_positions_agree_for_numpy_and_jax():
    order = BalancedOrder(4)
    x = np.arange(3 * 32).reshape(3, 32)
    np.testing.assert_array_equal(order.apply(x, 1), x[:, order.permutation(32)])
    np.testing.assert_array_equal(np.asarray(order.apply(jnp.asarray(x), 1)), order.apply(x, 1))
    np.testing.assert_array_equal(np.asarray(order.restore(order.apply(jnp.asarray(x), 1))), x)
    np.testing.assert_array_equal(order.restore(order.apply(x, 1), 1), x)
    np.testing.assert_array_equal(np.asarray(order.positions(32)), order.permutation(32))
    idx = jnp.arange(32)
    np.testing.assert_array_equal(np.asarray(order.position_of(idx, 32)), order.permutation(32))


def test_bad_orders_are_typed_errors():
    with pytest.raises(SequenceOrderError, match="multiple of 8"):
        BalancedOrder(4).permutation(100)
    with pytest.raises(SequenceOrderError, match="positive int"):
        BalancedOrder(0)


def test_balance_batch_permutes_the_seq_dims_only():
    order = BalancedOrder(2)
    batch = {"tokens": np.arange(16).reshape(2, 8), "label": np.arange(2)}
    out = balance_batch(batch, {"tokens": ("batch", "seq"), "label": ("batch",)}, order)
    np.testing.assert_array_equal(out["tokens"], batch["tokens"][:, order.permutation(8)])
    np.testing.assert_array_equal(out["label"], batch["label"])


def test_the_trace_context_sets_and_resets():
    assert (current_order(), current_attention()) == (None, None)
    with context_parallel(4, attention="gather_kv") as order:
        assert order == BalancedOrder(4) == current_order()
        assert current_attention() == "gather_kv"
    with context_parallel(1):
        assert current_order() is None
    assert (current_order(), current_attention()) == (None, None)
    assert plan_context(object()) is None

"""Routed experts traced on one device's tokens and experts (:mod:`spmdkit.expert_shard`):
the ``moe_experts`` op then runs its all-to-all program over the manual axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmdkit.errors import ShardingConflictError
from spmdkit.expert_shard import ExpertShard, current_expert_shard, expert_shard
from spmdkit.ops import moe_experts
from spmdkit.rules.moe import moe_experts_reference
from spmdkit.vma import shard_map

SHARD = ExpertShard(("data",), ("data",), (("data", 4),))


def test_the_shard_is_set_inside_only_and_counts_its_devices():
    assert current_expert_shard() is None
    with expert_shard(SHARD):
        assert current_expert_shard() is SHARD
    assert current_expert_shard() is None
    two = ExpertShard(("data", "expert"), ("expert",), (("data", 2), ("expert", 4)))
    assert (two.token_shards, two.expert_shards) == (8, 4)


def _args(t=32, d=8, k=2, e=8, f=16):
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    weights = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in ((e, d, f),) * 2]
    weights.append(rng.standard_normal((e, f, d)).astype(np.float32) * 0.5)
    return rng.standard_normal((t, d)).astype(np.float32), idx, w, *weights


def test_on_a_shard_the_op_exchanges_tokens_with_the_experts_devices():
    """Under a shard_map manual over ``data`` (4 devices: 8 tokens and 2 experts
    each), the op traced under expert_shard equals the unsharded op, value and
    gradients (the experts' own, on their devices), and notes its three forward
    all-to-alls (the per-expert counts, the tokens out and back: the tokens' two
    transposed in the backward)."""
    args = _args()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))  # automatic axes
    seen = []

    def local(*a):
        with expert_shard(SHARD) as noted:
            out = moe_experts(*a)
        seen.append(noted)
        return out

    rows, experts = P("data"), P("data")
    f = shard_map(
        local, mesh=mesh, in_specs=(rows,) * 3 + (experts,) * 3, out_specs=rows, check_vma=False
    )

    def loss(fn, x, w, wg, wu, wd):
        return jnp.sum(jnp.tanh(fn(x, args[1], w, wg, wu, wd)))

    diff = (0, 2, 3, 4, 5)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(f, *a), argnums=(0, 1, 2, 3, 4)))
    want = jax.value_and_grad(lambda *a: loss(moe_experts_reference, *a), argnums=(0, 1, 2, 3, 4))
    picked = [args[i] for i in diff]
    (v, g), (rv, rg) = got(*picked), want(*picked)
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    for a, b in zip(g, rg, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    kinds = [(kind, back) for kind, _, back in seen[0]]
    assert kinds == [("all_to_all", False), ("all_to_all", True), ("all_to_all", True)]
    # a buffer per peer of 8 tokens x min(top-k, local experts) rows, for 4 peers
    assert seen[0][1][1] == 4 * 8 * 2 * 8 * 4


def test_a_strategy_other_than_the_exchange_is_refused_on_a_shard():
    args = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in _args()]
    with expert_shard(SHARD), pytest.raises(ShardingConflictError, match="all_to_all"):
        jax.make_jaxpr(lambda *a: moe_experts(*a, strategy="local"), axis_env=[("data", 4)])(*args)

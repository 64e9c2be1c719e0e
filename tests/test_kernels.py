"""The attention kernels (:mod:`spmdkit.kernels`) inside ``shard_map``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmdkit.kernels import (
    blockwise_attention,
    blockwise_attention_lse,
    plain_attention,
    plain_attention_lse,
    record_visits,
)


@pytest.mark.slow
@pytest.mark.parametrize("lse", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_blockwise_grads_with_a_replicated_kv_and_a_sharded_query(lse):
    """Queries split over a manual axis (the sequence, as ``gather_kv`` runs it),
    keys and values replicated over it: the
    custom VJP's cotangents for K and V vary over the axis while K and V do not,
    so the kernel types its inputs alike; the K/V gradients are then summed over
    the axis and equal the unsharded attention's."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(r, (4, 32, 2, 8), jnp.float32) for r in keys)

    def kernel(q, k, v):
        offset = jax.lax.axis_index("data") * q.shape[1]  # the query block's position
        if lse:
            return blockwise_attention_lse(q, k, v, block_size=8, q_offset=offset)[0]
        return blockwise_attention(q, k, v, block_size=8, q_offset=offset)

    def sharded(q, k, v):
        body = lambda q, k, v: jax.lax.psum(jnp.sum(kernel(q, k, v) ** 2), "data")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "data"), P(), P()), out_specs=P())(
            q, k, v
        )

    def reference(q, k, v):
        return jnp.sum(plain_attention(q, k, v, causal=True) ** 2)

    got = jax.grad(sharded, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(reference, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_blockwise_skips_the_key_blocks_after_its_queries_and_records_the_rest():
    """Queries at positions 8..11, keys 0..15 in blocks of 4: the kernel visits
    blocks 0-2 (forward and backward) and skips block 3 at run time; the result is
    the plain kernel's. A call whose keys all follow its queries (queries 0..3,
    keys 4..19) visits nothing, forward or backward, and returns zeros at the lowest
    log-sum-exp (weight 0 in a merge). One compiled program runs both."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 4, 2, 4)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 16, 1, 4)), jnp.float32) for _ in range(2))

    def both(q, k, v):
        seen = blockwise_attention_lse(q, k, v, block_size=4, q_offset=8, k_offset=0)
        late = blockwise_attention_lse(q, k, v, block_size=4, q_offset=0, k_offset=4)
        return jnp.sum(seen[0] ** 2) + jnp.sum(late[0] ** 2), (seen, late)

    with record_visits() as visits:
        (_, (seen, late)), grads = jax.jit(  # the late call's visits would be q_offset 0
            jax.value_and_grad(both, argnums=(0, 1, 2), has_aux=True)
        )(q, k, v)
        jax.block_until_ready(grads)
    assert sorted((x.kind, x.q_offset, x.k_offset) for x in visits) == [
        (kind, 8, off) for kind in ("backward", "forward") for off in (0, 4, 8)
    ]
    want = plain_attention_lse(q, k, v, q_offset=8)
    for got, ref in zip(seen, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    out, lse = late
    assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == np.finfo(np.float32).min)

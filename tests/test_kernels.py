"""The attention kernels (:mod:`spmdkit.kernels`) inside ``shard_map``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmdkit.kernels import blockwise_attention, blockwise_attention_lse, plain_attention


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

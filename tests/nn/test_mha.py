"""spmdkit.nn.MultiHeadAttention: flax's parameters load unchanged; outputs equal flax's
module (causal or not, grouped-query); a mask falls back to flax's attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdkit import nn


@pytest.mark.parametrize(("kv_heads", "causal"), [(None, False), (2, True)])
def test_outputs_match_flax(kv_heads, causal):
    kw = {"num_kv_heads": kv_heads, "decode": False}
    with nnx.use_eager_sharding(False):
        ours = nn.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0), **kw)
        theirs = nnx.MultiHeadAttention(4, 16, rngs=nnx.Rngs(1), **kw)
    assert ours.query.kernel.get_metadata()["out_sharding"] == ("embed", "heads", "head_dim")
    nnx.update(ours, nnx.state(theirs))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32))
    np.testing.assert_allclose(
        jax.jit(lambda x: ours(x, is_causal=causal))(x),
        theirs(x, is_causal=causal),
        rtol=1e-4,
        atol=1e-5,
    )
    prims = [
        e.primitive.name for e in jax.make_jaxpr(lambda x: ours(x, is_causal=causal))(x).jaxpr.eqns
    ]
    inner = [p for p in prims if p == "custom_vjp_call"]
    assert inner, prims  # the attention is a region
    mask = jnp.tril(jnp.ones((8, 8), bool))
    np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), rtol=1e-4, atol=1e-5)

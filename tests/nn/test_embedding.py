"""spmdkit.nn.Embed: flax's table loads unchanged, lookups equal flax's, logical names."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmdkit import nn


def test_lookup_and_attend_match_flax():
    with nnx.use_eager_sharding(False):
        ours, theirs = nn.Embed(64, 16, rngs=nnx.Rngs(0)), nnx.Embed(64, 16, rngs=nnx.Rngs(1))
    assert ours.embedding.get_metadata()["out_sharding"] == ("vocab", "embed")
    nnx.update(ours, nnx.state(theirs))  # flax's state loads unchanged
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 8)))
    np.testing.assert_allclose(jax.jit(ours)(ids), theirs(ids), rtol=1e-6)
    x = theirs(ids)
    np.testing.assert_allclose(ours.attend(x), theirs.attend(x), rtol=1e-6)
    # attend is one contraction against the table (no transpose traced: its vocab
    # and embed dims map onto the logits and the contraction); dtype=None follows
    # the query, an explicit dtype is flax's
    eqns = jax.make_jaxpr(ours.attend)(x).eqns
    assert [e.primitive.name for e in eqns] == ["dot_general"]
    assert ours.attend(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    with nnx.use_eager_sharding(False):
        f32 = nn.Embed(64, 16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    nnx.update(f32, nnx.state(theirs))
    h = x.astype(jnp.bfloat16)
    np.testing.assert_allclose(f32.attend(h), theirs.attend(h), rtol=1e-6)
    assert f32.attend(h).dtype == theirs.attend(h).dtype == jnp.float32

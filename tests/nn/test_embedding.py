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

"""The model tests/step's tests share: a stack of dense layers scanned over stacked
weights (what ``nnx.scan`` / ``scan_layers=True`` trace to), small enough that
every test compiles in well under a second, and its plain gradient to compare with."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

L, D, B = 3, 16, 8


def init(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "w": jax.random.normal(k1, (L, D, D)) / np.sqrt(D),
        "b": 0.1 * jax.random.normal(k2, (L, D)),
        "out": jax.random.normal(k3, (D,)) / np.sqrt(D),
    }


def batch(seed=1, n=B):
    rs = np.random.RandomState(seed)
    return {"x": rs.randn(n, D).astype(np.float32), "y": rs.randn(n).astype(np.float32)}


def scanned_loss(params, batch):
    def layer(h, wb):
        w, b = wb
        z = checkpoint_name(h @ w.astype(h.dtype), "proj")
        return jnp.tanh(z + b.astype(h.dtype)), None

    h = batch["x"].astype(params["w"].dtype)
    h, _ = jax.lax.scan(layer, h, (params["w"], params["b"]))
    pred = h @ params["out"]
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)


def looped_loss(params, batch):
    h = batch["x"]
    for i in range(L):
        h = jnp.tanh(h @ params["w"][i] + params["b"][i])
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


def tagged_loss(params, batch):
    """``scanned_loss`` with its projection tagged ``query_proj`` (MaxText's name)."""

    def layer(h, wb):
        w, b = wb
        return jnp.tanh(checkpoint_name(h @ w, "query_proj") + b), None

    h, _ = jax.lax.scan(layer, batch["x"], (params["w"], params["b"]))
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


def assert_tree_close(got, want, rtol):
    """Leaf by leaf, relative to the leaf's largest magnitude (a leaf's entries
    that are zero in exact arithmetic carry only rounding noise)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)

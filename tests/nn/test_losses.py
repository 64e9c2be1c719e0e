"""spmdkit.nn losses equal optax's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit as sk
from spmdkit import nn


def test_equal_optax_per_example_and_mean():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 8, 32)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, 32, (4, 8)))
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    got = jax.jit(nn.softmax_cross_entropy_with_integer_labels)(logits, labels)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(nn.cross_entropy)(logits, labels), ref.mean(), rtol=1e-5)
    with pytest.raises(sk.ShardingConflictError, match="where"):
        nn.softmax_cross_entropy_with_integer_labels(logits, labels, where=labels > 0)

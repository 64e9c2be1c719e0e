"""spmdkit.nn norms: flax's parameters load unchanged and the outputs equal flax's
modules; logical names; sharded inputs; what flax offers and the ops do not raises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit import nn

RNG = np.random.default_rng(0)


def _x(*shape):
    return jnp.asarray(RNG.standard_normal(shape).astype(np.float32))


def _load(ours, theirs):
    """Our module with flax's state (random params so the affine map is exercised)."""
    state = nnx.state(theirs)
    state = jax.tree.map(lambda v: v + 0.1 * RNG.standard_normal(v.shape).astype(v.dtype), state)
    nnx.update(theirs, state)
    nnx.update(ours, state)
    return ours, theirs


CASES = [
    (lambda m, **k: m.LayerNorm(16, rngs=nnx.Rngs(0), **k), (4, 6, 16), {}),
    (lambda m, **k: m.RMSNorm(16, rngs=nnx.Rngs(0), **k), (4, 6, 16), {}),
    (lambda m, **k: m.GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0), **k), (2, 3, 3, 16), {}),
]


@pytest.mark.parametrize(("make", "shape", "kw"), CASES, ids=["layer", "rms", "group"])
def test_flax_params_load_and_outputs_match(make, shape, kw):
    with nnx.use_eager_sharding(False):
        fresh = make(nn, **kw)
        ours, theirs = _load(make(nn, **kw), make(nnx, **kw))
    params = jax.tree.leaves(
        nnx.state(fresh, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Param)
    )
    assert {v.get_metadata()["out_sharding"] for v in params} == {("norm",)}
    x = _x(*shape)
    np.testing.assert_allclose(jax.jit(ours)(x), theirs(x), rtol=1e-4, atol=1e-5)


def test_batch_norm_trains_and_evaluates_like_flax():
    with nnx.use_eager_sharding(False):
        ours, theirs = nn.BatchNorm(8, rngs=nnx.Rngs(0)), nnx.BatchNorm(8, rngs=nnx.Rngs(0))
    assert ours.mean.get_metadata()["out_sharding"] == ("norm",)
    ours, theirs = _load(ours, theirs)
    x = _x(4, 3, 3, 8)
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours.mean[...], theirs.mean[...], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.var[...], theirs.var[...], rtol=1e-4, atol=1e-6)
    y = ours(x, use_running_average=True)
    np.testing.assert_allclose(y, theirs(x, use_running_average=True), rtol=1e-4, atol=1e-5)


def test_sharded_input_keeps_its_layout(mesh2d):
    with nnx.use_eager_sharding(False):
        ln = nn.RMSNorm(16, rngs=nnx.Rngs(0), strategy="sharded_stats")
    x = jax.device_put(_x(8, 16), NamedSharding(mesh2d, P("a", "b")))
    y = ln(x)
    assert sk.TensorSpec.from_value(y).dims == (("a",), ("b",))


def test_what_the_ops_do_not_do_raises():
    with nnx.use_eager_sharding(False):
        ln = nn.LayerNorm(16, rngs=nnx.Rngs(0), reduction_axes=(1,), feature_axes=(1,))
        bn = nn.BatchNorm(16, rngs=nnx.Rngs(0), axis_name="data")
    with pytest.raises(sk.ShardingConflictError, match="trailing"):
        ln(_x(4, 16, 2))
    with pytest.raises(sk.ShardingConflictError, match="axis_name"):
        bn(_x(4, 16))

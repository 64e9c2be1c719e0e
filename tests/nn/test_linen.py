"""spmdkit.nn.linen: flax linen variables apply unchanged and the outputs equal flax
linen's modules; the parameters carry logical names; flax options the ops lack raise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen

import spmdkit as sk
from spmdkit.nn import linen as sklinen

pytestmark = pytest.mark.slow  # the default run covers them through the GPT-linen model

RNG = np.random.default_rng(0)


def _x(*shape):
    return jnp.asarray(RNG.standard_normal(shape).astype(np.float32))


def _perturb(variables):
    """flax's variables with random values (so the affine map is exercised)."""
    return jax.tree.map(lambda v: v + 0.1 * RNG.standard_normal(v.shape).astype(v.dtype), variables)


CASES = {
    "layer": ("LayerNorm", {"epsilon": 1e-5}, (4, 6, 16)),
    "layer_2d": ("LayerNorm", {"reduction_axes": (-2, -1), "feature_axes": (-2, -1)}, (4, 6, 16)),
    "rms": ("RMSNorm", {}, (4, 6, 16)),
    "group": ("GroupNorm", {"num_groups": 4}, (2, 3, 3, 16)),
    "group_size": ("GroupNorm", {"num_groups": None, "group_size": 8}, (2, 3, 3, 16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flax_linen_variables_apply_and_outputs_match(case):
    name, kw, shape = CASES[case]
    theirs, ours = getattr(linen, name)(**kw), getattr(sklinen, name)(**kw)
    x = _x(*shape)
    variables = _perturb(theirs.init(jax.random.key(0), x))
    boxed = ours.init(jax.random.key(0), x)
    # same variable tree (paths, shapes, dtypes); ours boxed with the logical names
    assert jax.tree.map(jnp.shape, linen.unbox(boxed)) == jax.tree.map(jnp.shape, variables)
    names = {b.names for b in jax.tree.leaves(boxed, is_leaf=_is_box)}
    assert names == {(None, "norm") if case == "layer_2d" else ("norm",)}
    np.testing.assert_allclose(
        jax.jit(ours.apply)(variables, x), theirs.apply(variables, x), rtol=1e-4, atol=1e-5
    )


def _is_box(v):
    return isinstance(v, linen.LogicallyPartitioned)


def test_batch_norm_trains_and_evaluates_like_flax_linen():
    theirs = linen.BatchNorm(use_running_average=False, momentum=0.9)
    ours = sklinen.BatchNorm(use_running_average=False, momentum=0.9)
    x = _x(4, 3, 3, 8)
    variables = _perturb(theirs.init(jax.random.key(0), x))
    y0, new0 = theirs.apply(variables, x, mutable=["batch_stats"])
    y1, new1 = jax.jit(lambda v, x: ours.apply(v, x, mutable=["batch_stats"]))(variables, x)
    np.testing.assert_allclose(y1, y0, rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree.leaves(new1), jax.tree.leaves(new0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    boxed = ours.init(jax.random.key(0), x)["batch_stats"]
    assert boxed["mean"].names == ("norm",)
    np.testing.assert_allclose(  # evaluation: the running statistics
        sklinen.BatchNorm(use_running_average=True).apply(variables, x),
        linen.BatchNorm(use_running_average=True).apply(variables, x),
        rtol=1e-4,
        atol=1e-5,
    )


def test_embed_looks_up_flax_linen_tables():
    theirs, ours = linen.Embed(32, 8), sklinen.Embed(32, 8)
    ids = jnp.asarray(RNG.integers(0, 32, size=(2, 5)), jnp.int32)
    variables = theirs.init(jax.random.key(0), ids)
    assert ours.init(jax.random.key(0), ids)["params"]["embedding"].names == ("vocab", "embed")
    np.testing.assert_array_equal(jax.jit(ours.apply)(variables, ids), theirs.apply(variables, ids))
    h = _x(2, 5, 8)
    np.testing.assert_allclose(  # one contraction, not flax's dot with a transpose
        ours.apply(variables, h, method="attend"),
        theirs.apply(variables, h, method="attend"),
        rtol=1e-6,
        atol=1e-6,
    )


def test_what_the_ops_do_not_do_raises():
    x = _x(4, 16, 2)
    with pytest.raises(sk.ShardingConflictError, match="trailing"):
        sklinen.LayerNorm(reduction_axes=1, feature_axes=1).init(jax.random.key(0), x)
    with pytest.raises(sk.ShardingConflictError, match="axis_name"):
        sklinen.RMSNorm(axis_name="data").init(jax.random.key(0), x)
    with pytest.raises(sk.ShardingConflictError, match="divides"):
        sklinen.GroupNorm(num_groups=3).init(jax.random.key(0), _x(2, 3, 3, 16))


def test_attention_applies_flax_linen_variables_through_the_op():
    x = _x(2, 8, 16)
    theirs = linen.MultiHeadDotProductAttention(num_heads=4)
    ours = sklinen.MultiHeadDotProductAttention(num_heads=4)
    variables = _perturb(theirs.init(jax.random.key(0), x))
    boxed = ours.init(jax.random.key(0), x)["params"]
    assert boxed["query"]["kernel"].names == ("embed", "heads", "head_dim")
    assert boxed["out"]["kernel"].names == ("heads", "head_dim", "embed")
    assert jax.tree.map(jnp.shape, linen.unbox(boxed)) == jax.tree.map(
        jnp.shape, variables["params"]
    )
    np.testing.assert_allclose(
        jax.jit(ours.apply)(variables, x), theirs.apply(variables, x), rtol=1e-4, atol=1e-5
    )
    prims = [e.primitive.name for e in jax.make_jaxpr(lambda x: ours.apply(variables, x))(x).eqns]
    assert "custom_vjp_call" in prims  # the attention is a region
    mask = linen.make_causal_mask(jnp.ones((2, 8)))  # a mask: flax's attention
    np.testing.assert_allclose(
        ours.apply(variables, x, mask=mask),
        theirs.apply(variables, x, mask=mask),
        rtol=1e-4,
        atol=1e-5,
    )

"""MoE: routing with capacity, dropped tokens, load-balancing loss, stacked experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdkit.models import moe
from spmdkit.models.layers import ModelConfigError, softmax_cross_entropy

_route = jax.jit(moe.route, static_argnames=("top_k", "capacity", "normalize_top_k"))


def _logits(experts, n_experts=4, strength=10.0):
    """Router logits [1, seq, n_experts] whose top choice per token is experts[i]."""
    e = jnp.asarray(experts)
    return strength * jnp.eye(n_experts)[e][None]


def test_capacity_formula():
    assert moe.capacity(16, n_experts=4, top_k=2, capacity_factor=1.25) == 10
    assert moe.capacity(16, n_experts=64, top_k=1, capacity_factor=1.0) == 1
    assert moe.capacity(4, n_experts=1, top_k=2, capacity_factor=2.0) == 4


def test_tokens_over_capacity_are_dropped_in_order():
    r = _route(_logits([0] * 5 + [1]), top_k=1, capacity=2)
    assert r.dispatch.shape == (1, 6, 4, 2)
    # Expert 0 takes tokens 0 and 1 in slots 0 and 1; tokens 2-4 are dropped.
    np.testing.assert_array_equal(r.dispatch[0, :, 0, :].sum(-1), [1, 1, 0, 0, 0, 0])
    assert r.dispatch[0, 0, 0, 0] == 1 and r.dispatch[0, 1, 0, 1] == 1
    np.testing.assert_array_equal(r.dropped[0, :, 0], [False, False, True, True, True, False])
    assert float(jnp.abs(r.combine[0, 2:5]).sum()) == 0.0
    # No slot holds two tokens; each kept token sits in exactly one slot.
    assert float(r.dispatch.sum(axis=1).max()) == 1.0
    np.testing.assert_array_equal(r.dispatch.sum(axis=(2, 3))[0], [1, 1, 0, 0, 0, 1])


def test_first_choices_claim_capacity_before_second_choices():
    # Token 0 prefers expert 1 then 0; tokens 1, 2 prefer expert 0.
    logits = jnp.array([[[4.0, 5.0, 0, 0], [5.0, 0, 0, 0], [5.0, 0, 0, 0]]])
    r = _route(logits, top_k=2, capacity=2)
    assert bool(r.dropped[0, 0, 1])  # token 0's second choice (expert 0) lost
    assert not bool(r.dropped[0, 1, 0]) and not bool(r.dropped[0, 2, 0])
    # Combine weights of a fully kept token sum to 1 (normalized top-k).
    np.testing.assert_allclose(r.combine[0, 1].sum(), 1.0, rtol=1e-6)


def test_aux_loss_is_one_when_balanced_and_large_when_collapsed():
    # Same shapes as above: one compilation. Capacity does not affect the aux loss.
    balanced = _route(jnp.zeros((1, 6, 4)), top_k=1, capacity=2)
    np.testing.assert_allclose(balanced.aux_loss, 1.0, rtol=1e-6)
    collapsed = _route(_logits([0] * 6, strength=20.0), top_k=1, capacity=2)
    assert float(collapsed.aux_loss) > 3.9  # -> n_experts


@pytest.mark.slow
def test_experts_are_one_stacked_param_with_expert_axis(tiny):
    _, cfg, model = tiny("moe")
    layer = model.layers[0].moe
    assert layer.w_gate.shape == (cfg.n_experts, cfg.d_model, cfg.d_mlp)
    assert layer.w_gate.get_metadata()["out_sharding"] == ("expert", "embed", "mlp")
    assert layer.w_down.get_metadata()["out_sharding"] == ("expert", "mlp", "embed")


def test_dropped_tokens_get_zero_expert_output():
    cfg = moe.MoEConfig(capacity_factor=0.25, top_k=1)  # capacity 1 of 16 tokens
    with nnx.use_eager_sharding(False):
        layer = moe.MoELayer(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 64)), jnp.float32)
    y, aux = nnx.jit(lambda layer, x: layer(x))(layer, x)
    per_token = np.asarray(jnp.abs(y).sum(-1))
    # At most one token per expert per sequence gets an output.
    assert ((per_token > 0).sum(axis=1) <= cfg.n_experts).all()
    assert (per_token == 0).sum() >= 2 * (16 - cfg.n_experts)
    assert np.isfinite(float(aux))


@pytest.mark.slow
def test_scanned_loss_adds_weighted_aux():
    cfg = moe.MoEConfig(scan_layers=True)
    with nnx.use_eager_sharding(False):
        model = moe.MoE(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    batch = moe.lm_batch(cfg, 2, np.random.default_rng(0))

    @nnx.jit
    def parts(model, batch):
        logits, aux = model(batch["tokens"])
        ce = softmax_cross_entropy(logits, batch["targets"])
        return ce, aux, moe.moe_loss(model, batch)

    ce, aux, loss = parts(model, batch)
    np.testing.assert_allclose(loss, ce + cfg.aux_loss_weight * aux, rtol=1e-6)
    assert 0.0 < float(aux) < cfg.n_experts + 1e-5  # E * sum(density * prob) <= E


def test_config_validates_itself():
    with pytest.raises(ModelConfigError, match="top_k <= n_experts"):
        moe.MoEConfig(n_experts=2, top_k=3)
    with pytest.raises(ModelConfigError, match="n_kv_heads"):  # Llama checks run too
        moe.MoEConfig(n_heads=4, n_kv_heads=3)

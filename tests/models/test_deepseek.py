"""DeepSeek style model: MLA against a plain reference, published shapes and names,
the two layer stacks, the config's checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdkit import models as zoo
from spmdkit.models import deepseek
from spmdkit.models import layers as lyr
from spmdkit.models.layers import ModelConfigError


def _mla_reference(attn, cfg, x):
    """MLA written out: the published fused matrices (``wkv_a`` with the rotated key's
    columns, ``wkv_b`` with the values'), one softmax over the causal scores, the
    values at their own width (no padding)."""
    nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    q = jnp.einsum("bsr,rhk->bshk", attn.q_norm(x @ attn.wq_a[...]), attn.wq_b[...])
    latent = x @ jnp.concatenate([attn.wkv_a[...], attn.wk_rope[...]], axis=1)
    wkv_b = jnp.concatenate([attn.wk_b[...], attn.wv_b[...]], axis=2)
    kv = jnp.einsum("bsr,rhk->bshk", attn.kv_norm(latent[..., :r]), wkv_b)
    k_rope = lyr.rope(latent[:, :, None, r:], theta=cfg.rope_theta)
    k_rope = jnp.broadcast_to(k_rope, (*kv.shape[:3], k_rope.shape[-1]))
    q = jnp.concatenate([q[..., :nope], lyr.rope(q[..., nope:], theta=cfg.rope_theta)], -1)
    k = jnp.concatenate([kv[..., :nope], k_rope], -1)
    s = x.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(nope + cfg.qk_rope_head_dim)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), kv[..., nope:])
    return jnp.einsum("bshk,hkd->bsd", o, attn.wo[...])


@pytest.mark.slow  # the README command's budget
def test_mla_equals_the_written_out_attention():
    # values narrower than queries (padded); the plain kernel compiles fastest
    cfg = deepseek.DeepSeekConfig(v_head_dim=12, attention="xla")
    with nnx.use_eager_sharding(False):
        attn = deepseek.MLAttention(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.d_model))
    got = nnx.jit(lambda m, x: m(x))(attn, x)
    np.testing.assert_allclose(got, _mla_reference(attn, cfg, x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tiny_v3_loss_is_finite_and_names_every_dim():
    spec = zoo.get_model("deepseek")
    cfg = spec.config("tiny_v3")
    with nnx.use_eager_sharding(False):
        model = spec.build(cfg, nnx.Rngs(jax.random.key(0, impl="rbg")))
    batch = spec.batch(cfg, 2, np.random.default_rng(0))
    loss = nnx.jit(spec.loss)(model, batch)
    assert loss.shape == () and np.isfinite(float(loss)) and float(loss) > 0
    # the aux-loss-free bias is state, moved by the load (one row per MoE layer)
    bias = model.moe_layers.moe.expert_bias[...]
    assert bias.shape == (cfg.n_layers - cfg.n_dense_layers, cfg.n_experts)
    assert np.any(np.asarray(bias) != 0)
    axes = zoo.param_axes(model)
    assert axes[("dense_layers", "attn", "wq_a")] == ("layers", "embed", "q_lora")
    assert axes[("moe_layers", "attn", "wk_b")] == ("layers", "kv_lora", "heads", "head_dim")
    assert axes[("moe_layers", "moe", "shared_gate")] == ("layers", "embed", "mlp")


def test_published_shapes_abstractly():
    v3 = zoo.abstract_model("deepseek", "v3_671b")
    assert v3.dense_layers.mlp.gate.shape == (3, 7168, 18432)
    attn = v3.moe_layers.attn
    assert attn.wq_a.shape == (58, 7168, 1536) and attn.wq_b.shape == (58, 1536, 128, 192)
    assert attn.wkv_a.shape == (58, 7168, 512) and attn.wk_rope.shape == (58, 7168, 64)
    assert attn.wk_b.shape == (58, 512, 128, 128) and attn.wv_b.shape == (58, 512, 128, 128)
    moe = v3.moe_layers.moe
    assert moe.w_gate.shape == (58, 256, 7168, 2048)
    assert moe.shared_gate.shape == (58, 7168, 2048) and moe.expert_bias.shape == (58, 256)
    lite = zoo.abstract_model("deepseek", "16b")  # no query compression
    assert lite.moe_layers.attn.wq.shape == (26, 2048, 16, 192)
    assert lite.moe_layers.attn.wq_a is None and lite.moe_layers.moe.expert_bias is None
    assert lite.moe_layers.moe.shared_gate.shape == (26, 2048, 2 * 1408)


def test_config_validates_itself():
    with pytest.raises(ModelConfigError, match="n_dense_layers"):
        deepseek.DeepSeekConfig(n_layers=2, n_dense_layers=3)
    with pytest.raises(ModelConfigError, match="v_head_dim"):
        deepseek.DeepSeekConfig(v_head_dim=64)
    with pytest.raises(ModelConfigError, match="top_k"):
        deepseek.DeepSeekConfig(n_experts=4, top_k=5)


def test_config_refuses_more_than_one_prediction_depth():
    with pytest.raises(ModelConfigError, match="mtp_layers"):
        deepseek.DeepSeekConfig(mtp_layers=2)


@pytest.mark.slow  # the README command's budget
def test_the_mtp_module_adds_its_weighted_loss_two_tokens_ahead():
    """``mtp_layers=1``: one more MoE block after the stack, reading the stack's
    state and the next token's embedding through a ``[2·d_model, d_model]``
    projection, and the shared head; its cross-entropy against the token two
    ahead joins the auxiliary loss at ``mtp_weight``. The main logits are the
    same function of the same weights as without the module."""
    import dataclasses

    cfg = dataclasses.replace(deepseek.CONFIGS["tiny_v3"](), mtp_layers=1, attention="xla")

    def build(config):
        return deepseek.DeepSeek(config, rngs=nnx.Rngs(0))

    # compiled calls: op by op, the forward passes on 8 CPU devices take longer
    forward = nnx.jit(lambda m, t: m(t))
    with nnx.use_eager_sharding(False):
        model = build(cfg)
    assert model.mtp.proj.shape == (2 * cfg.d_model, cfg.d_model)
    assert zoo.param_axes(model)[("mtp", "proj")] == ("mlp", "embed")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (2, 16)), jnp.int32)

    def aux_at(weight):
        return forward(build(dataclasses.replace(cfg, mtp_weight=weight)), tokens)

    with nnx.use_eager_sharding(False):
        (logits, aux), (_, no_mtp_loss) = aux_at(1.0), aux_at(0.0)
        plain = build(dataclasses.replace(cfg, mtp_layers=0))
    ce = float(aux - no_mtp_loss)
    assert 0.5 * np.log(cfg.vocab) < ce < 2 * np.log(cfg.vocab)  # a fresh model's CE
    # the main path: the plain model with the same weights (its state copied over)
    nnx.update(plain, nnx.state(model, nnx.Not(nnx.PathContains("mtp"))))
    np.testing.assert_allclose(forward(plain, tokens)[0], logits, rtol=1e-5, atol=1e-5)

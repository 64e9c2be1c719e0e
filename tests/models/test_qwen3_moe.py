"""Qwen3-MoE style model: qk-norm, published shapes and names, the config's checks."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from spmdkit import models as zoo
from spmdkit.models import qwen3_moe
from spmdkit.models.layers import ModelConfigError


def test_qk_norm_makes_attention_blind_to_the_query_and_key_scale():
    cfg = qwen3_moe.Qwen3MoEConfig(attention="xla")  # the plain kernel compiles fastest
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.d_model))
    run = nnx.jit(lambda m, x: m(x))
    outs = {}
    for qk_norm in (True, False):
        c = dataclasses.replace(cfg, qk_norm=qk_norm)
        with nnx.use_eager_sharding(False):
            attn = qwen3_moe.QKNormAttention(c, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
        before = run(attn, x)
        attn.wq[...] = attn.wq[...] * 3.0
        attn.wk[...] = attn.wk[...] * 3.0
        outs[qk_norm] = (before, run(attn, x))
    np.testing.assert_allclose(*outs[True], rtol=1e-4, atol=1e-5)
    assert not np.allclose(*outs[False], rtol=1e-3)


@pytest.mark.slow
def test_tiny_loss_is_finite_and_names_every_dim():
    spec = zoo.get_model("qwen3_moe")
    cfg = spec.config("tiny")
    with nnx.use_eager_sharding(False):
        model = spec.build(cfg, nnx.Rngs(jax.random.key(0, impl="rbg")))
    batch = spec.batch(cfg, 2, np.random.default_rng(0))
    loss = nnx.jit(spec.loss)(model, batch)
    assert loss.shape == () and np.isfinite(float(loss)) and float(loss) > 0
    axes = zoo.param_axes(model)
    assert axes[("layers", "attn", "q_norm", "scale")] == ("layers", "norm")
    assert axes[("layers", "moe", "w_gate")] == ("layers", "expert", "embed", "mlp")
    assert axes[("layers", "moe", "router")] == ("layers", "embed", None)


def test_published_shapes_abstractly():
    m = zoo.abstract_model("qwen3_moe", "30b_a3b")
    assert m.layers.attn.wq.shape == (48, 2048, 32, 128)
    assert m.layers.attn.wk.shape == (48, 2048, 4, 128)
    assert m.layers.attn.q_norm.scale.shape == (48, 128)
    assert m.layers.moe.w_gate.shape == (48, 128, 2048, 768)
    assert m.layers.moe.shared_gate is None
    oss = zoo.abstract_model("qwen3_moe", "gpt_oss_120b")
    assert oss.layers.attn.q_norm is None and oss.layers.moe.w_down.shape == (36, 128, 2880, 2880)


def test_config_validates_itself():
    with pytest.raises(ModelConfigError, match="top_k"):
        qwen3_moe.Qwen3MoEConfig(n_experts=4, top_k=8)
    with pytest.raises(ModelConfigError, match="n_kv_heads"):  # Llama checks run too
        qwen3_moe.Qwen3MoEConfig(n_heads=4, n_kv_heads=3)

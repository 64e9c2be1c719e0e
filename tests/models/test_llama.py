"""Llama style model: GQA shapes, scanned vs looped layers, causality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdkit.models import llama
from spmdkit.models.layers import ModelConfigError

_forward = nnx.jit(lambda model, tokens: model(tokens))


def test_grouped_query_shapes_and_names(tiny):
    _, cfg, model = tiny("llama")
    attn = model.layers[0].attn
    assert cfg.n_kv_heads < cfg.n_heads
    assert attn.wq.shape == (cfg.d_model, cfg.n_heads, cfg.head_dim)
    assert attn.wk.shape == (cfg.d_model, cfg.n_kv_heads, cfg.head_dim)
    assert attn.wk.get_metadata()["out_sharding"] == ("embed", "kv_heads", "head_dim")
    assert model.lm_head.get_metadata()["out_sharding"] == ("embed", "vocab")


@pytest.mark.slow
def test_scanned_and_looped_agree_for_the_same_weights(tiny):
    _, cfg, looped = tiny("llama")
    with nnx.use_eager_sharding(False):
        scanned = llama.Llama(
            llama.LlamaConfig(scan_layers=True), rngs=nnx.Rngs(jax.random.key(1, impl="rbg"))
        )
    wq = scanned.layers.attn.wq
    assert wq.shape == (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim)
    assert wq.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
    tokens = jnp.array([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 5, 6]], jnp.int32)
    before = _forward(scanned, tokens)
    nnx.update(scanned, llama.stack_layers(nnx.state(looped)))
    assert scanned.layers.attn.wq.get_metadata()["out_sharding"][0] == "layers"
    a, b = _forward(looped, tokens), _forward(scanned, tokens)
    assert not np.allclose(before, b)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Causal: changing token 3 leaves positions 0-2 unchanged.
    np.testing.assert_allclose(a[0, :3], a[1, :3], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[0, 3:], a[1, 3:])


def test_config_validates_itself():
    with pytest.raises(ModelConfigError, match="n_kv_heads divide n_heads"):
        llama.LlamaConfig(n_heads=4, n_kv_heads=3)

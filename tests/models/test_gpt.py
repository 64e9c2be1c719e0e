"""GPT-2 style model: tied embeddings, causality, parameter layout, dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdkit.models import gpt
from spmdkit.models.layers import ModelConfigError

_forward = nnx.jit(lambda model, tokens: model(tokens))


@pytest.mark.slow
def test_tied_embeddings_are_the_output_projection(tiny):
    _, _, model = tiny("gpt")
    names = {p[-1] for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert "lm_head" not in names
    a = jnp.array([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 6]], jnp.int32)
    table = model.embed.embedding[...]
    try:
        model.embed.embedding[...] = table.at[7].set(0.0)
        zero_row = _forward(model, a)
        model.embed.embedding[...] = table.at[7].set(1.0)
        one_row = _forward(model, a)
    finally:
        model.embed.embedding[...] = table
    # Token 7 never occurs in the input: only its output logit can change.
    diff = np.abs(np.asarray(one_row - zero_row)).max(axis=(0, 1))
    assert diff[7] > 0 and np.all(np.delete(diff, 7) == 0)
    # Causal: changing token 4 leaves the logits of positions 0-3 unchanged.
    logits = _forward(model, a)
    np.testing.assert_allclose(logits[0, :4], logits[1, :4], rtol=1e-5, atol=1e-6)
    assert not np.allclose(logits[0, 4:], logits[1, 4:])


def test_param_layout(tiny):
    _, cfg, model = tiny("gpt")
    assert model.embed.embedding.get_metadata()["out_sharding"] == ("vocab", "embed")
    assert model.pos.get_metadata()["out_sharding"] == ("pos", "embed")
    wq = model.blocks[0].attn.wq
    assert wq.shape == (cfg.d_model, cfg.n_heads, cfg.head_dim)
    assert wq.get_metadata()["out_sharding"] == ("embed", "heads", "head_dim")
    assert model.blocks[0].fc.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")


def test_dropout_only_in_train_mode():
    cfg = gpt.GPTConfig(n_layers=1, dropout=0.5)
    with nnx.use_eager_sharding(False):
        model = gpt.GPT(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    model.eval()
    np.testing.assert_array_equal(_forward(model, tokens), _forward(model, tokens))
    model.train()
    assert not np.allclose(_forward(model, tokens), _forward(model, tokens))


def test_config_validates_itself():
    with pytest.raises(ModelConfigError, match="n_heads divide d_model"):
        gpt.GPTConfig(d_model=64, n_heads=5)
    with pytest.raises(ModelConfigError, match="max_seq"):
        gpt.GPTConfig(seq_len=32, max_seq=16)

"""Linen GPT: LogicallyPartitioned boxes, and the NNX bridge carrying the same names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from spmdkit import models as zoo
from spmdkit.models import gpt, gpt_linen


def test_linen_init_gives_logically_partitioned_boxes():
    module = gpt_linen.GPTLinen(gpt.GPTConfig())
    boxes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    params = boxes["params"]
    assert isinstance(params["embed"]["embedding"], nn.LogicallyPartitioned)
    assert params["embed"]["embedding"].names == ("vocab", "embed")
    specs = nn.get_partition_spec(params)
    assert tuple(specs["block_0"]["wq"]) == ("embed", "heads", "head_dim")


@pytest.mark.slow
def test_bridge_keeps_names_and_matches_linen_apply(tiny):
    _, cfg, model = tiny("gpt_linen")
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = {p: v.get_metadata()["out_sharding"] for p, v in flat}
    assert names[("block_0", "fc_kernel")] == ("embed", "mlp")
    # The same names (as a multiset) as the NNX GPT.
    nnx_names = sorted(zoo.param_axes(zoo.abstract_model("gpt", cfg)).values())
    assert sorted(names.values()) == nnx_names
    # The wrapper computes what linen's apply computes with the same weights.
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (2, 16)), jnp.int32)
    params = {}
    for path, v in flat:
        d = params
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v[...]
    linen_apply = jax.jit(gpt_linen.GPTLinen(cfg).apply)
    ref = linen_apply({"params": params}, tokens)
    out = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_dropout_is_refused():
    with nnx.use_eager_sharding(False), pytest.raises(zoo.ModelConfigError, match="dropout"):
        gpt_linen.build(gpt.GPTConfig(dropout=0.1), nnx.Rngs(0))

"""The model registry: every reference model builds, trains and names its dims."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmdkit import models as zoo


@pytest.fixture(params=sorted(zoo.MODELS))
def built(request, tiny):
    return tiny(request.param)


#: The models whose tiny loss-and-grad check runs in the slow step (its cost is the
#: model's compile); the others' runs in the default run.
SLOW_LOSS_AND_GRAD = frozenset(
    {"convnet", "deepseek", "gpt", "gpt_linen", "llama", "moe", "qwen3_moe"}
)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "built",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LOSS_AND_GRAD else name
        for name in sorted(zoo.MODELS)
    ],
    indirect=True,
)
def test_tiny_loss_and_grad(built):
    spec, cfg, model = built
    batch = spec.batch(cfg, 2, np.random.default_rng(0))
    loss, grads = nnx.jit(nnx.value_and_grad(spec.loss))(model, batch)
    assert loss.shape == ()
    assert np.isfinite(float(loss))
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    # Every parameter gets a gradient (no dead branch), except MoE experts that
    # happened to receive no token; at least most are non-zero.
    nonzero = [bool(jnp.any(g != 0)) for g in leaves]
    assert sum(nonzero) >= 0.9 * len(nonzero)


def test_every_variable_has_allowed_logical_names(built):
    _, _, model = built
    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    flat = nnx.to_flat_state(state)
    assert len(flat) > 0
    axes = zoo.param_axes(model)
    for path, var in flat:
        names = axes[path]
        assert names is not None, path
        assert len(names) == var.ndim, (path, names, var.shape)
        # None: a dim kept whole on purpose (a router's experts: top-k reads every score)
        assert set(names) - {None} <= zoo.PARAM_AXES, (path, names)
        assert any(n is not None for n in names), (path, names)


def test_batch_fields_named_and_abstract_batch_matches(built):
    spec, cfg, _ = built
    concrete = spec.batch(cfg, 4, np.random.default_rng(1))
    abstract = spec.batch(cfg, 4, None)
    assert set(concrete) == set(abstract) == set(spec.batch_axes)
    for k, names in spec.batch_axes.items():
        assert isinstance(abstract[k], jax.ShapeDtypeStruct)
        assert abstract[k].shape == concrete[k].shape and abstract[k].dtype == concrete[k].dtype
        assert len(names) == concrete[k].ndim
        assert set(names) <= zoo.BATCH_AXES
        assert names[0] == "batch" and concrete[k].shape[0] == 4


def test_abstract_build_matches_concrete(built):
    spec, cfg, model = built
    abstract = zoo.abstract_model(spec, cfg)
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert zoo.count_params(abstract) == zoo.count_params(model)
    assert zoo.param_axes(abstract) == zoo.param_axes(model)


def test_eager_sharding_without_mesh_is_refused():
    # Documents why models are built under nnx.use_eager_sharding(False).
    spec = zoo.get_model("gpt")
    with nnx.use_eager_sharding(True), pytest.raises(ValueError, match="mesh"):
        spec.build(spec.configs["tiny"](), nnx.Rngs(0))


@pytest.mark.parametrize(
    ("name", "size", "published"),
    [
        ("gpt", "124m", 124_439_808),  # GPT-2 small, tied embeddings
        ("llama", "8b", 8_030_261_248),  # Llama-3 8B
        ("llama", "70b", 70_553_706_496),  # Llama-3 70B
        ("moe", "mixtral_8x7b", 46_702_792_704),  # Mixtral 8x7B
    ],
)
def test_real_sizes_param_counts_abstractly(name, size, published):
    n = zoo.count_params(zoo.abstract_model(name, size))
    assert abs(n - published) <= 0.01 * published, n


def test_unknown_model_and_size_errors_name_the_known_ones():
    with pytest.raises(zoo.UnknownModelError, match="llama") as e:
        zoo.get_model("lama")
    assert isinstance(e.value, LookupError) and "gpt_linen" in str(e.value)
    with pytest.raises(zoo.UnknownModelError, match="124m"):
        zoo.get_model("gpt").config("125m")


def test_every_model_has_tiny_and_a_real_size():
    assert set(zoo.MODELS) == {
        "gpt",
        "llama",
        "moe",
        "deepseek",
        "qwen3_moe",
        "convnet",
        "gpt_linen",
    }
    for name, spec in zoo.MODELS.items():
        assert spec.name == name
        assert "tiny" in spec.configs and "small" in spec.configs
        assert len(spec.configs) >= 3

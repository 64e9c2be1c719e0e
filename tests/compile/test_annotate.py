"""Born-sharded parameters: init_sharded from a plan, the shard class decorator."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.compile import init_sharded, shard
from spmdkit.introspect import ModelError, describe
from spmdkit.planner import plan
from tests.plan_model import Toy, toy_batch, toy_init, toy_loss


def test_init_sharded_places_every_param_as_planned():
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    p = plan(info, sk.make_mesh(data=2, model=4), "megatron", estimator="analytic")
    params = init_sharded(info, p)
    assert params["mixers"][0]["up"][...].sharding.spec == p.params["mixers/0/up"]
    assert params["table"][...].sharding.spec == P("model")


@pytest.mark.slow
def test_init_sharded_arrays_live_on_the_users_explicit_mesh():
    """sk.make_mesh makes Explicit axes; the params stay on that mesh, so plain
    jax.jit under jax.set_mesh(mesh) runs on them, and sk.jit takes them too."""
    mesh = sk.make_mesh(data=2, model=4)
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    p = plan(info, mesh, "fsdp", estimator="analytic")
    params = init_sharded(info, p)
    leaf = next(x for x in jax.tree.leaves(params) if x.sharding.spec != P())
    assert leaf.sharding.mesh == mesh
    with jax.set_mesh(mesh):
        doubled = jax.jit(lambda t: jax.tree.map(lambda x: 2 * x, t))(params)
    assert jax.tree.leaves(doubled)[0].sharding.mesh == mesh
    loss, _ = sk.jit(jax.value_and_grad(info.loss_fn), p)(params, toy_batch())
    assert jnp.isfinite(loss)


def test_init_sharded_needs_an_initialiser():
    with nnx.use_eager_sharding(False):
        model = Toy(rngs=nnx.Rngs(0))
    info = describe(model, loss=toy_loss, batch=toy_batch())
    p = plan(info, sk.make_mesh(data=8), "dp", estimator="analytic")
    with pytest.raises(ModelError, match="re-initialised"):
        init_sharded(info, p)


def test_shard_decorator_creates_sharded_instances():
    mesh = sk.make_mesh(data=2, model=4)

    @shard("megatron", mesh=mesh)
    class ShardedToy(Toy):
        pass

    model = ShardedToy(rngs=nnx.Rngs(0))
    assert isinstance(model, Toy)
    assert model.mixers[0].up[...].sharding.spec == P(None, "model")
    assert model.table[...].sharding.spec == P("model")
    with nnx.use_eager_sharding(False):
        plain = Toy(rngs=nnx.Rngs(0))
    assert jnp.allclose(model.mixers[1].down[...], plain.mixers[1].down[...])


def test_shard_needs_mesh_for_rules():
    with pytest.raises(ModelError, match="mesh"):
        shard("fsdp")

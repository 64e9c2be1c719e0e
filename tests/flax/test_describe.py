"""Reading flax models (NNX and linen), born-sharded init and the shard decorator."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.flax import ModelError, describe, path_str, shard
from spmdkit.planner import plan
from tests.plan_model import Toy, toy_batch, toy_loss


def test_describe_reads_logical_names():
    info = describe(lambda: Toy(rngs=nnx.Rngs(0)), loss=toy_loss, batch=toy_batch())
    by = info.by_path()
    assert by["mixers/0/up"].logical == ("embed", "mlp")
    assert by["table"].shape == (64, 32)
    assert info.batch_axes["tokens"] == ("batch", "seq")
    assert jax.tree.leaves(info.abstract_params)[0].__class__ is jax.ShapeDtypeStruct


def test_describe_needs_loss_and_batch():
    with pytest.raises(ModelError, match="loss"):
        describe(lambda: Toy(rngs=nnx.Rngs(0)))


def test_path_str_drops_variable_value():
    kp = (jax.tree_util.DictKey("a"), jax.tree_util.GetAttrKey("value"))
    assert path_str(kp) == "a"


def test_linen_logically_partitioned():
    import flax.linen as nn

    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param(
                "w", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")), (4, 8)
            )
            b = self.param("b", nn.with_partitioning(nn.initializers.zeros, ("model",)), (8,))
            return x @ w + b

    def loss(variables, batch):
        return Lin().apply(variables, batch["x"]).sum()

    x = jnp.ones((8, 4))
    info = describe(Lin(), loss=loss, batch={"x": x}, init_args=(x,))
    by = info.by_path()
    assert by["params/w"].logical == ("embed", "mlp")
    assert by["params/b"].pinned == P("model")
    p = plan(info, sk.abstract_mesh(data=2, model=4), "megatron")
    assert p.params["params/w"] == P(None, "model") and p.params["params/b"] == P("model")


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

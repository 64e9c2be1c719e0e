"""Reading flax models (NNX and linen) abstractly; the ModelInfo memo; no planner import."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.flax import ModelError, describe, path_str
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


def test_memo_computes_once_per_key():
    info = describe(lambda: Toy(rngs=nnx.Rngs(0)), loss=toy_loss, batch=toy_batch())
    calls = []
    assert info.memo(("t", 1), lambda: calls.append(1) or "a") == "a"
    assert info.memo(("t", 1), lambda: calls.append(1) or "b") == "a"
    assert info.memo(("t", 2), lambda: calls.append(1) or "c") == "c"
    assert calls == [1, 1]
    assert "memo" not in repr(info)


def test_describe_never_imports_the_planner():
    """The planner imports describe; describe (even inside functions) never imports
    the planner, compile or verification."""
    import ast
    import inspect

    import spmdkit.flax.model as module

    tree = ast.parse(inspect.getsource(module))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    for stage in ("planner", "compile", "verification"):
        assert not [m for m in imported if m and f"spmdkit.{stage}" in m], stage

"""Reading flax models (NNX and linen) abstractly; the ModelInfo memo; no planner import."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.introspect import ModelError, describe, path_str
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

    import spmdkit.introspect.model as module

    tree = ast.parse(inspect.getsource(module))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    for stage in ("planner", "compile", "verification"):
        assert not [m for m in imported if m and f"spmdkit.{stage}" in m], stage


class _LinenBN:
    """A linen module with BatchNorm, built lazily (linen imports on first use)."""

    @staticmethod
    def make():
        import flax.linen as nn

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(2)(nn.BatchNorm(use_running_average=False)(x))

        return Net()


def test_linen_collections_besides_params_are_state():
    """batch_stats are state (not params); the loss returns (loss, updates) as
    linen's apply(mutable=...) gives them, a scalar loss keeps the state (warned),
    and updates for a collection the model lacks are a typed error."""
    net, x = _LinenBN.make(), jnp.ones((4, 3))

    def loss(v, b):
        y, updates = net.apply(v, b["x"], mutable=["batch_stats"])
        return y.sum(), updates

    info = describe(net, loss=loss, batch={"x": x}, init_args=(x,))
    assert info.has_state and [p.path for p in info.params] == [
        "params/BatchNorm_0/bias",
        "params/BatchNorm_0/scale",
        "params/Dense_0/bias",
        "params/Dense_0/kernel",
    ]
    assert [s.path for s in info.state] == [
        "batch_stats/BatchNorm_0/mean",
        "batch_stats/BatchNorm_0/var",
    ]
    _, new = info.state_loss_fn(info.init_fn(), {"x": x + 1.0}, info.init_state_fn())
    assert float(new["batch_stats"]["BatchNorm_0"]["mean"][0]) == pytest.approx(0.02)

    def scalar(v, b):
        return net.apply(v, b["x"], mutable=["batch_stats"])[0].sum()

    frozen = describe(net, loss=scalar, batch={"x": x}, init_args=(x,))
    with pytest.warns(UserWarning, match="returns no updated state"):
        _, same = frozen.state_loss_fn(frozen.init_fn(), {"x": x}, frozen.init_state_fn())
    assert float(same["batch_stats"]["BatchNorm_0"]["var"][0]) == 1.0
    wrong = describe(net, loss=lambda v, b: (scalar(v, b), {"cache": {}}), batch={"x": x},
                     init_args=(x,))  # fmt: skip
    with pytest.raises(ModelError, match="cache"):
        wrong.state_loss_fn(wrong.init_fn(), {"x": x}, wrong.init_state_fn())


def test_nnx_batch_stats_are_state_read_back_after_the_loss():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)  # RNG streams: not state

        def __call__(self, x):
            return self.bn(self.lin(x))

    x = jnp.ones((2, 3))
    info = describe(lambda: Net(nnx.Rngs(0)), loss=lambda m, b: m(b["x"]).sum(), batch={"x": x})
    assert [s.path for s in info.state] == ["bn/mean", "bn/var"]
    assert "bn/mean" not in info.by_path()
    (_, new), grads = jax.value_and_grad(info.state_loss_fn, has_aux=True)(
        info.init_fn(), {"x": x}, info.init_state_fn()
    )
    assert float(jnp.abs(new["bn"]["mean"][...]).sum()) > 0  # updated in place, read back
    assert "mean" not in grads["bn"]

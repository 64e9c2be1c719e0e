"""Names for every parameter: inferred from the traced loss, given by path, flax's padding."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.planner import LogicalRules, PlanError, preset_rules
from spmdkit.planner.naming import infer_names
from tests.zoo.models import ZOO

MESH = sk.abstract_mesh(data=2, model=4)
LINEN_NAMES = {
    "*/attn/[qkv]*/kernel": ("embed", "heads", "head_dim"),
    "*/attn/out/kernel": ("heads", "head_dim", "embed"),
}


def _info(name):
    case = ZOO[name]
    return describe(case.model(), loss=case.loss, batch=case.batch(), init_args=case.init_args())


@pytest.fixture(scope="module")
def nnx_decoder():
    return _info("nnx_decoder")


@pytest.fixture(scope="module")
def linen_decoder():
    return _info("linen_decoder")


def test_roles_follow_megatron_column_and_row(nnx_decoder):
    """A matmul whose input is the residual stream is column-parallel, one whose
    input came from a column-parallel output is row-parallel; the embedding's
    vocabulary names the head's output."""
    roles = infer_names(nnx_decoder)
    names = {path: role.names for path, role in roles.items()}
    assert names["embed/embedding"] == ("vocab", "embed")
    assert names["blocks/0/attn/q/kernel"] == ("embed", "mlp")
    assert names["blocks/0/attn/out/kernel"] == ("heads", "head_dim", "embed")  # nnx.Einsum
    assert names["blocks/0/gate/kernel"] == ("embed", "mlp")
    assert names["blocks/0/down/kernel"] == ("mlp", "embed")
    assert names["head/kernel"] == ("embed", "vocab")
    assert names["blocks/0/norm1/scale"] == ("norm",)
    assert roles["blocks/0/down/kernel"].is_weight
    assert not roles["blocks/0/norm1/scale"].is_weight


def test_conv_kernels_and_position_embeddings():
    roles = infer_names(_info("vit"))
    assert roles["patch/kernel"].names == ("conv_window", "conv_window", "conv_in", "conv_out")
    assert roles["blocks/0/attn/query/kernel"].names == ("embed", "heads", "head_dim")
    assert roles["blocks/0/attn/out/kernel"].names == ("heads", "head_dim", "embed")
    assert roles["blocks/0/fc2/kernel"].names == ("mlp", "embed")
    assert roles["pos"].names == (None, None, "norm")


def test_megatron_shards_an_unnamed_model_and_the_table_says_inferred(nnx_decoder):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every weight placed: no warning
        p = sk.plan(nnx_decoder, MESH, "megatron", estimator="analytic")
    assert p.params["blocks/0/up/kernel"] == P(None, "model")
    assert p.params["blocks/0/down/kernel"] == P("model")
    assert p.params["embed/embedding"] == P("model")
    assert p.names_from["blocks/0/up/kernel"] == "inferred"
    assert "embed,mlp (inferred)" in p.table()
    assert sk.Plan.from_json(p.to_json()).names_from == p.names_from


def test_flax_pads_fewer_names_and_a_tp_preset_warns(linen_decoder):
    """linen's DenseGeneral gives its 3-D kernels the flat initializer's two names:
    padded as flax pads, megatron leaves them off the model axis, and says so."""
    path = "params/block_0/attn/query/kernel"
    assert next(p for p in linen_decoder.params if p.path == path).logical == ("embed", "kv")
    with pytest.warns(UserWarning, match=r"(?s)get no 'model' axis.*attn/query/kernel.*names="):
        p = sk.plan(linen_decoder, MESH, "megatron", estimator="analytic")
    assert p.params[path] == P()
    with pytest.raises(PlanError, match="attn/query/kernel"):
        sk.plan(linen_decoder, MESH, "megatron", estimator="analytic", strict=True)


def test_names_by_path_glob_fix_it(linen_decoder):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = sk.plan(linen_decoder, MESH, "megatron", estimator="analytic", names=LINEN_NAMES)
    assert p.params["params/block_1/attn/key/kernel"] == P(None, "model")
    assert p.params["params/block_1/attn/out/kernel"] == P("model")
    assert p.names_from["params/block_1/attn/out/kernel"] == "given"
    assert "heads,head_dim,embed (given)" in p.table()


def test_names_none_replicates_on_purpose_without_warning(linen_decoder):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = sk.plan(linen_decoder, MESH, "megatron", estimator="analytic", names={"*/attn/*": None})
    assert p.params["params/block_0/attn/value/kernel"] == P()


def test_a_glob_matching_nothing_or_too_many_names_is_an_error(linen_decoder):
    with pytest.raises(PlanError, match="matches none"):
        sk.plan(linen_decoder, MESH, "dp", estimator="analytic", names={"*/atn/*": None})
    with pytest.raises(PlanError, match="at most one logical name per dim"):
        sk.plan(
            linen_decoder,
            MESH,
            "dp",
            estimator="analytic",
            names={"*/mlp/Dense_0/kernel": ("embed", "mlp", "mlp")},
        )


def test_resolve_pads_and_flax_tables_are_rules():
    rules = LogicalRules.coerce((("embed", None), ("kv", None), ("heads", "model")))
    assert rules.resolve(("heads", "kv"), (4, 8, 32), MESH) == P("model")
    with pytest.raises(PlanError, match="at most one"):
        rules.resolve(("heads", "kv", "embed", "x"), (4, 8, 32), MESH)
    megatron = preset_rules("megatron", MESH)
    assert megatron.resolve(("embed", "joined_kv"), (32, 32), MESH) == P(None, "model")
    assert megatron.resolve(("embed", "kv"), (32, 8), MESH) == P()


class _SyncNorm(__import__("flax").linen.Module):
    """A linen layer written for pmap: BatchNorm averages over ``axis_name``."""

    axis: str | None = "batch"

    @__import__("flax").linen.compact
    def __call__(self, x):
        nn = __import__("flax").linen
        h = nn.Dense(16)(x)
        return nn.BatchNorm(use_running_average=False, axis_name=self.axis)(h)


def _sync_loss(variables, batch):
    out, updates = _SyncNorm().apply(variables, batch["x"], mutable=["batch_stats"])
    return (out**2).mean(), updates


def test_a_pmap_axis_name_is_a_typed_error_or_bound():
    import jax
    import numpy as np

    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    kw = {"loss": _sync_loss, "batch": {"x": x}, "init_args": (x,), "estimator": "analytic"}
    with pytest.raises(sk.SpmdError, match=r"(?s)unbound axis name.*axis_names=\('batch',\)"):
        sk.plan(_SyncNorm(), MESH, "dp", **kw)
    p = sk.plan(_SyncNorm(), MESH, "dp", axis_names=("batch",), **kw)
    assert p.params
    info = describe(
        _SyncNorm(), loss=_sync_loss, batch={"x": x}, init_args=(x,), axis_names=("batch",)
    )
    params, state = info.init_fn(), info.init_state_fn()
    # one device's BatchNorm over the whole batch: what the pmean averages to
    plain, updates = _SyncNorm(axis=None).apply({**params, **state}, x, mutable=["batch_stats"])
    (loss, new), grads = jax.jit(jax.value_and_grad(info.state_loss_fn, has_aux=True))(
        params, {"x": x}, state
    )
    np.testing.assert_allclose(loss, (plain**2).mean(), rtol=1e-6)
    for got, want in zip(*map(jax.tree.leaves, (new, updates)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert grads["params"]["Dense_0"]["kernel"].shape == (
        4,
        16,
    )


def test_scanned_layers_get_a_layers_dim_and_match_the_models_own_names():
    """Inside a layer scan each weight is one slice: its stacked dim is ``layers``;
    the rest agrees with llama's hand-written names (kv heads are heads)."""
    import dataclasses

    from spmdkit.models import get_model

    spec = get_model("llama")
    cfg = dataclasses.replace(spec.config("tiny"), scan_layers=True)
    info = describe(spec, config=cfg)
    roles = infer_names(info)
    for p in info.params:
        own = tuple("heads" if n == "kv_heads" else n for n in p.logical)
        assert roles[p.path].names == own, p.path


def _head_only():
    """One Linear(32, 5): its inferred names put the 5 outputs on the model axis."""
    import jax.numpy as jnp
    from flax import nnx

    class Head(nnx.Module):
        def __init__(self, rngs):
            self.head = nnx.Linear(32, 5, rngs=rngs)

        def __call__(self, x):
            return self.head(x)

    batch = {"x": jnp.ones((8, 32)), "y": jnp.ones((8, 5))}
    return sk.describe(
        lambda: Head(nnx.Rngs(0)),
        loss=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
        batch=batch,
    )


def test_megatron_says_which_dim_does_not_divide_and_fixes_that_weight():
    info = _head_only()
    mesh = sk.abstract_mesh(data=2, model=4)
    with pytest.warns(UserWarning) as rec:
        sk.plan(info, mesh, "megatron", estimator="analytic")
    text = str(rec[0].message)
    assert "head/kernel (32, 5)" in text
    assert "dim 1 ('mlp', size 5) goes on model=4 but 5 does not divide by 4" in text
    assert "names={'head/kernel': ('mlp', None)}" in text and "*/attn/*" not in text
    # the fix it names works: dim 0 on the model axis, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = sk.plan(info, mesh, "megatron", estimator="analytic", names={"head/kernel": ("mlp",)})
    assert p.params["head/kernel"] == P("model")


class _UnnamedMoE(nnx.Module):
    """A plain-jnp top-2 MoE with no logical names: tokens sorted by expert, one
    grouped GEMM (``lax.ragged_dot``) per projection."""

    def __init__(self, rngs, vocab=32, d=16, f=32, experts=4):
        def param(*shape):
            return nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), shape))

        self.table, self.router = param(vocab, d), param(d, experts)
        self.up, self.down = param(experts, d, f), param(experts, f, d)
        self.unembed, self.experts = param(d, vocab), experts

    def __call__(self, tokens):
        x = jnp.take(self.table[...], tokens.reshape(-1), axis=0)
        weights, chosen = jax.lax.top_k(jax.nn.softmax(x @ self.router[...]), 2)
        order = jnp.argsort(chosen.reshape(-1))
        sizes = jnp.bincount(chosen.reshape(-1), length=self.experts).astype(jnp.int32)
        h = jax.nn.gelu(jax.lax.ragged_dot(x[order // 2], self.up[...], sizes))
        y = jax.lax.ragged_dot(h, self.down[...], sizes)[jnp.argsort(order)]
        return (x + jnp.sum(y.reshape(-1, 2, x.shape[-1]) * weights[..., None], 1)) @ self.unembed[
            ...
        ]


def test_grouped_gemm_weights_are_named_expert_and_ep_shards_them():
    def loss(model, batch):
        return jnp.mean(model(batch["tokens"]) ** 2)

    batch = {"tokens": jnp.zeros((8, 8), jnp.int32)}
    info = describe(lambda: _UnnamedMoE(nnx.Rngs(0)), loss=loss, batch=batch)
    names = {path: role.names for path, role in infer_names(info).items()}
    assert names["up"] == ("expert", "embed", "mlp")
    assert names["down"] == ("expert", "mlp", "embed")  # its input came from up's features
    assert names["table"] == ("vocab", "embed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = sk.plan(info, MESH, "ep", estimator="analytic")
    assert p.params["up"] == P("model") and p.params["down"] == P("model")
    assert p.names_from["up"] == "inferred"

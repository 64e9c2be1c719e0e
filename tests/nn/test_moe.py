"""spmdkit.nn.MoE: routing, losses and the aux-loss-free bias around the moe_experts
op; a tiny decoder with it trains a step under the ``ep`` and ``fsdp`` presets with the
loss and grads of one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import spmdkit as sk
from spmdkit.errors import ShardingConflictError
from spmdkit.introspect import describe
from spmdkit.rules.moe import moe_experts_reference

V, D, S, B = 32, 16, 8, 8


class TinyMoEDecoder(nnx.Module):
    def __init__(self, rngs, **kw):
        init = jax.nn.initializers.normal(0.5)
        self.embed = nnx.Param(init(rngs.params(), (V, D)), out_sharding=("vocab", "embed"))
        self.moe = sk.nn.MoE(D, n_experts=8, top_k=2, d_ff_expert=16, rngs=rngs, **kw)
        self.head = nnx.Param(init(rngs.params(), (D, V)), out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x = self.embed[...][tokens]
        y, aux = self.moe(x)
        return (x + y) @ self.head[...], aux


@pytest.fixture(autouse=True)
def _lazy_sharding():
    """Parameters built without a mesh carry their names only (the planner places them)."""
    with nnx.use_eager_sharding(False):
        yield


def decoder_loss(model, batch):
    logits, aux = model(batch["tokens"])
    return sk.nn.cross_entropy(logits, batch["targets"]) + aux


def _batch():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, V, (B, S + 1)).astype(np.int32)
    return {"tokens": toks[:, :-1], "targets": toks[:, 1:]}


KW = dict(n_shared_experts=1, z_loss_weight=1e-3, load_balance="sequence", score="sigmoid")


def test_the_layer_is_the_reference_experts_plus_shared_and_losses():
    moe = sk.nn.MoE(D, n_experts=8, top_k=2, d_ff_expert=16, rngs=nnx.Rngs(0), **KW)
    x = jax.random.normal(jax.random.key(1), (2, S, D))
    y, aux = moe(x)
    t = x.reshape(-1, D)
    logits = t @ moe.router[...]
    scores = jax.nn.sigmoid(logits)
    w, idx = jax.lax.top_k(scores, 2)
    w = w / w.sum(-1, keepdims=True)
    want = moe_experts_reference(t, idx, w, moe.w_gate[...], moe.w_up[...], moe.w_down[...])
    gate, up = t @ moe.shared_gate[...], t @ moe.shared_up[...]
    want = want + (jax.nn.silu(gate) * up) @ moe.shared_down[...]
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-5, atol=1e-6)
    chosen = jax.nn.one_hot(idx, 8).sum(1).reshape(2, S, 8)
    probs = (scores / scores.sum(-1, keepdims=True)).reshape(2, S, 8)
    lb = 8 * jnp.mean(jnp.sum(chosen.mean(1) / 2 * probs.mean(1), -1))
    z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    np.testing.assert_allclose(float(aux), float(0.01 * lb + 1e-3 * z), rtol=1e-5)


def _group_limited_numpy(scores, bias, groups, group_top_k, k):
    """DeepSeek-V3's group-limited choice, token by token in numpy: each group's
    score is the sum of its two best biased scores; top-k among the kept groups."""
    t, e = scores.shape
    per = e // groups
    out = np.zeros((t, k), np.int64)
    for i in range(t):
        pick = scores[i] + bias
        group_score = [np.sort(pick[g * per : (g + 1) * per])[-2:].sum() for g in range(groups)]
        kept = np.argsort(group_score)[::-1][:group_top_k]
        allowed = np.concatenate([np.arange(g * per, (g + 1) * per) for g in kept])
        out[i] = allowed[np.argsort(pick[allowed])[::-1][:k]]
    return out


def test_group_limited_routing_picks_from_the_best_groups_as_numpy_does():
    kw = dict(n_experts=16, top_k=4, d_ff_expert=16, score="sigmoid", rngs=nnx.Rngs(0))
    moe = sk.nn.MoE(D, groups=4, group_top_k=2, aux_loss_free_bias=True, **kw)
    moe.update_bias = False
    bias = np.asarray(jax.random.normal(jax.random.key(2), (16,))) * 0.3
    moe.expert_bias[...] = jnp.asarray(bias, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, S, D))
    y, _ = moe(x)
    t = np.asarray(x.reshape(-1, D), np.float64)
    scores = 1 / (1 + np.exp(-(t @ np.asarray(moe.router[...], np.float64))))
    idx = _group_limited_numpy(scores, bias, 4, 2, 4)
    assert max(len(set(row // 4)) for row in idx) <= 2  # at most group_top_k groups a token
    w = np.take_along_axis(scores, idx, -1)
    w = w / w.sum(-1, keepdims=True)
    want = moe_experts_reference(
        jnp.asarray(t, jnp.float32),
        jnp.asarray(idx, jnp.int32),
        jnp.asarray(w, jnp.float32),
        moe.w_gate[...],
        moe.w_up[...],
        moe.w_down[...],
    )
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-5, atol=1e-6)
    plain = sk.nn.MoE(D, aux_loss_free_bias=True, **kw)  # same weights (same seed)
    plain.update_bias = False
    plain.expert_bias[...] = jnp.asarray(bias, jnp.float32)
    free = np.asarray(jax.lax.top_k(jax.nn.sigmoid(t @ plain.router[...]) + bias, 4)[1])
    assert (np.sort(free, -1) != np.sort(idx, -1)).any()  # the limit changed some choices


@pytest.mark.slow
def test_the_aux_loss_free_bias_is_state_moved_by_the_load():
    moe = sk.nn.MoE(
        D,
        n_experts=8,
        top_k=2,
        d_ff_expert=16,
        rngs=nnx.Rngs(0),
        aux_loss_free_bias=True,
        bias_update_rate=0.1,
    )
    x = jax.random.normal(jax.random.key(1), (2, S, D))
    _, idx = jax.lax.top_k(jax.nn.softmax(x.reshape(-1, D) @ moe.router[...]), 2)
    load = np.asarray(jax.nn.one_hot(idx, 8).sum((0, 1)))
    moe(x)
    np.testing.assert_allclose(
        np.asarray(moe.expert_bias[...]), 0.1 * np.sign(load.mean() - load), rtol=1e-6
    )
    grads = nnx.grad(lambda m: m(x)[0].sum())(moe)
    assert "expert_bias" not in nnx.to_pure_dict(grads)  # not a parameter
    info = describe(
        lambda: TinyMoEDecoder(nnx.Rngs(0), aux_loss_free_bias=True),
        loss=decoder_loss,
        batch=_batch(),
    )
    assert [s.path for s in info.state] == ["moe/expert_bias"]
    params, batch = info.init_fn(), _batch()
    _, new_state = info.state_loss_fn(params, batch, info.init_state_fn())
    assert np.any(np.asarray(jax.tree.leaves(new_state)[0]) != 0)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ep", "fsdp"])
def test_a_decoder_step_under_a_preset_equals_one_device(preset):
    info = describe(lambda: TinyMoEDecoder(nnx.Rngs(0), **KW), loss=decoder_loss, batch=_batch())
    params, batch = info.init_fn(), _batch()
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(info.loss_fn))(params, batch)
    plan = sk.plan(info, sk.make_mesh(data=8), preset, estimator="analytic")
    step = sk.jit(jax.value_and_grad(info.loss_fn), plan)
    loss, grads = step(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
    # the compiled collectives as predicted (the peak memory is not checked here: the
    # region's exchange buffers are under-counted under fsdp)
    rows = plan.verify(step, params, batch).rows
    assert rows and all(ok for kind, _, _, ok in rows if kind != "peak memory"), rows
    a2a = [c for c in sk.report(step, params, batch).collectives if c.kind == "all_to_all"]
    if preset == "ep":  # experts over the mesh: the tokens exchanged, there and back
        assert plan.params["moe/w_gate"][0] == "data"
        assert len(a2a) >= 5  # forward counts, tokens, results; the backward's two
    else:  # the fsdp preset shards the experts too (they divide the mesh): EP x FSDP
        assert plan.params["moe/w_gate"][0] is not None or not a2a


def test_bad_settings_raise():
    with pytest.raises(ShardingConflictError, match="score"):
        sk.nn.MoE(D, n_experts=8, top_k=2, d_ff_expert=16, score="relu", rngs=nnx.Rngs(0))
    with pytest.raises(ShardingConflictError, match="top_k"):
        sk.nn.MoE(D, n_experts=2, top_k=3, d_ff_expert=16, rngs=nnx.Rngs(0))
    with pytest.raises(ShardingConflictError, match="together"):
        sk.nn.MoE(D, n_experts=8, top_k=2, d_ff_expert=16, groups=4, rngs=nnx.Rngs(0))
    with pytest.raises(ShardingConflictError, match="divides n_experts"):
        sk.nn.MoE(
            D, n_experts=8, top_k=2, d_ff_expert=16, groups=3, group_top_k=1, rngs=nnx.Rngs(0)
        )
    with pytest.raises(ShardingConflictError, match="at least top_k"):
        sk.nn.MoE(
            D, n_experts=8, top_k=4, d_ff_expert=16, groups=4, group_top_k=1, rngs=nnx.Rngs(0)
        )

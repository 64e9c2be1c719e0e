"""spmdkit.ops.moe_experts: forward and grads equal the unsharded reference (a dense
per-token gather of each token's experts) under expert parallelism (all-to-all and
local), expert tensor parallelism, FSDP storage of the experts and tokens-only
sharding; the compiled step runs the all-to-alls the rule states."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import ShardingConflictError
from spmdkit.rules.moe import expert_capacity, moe_experts_reference
from spmdkit.verification.hlo import compiled_collectives, summarize

T, D, K, E, F = 32, 8, 2, 8, 8
RTOL, ATOL = 1e-5, 1e-5
_COT = np.random.default_rng(7).standard_normal((T, D)).astype(np.float32)


def _values(seed=0, t=T, e=E, k=K):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    return (
        rng.standard_normal((t, D)).astype(np.float32),
        idx,
        rng.random((t, k)).astype(np.float32),
        rng.standard_normal((e, D, F)).astype(np.float32) * 0.5,
        rng.standard_normal((e, D, F)).astype(np.float32) * 0.5,
        rng.standard_normal((e, F, D)).astype(np.float32) * 0.5,
    )


def _loss(fn, **kw):
    def loss(x, idx, w, wg, wu, wd):
        y = fn(x, idx, w, wg, wu, wd, **kw)
        return jnp.sum(y * _COT), y

    return jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5), has_aux=True)


def _reference(vals, **kw):
    with jax.default_device(jax.devices()[0]):
        return jax.jit(_loss(moe_experts_reference, **kw))(*vals)


# mesh axes, token spec, gate/up spec, down spec, strategy
LAYOUTS = {
    "ep8": (dict(ep=8), P("ep"), P("ep"), P("ep"), None),
    "ep4_tp2": (dict(ep=4, tp=2), P("ep"), P("ep", None, "tp"), P("ep", "tp"), None),
    "ep4_fsdp2": (dict(fs=2, ep=4), P(("fs", "ep")), P("ep", "fs"), P("ep", None, "fs"), None),
    "tokens_only": (dict(dp=8), P("dp"), P(), P(), None),
    "local_ep4_dp2": (dict(dp=2, ep=4), P("dp"), P("ep"), P("ep"), "local"),
    "ep_joins_tokens": (dict(dp=2, ep=4), P("dp"), P("ep"), P("ep"), "all_to_all"),
}


def _sharded(layout, vals):
    axes, tok, gu, down, strategy = LAYOUTS[layout]
    mesh = sk.make_mesh(**axes)
    specs = (tok, tok, tok, gu, gu, down)
    return (
        mesh,
        [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(vals, specs, strict=True)],
        strategy,
    )


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(k, marks=pytest.mark.slow) if k.startswith(("ep4_tp2", "ep_joins")) else k
        for k in sorted(LAYOUTS)
    ],
)
def test_forward_and_grads_equal_one_device(layout):
    vals = _values()
    (ref_loss, ref_y), ref_g = _reference(vals)
    _, args, strategy = _sharded(layout, vals)
    kw = {} if strategy is None else {"strategy": strategy}
    (loss, y), grads = jax.jit(_loss(sk.ops.moe_experts, **kw))(*args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL)
    for g, r in zip(grads, ref_g, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=RTOL, atol=ATOL)


def test_token_dropping_is_the_same_on_every_layout():
    vals = _values(1)
    (_, ref_y), ref_g = _reference(vals, capacity_factor=0.75)
    (_, dropless), _ = _reference(vals)
    assert not np.allclose(np.asarray(ref_y), np.asarray(dropless))  # something dropped
    _, args, _ = _sharded("ep8", vals)
    (_, y), grads = jax.jit(_loss(sk.ops.moe_experts, capacity_factor=0.75))(*args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=RTOL, atol=ATOL)
    for g, r in zip(grads, ref_g, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=RTOL, atol=ATOL)


def test_capacity_keeps_the_first_assignments_of_each_expert():
    assert expert_capacity(64, 2, 8, 1.25) == 20
    x = np.ones((4, 1), np.float32)
    idx = np.array([[0, 1], [0, 1], [0, 1], [0, 1]], np.int32)
    w = np.ones((4, 2), np.float32)
    ones = np.ones((2, 1, 1), np.float32)
    y = moe_experts_reference(x, idx, w, ones, ones, ones, capacity_factor=1.0)  # C = 4
    full = float(jax.nn.silu(1.0))
    np.testing.assert_allclose(np.asarray(y)[:, 0], [2 * full] * 4, rtol=1e-6)
    y = moe_experts_reference(x, idx, w, ones, ones, ones, capacity_factor=0.5)  # C = 2
    np.testing.assert_allclose(np.asarray(y)[:, 0], [2 * full] * 2 + [0, 0], rtol=1e-6)


def test_the_ep_step_compiles_the_predicted_all_to_alls():
    vals = _values()
    mesh, args, _ = _sharded("ep8", vals)
    step = _loss(sk.ops.moe_experts)
    found = summarize(c for c in compiled_collectives(step, *args) if c.kind == "all_to_all")
    # per device: 4 tokens x min(k, 1 local expert) rows per peer, 8 peers, D floats;
    # forward: counts (8 int32), tokens out, results back; backward: the two transposed
    rows = T // 8 * 1
    tokens = 8 * rows * D * 4
    assert found == {"all_to_all": {"count": 5, "payload_bytes": 4 * tokens + 8 * 4}}
    predicted = sk.infer_forward(
        "moe_experts",
        *(sk.TensorSpec.from_sharding(a.shape, a.sharding, dtype=a.dtype) for a in args),
        mesh=mesh,
    ).collectives
    assert sorted(c.payload_bytes for c in predicted) == [32, tokens, tokens]


def test_token_dropping_gathers_the_counts_it_predicts():
    """Capacity mode ranks a token shard after the shards before it: the per-expert
    counts are all-gathered over the token axes, and the rule predicts that gather."""
    mesh, args, _ = _sharded("ep8", _values(1))
    fwd = lambda *a: sk.ops.moe_experts(*a, capacity_factor=0.75)  # noqa: E731
    found = summarize(c for c in compiled_collectives(fwd, *args) if c.kind == "all_gather")
    counts = 8 * E * 4  # int32 [token shards, E]
    assert found == {"all_gather": {"count": 1, "payload_bytes": counts}}
    predicted = sk.infer_forward(
        "moe_experts",
        *(sk.TensorSpec.from_sharding(a.shape, a.sharding, dtype=a.dtype) for a in args),
        mesh=mesh,
        capacity_factor=0.75,
    ).collectives
    assert [c.payload_bytes for c in predicted if c.kind == "all_gather"] == [counts]


def test_bad_inputs_raise_typed_errors():
    x, idx, w, wg, wu, wd = _values()
    mesh = sk.make_mesh(ep=8)
    with pytest.raises(ShardingConflictError, match="integer expert ids"):
        sk.ops.moe_experts(x, idx.astype(np.float32), w, wg, wu, wd, mesh=mesh)
    with pytest.raises(ShardingConflictError, match="w_down"):
        sk.ops.moe_experts(x, idx, w, wg, wu, wd.transpose(0, 2, 1)[:, :4], mesh=mesh)
    with pytest.raises(ShardingConflictError, match="capacity_factor"):
        sk.ops.moe_experts(x, idx, w, wg, wu, wd, mesh=mesh, capacity_factor=-1.0)
    with pytest.raises(ShardingConflictError, match="strategy"):
        sk.ops.moe_experts(x, idx, w, wg, wu, wd, mesh=mesh, strategy="ragged")

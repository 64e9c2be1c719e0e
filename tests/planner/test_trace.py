"""The planner's trace of the step: the program it plans is the one that runs, key included."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.planner.trace import trace_step, train_step
from spmdkit.step.loss import placeholder_keys


class Dropped(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jnp.tanh(self.l1(x))))


def dropout_loss(model, batch):  # dropout as users write it, with aux
    y = model(batch["x"])
    return jnp.mean((y - batch["y"]) ** 2), {"y0": y[0, 0]}


BATCH = {"x": jnp.ones((16, 8)), "y": jnp.zeros((16, 8))}


def test_the_planner_traces_the_step_key_as_an_input():
    """A model drawing random numbers is planned on the step sk.train_step builds:
    its key an input (not a placeholder constant), its aux kept."""
    info = sk.describe(Dropped(nnx.Rngs(0)), loss=dropout_loss, batch=BATCH)
    assert jax.dtypes.issubdtype(info.trace_args()[-1].dtype, jax.dtypes.prng_key)
    opt = optax.adam(1e-3)
    with placeholder_keys() as seen:
        p = sk.plan(info, sk.abstract_mesh(data=4, model=2), "fsdp", optimizer=opt)
    assert p.cost.estimator == "propagate"
    assert seen == []  # nothing the planner traced drew from a fixed key
    step = train_step(info, opt)
    abstract_opt = jax.eval_shape(opt.init, info.abstract_params)
    jaxpr = jax.make_jaxpr(step)(info.abstract_params, abstract_opt, *info.trace_args()[1:])
    dtypes = [v.aval.dtype for v in jaxpr.jaxpr.invars]
    assert sum(jax.dtypes.issubdtype(d, jax.dtypes.prng_key) for d in dtypes) == 1
    out = jax.eval_shape(step, info.abstract_params, abstract_opt, *info.trace_args()[1:])
    assert set(out[-1][1]) == {"y0"}  # (loss, aux)


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 1024, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(1024, 64, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jnp.tanh(self.l1(x))))


def wide_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


WIDE = {"x": jnp.ones((64, 64)), "y": jnp.zeros((64, 64))}


@pytest.mark.parametrize("strategy", ["dp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_dropout_step_verifies_against_its_plan(strategy):
    """The plan's prediction, propagated through the step with its key, holds for the
    compiled step train runs, and the key is live in it."""
    info = sk.describe(lambda: Wide(nnx.Rngs(0)), loss=wide_loss, batch=WIDE)
    mesh = sk.make_mesh(data=4, model=2)
    opt = optax.adam(1e-3)
    p = sk.plan(info, mesh, strategy, optimizer=opt)
    params = sk.init_sharded(info, p)
    abstract_opt = jax.eval_shape(opt.init, params)
    opt_state = jax.jit(opt.init, out_shardings=p.opt_shardings(abstract_opt))(params)
    step = sk.jit(sk.train_step(info, opt, p), p)
    a = step(params, opt_state, WIDE, jax.random.key(1))[-1]
    b = step(params, opt_state, WIDE, jax.random.key(2))[-1]
    assert a != b  # the key is live in the compiled step
    report = p.verify(step, params, opt_state, WIDE, jax.random.key(3))
    assert report.ok, report
    if strategy == "fsdp":  # the mask's bits made per device (batch split 8 ways)
        text = step.compile(params, opt_state, WIDE, jax.random.key(3)).as_text()
        assert "u32[64,1024]" not in text and "u32[8,1024]" in text
        one = jax.jit(sk.train_step(info, opt, sk.Recipe()))  # the numbers on one device
        host = jax.device_get((params, opt_state))
        np.testing.assert_allclose(a, one(*host, WIDE, jax.random.key(1))[-1], rtol=1e-6)


# -- mixture of experts: the step's top-k ---------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_the_trace_reads_top_k_from_the_router_and_prices_experts_by_it(top_k):
    from models.moe import MoEConfig
    from spmdkit.models import get_model
    from spmdkit.planner.analytic import param_flops, param_groups

    info = describe(get_model("moe"), config=MoEConfig(top_k=top_k))
    trace = trace_step(info, None)
    assert trace.expert_top_k == {4: top_k}  # lax.top_k over the 4 experts' router scores
    groups = {g.key.rsplit("/", 1)[-1]: g for g in param_groups(info, trace)}
    up = groups["w_up"]
    assert up.logical[0] == "expert"
    # 6 FLOPs per weight per token it sees: top_k of the 4 experts see each token
    assert param_flops(up, trace) == 6.0 * trace.tokens * math.prod(up.shape) * top_k / 4


def _param(rngs, names, shape):
    init = nnx.with_partitioning(nnx.initializers.normal(0.1), names)
    return nnx.Param(init(rngs.params(), shape))


class SortedMoE(nnx.Module):
    """A dropless MoE that routes with no ``top_k``: each token's 3 best experts from a
    sort of its scores, the rows sorted by expert into one grouped GEMM."""

    def __init__(self, rngs, d=8, f=16, experts=4):
        self.router = _param(rngs, ("embed", None), (d, experts))
        self.up = _param(rngs, ("expert", "embed", "mlp"), (experts, d, f))
        self.down = _param(rngs, ("expert", "mlp", "embed"), (experts, f, d))
        self.experts = experts

    def __call__(self, x):
        chosen = jnp.argsort(-(x @ self.router[...]), axis=-1)[:, :3].reshape(-1)
        order = jnp.argsort(chosen)
        sizes = jnp.bincount(chosen, length=self.experts).astype(jnp.int32)
        h = jax.nn.relu(jax.lax.ragged_dot(x[order // 3], self.up[...], sizes))
        y = jax.lax.ragged_dot(h, self.down[...], sizes)[jnp.argsort(order)]
        return x + y.reshape(x.shape[0], 3, -1).sum(1)


def test_with_no_router_top_k_the_grouped_gemms_rows_per_token_are_the_top_k():
    from spmdkit.planner.analytic import param_groups
    from spmdkit.planner.group_gemms import routed_share

    def loss(model, batch):
        return jnp.mean(model(batch["x"]) ** 2)

    batch = {"x": jnp.ones((16, 8))}
    info = describe(lambda: SortedMoE(nnx.Rngs(0)), loss=loss, batch=batch)
    trace = trace_step(info, None)
    assert trace.expert_top_k == {4: 3.0}  # 48 rows into the experts for 16 tokens
    up = next(g for g in param_groups(info, trace) if g.key == "up")
    assert routed_share(up, trace) == 3 / 4
    # each grouped GEMM multiplies its 48 rows by one expert's 8 x 16 weights: up's
    # value and weight grad, down's value and both grads (the batch needs no grad);
    # the router's forward (its sort has no gradient)
    assert trace.flops == 5 * (2.0 * 48 * 8 * 16) + 2.0 * 16 * 8 * 4


class TwiceHead(nnx.Module):
    """A head read by two weight matmuls (a shared output projection, as DeepSeek's
    multi-token-prediction module reuses it), and one read once."""

    def __init__(self, rngs):
        self.body = nnx.Param(jax.random.normal(rngs.params(), (8, 8)) * 0.3)
        self.head = nnx.Param(jax.random.normal(rngs.params(), (8, 16)) * 0.3)

    def __call__(self, x):
        h = x @ self.body[...]
        return h @ self.head[...], jnp.tanh(h) @ self.head[...].astype(jnp.bfloat16)


def twice_loss(model, batch):
    a, b = model(batch["x"])
    return jnp.mean(a**2) + jnp.mean(b.astype(jnp.float32) ** 2)


def test_a_weight_two_matmuls_read_computes_twice():
    """The trace counts the weight matmuls outside the layer scans that read each
    param (through casts): the head two, the body one (not listed); the analytic
    FLOPs of the head's group double."""
    from spmdkit.planner.analytic import param_flops, param_groups

    with nnx.use_eager_sharding(False):
        info = describe(lambda: TwiceHead(nnx.Rngs(0)), loss=twice_loss, batch=BATCH)
    trace = trace_step(info, None)
    assert trace.param_uses == {"head": 2}
    groups = {g.key: g for g in param_groups(info, trace)}
    assert (groups["head"].uses, groups["body"].uses) == (2, 1)
    assert param_flops(groups["head"], trace) == 6 * 16 * 8 * 16 * 2


class Lookup(nnx.Module):
    """A table read by index (as ``nnx.Embed`` and spmdkit's ``Embed`` do) and by
    a plain ``jnp.take``, and a tied table also read by a matmul."""

    def __init__(self, rngs):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (32, 8)) * 0.3)
        self.taken = nnx.Param(jax.random.normal(rngs.params(), (32, 8)) * 0.3)
        self.tied = nnx.Embed(32, 8, rngs=rngs)
        self.body = nnx.Param(jax.random.normal(rngs.params(), (8, 8)) * 0.3)

    def __call__(self, ids):
        h = self.table[...][ids] + jnp.take(self.taken[...], ids, axis=0) + self.tied(ids)
        return self.tied.attend(jnp.tanh(h @ self.body[...]))


def lookup_loss(model, batch):
    return jnp.mean(model(batch["ids"]) ** 2)


def test_a_table_only_gathered_from_adds_no_matmul_flops():
    """An embedding table's lookup reads rows, no weight matmul: the trace lists
    the tables only gathered from with 0 uses, so the analytic model prices no
    FLOPs for them (it priced 6 a weight and token, the LM head's, and scaled every
    other group's down to match the traced total); a tied table, also read by a
    matmul, keeps its one use."""
    from spmdkit.planner.analytic import param_flops, param_groups

    batch = {"ids": np.arange(32, dtype=np.int32).reshape(4, 8) % 32}
    with nnx.use_eager_sharding(False):
        info = describe(lambda: Lookup(nnx.Rngs(0)), loss=lookup_loss, batch=batch)
    trace = trace_step(info, None)
    assert trace.param_uses == {"table": 0, "taken": 0}
    groups = {g.key: g for g in param_groups(info, trace)}
    assert param_flops(groups["table"], trace) == param_flops(groups["taken"], trace) == 0
    assert groups["tied/embedding"].uses == 1 and param_flops(groups["body"], trace) > 0

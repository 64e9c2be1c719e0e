"""ragged_dot_general (grouped GEMM): each dim sharded, checked against the unsharded op
and XLA's own partitioning; a plain-jnp MoE layer planned and run by sk.jit."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.compile import init_sharded, jit
from spmdkit.introspect import describe
from spmdkit.planner import plan
from spmdkit.rules.ragged import (
    FORWARD,
    LHS_COTANGENT,
    RHS_COTANGENT,
    RaggedDotRule,
    group_sizes_values,
    ragged_dot_notation,
)
from spmdkit.spec import TensorSpec
from spmdkit.testing import check_jit, check_rule
from spmdkit.verification.hlo import parse_collectives

OP = "ragged_dot_general"
F, INT = "float32", "int32"


def T(shape, *dims, partial=None, dtype=F):
    return TensorSpec(shape, P(*dims), partial=partial or {}, dtype=dtype)


def _forward(mesh, *specs, dn=FORWARD):
    return sk.infer_forward(OP, *specs, mesh=mesh, ragged_dot_dimension_numbers=dn)


def test_notation_of_the_three_forms_a_train_step_holds():
    shapes = ((8, 4), (3, 4, 6), (3,))
    assert str(ragged_dot_notation(shapes, ragged_dot_dimension_numbers=FORWARD)) == (
        "m0 k0, G k0 n0, G -> m0 n0  [reduce k0,G: sum]"
    )
    d_lhs = ragged_dot_notation(
        ((8, 6), (3, 4, 6), (3,)), ragged_dot_dimension_numbers=LHS_COTANGENT
    )
    assert str(d_lhs) == "m0 k0, G n0 k0, G -> m0 n0  [reduce k0,G: sum]"
    d_rhs = ragged_dot_notation(((8, 4), (8, 6), (3,)), ragged_dot_dimension_numbers=RHS_COTANGENT)
    assert str(d_rhs) == "k0 m0, k0 n0, G -> G m0 n0  [reduce k0: sum]"


@pytest.fixture(scope="module")
def amesh():
    return sk.abstract_mesh(data=2, model=4)


def test_each_dim_sharded_gives_the_layout_the_algebra_says(amesh):
    gs = T((4,), dtype=INT)
    rhs = (4, 8, 16)
    # expert parallel: the rows of the local experts, sum-partial over the expert axis
    res = _forward(amesh, T((16, 8)), T(rhs, "model"), gs)
    assert res.inputs[1].dims == (("model",), (), ())
    assert res.outputs[0] == T((16, 16), partial={"model": "sum"})
    # the ragged (token) dim: rows stay where they are, no communication
    res = _forward(amesh, T((16, 8), "data"), T(rhs), gs)
    assert res.outputs[0] == T((16, 16), "data")
    # the contracted dim on both operands: sum-partial
    res = _forward(amesh, T((16, 8), None, "model"), T(rhs, None, "model"), gs)
    assert res.outputs[0] == T((16, 16), partial={"model": "sum"})
    # expert tensor parallel: the output dim
    res = _forward(amesh, T((16, 8), "data"), T(rhs, "model", None, None), gs)
    assert res.outputs[0].partial == (("model", "sum"),)
    res = _forward(amesh, T((16, 8), "data"), T(rhs, None, None, "model"), gs)
    assert res.outputs[0] == T((16, 16), "data", "model")


def test_group_sizes_never_decide_and_stay_whole_along_the_groups(amesh):
    res = _forward(amesh, T((16, 8)), T((4, 8, 16)), T((4,), "model", dtype=INT))
    assert res.inputs[2].dims == ((),)
    assert res.outputs[0] == T((16, 16))


def test_the_rhs_cotangent_is_expert_sharded_when_its_output_is(amesh):
    args = (T((16, 8)), T((16, 16)), T((4,), dtype=INT))
    rule = sk.get_rule(OP)
    attrs = {"ragged_dot_dimension_numbers": RHS_COTANGENT}
    ctx = sk.RuleContext(OP, {"data": 2, "model": 4}, attrs)
    res = rule.backward(ctx, args, (T((4, 8, 16), "model"),))
    assert [s.dims for s in res.inputs] == [((), ()), ((), ()), ((),)]
    assert res.outputs[0] == T((4, 8, 16), "model")
    # the token dim sharded on both: each device sums its own rows per group
    res = _forward(amesh, T((16, 8), "data"), T((16, 16), "data"), args[2], dn=RHS_COTANGENT)
    assert res.outputs[0] == T((4, 8, 16), partial={"data": "sum"})


def test_the_grad_of_expert_parallel_is_partial_for_tokens_sharded_for_experts(amesh):
    rule = sk.get_rule(OP)
    ctx = sk.RuleContext(OP, {"data": 2, "model": 4}, {"ragged_dot_dimension_numbers": FORWARD})
    res = rule.grad(
        ctx,
        (T((16, 8), "data"), T((4, 8, 16), "model"), T((4,), dtype=INT)),
        (T((16, 16), "data"),),
    )
    d_lhs, d_rhs, _ = res.input_grads
    assert d_lhs == T((16, 8), "data", partial={"model": "sum"})
    assert d_rhs == T((4, 8, 16), "model", partial={"data": "sum"})
    with pytest.raises(sk.ShardingConflictError, match="no transpose"):
        ctx2 = sk.RuleContext(OP, ctx.axis_sizes, {"ragged_dot_dimension_numbers": RHS_COTANGENT})
        rule.grad(ctx2, (T((16, 8)), T((16, 16)), T((4,), dtype=INT)), (T((4, 8, 16)),))


def test_the_ragged_batch_mode_and_group_offset_have_no_rule(amesh):
    batch_mode = lax.RaggedDotDimensionNumbers((((2,), (1,)), ((0,), (0,))), (0,), ())
    with pytest.raises(sk.ShardingConflictError, match="ragged-batch"):
        _forward(amesh, T((4, 8, 8)), T((4, 8, 6)), T((4,), dtype=INT), dn=batch_mode)
    with pytest.raises(sk.ShardingConflictError, match="group_offset"):
        sk.infer_forward(
            OP,
            T((16, 8)),
            T((4, 8, 16)),
            T((4,), dtype=INT),
            mesh=amesh,
            ragged_dot_dimension_numbers=FORWARD,
            group_offset=jnp.zeros((1,), jnp.int32),
        )


def test_group_sizes_values_are_valid_with_empty_groups_and_spare_rows():
    rng = np.random.default_rng(0)
    for _ in range(20):
        _, _, gs = group_sizes_values(((8, 4), (5, 4, 6), (2, 5)), rows=8)(rng)
        assert gs.shape == (2, 5) and gs.dtype == np.int32
        assert (gs >= 0).all() and (gs.sum(-1) == 6).all()


@pytest.fixture(scope="module")
def mesh1d():
    return sk.make_mesh(x=4)


def test_a_mistaken_local_computation_is_caught_by_the_sweep(mesh1d):
    """The sweep is not blind: the op run on each device's pieces as they are (its
    groups counted from row 0 and group 0) is wrong on sharded tokens or experts."""

    class Unshifted(RaggedDotRule):
        def local_fn(self, lctx):
            return sk.FactorRule.local_fn(self, lctx)

    rule = Unshifted(sk.get_rule(OP).examples[:1])
    rule.name = "ragged_unshifted"
    report = check_rule(rule, mesh=mesh1d, max_cases=8, grads=False, missing=False)
    assert report.wrong


class _AsXlaPartitions(RaggedDotRule):
    """The rule's layouts, compiled as the plain primitive (XLA partitions it)."""

    @property
    def has_custom_local_fn(self):
        return False


@pytest.mark.slow
def test_xla_partitions_the_primitive_as_predicted_but_for_a_group_sizes_gather(mesh1d):
    """XLA's own partitioning of the primitive (its CPU lowering: each group's rows
    masked, one dense contraction over the groups) on the rule's layouts. Tokens, the
    contracted dim or the output dim sharded move what the rule predicts (nothing, or
    the partial's all-reduce). Experts sharded add one all-gather of the group ends
    (g int32s): the lowering's cumsum of group_sizes, split with the groups."""
    rule = _AsXlaPartitions(sk.get_rule(OP).examples[:2])
    rule.name = "ragged_as_xla"
    report = check_jit(rule, mesh=mesh1d, max_cases=None)
    assert report.cases > 20
    for m in report.mismatches:
        assert "f32[4@x,4,8], i32[4])" in m, m  # the experts sharded
        assert m.endswith("HLO all_gather 4×: 16 B is not in the plan"), m


# -- a user's plain-jnp MoE layer -------------------------------------------------------


def _param(rngs, names, shape):
    init = nnx.with_partitioning(nnx.initializers.normal(0.1), names)
    return nnx.Param(init(rngs.params(), shape))


class RaggedMoE(nnx.Module):
    """Top-2 dropless MoE as MaxText's sparse path writes it: tokens sorted by expert,
    one grouped GEMM per projection, unsorted and combined by the router weights."""

    def __init__(self, vocab=32, d=16, f=32, experts=4, *, rngs):
        self.table = _param(rngs, ("vocab", "embed"), (vocab, d))
        self.router = _param(rngs, ("embed", None), (d, experts))
        self.up = _param(rngs, ("expert", "embed", "mlp"), (experts, d, f))
        self.down = _param(rngs, ("expert", "mlp", "embed"), (experts, f, d))
        self.unembed = _param(rngs, ("embed", "vocab"), (d, vocab))
        self.experts = experts

    def __call__(self, tokens):
        x = jnp.take(self.table[...], tokens, axis=0)
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        weights, chosen = lax.top_k(jax.nn.softmax(flat @ self.router[...]), 2)
        expert = chosen.reshape(-1)
        order = jnp.argsort(expert)
        rows = flat[order // 2]
        sizes = jnp.bincount(expert, length=self.experts).astype(jnp.int32)
        h = jax.nn.gelu(lax.ragged_dot(rows, self.up[...], sizes))
        y = lax.ragged_dot(h, self.down[...], sizes)
        y = y[jnp.argsort(order)].reshape(b * s, 2, d)
        moe = jnp.sum(y * weights[..., None], axis=1)
        return (x + moe.reshape(b, s, d)) @ self.unembed[...]


def _loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _batch():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "tokens": jax.random.randint(k1, (8, 8), 0, 32),
        "targets": jax.random.randint(k2, (8, 8), 0, 32),
    }


@pytest.fixture(scope="module")
def moe_info():
    return describe(lambda: RaggedMoE(rngs=nnx.Rngs(0)), loss=_loss, batch=_batch())


@pytest.fixture(scope="module")
def moe_reference(moe_info):
    with nnx.use_eager_sharding(False):
        params = moe_info.init_fn()
    return jax.jit(jax.value_and_grad(moe_info.loss_fn))(params, _batch())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("fsdp", marks=pytest.mark.slow),
        pytest.param("ep", marks=pytest.mark.slow),  # the README command's budget
        pytest.param("auto", marks=pytest.mark.slow),
    ],
)
def test_a_plain_jnp_moe_plans_with_the_rule_and_matches_one_device(
    moe_info, moe_reference, strategy
):
    mesh = sk.make_mesh(data=2, model=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p = plan(
            moe_info,
            mesh,
            strategy,
            estimator="propagate" if strategy == "auto" else "analytic",
            recipe=sk.Recipe() if strategy == "auto" else None,
        )
    assert not [w for w in seen if "ragged_dot_general" in str(w.message)]
    if strategy == "ep":
        assert p.params["up"] == P("model") and p.params["down"] == P("model")
    params = init_sharded(moe_info, p)
    step = jit(jax.value_and_grad(moe_info.loss_fn), p)
    _, prop = step.program(params, _batch())
    assert "ragged_dot_general" not in prop.unknown
    ragged = [r for r in prop.records if r.primitive == "ragged_dot_general"]
    assert len(ragged) == 6  # two projections, each with its two cotangents
    if strategy == "ep":  # the experts' weight grads are computed expert-sharded
        assert all(r.outputs[0].dims[0] == ("model",) for r in ragged if r.outputs[0].ndim == 3)
    loss, grads = step(params, _batch())
    if strategy == "ep":
        _the_compiled_collectives_are_the_predicted_ones(p, step, params)
    ref_loss, ref_grads = moe_reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def _the_compiled_collectives_are_the_predicted_ones(p, step, params):
    """The experts' sum-partial rows are all-reduced over the expert axis where the
    plan says, to the byte, and nothing else is compiled: the replay runs each
    grouped GEMM partial over the experts' axis with the rule's local computation
    (the group sizes shifted on each device, no collective), where XLA's
    partitioned lowering all-gathered the group ends (4 int32s over the 4 expert
    shards, 8 of them in this step, on CPU under jax 0.10)."""
    report = p.verify(step, params, _batch())
    assert report.ok, str(report)
    rows = {what: (pred, got) for what, pred, got, _ in report.rows}
    assert rows["all_reduce"][0] == rows["all_reduce"][1]
    compiled = parse_collectives(step.compile(params, _batch()).as_text())
    # integer collectives only where the plan moves the router's expert ids (top_k
    # runs on each device's rows, and its ids are resharded for the grouped GEMMs),
    # never XLA's own gathers of the group ends
    stray = [
        c
        for c in compiled
        if "s32" in tuple(c.dtypes)
        and not any("spmdkit/resharding/execute.py" in f for f in c.frames)
    ]
    assert not stray
    assert rows.get("all_gather", (0, 0))[0] == rows.get("all_gather", (0, 0))[1]

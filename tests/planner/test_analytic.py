"""The analytic cost model, per parameter group: what each layout moves and keeps."""

import pytest

from spmdkit.flax import describe
from spmdkit.planner.analytic import CostContext, GroupLayout, group_cost, param_groups, total_cost
from spmdkit.planner.search import trace_step
from spmdkit.spec import axis_sizes
from spmdkit.topology import DEFAULT_TOPOLOGY
from tests.plan_model import toy_batch, toy_init, toy_loss


@pytest.fixture(scope="module")
def model(amesh):
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    trace = trace_step(info, None)
    groups = {g.key: g for g in param_groups(info, trace)}
    ctx = CostContext(amesh, axis_sizes(amesh), DEFAULT_TOPOLOGY, trace, 1e12, 1.0)
    return groups, ctx


def test_layers_share_a_group(model):
    groups, _ = model
    up = groups["mixers/*/up"]
    assert up.paths == ("mixers/0/up", "mixers/1/up") and up.count == 2
    assert up.nbytes == 32 * 64 * 4 and up.opt_bytes == 2 * up.nbytes  # adam: mu, nu


def test_data_parallel_all_reduces_the_grads(model):
    groups, ctx = model
    up = groups["mixers/*/up"]
    c = group_cost(ctx, up, ((), ()), ((), ()), ("data", "model"), ())
    assert dict(c.comm_bytes) == {"all_reduce": 2 * up.nbytes}
    assert c.params == c.grads == 2 * up.nbytes and c.tp_weight == 0


def test_fsdp_gathers_and_scatters_the_same_bytes(model):
    groups, ctx = model
    up = groups["mixers/*/up"]
    c = group_cost(ctx, up, (("data", "model"), ()), (("data", "model"), ()), ("data", "model"), ())
    assert dict(c.comm_bytes) == {"all_gather": 2 * up.nbytes, "reduce_scatter": 2 * up.nbytes}
    assert c.params == 2 * up.nbytes / 8


def test_tensor_parallel_moves_activations_and_splits_compute(model):
    groups, ctx = model
    up = groups["mixers/*/up"]
    dp = group_cost(ctx, up, ((), ()), ((), ()), ("data",), ())
    tp = group_cost(ctx, up, ((), ("model",)), ((), ("model",)), ("data",), ())
    tokens_local = ctx.trace.tokens / 2
    activations = 2 * tokens_local * 32 * 4  # per layer, tokens × embed
    grads = 2 * up.nbytes / 4  # each shard's grad, summed over the data axis
    assert dict(tp.comm_bytes) == {"all_reduce": activations + grads}
    assert tp.compute_s == pytest.approx(dp.compute_s / 4) and tp.tp_weight > 0


def test_zero1_gathers_the_updated_params(model):
    groups, ctx = model
    up = groups["mixers/*/up"]
    plain = group_cost(ctx, up, ((), ()), ((), ()), ("data", "model"), ())
    zero1 = group_cost(ctx, up, ((), ()), ((), ("data", "model")), ("data", "model"), ())
    assert dict(zero1.comm_bytes)["all_gather"] == 2 * up.nbytes  # the updated params
    assert zero1.opt == plain.opt / 8


def test_total_adds_the_groups(model):
    groups, ctx = model
    gs = list(groups.values())
    layout = [GroupLayout(((),) * len(g.shape), ((),) * len(g.shape)) for g in gs]
    cost = total_cost(ctx, gs, layout, ("data", "model"), ())
    assert cost.memory["params"] == sum(g.nbytes * g.count for g in gs)
    assert set(cost.comm_bytes) == {"all_reduce"} and cost.estimator == "analytic"
    assert cost.step_time_s == pytest.approx(cost.compute_time_s + cost.comm_time_s)

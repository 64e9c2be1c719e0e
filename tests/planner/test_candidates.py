"""Candidates: the floor auto prunes propagations with is below what propagation gives."""

import dataclasses

import spmdkit as sk
from spmdkit.planner.candidates import step_floor
from spmdkit.planner.search import plan
from spmdkit.topology import DEFAULT_TOPOLOGY
from tests.plan_model import toy_batch, toy_init, toy_loss

#: The toy model's logical names, every one replicated (the batch too).
REPLICATED = [(n, None) for n in ("vocab", "embed", "mlp", "heads", "head_dim", "norm")] + [
    ("batch", None),
    ("seq", None),
]


def test_step_floor_is_below_the_propagated_step():
    """For a preset that splits the batch and a table that replicates everything:
    the floor of the analytic cost (compute, plus one
    collective's latency where the batch is split) is at most the step that
    propagating the same layout gives, and above the compute alone exactly
    where the batch is split."""
    mesh = sk.abstract_mesh(data=4, model=2)
    kw = {"loss": toy_loss, "batch": toy_batch()}
    for strategy in ("dp", REPLICATED):
        analytic = plan(toy_init, mesh, strategy, estimator="analytic", **kw)
        batch = analytic.activation.get("batch", ())
        floor = step_floor(analytic.cost, batch, mesh, DEFAULT_TOPOLOGY)
        assert floor <= plan(toy_init, mesh, strategy, **kw).cost.step_time_s, strategy
        assert (floor > analytic.cost.compute_time_s) == bool(batch), strategy


def test_step_floor_has_no_floor_where_more_than_all_communication_hides():
    """The floor follows the re-costing formula only where it grows with the
    collectives' time (a hidden share of at most 1); otherwise it is 0."""
    mesh = sk.abstract_mesh(data=4, model=2)
    dp = plan(toy_init, mesh, "dp", loss=toy_loss, batch=toy_batch(), estimator="analytic")
    odd = dataclasses.replace(dp.cost, hidden_comm_s=2 * dp.cost.comm_time_s)
    assert step_floor(dp.cost, ("data", "model"), mesh, DEFAULT_TOPOLOGY) > 0
    assert step_floor(odd, ("data", "model"), mesh, DEFAULT_TOPOLOGY) == 0.0

"""Candidates: the floor auto prunes propagations with is below what propagation gives."""

import dataclasses

import spmdkit as sk
from spmdkit.flax import describe
from spmdkit.planner.candidates import step_floor
from spmdkit.planner.search import _planner
from spmdkit.topology import DEFAULT_TOPOLOGY
from tests.plan_model import toy_batch, toy_init, toy_loss


def test_step_floor_is_below_the_propagated_step():
    """For a preset that splits the batch, a tensor-parallel one and a searched
    candidate that splits nothing: the floor (compute, plus one
    collective's latency where the batch is split) is at most the step that
    propagating the candidate gives, and above its compute alone where the
    batch is split."""
    mesh = sk.abstract_mesh(data=4, model=2)
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    planner = _planner(info, mesh, None, DEFAULT_TOPOLOGY, None, None, "propagate")
    cands = [planner.preset("dp", None), planner.preset("megatron", None)]
    cands += [c for c in planner.searched() if not c.activation["batch"]][:1]
    assert len(cands) == 3
    for c in cands:
        floor = step_floor(c, mesh, DEFAULT_TOPOLOGY)
        assert floor <= planner.propagated(c).cost.step_time_s, c.label
        split = bool(c.activation.get("batch"))
        assert (floor > c.cost.compute_time_s) == split, c.label


def test_step_floor_has_no_floor_where_more_than_all_communication_hides():
    """The floor follows the re-costing formula only where it grows with the
    collectives' time (a hidden share of at most 1); otherwise it is 0."""
    mesh = sk.abstract_mesh(data=4, model=2)
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    planner = _planner(info, mesh, None, DEFAULT_TOPOLOGY, None, None, "analytic")
    c = planner.preset("dp", None)
    odd = c._replace(cost=dataclasses.replace(c.cost, hidden_comm_s=2 * c.cost.comm_time_s))
    assert step_floor(c, mesh, DEFAULT_TOPOLOGY) > 0
    assert step_floor(odd, mesh, DEFAULT_TOPOLOGY) == 0.0

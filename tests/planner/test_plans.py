"""Plans and costs as plain data: JSON, printing, shardings of params, state and batch."""

import dataclasses

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

from spmdkit.introspect import describe
from spmdkit.planner.logical import PlanError
from spmdkit.planner.plans import Cost, Plan, dims_spec, spec_dims
from tests.plan_model import toy_batch, toy_init, toy_loss


def test_json_round_trip(plans):
    for p in plans.values():
        back = Plan.from_json(p.to_json())
        assert back == p and back.params == p.params and back.cost == p.cost


def test_print_is_a_table(plans):
    text = str(plans["auto"])
    assert "bytes/dev" in text and "runner-up plans" in text and "memory/device" in text
    assert "mixers/*/up" in text


def test_cost_prints_with_the_shared_units():
    """spmdkit.util's fmt_bytes/fmt_time: binary units up to TiB, zero time in µs."""
    cost = Cost(1.5e-3, 1.5e-3, 0.0, {"all_reduce": 3 * 2**40}, {"params": 8192})
    assert cost.summary() == (
        "step 1.50 ms (compute 1.50 ms, comm 0.0 µs), comm 3.0 TiB, memory 8.0 KiB"
    )


def test_the_table_says_what_is_hidden_only_when_something_is(plans):
    """``hidden_comm_s`` is ``comm - (step - compute)``: where nothing overlaps (a CPU
    topology) rounding leaves ±1 ulp, which the table must not print as hidden."""
    p = plans["dp"]
    comm, compute = 3.77e-3, 4.6e-3
    nothing = comm - ((compute + comm) - compute)
    assert nothing != 0.0  # the rounding this guards against
    cost = Cost(
        compute + comm, compute, comm, {"all_reduce": 1}, {"params": 8}, hidden_comm_s=nothing
    )
    assert "hidden" not in str(dataclasses.replace(p, cost=cost))
    cost = dataclasses.replace(cost, hidden_comm_s=1e-3)
    assert ", 1.00 ms of it hidden (" in str(dataclasses.replace(p, cost=cost))


def test_dims_and_specs_round_trip():
    dims = (("data", "model"), (), ("model",))
    assert dims_spec(dims) == P(("data", "model"), None, "model")
    assert spec_dims(dims_spec(dims), 3) == dims
    assert dims_spec(((), ())) == P() and spec_dims(P(), 2) == ((), ())


def test_state_and_batch_shardings(plans):
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    p = plans["zero1"]
    opt_state = jax.eval_shape(optax.adam(1e-3).init, info.abstract_params)
    ps, os_ = p.state_shardings(info.abstract_params, opt_state)
    assert jax.tree.structure(ps) == jax.tree.structure(info.abstract_params)
    specs = [s.spec for s in jax.tree.leaves(os_)]
    assert P() in specs and any(s != P() for s in specs)
    bs = p.batch_sharding(info.batch)
    assert bs["tokens"].spec == P(("data", "model"))


def test_batch_not_dividing_raises(plans):
    with pytest.raises(PlanError, match="multiple"):
        plans["dp"].batch_spec("tokens", (6, 16))


def test_the_table_shows_params_as_the_recipe_stores_them():
    """Under master_weights='optimizer' a float32 parameter is held in bf16: its
    bytes per device halve in the table."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    import spmdkit as sk

    mesh = AbstractMesh((2,), ("data",))
    info = {"w": ((8, 16), "float32", ("embed", "mlp"))}
    rows = []
    for master in ("params", "optimizer"):
        recipe = sk.Recipe(compute_dtype="bfloat16", master_weights=master)
        plan = sk.Plan(mesh, {"w": P()}, {"w": P("data")}, {}, info=info, recipe=recipe)
        rows.append(
            next(line for line in plan.table().splitlines() if line.strip().startswith("w "))
        )
    assert rows[0].rstrip().endswith("512 B") and rows[1].rstrip().endswith("256 B")

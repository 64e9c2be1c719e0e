"""sk.diff: spec changes per tensor, and deltas per group and kind that add up to the totals."""

import dataclasses
import math

import pytest

import spmdkit as sk
from models import get_model
from spmdkit.introspect.model import describe
from spmdkit.planner import PlanDiff, diff, plan
from spmdkit.planner.logical import PlanError
from spmdkit.planner.plans import Plan
from spmdkit.step.recipe import Recipe


@pytest.fixture(scope="module")
def llama(tiny_infos):
    return tiny_infos["llama"]


@pytest.fixture(scope="module")
def pair(llama, llama_fsdp, amesh):
    return llama_fsdp, plan(llama, amesh, "megatron")


def _check_sums(d: PlanDiff) -> None:
    t = d.total
    assert sum(r.memory.delta for r in d.groups) == t.memory.delta
    assert sum(r.comm_bytes.delta for r in d.groups) == t.comm_bytes.delta
    assert math.isclose(
        sum(r.step_time_s.delta for r in d.groups), t.step_time_s.delta, abs_tol=1e-12
    )
    assert sum(r.comm_bytes.delta for r in d.kinds) == t.comm_bytes.delta
    for side in ("a", "b"):
        assert sum(getattr(r.memory, side) for r in d.groups) == getattr(t.memory, side)


def test_deltas_add_up_and_name_the_groups(pair):
    a, b = pair
    d = diff(a, b)
    _check_sums(d)
    assert d.total.comm_bytes.a == a.cost.total_comm_bytes
    assert d.total.step_time_s.b == b.cost.step_time_s
    rows = {r.name: r for r in d.groups}
    # propagated plans attribute every byte: nothing is left in the rest row
    assert rows["rest"].comm_bytes == sk.planner.compare.Change(0, 0)
    # fsdp gathers the MLP weights, megatron does not
    assert rows["layers/*/mlp/up"].comm_bytes.delta < 0
    kinds = {r.name: r for r in d.kinds}
    assert kinds["all_gather"].comm_bytes.b == 0 < kinds["all_gather"].comm_bytes.a
    up = next(s for s in d.specs if s.path == "layers/*/mlp/up")
    assert up.count == 2 and up.params == ("[(data,model)]", "[_,model]")
    assert d.strategy == ("fsdp", "megatron") and d.mesh is None and d.recipe is None
    text = str(d)
    assert "diff fsdp → megatron" in text and "layers/*/mlp/up" in text


def test_same_plan_changes_nothing_and_json_round_trips(pair):
    a, b = pair
    same = diff(a, Plan.from_json(a.to_json()))
    assert same.specs == () and not any(r.changed for r in same.groups)
    assert diff(Plan.from_json(a.to_json()), b) == diff(a, b)


def test_recipe_change_and_analytic_plans(llama, amesh):
    a = plan(llama, amesh, "fsdp", estimator="analytic")
    b = plan(llama, amesh, "fsdp", estimator="analytic", recipe=Recipe(remat="full"))
    d = diff(a, b)
    _check_sums(d)
    assert d.recipe is not None and d.specs == ()
    assert any("no propagated provenance" in n for n in d.notes)


def test_refuses_plans_of_different_models_and_uncosted_plans(pair):
    a, b = pair
    other = dataclasses.replace(b, params={"w": b.params["embed/embedding"]})
    with pytest.raises(PlanError, match="one model"):
        diff(a, other)
    with pytest.raises(PlanError, match="costed Plan"):
        diff(a, dataclasses.replace(b, cost=None))


@pytest.mark.slow
def test_llama3_8b_fsdp_vs_megatron_on_64_devices_adds_up():
    mesh = sk.abstract_mesh(data=8, model=8)
    info = describe(get_model("llama"), config="8b", batch_size=64)
    a, b = plan(info, mesh, "fsdp"), plan(info, mesh, "megatron")
    d = diff(a, b)
    _check_sums(d)
    assert d.total.memory.delta == b.cost.peak_bytes - a.cost.peak_bytes
    assert d.total.comm_bytes.delta == b.cost.total_comm_bytes - a.cost.total_comm_bytes
    assert math.isclose(
        sum(r.step_time_s.delta for r in d.groups),
        b.cost.step_time_s - a.cost.step_time_s,
        rel_tol=1e-9,
    )
    assert {s.path for s in d.specs} >= {"layers/mlp/up", "embed/embedding"}
    # megatron's row-parallel weights cause its activations' all-reduces
    assert d.kinds and any(r.comm_bytes.b for r in d.groups if r.name == "layers/mlp/down")

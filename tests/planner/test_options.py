"""plan()'s options as values: CostModel and SearchOptions validate when built, and
plan's keywords build the same values (one way or the other, not both)."""

import pytest

import spmdkit as sk
from spmdkit.planner.logical import PlanError
from spmdkit.planner.options import given
from tests.plan_model import toy_batch, toy_init, toy_loss


@pytest.mark.parametrize(
    "kw",
    [{"estimator": "guess"}, {"memory_budget": -1}, {"memory_budget": True}, {"peak_flops": "1"}],
)
def test_a_cost_model_refuses_bad_values(kw):
    with pytest.raises(PlanError, match=next(iter(kw))):
        sk.CostModel(**kw)


def test_search_options_check_themselves_and_hash():
    with pytest.raises(PlanError, match="pipeline is None, 'auto'"):
        sk.SearchOptions(pipeline="sometimes")
    with pytest.raises(PlanError, match="aliases map logical names"):
        sk.SearchOptions(aliases={"q_heads": 3})
    opts = sk.SearchOptions(aliases={"q_heads": "heads"})
    assert opts == sk.SearchOptions(aliases=(("q_heads", "heads"),))
    assert hash(opts) == hash(sk.SearchOptions(aliases=[("q_heads", "heads")]))
    assert opts.alias_map["q_heads"] == "heads" and opts.alias_map["activation_batch"] == "batch"


def test_given_keeps_the_value_or_the_keywords_but_not_both():
    costs = sk.CostModel(estimator="analytic")
    assert given(None, costs) is costs and given(costs, sk.CostModel()) is costs
    with pytest.raises(PlanError, match="memory_budget"):
        given(costs, sk.CostModel(memory_budget=2**30))
    with pytest.raises(PlanError, match="SearchOptions"):
        given(costs, sk.SearchOptions())


def test_plan_takes_the_values_as_its_keywords(amesh):
    kw = {"loss": toy_loss, "batch": toy_batch()}
    by_keywords = sk.plan(toy_init, amesh, "auto", estimator="analytic", memory_budget=2**20, **kw)
    costs = sk.CostModel(estimator="analytic", memory_budget=2**20)
    by_value = sk.plan(toy_init, amesh, "auto", cost_model=costs, **kw)
    assert by_value == by_keywords and by_value.memory_budget == 2**20
    with pytest.raises(PlanError, match="each option given once"):
        sk.plan(
            toy_init, amesh, "dp", cost_model=costs, estimator="analytic", peak_flops=1e12, **kw
        )

"""Plans: logical rules, presets, JSON, printing, auto search (planning only, no compiles)."""

import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.planner import (
    PRESETS,
    LogicalRules,
    Plan,
    PlanError,
    UnknownLogicalAxisError,
    axis_roles,
    plan,
    preset_rules,
)
from tests.plan_model import toy_batch, toy_init, toy_loss


@pytest.fixture(scope="module")
def amesh():
    return sk.abstract_mesh(data=2, model=4)


@pytest.fixture(scope="module")
def plans(amesh):
    batch = toy_batch()
    return {
        s: plan(toy_init, amesh, s, loss=toy_loss, batch=batch, estimator="analytic")
        for s in (*PRESETS, "auto")
    }


def test_rules_first_free_entry_wins(amesh):
    rules = LogicalRules((("embed", "model"), ("mlp", "model"), ("mlp", "data"), ("mlp", None)))
    assert rules.resolve(("embed", "mlp"), (64, 256), amesh) == P("model", "data")
    assert rules.resolve(("mlp", "embed"), (256, 64), amesh) == P("model")


def test_rules_skip_entries_that_do_not_divide(amesh):
    rules = LogicalRules((("vocab", "model"), ("vocab", "data")))
    assert rules.resolve(("vocab",), (6,), amesh) == P("data")


def test_unknown_logical_name_raises_not_replicates(amesh):
    rules = LogicalRules((("embed", "model"),))
    with pytest.raises(UnknownLogicalAxisError, match="hidden"):
        rules.resolve(("embed", "hidden"), (8, 8), amesh, where="w")


def test_rule_naming_missing_mesh_axis_raises(amesh):
    with pytest.raises(PlanError, match="mesh axes"):
        LogicalRules((("embed", "fsdp"),)).resolve(("embed",), (8,), amesh)


def test_axis_roles_by_name_and_position():
    assert axis_roles(sk.abstract_mesh(a=2, b=4))["model"] == ("b",)
    assert axis_roles(sk.abstract_mesh(x=8))["data"] == ("x",)
    roles = axis_roles(sk.abstract_mesh(model=4, data=2))
    assert roles["data"] == ("data",) and roles["model"] == ("model",)


def test_unknown_preset_names_near_match(amesh):
    with pytest.raises(PlanError, match="fsdp"):
        preset_rules("fdsp", amesh)


def test_presets_layouts(plans):
    dp, fsdp, zero1, meg = plans["dp"], plans["fsdp"], plans["zero1"], plans["megatron"]
    assert dp.params["mixers/0/up"] == P() and dp.activation["batch"] == ("data", "model")
    assert fsdp.params["mixers/0/up"] == P(("data", "model"))
    assert zero1.params["mixers/0/up"] == P() and zero1.opt["mixers/0/up"] != P()
    # column- then row-parallel MLP and attention, vocab-parallel embedding
    assert meg.params["mixers/0/up"] == P(None, "model")
    assert meg.params["mixers/0/down"] == P("model")
    assert meg.params["mixers/0/qkv"] == P(None, "model")
    assert meg.params["table"] == P("model")
    assert meg.activation["batch"] == ("data",)
    assert plans["megatron_sp"].activation["seq"] == ("model",)
    assert plans["tp_fsdp"].params["mixers/0/up"] == P("data", "model")


def test_auto_not_worse_than_best_preset(plans):
    best = min(plans[s].cost.step_time_s for s in PRESETS)
    assert plans["auto"].cost.step_time_s <= best
    assert plans["auto"].alternatives


def test_auto_respects_memory_budget(amesh):
    free = plan(toy_init, amesh, "auto", loss=toy_loss, batch=toy_batch(), estimator="analytic")
    tight = plan(
        toy_init,
        amesh,
        "auto",
        loss=toy_loss,
        batch=toy_batch(),
        memory_budget=free.cost.peak_bytes // 3,
        estimator="analytic",
    )
    assert tight.cost.peak_bytes <= free.cost.peak_bytes // 3
    assert tight.cost.step_time_s >= free.cost.step_time_s


def test_auto_without_a_fitting_plan_takes_the_smallest_and_warns(amesh):
    kw = {"loss": toy_loss, "batch": toy_batch(), "estimator": "analytic"}
    with pytest.warns(UserWarning, match="no candidate fits the memory budget"):
        p = plan(toy_init, amesh, "auto", memory_budget=1, **kw)
    others = [c for _, c in p.alternatives]
    assert others and all(p.cost.peak_bytes <= c.peak_bytes for c in others)
    assert p.cost.peak_bytes < max(c.peak_bytes for c in others)  # not merely a tie


def test_auto_is_deterministic(plans, amesh):
    again = plan(toy_init, amesh, "auto", loss=toy_loss, batch=toy_batch(), estimator="analytic")
    assert again == plans["auto"]


def test_json_round_trip(plans):
    for p in plans.values():
        back = Plan.from_json(p.to_json())
        assert back == p and back.params == p.params and back.cost == p.cost


def test_print_is_a_table(plans):
    text = str(plans["auto"])
    assert "bytes/dev" in text and "runner-up plans" in text and "memory/device" in text
    assert "mixers/*/up" in text


def test_state_and_batch_shardings(plans):
    import jax
    import optax

    from spmdkit.flax import describe

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


def test_custom_rules_table(amesh):
    names = ("vocab", "embed", "mlp", "heads", "head_dim", "norm", "batch", "seq")
    table = [(n, None) for n in names] + [("batch", "data")]
    table[2] = ("mlp", "model")
    p = plan(toy_init, amesh, table, loss=toy_loss, batch=toy_batch())
    assert p.params["mixers/1/up"] == P(None, "model") and p.strategy == "rules"


def test_auto_with_propagation_beats_every_preset():
    mesh = sk.abstract_mesh(data=4, model=2)
    p = plan(toy_init, mesh, "auto", loss=toy_loss, batch=toy_batch())
    assert p.cost.estimator == "propagate"
    presets = {n: c for n, c in p.alternatives if n in PRESETS}
    assert p.chosen in PRESETS or len(presets) == len(PRESETS)
    assert all(p.cost.step_time_s <= c.step_time_s for c in presets.values())
    single = plan(toy_init, mesh, "megatron", loss=toy_loss, batch=toy_batch())
    assert single.cost.estimator == "propagate" and single.cost.comm_bytes


def test_unknown_estimator(amesh):
    with pytest.raises(PlanError, match="estimator"):
        plan(toy_init, amesh, "dp", loss=toy_loss, batch=toy_batch(), estimator="guess")


@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "convnet", "gpt_linen"])
def test_reference_models_auto_vs_presets(name):
    from spmdkit.models import get_model

    mesh = sk.abstract_mesh(data=2, model=4)
    p = plan(get_model(name), mesh, "auto", config="tiny", estimator="analytic")
    costs = [c.step_time_s for n, c in p.alternatives if n in PRESETS]
    assert costs and p.cost.step_time_s <= min(costs)


def test_ep_puts_experts_on_the_model_axis():
    from spmdkit.models import get_model

    mesh = sk.abstract_mesh(data=2, model=4)
    p = plan(get_model("moe"), mesh, "ep", config="tiny", estimator="analytic")
    expert_params = [k for k, (_, _, names) in p.info.items() if names and "expert" in names]
    assert expert_params
    for k in expert_params:
        names = p.info[k][2]
        spec = tuple(p.params[k]) + (None,) * len(names)
        assert spec[names.index("expert")] == "model"
    assert p.activation["batch"] == ("data", "model")

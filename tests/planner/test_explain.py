"""plan.explain: every parameter's chain names what decided it; equations, alternatives, text."""

import itertools

import pytest

from spmdkit.planner import PRESETS, plan
from spmdkit.planner.explain import DECIDERS, Explanation
from spmdkit.planner.logical import PlanError
from spmdkit.planner.plans import Plan
from spmdkit.planner.provenance import ACTIVATIONS, group_key
from tests.sampling import latin, sampled

STRATEGIES = (*PRESETS, "auto")
MODELS = ("gpt", "llama")


@pytest.fixture(scope="module")
def infos(tiny_infos):
    return tiny_infos


@pytest.fixture(scope="module")
def fsdp(llama_fsdp):
    """Llama's fsdp plan, costed by propagation (equations recorded)."""
    return llama_fsdp


def _check_chains(p: Plan) -> None:
    for path in p.params:
        e = p.explain(path)
        first = e.decided_by
        assert first is not None and first.kind in DECIDERS, (p.strategy, path, e.chain)
        if first.kind == "rule":
            assert "rule" in first.text or "preset's default" in first.text
        assert e.spec.startswith("[") and path in e.tensors


@pytest.mark.heavy
@pytest.mark.parametrize("model", MODELS)
def test_every_parameter_under_every_strategy_names_its_decider(infos, amesh, model):
    for strategy in STRATEGIES:
        _check_chains(plan(infos[model], amesh, strategy, estimator="analytic"))


#: Each strategy with one model in CI's slow step, every pair with SPMDKIT_FULL_SWEEP=1.
PROPAGATED = sampled(
    list(itertools.product(STRATEGIES, MODELS)), latin(STRATEGIES, MODELS), marks=[pytest.mark.slow]
)


@pytest.mark.parametrize("strategy, model", PROPAGATED)
def test_propagated_plans_name_deciders_and_equations(infos, amesh, strategy, model):
    p = plan(infos[model], amesh, strategy)
    _check_chains(p)
    # every group read by a matmul or lookup names an equation with a source line
    for key in p.provenance.uses:
        uses = p.provenance.uses[key]
        assert uses and all(u.phase in ("forward", "backward", "update") for u in uses)


def test_fsdp_names_the_gather_and_the_scatter_of_a_weight(fsdp):
    e = fsdp.explain("layers/*/mlp/up")
    assert e.tensors == ("layers/0/mlp/up", "layers/1/mlp/up")
    kinds = [(link.use.phase, m.kind) for link in e.chain if link.use for m in link.use.moves]
    assert ("forward", "all_gather") in kinds and ("backward", "reduce_scatter") in kinds
    assert e.collectives["all_gather"] > 0 and e.comm_time_s > 0
    text = str(e)
    assert "'fsdp' table's rule ('embed', (data,model))" in text
    assert "models/llama.py" in text


def test_collectives_of_every_group_add_up_to_the_plans(fsdp):
    prov = fsdp.provenance
    total: dict[str, int] = dict(prov.comm_bytes.get(ACTIVATIONS, {}))
    for key in {group_key(p) for p in fsdp.params}:
        for kind, n in fsdp.explain(key).collectives.items():
            total[kind] = total.get(kind, 0) + n
    assert total == dict(fsdp.cost.comm_bytes)


def test_auto_shows_what_the_search_costed(infos, amesh):
    p = plan(infos["llama"], amesh, "auto", estimator="analytic")
    e = p.explain("layers/*/mlp/down")
    assert e.chain[0].kind == "choice"
    assert e.costed > len(e.alternatives) > 0
    # the chosen layout is the search's fastest for a searched plan
    if p.chosen.startswith("searched"):
        assert all(a.time_delta_s >= 0 for a in e.alternatives)
    assert "alternatives the search costed" in str(e)


def test_logical_names_batch_fields_and_activations(fsdp):
    e = fsdp.explain("mlp")
    assert e.kind == "logical" and "layers/0/mlp/up" in e.tensors
    assert fsdp.explain("batch").spec == "(data,model)"
    (field,) = [f for f in fsdp.batch_axes if "batch" in fsdp.batch_axes[f]][:1]
    assert fsdp.explain(field).kind == "batch"
    named = next(iter(fsdp.provenance.named))
    act = fsdp.explain(named)
    assert act.kind == "activation" and act.chain[0].kind == "equation"


def test_explain_survives_json(fsdp):
    back = Plan.from_json(fsdp.to_json())
    assert str(back.explain("embed/embedding")) == str(fsdp.explain("embed/embedding"))
    assert isinstance(back.explain("mlp"), Explanation)


def test_an_unknown_name_says_what_is_near(fsdp):
    with pytest.raises(PlanError, match="did you mean 'embed/embedding'"):
        fsdp.explain("embed/embeding")


def test_a_pinned_weight_is_explained_by_its_constraint(amesh):
    import flax.linen as nn
    import jax.numpy as jnp

    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x):
            names = ("embed", "mlp")
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, names), (4, 8))
            b = self.param("b", nn.with_partitioning(nn.initializers.zeros, ("model",)), (8,))
            return x @ w + b

    def loss(variables, batch):
        return Lin().apply(variables, batch["x"]).sum()

    x = jnp.ones((8, 4))
    p = plan(Lin(), amesh, "megatron", loss=loss, batch={"x": x}, init_args=(x,))
    assert p.explain("params/b").decided_by.kind == "constraint"
    e = p.explain("params/w")
    assert e.decided_by.kind == "rule" and "('mlp', model) → model" in str(e)

"""plan.to_rules(): the exported table read by flax gives the plan's layouts, and a
plain jax.jit step with it compiles to sk.jit's shardings and collectives."""

import itertools
from collections import Counter

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.planner import PRESETS, plan
from spmdkit.planner.rule_export import RuleTable, flax_resolve
from spmdkit.util import path_str
from spmdkit.verification.hlo import parse_collectives
from tests.sampling import latin, sampled

STRATEGIES = (*PRESETS, "auto")
ENFORCE = False


def _flax_spec(table: RuleTable, names, ndim: int, *, opt: bool = False) -> P:
    rules = table.opt_rules if opt and table.opt_rules is not None else table.rules
    spec = nn.logical_to_mesh_axes(None if names is None else tuple(names), rules)
    return P() if spec is None else spec


def _norm(spec: P, ndim: int) -> tuple:
    dims = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return tuple((dims + [()] * ndim)[:ndim])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flax_reads_every_layout_from_the_table_or_an_override(plans, strategy):
    p = plans[strategy]
    table = p.to_rules()
    assert isinstance(table.rules, tuple) and all(len(e) == 2 for e in table.rules)
    for kind, specs, overrides in (
        ("params", p.params, table.overrides),
        ("opt", p.opt, table.opt_overrides),
    ):
        for path, spec in specs.items():
            shape, _, names = p.info[path]
            got = overrides.get(path) or _flax_spec(table, names, len(shape), opt=kind == "opt")
            assert _norm(got, len(shape)) == _norm(spec, len(shape)), (strategy, kind, path)
    # an override is only written where the table alone gives another layout
    for path, spec in table.overrides.items():
        shape, _, names = p.info[path]
        assert _norm(_flax_spec(table, names, len(shape)), len(shape)) != _norm(spec, len(shape))
    for name, axes in p.activation.items():
        assert _norm(_flax_spec(table, (name,), 1), 1) == (tuple(axes),)


def test_flax_resolve_is_flaxs_reading():
    rules = (("batch", ("data", "model")), ("embed", "data"), ("mlp", "model"), ("mlp", None))
    for names in (("embed", "mlp"), ("mlp", "embed"), ("batch", "embed"), ("mlp",), (None, "mlp")):
        want = _norm(nn.logical_to_mesh_axes(names, rules), len(names))
        assert flax_resolve(rules, names, len(names)) == want, names
    assert flax_resolve(rules, ("embed", "embed"), 2) is None  # flax refuses repeats


def test_a_table_that_cannot_hold_the_plan_names_tensors_and_overrides(plans):
    """Two tensors with one logical name laid out differently: the export says
    which, and overrides them."""
    mesh = sk.abstract_mesh(data=2, model=4)
    info = {
        "a": ((8, 16), "float32", ("embed", "mlp")),
        "b": ((16, 8), "float32", ("mlp", "embed")),
    }
    params = {"a": P("data", "model"), "b": P("data", "model")}  # embed: data in a, model in b
    p = sk.Plan(mesh, params, dict(params), {"batch": ("data",)}, info=info)
    table = p.to_rules()
    assert len(table.overrides) == 1 and not table.exact
    names = {c.name for c in table.conflicts}
    assert names == {"embed", "mlp"}, table.conflicts
    text = str(table)
    assert "conflict: 'embed'" in text and "override:" in text
    yaml = table.to_yaml()
    assert yaml.splitlines()[1] == "mesh_axes: ['data', 'model']"
    assert "  ['batch', ['data']]," in yaml and "logical_axis_rules: [" in yaml
    assert "# parameter overrides" in yaml


def _logical_shardings(tree, names_of, table: RuleTable, mesh, overrides, *, opt=False):
    """NamedShardings from flax's logical_to_mesh_sharding on each leaf's names,
    the table's overrides by path."""
    rules = table.opt_rules if opt and table.opt_rules is not None else table.rules

    def one(kp, x):
        path = path_str(kp)
        for p, spec in overrides.items():
            if path == p or path.endswith("/" + p):
                return NamedSharding(mesh, spec)
        names = names_of(path, np.shape(x))
        logical = P() if names is None else P(*names)
        return nn.logical_to_mesh_sharding(logical, mesh, rules)

    return jax.tree_util.tree_map_with_path(one, tree)


def _collectives(compiled) -> Counter:
    return Counter((c.kind, c.payload_bytes) for c in parse_collectives(compiled.as_text()))


def _round_trip(info, strategy, mesh):
    opt = optax.adam(1e-3)
    kw = {"recipe": sk.Recipe()} if strategy == "auto" else {}
    p = plan(info, mesh, strategy, estimator="analytic", **kw)
    table = p.to_rules()
    abstract_opt = jax.eval_shape(opt.init, info.abstract_params)
    by_path = {q.path: q for q in info.params}

    def param_names(path, shape):
        return by_path[path].logical if path in by_path else None

    def opt_names(path, shape):
        hits = [q for q in by_path if path.endswith("/" + q) and by_path[q].shape == shape]
        return by_path[max(hits, key=len)].logical if hits else None

    # sk.jit: the plan's own step
    params, opt_state = p.abstract(info.abstract_params, abstract_opt)
    batch = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        info.batch,
        p.batch_sharding(info.batch),
    )
    ours = sk.jit(sk.train_step(info, opt, p), p, enforce=ENFORCE).compile(params, opt_state, batch)

    # plain flax + jax.jit: shardings from the exported table only
    pm = _logical_shardings(info.abstract_params, param_names, table, mesh, table.overrides)
    om = _logical_shardings(abstract_opt, opt_names, table, mesh, table.opt_overrides, opt=True)
    bm = {
        k: nn.logical_to_mesh_sharding(P(*info.batch_axes[k]), mesh, table.rules)
        for k in info.batch
    }

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(info.loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    plain = jax.jit(step, in_shardings=(pm, om, bm), out_shardings=(pm, om, None))
    theirs = plain.lower(info.abstract_params, abstract_opt, info.batch).compile()

    for what in ("input_shardings", "output_shardings"):
        a = jax.tree.leaves(getattr(ours, what))
        b = jax.tree.leaves(getattr(theirs, what))
        shapes = [np.shape(x) for x in jax.tree.leaves((params, opt_state, batch))]
        assert len(a) == len(b), what
        if what == "input_shardings":
            for sa, sb, shape in zip(a, b, shapes, strict=True):
                assert sa.is_equivalent_to(sb, len(shape)), (strategy, what, sa, sb)
        else:
            out_shapes = [np.shape(x) for x in jax.tree.leaves((params, opt_state))] + [()]
            for sa, sb, shape in zip(a, b, out_shapes, strict=True):
                assert sa.is_equivalent_to(sb, len(shape)), (strategy, what, sa, sb)
    assert _collectives(ours) == _collectives(theirs), strategy
    return table


@pytest.fixture(scope="module")
def gpt():
    from spmdkit.introspect import describe
    from spmdkit.models import get_model

    return describe(get_model("gpt"), config="tiny", batch_size=8)


@pytest.mark.heavy
def test_a_plain_jit_step_with_the_exported_table_compiles_as_sk_jit(gpt):
    table = _round_trip(gpt, "fsdp", sk.make_mesh(data=2, model=4, axis_types="auto"))
    # fsdp's preset table is read by flax's order, so one table holds its plan: no
    # override (when spmdkit read tables dim by dim, wo and proj needed one each)
    assert table.exact, str(table)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_round_trip_every_strategy_on_tiny_gpt(gpt, strategy):
    _round_trip(gpt, strategy, sk.make_mesh(data=2, model=4, axis_types="auto"))


#: Llama and the MoE models (GShard's capacity routing, and Qwen3-MoE's dropless
#: grouped GEMMs, its tokens exchanged by all-to-all where the plan splits them
#: over the experts' axes): each strategy once in the slow step (a latin sample),
#: every pair with SPMDKIT_FULL_SWEEP=1.
OTHER_MODELS = ("llama", "moe", "qwen3_moe")
OTHERS = sampled(
    list(itertools.product(STRATEGIES, OTHER_MODELS)),
    latin(STRATEGIES, OTHER_MODELS),
    marks=[pytest.mark.slow],
)


@pytest.mark.parametrize("strategy, model", OTHERS)
def test_round_trip_on_llama_and_the_moe_models(strategy, model):
    from spmdkit.introspect.model import describe
    from spmdkit.models import get_model

    info = describe(get_model(model), config="tiny", batch_size=8)
    _round_trip(info, strategy, sk.make_mesh(data=2, model=4, axis_types="auto"))


def _same_layouts(a, b):
    for table in ("params", "opt", "grads", "state"):
        assert getattr(a, table) == getattr(b, table), table
    assert a.activation == b.activation


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_exported_table_plans_the_plan_again(plans, amesh, strategy):
    """sk.plan(model, mesh, p.to_rules(), recipe=p.recipe) gives p's layouts
    (parameters, optimizer state, ZeRO-2's gradients, activations) and its cost:
    a user keeps auto's choice as a table and plans from it next time."""
    from tests.plan_model import toy_batch, toy_init, toy_loss

    p = plans[strategy]
    q = plan(
        toy_init,
        amesh,
        p.to_rules(),
        loss=toy_loss,
        batch=toy_batch(),
        estimator="analytic",
        recipe=p.recipe,
    )
    _same_layouts(p, q)
    assert q.cost.step_time_s == pytest.approx(p.cost.step_time_s)
    assert q.cost.peak_bytes == p.cost.peak_bytes


@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "tp_fsdp", "auto"])
def test_an_exported_table_plans_tiny_gpt_again(gpt, strategy):
    mesh = sk.abstract_mesh(data=2, model=4)
    p = plan(gpt, mesh, strategy, estimator="analytic")
    table = p.to_rules()
    q = plan(gpt, mesh, table, estimator="analytic", recipe=p.recipe)
    _same_layouts(p, q)
    assert q.cost.peak_bytes == p.cost.peak_bytes
    assert table.grads_sharded == (strategy == "zero2")
    # a name the table lacks reads as flax reads it (replicated), explain included
    for path in q.params:
        assert q.explain(path).chain, path


def test_an_exported_table_refuses_what_it_cannot_hold(gpt):
    from spmdkit.planner.logical import PlanError

    table = plan(gpt, sk.abstract_mesh(data=2, model=4), "megatron", estimator="analytic")
    table = table.to_rules()
    with pytest.raises(PlanError, match="every axis the exported table") as e:
        plan(gpt, sk.abstract_mesh(data=8), table, estimator="analytic")
    assert "table.rules" in str(e.value)
    with pytest.raises(PlanError, match="divides its dims"):
        plan(gpt, sk.abstract_mesh(data=1, model=3), table, estimator="analytic")
    with pytest.raises(PlanError, match="no extra rules="):
        plan(gpt, sk.abstract_mesh(data=2, model=4), table, rules=[("mlp", None)])


@pytest.mark.slow
def test_an_exported_table_without_the_stack_names_plans_and_explains():
    """A scanned MoE's table names neither ``layers`` nor ``mlp`` (replicated, so
    flax needs no rule): the plan from it reads them as flax does, and explain
    walks every parameter."""
    from spmdkit.models import get_model

    spec = get_model("qwen3_moe")
    mesh = sk.abstract_mesh(data=8)
    p = plan(spec, mesh, "fsdp", config="tiny", batch_size=16, estimator="analytic")
    table = p.to_rules()
    assert "layers" not in dict(table.rules)
    q = plan(spec, mesh, table, config="tiny", batch_size=16, estimator="analytic")
    _same_layouts(p, q)
    for path in q.params:
        assert q.explain(path).chain, path

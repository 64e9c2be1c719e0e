"""Candidates: the floor auto prunes propagations with is below what propagation gives;
the propagated peak a plan budgets with is the one verify holds to the compiled step."""

import dataclasses
import math

import jax
import numpy as np
import optax
import pytest

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


def test_a_cpu_topology_prices_one_latency_per_combined_group_of_all_reduces():
    """XLA:CPU combines the step's independent all-reduces: on a topology that
    says so, the propagated all-reduces of one group of axes in one pass pay one
    latency, so dp's step is cheaper by exactly the latencies of the others; a
    topology that does not combine prices each."""
    from spmdkit.planner.candidates import combined_latency

    mesh = sk.make_mesh(data=8)
    cpu = dataclasses.replace(sk.Topology.cpu(8, cores=2), fresh_page_s=0.0)
    each = dataclasses.replace(cpu, combines_all_reduces=False)
    kw = {"loss": toy_loss, "batch": toy_batch(), "strategy": "dp"}
    combined = plan(toy_init, mesh, topology=cpu, **kw).cost
    separate = plan(toy_init, mesh, topology=each, **kw).cost
    latency = cpu.collective_time("all_reduce", 0, 8, ("data",), mesh)
    saved = separate.comm_time_s - combined.comm_time_s
    # the toy model's grads are several all-reduces over one axis in the backward
    assert saved >= latency
    assert saved / latency == pytest.approx(round(saved / latency))
    assert separate.step_time_s - combined.step_time_s == pytest.approx(saved)
    assert combined_latency([], cpu, mesh) == 0.0
    assert combined_latency([object()], each, mesh) == 0.0  # never read: not combined


@pytest.mark.slow
def test_planned_peak_is_verifys_for_the_donated_step_of_a_vocabulary_heavy_model():
    """A Llama whose 16,384-token vocabulary dwarfs its 64-wide layers (the f32
    logits, 33.6 MB, are over a third of the step's memory), dp on one device: the
    peak the plan budgets with (``cost.peak_bytes``: arguments plus temporaries,
    the parameters and optimizer state updated in their donated buffers) is the
    lower end of what ``plan.verify`` predicts for the step ``sk.train`` compiles
    (state donated), and XLA's peak is within verify's tolerance of that range.
    The plan holds the logits' two f32 buffers (the softmax's and the logits'
    gradient) at its peak. Measured on XLA:CPU (jax 0.10.2): planned 95.6 MiB,
    range 95.6-127.7, compiled 136.2; the compiled peak also holds a transposed
    copy of the logits' gradient for the output projection's weight gradient,
    which XLA:CPU lays out for its dot (cuBLAS reads either layout)."""
    spec = sk.models.get_model("llama")
    cfg = dataclasses.replace(spec.configs["tiny_scan"](), vocab=16384, seq_len=128)
    batch = spec.batch(cfg, 4, np.random.default_rng(0))
    info = sk.describe(spec, config=cfg, batch=batch)
    opt = optax.adam(1e-3)
    p = sk.plan(info, sk.make_mesh(data=1, model=1), "dp", optimizer=opt)
    params, opt_state = p.abstract(
        info.abstract_params, jax.eval_shape(opt.init, info.abstract_params)
    )
    abstract_batch = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
        batch,
        p.batch_sharding(batch),
    )
    step = sk.jit(sk.train_step(info, opt, p), p, donate_state=True)
    report = p.verify(step, params, opt_state, abstract_batch)
    assert report.ok, report
    low, _ = report.ranges["peak memory"]
    assert low == p.cost.peak_bytes
    assert p.cost.memory["outputs"] == 4  # the loss: every update reuses its buffer
    logits = 4 * 128 * 16384 * 4
    assert p.cost.memory["temporaries"] >= 2 * logits
    compiled = dict((what, c) for what, _, c, _ in report.rows)["peak memory"]
    # what XLA:CPU holds beyond the plan: the gradient's transposed copy, a few
    # parameter-sized buffers
    assert low <= compiled <= p.cost.peak_bytes + 1.5 * logits


def test_the_distributed_optimizer_shards_only_where_the_dims_divide():
    """``megatron+zero1`` on ``data=2 × model=4``: a weight whose head dim (4)
    the model axis fills takes the data axis on another dim that divides, and
    every optimizer spec divides its shape (the state is placed, not refused by
    jax when the step compiles)."""
    from jax.sharding import PartitionSpec as P

    from spmdkit.introspect import describe
    from spmdkit.models import get_model

    info = describe(get_model("gpt"), config="tiny", batch_size=8)
    mesh = sk.abstract_mesh(data=2, model=4)
    p = plan(info, mesh, "megatron+zero1", estimator="analytic")
    sizes = dict(mesh.shape)
    for path, spec in p.opt.items():
        shape = p.info[path][0]
        for d, entry in enumerate(spec):
            axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
            assert shape[d] % math.prod(sizes[a] for a in axes) == 0, (path, spec, shape)
    assert p.params["blocks/0/attn/bq"] == P("model")  # 4 heads × 16
    assert p.opt["blocks/0/attn/bq"] == P("model", "data")


def test_the_budget_move_is_the_one_a_full_scan_picks():
    """Over budget, search_layouts takes the first move with the strictly smallest
    Δtime per byte saved; the moves it keeps per group pick the same one as
    scanning every option of every group, ties and not-a-number ratios too."""
    import random

    from spmdkit.planner.analytic import GroupCost
    from spmdkit.planner.candidates import budget_moves

    rng = random.Random(0)
    times = [1.0, 2.0, 3.0, math.inf]  # inf - inf: a ratio that is not a number
    for _ in range(300):
        costs = [
            [
                GroupCost(0.0, rng.choice(times), (), rng.choice([1, 2, 4]), 0, 0, 0)
                for _ in range(rng.randint(1, 5))
            ]
            for _ in range(rng.randint(1, 4))
        ]
        pick = [rng.randrange(len(row)) for row in costs]
        full = None
        for i, row in enumerate(costs):
            cur = row[pick[i]]
            for j, c in enumerate(row):
                saved = cur.memory - c.memory
                if saved > 0:
                    ratio = (c.time - cur.time) / saved
                    if full is None or ratio < full[0]:
                        full = (ratio, i, j)
        kept = None
        for i, row in enumerate(costs):
            for ratio, j in budget_moves(lambda i, j, c=costs: c[i][j], i, pick[i], len(row)):
                if kept is None or ratio < kept[0]:
                    kept = (ratio, i, j)
        assert (full is None) == (kept is None)
        assert full is None or full[1:] == kept[1:]


def test_a_presets_layouts_are_resolved_once_per_plan_and_match_its_tables():
    """preset_choice: a preset's table and layouts are those of preset_tables and
    rules_choice, resolved once for a plan call's extra rules, mesh and groups (the
    same under every recipe), handed back as a new list each time; other extra
    rules resolve anew."""
    from spmdkit.introspect import describe
    from spmdkit.models import get_model
    from spmdkit.planner import candidates
    from spmdkit.planner.search import planner_for

    info = describe(get_model("llama"), config="tiny_scan", batch_size=8)
    problem = planner_for(info, sk.abstract_mesh(data=2, model=2)).problem
    mesh, groups, memo = problem.mesh, problem.groups, {}
    for name in ("fsdp", "megatron_sp+zero1"):
        rules, choice = candidates.preset_choice(memo, name, None, mesh, groups)
        want, want_opt = candidates.preset_tables(name, None, mesh)
        assert rules == want
        assert choice == candidates.rules_choice(want, want_opt, groups, mesh, name)
        again = candidates.preset_choice(memo, name, None, mesh, groups)
        assert again[0] is rules and again[1] == choice and again[1] is not choice
    extra = [("embed", None)]
    rules, choice = candidates.preset_choice(memo, "fsdp", extra, mesh, groups)
    assert rules == candidates.preset_tables("fsdp", extra, mesh)[0]
    assert len(memo) == 3


def test_the_expert_exchange_is_never_hidden_under_compute():
    """The routed experts' all-to-alls sit on the critical path: of a propagated
    step whose analytic cost would hide all its communication, the exchanges'
    seconds (:func:`exchange_time`: the four of a forward and grad, each a
    routed-rows all-to-all) stay exposed; the rest hides."""
    from jax.sharding import PartitionSpec as P

    from spmdkit.planner.candidates import exchange_time, recost_step
    from spmdkit.propagation import propagate
    from tests.propagation.test_regions import _experts

    loss, args = _experts()
    ep = P("expert")
    prop = propagate(
        jax.grad(loss, argnums=(0, 3, 4, 5)),
        *args,
        in_specs=(ep,) * 6,
        mesh=sk.abstract_mesh(expert=8),
        arg_roles=("batch",) * 3 + ("params",) * 3,
    )
    sent = [c for c in prop.collectives() if c.routed_bytes is not None]
    assert len(sent) == 4
    exchange = exchange_time(prop.records)
    assert math.isclose(exchange, sum(c.time_s for c in sent))
    mesh = sk.abstract_mesh(data=4, model=2)
    dp = plan(toy_init, mesh, "dp", loss=toy_loss, batch=toy_batch(), estimator="analytic")
    hides_all = dataclasses.replace(dp.cost, hidden_comm_s=dp.cost.comm_time_s, compute_time_s=1.0)
    comm = 3 * exchange
    assert recost_step(hides_all, comm, DEFAULT_TOPOLOGY)[0] == pytest.approx(1.0)
    step = recost_step(hides_all, comm, DEFAULT_TOPOLOGY, exchange)[0]
    assert step == pytest.approx(1.0 + exchange)

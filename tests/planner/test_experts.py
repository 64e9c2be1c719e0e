"""spmdkit.planner.experts: the analytic model prices a moe_experts call's exchanges as the
rule states them (and as propagation counts them), its experts unsplit by FSDP over the
expert-parallel axes, its buffers in memory."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.planner import experts
from spmdkit.planner.trace import trace_step

V, S, B = 32, 8, 8
T, D_MODEL, E, K = B * S, 16, 8, 2  # the decoder's tokens, width, experts, top-k


class MoEDecoder(nnx.Module):
    def __init__(self, rngs, **kw):
        init = jax.nn.initializers.normal(0.5)
        self.embed = nnx.Param(init(rngs.params(), (V, D_MODEL)), out_sharding=("vocab", "embed"))
        self.moe = sk.nn.MoE(D_MODEL, n_experts=E, top_k=K, d_ff_expert=16, rngs=rngs, **kw)
        self.head = nnx.Param(init(rngs.params(), (D_MODEL, V)), out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x = self.embed[...][tokens]
        y, aux = self.moe(x)
        return (x + y) @ self.head[...], aux


def decoder_loss(model, batch):
    logits, aux = model(batch["tokens"])
    return sk.nn.cross_entropy(logits, batch["targets"]) + aux


def decoder_info():
    """The MoE decoder described on a batch of random tokens."""
    toks = np.random.default_rng(0).integers(0, V, (B, S + 1)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:]}
    with nnx.use_eager_sharding(False):
        return describe(lambda: MoEDecoder(nnx.Rngs(0)), loss=decoder_loss, batch=batch)


@pytest.fixture(scope="module")
def info():
    return decoder_info()


def _rule_bytes(n_ep: int, t_axes: int) -> int:
    """The all-to-alls of one call's train step: the forward's counts and two token
    buffers (rules/moe.py ``_own``), and the grad region's transposes of the two
    (it reads the buffers the forward region kept: ``residual_programs``)."""
    t_local = T // t_axes
    buf = n_ep * t_local * min(K, E // n_ep) * D_MODEL * 4
    counts = n_ep * (E // n_ep) * 4
    return 4 * buf + counts


def test_the_trace_reads_the_call(info):
    call = trace_step(info, None).moe_calls[E]
    assert (call.tokens, call.top_k, call.d_model, call.d_ff, call.calls) == (T, K, D_MODEL, 16, 1)


@pytest.mark.parametrize(
    ("shape", "n_ep", "t_axes"), [({"data": 8}, 8, 8), ({"data": 2, "expert": 4}, 4, 8)]
)
def test_the_exchanges_are_the_rules_and_propagations(info, shape, n_ep, t_axes):
    mesh = sk.abstract_mesh(**shape)
    analytic = sk.plan(info, mesh, "ep", estimator="analytic")
    propagated = sk.plan(info, mesh, "ep", estimator="propagate")
    assert analytic.params["moe/w_down"][0] in ("data", "expert")
    want = _rule_bytes(n_ep, t_axes)
    assert analytic.cost.comm_bytes["all_to_all"] == want
    assert propagated.cost.comm_bytes["all_to_all"] == want
    # experts split over a batch axis are expert parallel, not FSDP: nothing gathered
    assert "all_gather" not in analytic.cost.comm_bytes
    assert analytic.cost.memory["moe_buffers"] > 0
    # what the grad reads, held from the forward: the rows received, their counts
    # and the results back (the decoder's one call)
    t_local = T // t_axes
    kept = n_ep * t_local * min(K, E // n_ep) * D_MODEL * 4 + n_ep * (E // n_ep) * 4
    assert analytic.cost.memory["moe_kept"] == kept + t_local * K * D_MODEL * 4


def test_the_buffers_and_rows_follow_the_ep_degree(info):
    plans = {
        n: sk.plan(info, sk.abstract_mesh(data=8 // n, expert=n), "ep", estimator="analytic")
        for n in (2, 4, 8)
    }
    # the padded buffers: n_ep * T_local * min(k, E_local) rows, T_local = T / 8;
    # three D wide and four F wide, and the E_local experts' three weight gradients
    rows = {n: n * (T // 8) * min(K, E // n) for n in plans}
    mem = {n: p.cost.memory["moe_buffers"] for n, p in plans.items()}
    f_local = 16
    for n in plans:
        grads = 3 * (E // n) * D_MODEL * f_local * 4
        assert mem[n] == pytest.approx(rows[n] * (3 * D_MODEL + 4 * f_local) * 4 + grads)


@pytest.mark.parametrize("form", ["routed", "node_dedup"])
def test_a_dispatcher_sized_at_run_time_holds_the_rows_routed(info, form):
    """A priced-only exchange form whose buffers are sized once the counts are
    exchanged (``expert_exchange="routed"``: Megatron-LM's alltoall dispatcher;
    ``"node_dedup"``: DeepEP's) holds the rows routed to the busiest device,
    ``T_local * k`` times the load imbalance, where the op pads its buffer to
    ``n_ep * T_local * min(k, E_local)``: the kept rows and the backward's D-wide
    and F-wide buffers shrink by their ratio, and the plan says it is priced only.
    The parameters' memory and the exchange's payload (the op's) do not move."""
    import dataclasses

    mesh = sk.abstract_mesh(data=2, expert=4)
    n_ep, t_local, f_local = 4, T // 8, 16
    op = sk.Topology.h100()
    sized = dataclasses.replace(op, expert_exchange=form)
    plans = {
        t.expert_exchange: sk.plan(info, mesh, "ep", estimator="analytic", topology=t)
        for t in (op, sized)
    }
    busiest = experts.load_imbalance(trace_step(info, None).moe_calls[E], n_ep, t_local)
    padded, routed = n_ep * t_local * min(K, E // n_ep), t_local * K * busiest
    assert busiest > 1 and routed < padded / 2
    grads = 3 * (E // n_ep) * D_MODEL * f_local * 4
    counts, back = n_ep * (E // n_ep) * 4, t_local * K * D_MODEL * 4
    for name, rows in (("all_to_all", padded), (form, routed)):
        mem = plans[name].cost.memory
        want = rows * (3 * D_MODEL + 4 * f_local) * 4 + grads
        assert mem["moe_buffers"] == pytest.approx(want, abs=1)
        assert mem["moe_kept"] == pytest.approx(rows * D_MODEL * 4 + counts + back, abs=1)
    for kind in ("params", "grads", "opt_state"):
        assert plans[form].cost.memory[kind] == plans["all_to_all"].cost.memory[kind]
    payload = plans["all_to_all"].cost.comm_bytes["all_to_all"]
    assert plans[form].cost.comm_bytes["all_to_all"] == payload
    assert "priced_only" in [n.kind for n in plans[form].notes]
    assert "priced_only" not in [n.kind for n in plans["all_to_all"].notes]
    if form == "routed":  # its link carries the routed rows, as a GPU's ragged exchange
        step = plans["all_to_all"].cost.step_time_s
        assert plans[form].cost.step_time_s == pytest.approx(step)


@pytest.fixture(scope="module")
def wide_qwen3():
    """Tiny Qwen3-MoE (scanned) with experts three times as wide as the model, so
    that ``D``-wide and ``F``-wide buffers differ."""
    import dataclasses

    from spmdkit.models import get_model

    spec = get_model("qwen3_moe")
    cfg = spec.configs["tiny"]()
    cfg = dataclasses.replace(cfg, d_ff_expert=3 * cfg.d_model)
    return describe(spec, config=cfg, batch_size=16)


@pytest.mark.parametrize("shape", [{"data": 8}, {"data": 2, "expert": 4}])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_backward_buffers_are_the_grad_regions(wide_qwen3, monkeypatch, shape, remat):
    """The analytic working set of one call's backward is what propagation holds
    there: the grad region's own temporaries (its per-device program's peak), and
    under a recompute that reruns the exchange what the recomputed forward hands
    it (the rows received, their counts, the results back)."""
    from spmdkit.propagation import driver

    seen: dict[bool, int] = {}
    orig = driver.region_temp_parts

    def spy(prim, params, attrs, required, produced, mesh, **kw):
        parts = orig(prim, params, attrs, required, produced, mesh, **kw)
        if params["op"] == "moe_experts" and prim.endswith("_grad") and kw.get("duplicate"):
            seen[True] = max(seen.get(True, 0), sum(parts))
        return parts

    monkeypatch.setattr(driver, "region_temp_parts", spy)
    mesh = sk.abstract_mesh(**shape)
    recipe = sk.Recipe(remat=remat)
    analytic = sk.plan(wide_qwen3, mesh, "ep", recipe=recipe, estimator="analytic").cost
    sk.plan(wide_qwen3, mesh, "ep", recipe=recipe, estimator="propagate")
    temps = seen[True]
    held = 0
    if remat == "full":  # the forward's residuals: as moe_kept holds them without recompute
        none = sk.plan(wide_qwen3, mesh, "ep", estimator="analytic").cost.memory["moe_kept"]
        held = none / _layers(wide_qwen3)
    assert analytic.memory["moe_buffers"] == pytest.approx(temps + held, rel=0.05)


def _layers(info) -> int:
    """The scanned layers of a described model."""
    return next(p.shape[0] for p in info.params if "layers" in (p.logical or ()))


def test_the_experts_batched_dots_are_no_attention(info):
    """moe_experts' unsharded computation contracts each assignment with its
    expert's weights in a dot batched over the tokens: those FLOPs are the
    experts' (priced per weight), not attention's, which this decoder has none of."""
    trace = trace_step(info, None)
    assert trace.moe_calls[E].calls == 1
    assert trace.attn_fwd_flops == 0.0
    assert trace.attn_flops == 0.0


def test_a_ragged_backend_sends_the_routed_rows_over_the_link(info):
    """On a backend with a ragged all-to-all (a GPU) the exchange's link time is the
    routed rows' (``T_local * k`` of ``D``), while the padded buffer stays its
    payload; a CPU's padded all-to-all sends the whole buffer."""
    import dataclasses

    mesh = sk.abstract_mesh(data=2, expert=4)
    gpu = sk.Topology.h100()
    cpu = dataclasses.replace(gpu, platform="cpu")
    plans = {
        t.platform: sk.plan(info, mesh, "ep", estimator="analytic", topology=t) for t in (gpu, cpu)
    }
    assert {"gpu", "tpu"} <= experts.RAGGED_BACKENDS and "cpu" not in experts.RAGGED_BACKENDS
    assert plans["gpu"].cost.comm_bytes == plans["cpu"].cost.comm_bytes
    t_local, n_ep = T // 8, 4
    buf = n_ep * t_local * min(K, E // n_ep) * D_MODEL * 4
    # the busiest device's routed rows (uniform routing)
    busiest = experts.load_imbalance(trace_step(info, None).moe_calls[E], n_ep, t_local)
    routed = t_local * K * D_MODEL * 4 * busiest
    per = {
        b: gpu.collective_time("all_to_all", int(b * 3 / 4), 4, ("expert",), mesh)
        for b in (buf, routed)
    }
    saved = plans["cpu"].cost.comm_time_s - plans["gpu"].cost.comm_time_s
    assert saved == pytest.approx(4 * (per[buf] - per[routed]))


@pytest.mark.slow
def test_deepseek_v3_671b_plans_on_1024_h100s_within_80_gib():
    """Issue 44's acceptance: DeepSeek-V3 671B (the zoo's ``deepseek`` at ``v3_671b``:
    MLA, 3 dense layers, 256 experts top-8 and a shared one) on 1,024 abstract H100s
    as TP 2 x EP 32 x DP 16 would lay them out, global batch 8,192 of 4,096 tokens,
    ``pipeline="auto"``, ``allow_fp8``: auto fits 80 GiB within a minute of the
    process's CPU time (the analytic estimator; the machine's load does not count)."""
    import time

    from spmdkit.models import get_model

    v3 = describe(get_model("deepseek"), config="v3_671b", batch_size=8192)
    start = time.process_time()
    p = sk.plan(
        v3,
        sk.abstract_mesh(data=16, expert=32, model=2),
        "auto",
        pipeline="auto",
        allow_fp8=True,
        estimator="analytic",
    )
    took = time.process_time() - start
    assert p.cost.peak_bytes <= 80 * 2**30
    assert took <= 60, took


# CI's slow step leaves this out (SPMDKIT_FULL_SWEEP=1 runs it): about 150 CPU s of
# planning with every lever allowed; the plan-time and 80 GiB bound above stays in CI
@pytest.mark.full
@pytest.mark.slow
def test_deepseek_v3_auto_is_not_worse_than_the_published_layout_by_its_prices():
    """Issue 44's acceptance on the calibration's DeepSeek-V3 row (TP 2 x PP 8 x VP 4
    x EP 64, FP8, the published run's DeepEP exchange priced): auto on the row's
    devices, with the levers the published recipe uses allowed (as the
    calibration's auto column plans it, analytic), fits 80 GiB at no fewer than the
    published layout's tokens per second per GPU priced on the same topology (its
    flat Megatron-LM layouts come within 3%; auto also costs PP 8 x VP 4 with its
    own uneven layouts and the stages' experts over the expert and tensor axes,
    the published pipeline's EP 64). Before auto costed
    the tensor-parallel presets with the experts expert-parallel (and grew
    micro-batches while a faster plan could fit) it reached about 0.7 of it."""
    from tests.scripts import loaded_script

    with loaded_script("benchmarks/calibration.py") as cal:
        row = cal.DEEPSEEK_V3
        topology = cal.row_topology(row)
        published = cal.tok_s(row, cal.predict(row, topology))
        spec, config = cal._model(row)
        options = sk.SearchOptions(
            pipeline="auto",
            allow_fp8=True,
            allow_master_weights=True,
            allow_local_statistics=True,
        )
        p = sk.plan(
            spec,
            sk.abstract_mesh(**cal.auto_mesh(row)),
            "auto",
            config=config,
            batch_size=row["batch"],
            topology=topology,
            estimator="analytic",
            options=options,
        )
        assert p.cost.peak_bytes <= 80 * 2**30
        assert cal.tok_s(row, p.cost) >= published, (p.chosen, published)


def _pipelined_qwen3(remats):
    """Tiny Qwen3-MoE planned (analytic) on pipe 2 x data 4, experts over data, 1F1B
    with 4 micro-batches, under each remat policy: (config, pipeline, plans)."""
    from spmdkit.models import get_model
    from spmdkit.pipeline import Pipeline

    spec = get_model("qwen3_moe")
    cfg = spec.configs["tiny"]()
    pipe = Pipeline(stages=2, microbatches=4, schedule="1f1b", local_statistics=True)
    plans = {
        remat: sk.plan(
            spec,
            sk.abstract_mesh(pipe=2, data=4),
            "fsdp",
            config=cfg,
            batch_size=16,
            rules=[("expert", ("data",))],
            recipe=sk.Recipe(remat=remat),
            pipeline=pipe,
            estimator="analytic",
        )
        for remat in remats
    }
    return cfg, pipe, plans


@pytest.mark.slow
def test_a_pipelined_stage_runs_the_forwards_exchanges_and_their_transposes():
    """In a pipelined stage the executor runs moe_experts' per-device program under
    plain autodiff (spmdkit.expert_shard: no grad region rerunning the forward):
    per call and micro-batch the two token buffers, their transposes and one count
    exchange; the forward's three again where the recipe recomputes the layer."""
    cfg, pipe, got = _pipelined_qwen3(("none", "full"))
    assert got["none"].params["layers/moe/w_down"][1] == "data"
    n_ep, e_local = 4, cfg.n_experts // 4
    t_local = 16 * cfg.seq_len // 4 // pipe.microbatches  # a device's tokens of a micro-batch
    buf = n_ep * t_local * min(cfg.top_k, e_local) * cfg.d_model * 4
    counts = n_ep * e_local * 4
    calls = cfg.n_layers // pipe.stages * pipe.microbatches
    assert got["none"].cost.comm_bytes["all_to_all"] == calls * (4 * buf + counts)
    assert got["full"].cost.comm_bytes["all_to_all"] == calls * (6 * buf + 2 * counts)


@pytest.mark.slow
def test_a_pipelined_stage_holds_the_kept_buffers_per_micro_batch_in_flight():
    """A pipelined stage keeping the exchanged buffers (``save_out_proj_experts``)
    holds one call's rows received, counts and results back per layer with every
    residual set (each micro-batch in flight, and the tick's two): the traced
    step's residuals hold only stand-ins for them, so the price adds them beyond
    ``save_out_proj``'s (which reruns the exchange and keeps neither)."""
    from spmdkit.pipeline.memory import StageSizes, stage_buffers

    cfg, pipe, plans = _pipelined_qwen3(("save_out_proj", "save_out_proj_experts"))
    acts = {remat: p.cost.memory["activations"] for remat, p in plans.items()}
    n_ep, e_local = 4, cfg.n_experts // 4
    t_local = 16 * cfg.seq_len // 4 // pipe.microbatches  # a device's tokens of a micro-batch
    got = n_ep * t_local * min(cfg.top_k, e_local) * cfg.d_model * 4
    back = t_local * cfg.top_k * cfg.d_model * 4
    counts = n_ep * e_local * 4
    held = stage_buffers(pipe, StageSizes(residual=1.0, head=0.0, carry=0.0))
    sets = held["stash"] + held["tick"]  # residual sets a device holds at its peak
    layers = cfg.n_layers // pipe.stages
    kept = acts["save_out_proj_experts"] - acts["save_out_proj"]
    assert kept == pytest.approx(sets * layers * (got + back + counts), abs=2)


def test_the_search_costs_only_the_layouts_the_op_runs_as_priced(info):
    """The op gathers an expert weight whole before it runs unless its ``D`` is split
    over token axes only and its ``F`` over none; its gradient then leaves each layer
    whole. The search leaves those layouts out rather than price them as FSDP."""
    from spmdkit.planner.analytic import CostContext, param_groups
    from spmdkit.planner.candidates import layout_options

    mesh = sk.abstract_mesh(data=4, model=2)
    trace = trace_step(info, None)
    groups = [g for g in param_groups(info, trace) if experts.moe_call(g, trace)]
    assert {g.logical[-1] for g in groups} == {"embed", "mlp"}
    sizes = {"data": 4, "model": 2}
    ctx = CostContext(mesh, sizes, sk.Topology.h100(), trace, None, 1.0)
    for g in groups:
        options, _ = layout_options(ctx, g, ("data",), (), sizes)
        names = list(g.logical)
        assert options
        for o in options:
            embed, mlp = o.params[names.index("embed")], o.params[names.index("mlp")]
            ep = set(o.params[names.index("expert")])
            assert set(embed) <= {"data"} | ep, (g.key, o.params)
            assert not set(mlp) & ({"data"} | ep), (g.key, o.params)
        assert any(o.params[names.index("embed")] == ("data",) for o in options), g.key


def test_runs_as_priced_reads_the_weights_dims():
    class G:
        logical = ("layers", "expert", "embed", "mlp")

    assert experts.runs_as_priced(G, ((), (), ("data",), ("model",)), ("data",))
    assert experts.runs_as_priced(G, ((), ("expert",), (), ()), ("data",))
    # D over a non-token axis, F over a token axis: gathered whole before the op
    assert not experts.runs_as_priced(G, ((), (), ("model",), ()), ("data",))
    assert not experts.runs_as_priced(G, ((), (), (), ("data",)), ("data",))
    # EP x FSDP x expert TP
    assert experts.runs_as_priced(G, ((), ("expert",), ("data",), ("model",)), ("data",))


def _hit(experts_total: int, here: int, k: int) -> float:
    """The chance that ``here`` of the experts hold one of a token's ``k`` (uniform)."""
    return 1 - math.comb(experts_total - here, k) / math.comb(experts_total, k)


def test_a_node_deduplicated_exchange_sends_a_token_once_per_remote_node(info):
    """``Topology(expert_exchange="node_dedup")`` prices each token exchange as
    DeepEP's normal kernels run it: over the network once per remote node holding
    one of the token's experts, fanned out inside the node at once, the slower of
    the two. Here EP 4 over nodes of 2 GPUs: 2 nodes of 4 experts each, so a token
    (top-2 of 8) crosses to the other node with chance 1 - C(4,2)/C(8,2), not with
    each of its copies; the payload (the padded buffer) is unchanged, and the plan
    says the form is priced only."""
    import dataclasses

    mesh = sk.abstract_mesh(data=2, expert=4)
    plain = sk.Topology.h100(gpus_per_node=2)
    dedup = dataclasses.replace(plain, expert_exchange="node_dedup")
    assert plain.node_share(("expert",), mesh) == 2
    plans = {
        t.expert_exchange: sk.plan(info, mesh, "ep", estimator="analytic", topology=t)
        for t in (plain, dedup)
    }
    assert plans["node_dedup"].cost.comm_bytes == plans["all_to_all"].cost.comm_bytes
    t_local = T // 8
    row = D_MODEL * 4 * experts.load_imbalance(trace_step(info, None).moe_calls[E], 4, t_local)
    routed = t_local * K * row
    old = plain.collective_time("all_to_all", int(routed * 3 / 4), 4, ("expert",), mesh)
    network = 10e-6 + t_local * _hit(E, E // 2, K) * row / 50e9
    fan_out = 5e-6 + t_local * 4 * _hit(E, E // 4, K) / 2 * row / 450e9
    new = max(network, fan_out)
    assert new < old
    saved = plans["all_to_all"].cost.comm_time_s - plans["node_dedup"].cost.comm_time_s
    assert saved == pytest.approx(4 * (old - new))
    kinds = [n.kind for n in plans["node_dedup"].notes]
    assert kinds.count("priced_only") == 1
    assert "priced_only" not in [n.kind for n in plans["all_to_all"].notes]
    assert "DeepEP" in next(str(n) for n in plans["node_dedup"].notes if n.kind == "priced_only")


def test_reach_chance_with_a_group_limit_is_hand_worked_and_sampled():
    """DeepSeek-V3 on 8 nodes (256 experts in 8 groups, one a node; top-8 in 4
    groups): a node is reached when its group is kept (1/2) and one of the 8
    experts, uniform among the 4 groups' 128, is its: 1/2 (1 - C(96,8)/C(128,8)),
    against 1 - C(224,8)/C(256,8) unlimited. Two groups a holder (8 experts in 4
    groups on 2 nodes, top-2 in 2 groups) sums over how many of its groups are
    kept; the formula matches uniform group-limited routing sampled."""
    v3 = experts.reach_chance(256, 8, 8, (8, 4))
    assert v3 == pytest.approx(0.5 * (1 - math.comb(96, 8) / math.comb(128, 8)))
    assert experts.reach_chance(256, 8, 8, None) == pytest.approx(_hit(256, 32, 8))
    assert 8 * v3 <= 4 < 8 * _hit(256, 32, 8)  # at most group_top_k nodes a token
    two = experts.reach_chance(8, 2, 2, (4, 2))
    assert two == pytest.approx(4 / 6 * (1 - 1 / 6) + 1 / 6)  # j = 1, 2 of its groups
    rng = np.random.default_rng(0)
    for e, k, holders, (g, gk) in ((8, 2, 2, (4, 2)), (16, 3, 8, (4, 2)), (24, 4, 3, (6, 3))):
        kept = np.argsort(rng.random((20000, g)), -1)[:, :gk]  # uniform groups
        per = e // g
        slots = np.argsort(rng.random((20000, gk * per)), -1)[:, :k]  # uniform experts
        chosen = kept[np.arange(20000)[:, None], slots // per] * per + slots % per
        reached = (chosen // (e // holders) == 0).any(-1).mean()  # holder 0 (symmetric)
        assert experts.reach_chance(e, k, holders, (g, gk)) == pytest.approx(reached, abs=0.01)
    assert experts.reach_chance(12, 2, 4, (3, 1)) == _hit(12, 3, 2)  # not mapping: unlimited


def test_a_group_limited_router_lowers_the_node_deduplicated_price():
    """The decoder above routing top-2 of 8 experts in 2 of 4 groups, EP 4 over
    nodes of 2 GPUs: the trace reads the limit off the op, and each exchange costs
    the hand-worked max(network, fan-out) with p_node = 13/18 (two groups a node)
    and p_device = 5/12 (one group a device), below the unlimited 11/14 and 13/28."""
    import dataclasses

    toks = np.random.default_rng(0).integers(0, V, (B, S + 1)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:]}
    with nnx.use_eager_sharding(False):
        grouped = describe(
            lambda: MoEDecoder(nnx.Rngs(0), groups=4, group_top_k=2),
            loss=decoder_loss,
            batch=batch,
        )
    assert trace_step(grouped, None).moe_calls[E].groups == (4, 2)
    mesh = sk.abstract_mesh(data=2, expert=4)
    plain = sk.Topology.h100(gpus_per_node=2)
    dedup = dataclasses.replace(plain, expert_exchange="node_dedup")
    costs = [
        sk.plan(grouped, mesh, "ep", estimator="analytic", topology=t).cost for t in (plain, dedup)
    ]
    t_local = T // 8
    call = trace_step(grouped, None).moe_calls[E]
    row = D_MODEL * 4 * experts.load_imbalance(call, 4, t_local)
    old = plain.collective_time("all_to_all", int(t_local * K * row * 3 / 4), 4, ("expert",), mesh)
    network = 10e-6 + t_local * 13 / 18 * row / 50e9
    fan_out = 5e-6 + t_local * 4 * 5 / 12 / 2 * row / 450e9
    assert costs[0].comm_time_s - costs[1].comm_time_s == pytest.approx(
        4 * (old - max(network, fan_out))
    )
    assert _hit(E, E // 2, K) > 13 / 18 and _hit(E, E // 4, K) > 5 / 12


def test_a_policy_keeping_the_experts_buffers_prices_no_rerun(info):
    """``save_out_proj_experts`` (or ``names`` with the ``moe_experts`` tag) keeps
    the buffers the forward exchanged: the exchanges are no-remat's (the forward's
    three are not rerun) and the buffers are held (``moe_kept``); every other
    policy reruns them."""
    assert experts.KEPT_TAG == "moe_experts"
    assert not experts.reruns_exchange(sk.Recipe(remat="save_out_proj_experts"))
    assert not experts.reruns_exchange(sk.Recipe(remat="names", save_names=("moe_experts",)))
    assert experts.reruns_exchange(sk.Recipe(remat="save_out_proj"))
    assert not experts.reruns_exchange(sk.Recipe())
    mesh = sk.abstract_mesh(data=8)
    costs = {
        r: sk.plan(info, mesh, "ep", estimator="analytic", recipe=sk.Recipe(remat=r)).cost
        for r in ("none", "save_out_proj", "save_out_proj_experts")
    }
    a2a = {r: c.comm_bytes["all_to_all"] for r, c in costs.items()}
    assert a2a["save_out_proj_experts"] == a2a["none"] == _rule_bytes(8, 8)
    buf, counts = 8 * (T // 8) * min(K, E // 8) * D_MODEL * 4, 8 * (E // 8) * 4
    assert a2a["save_out_proj"] == 6 * buf + 2 * counts == a2a["none"] + 2 * buf + counts
    assert costs["save_out_proj_experts"].memory["moe_kept"] > 0
    assert "moe_kept" not in costs["save_out_proj"].memory


def test_an_ep_group_inside_one_node_exchanges_as_before(info):
    """A node-deduplicated exchange inside one node is the plain one (nothing
    crosses the network): the price is the all-to-all's."""
    import dataclasses

    mesh = sk.abstract_mesh(data=2, expert=4)
    plain = sk.Topology.h100()
    dedup = dataclasses.replace(plain, expert_exchange="node_dedup")
    costs = [
        sk.plan(info, mesh, "ep", estimator="analytic", topology=t).cost for t in (plain, dedup)
    ]
    assert costs[0].comm_time_s == costs[1].comm_time_s


@pytest.fixture(scope="module")
def long_batch():
    """The decoder on 64 sequences of 64 tokens: its exchanges outweigh its
    gradient all-reduces."""
    toks = np.random.default_rng(0).integers(0, V, (64, 65)).astype(np.int32)
    batch = {"tokens": toks[:, :-1], "targets": toks[:, 1:]}
    with nnx.use_eager_sharding(False):
        return describe(lambda: MoEDecoder(nnx.Rngs(0)), loss=decoder_loss, batch=batch)


def test_the_1f1b_overlap_hides_each_pass_exchanges_under_the_other_pass(long_batch):
    """``Topology(expert_overlap=True)`` in a step of two micro-batches: the
    forward's dispatch and combine become overlappable like the gradient
    all-reduces, the backward's two (their transposes) hide only under the
    forward's compute (a third of the step's, at the topology's overlap share);
    the collectives and the compute stay what they were; one micro-batch has
    nothing to pair with. (Links without latency: the times are the bytes'.)"""
    import dataclasses

    mesh = sk.abstract_mesh(data=2, expert=4)
    plain = dataclasses.replace(
        sk.Topology.h100(gpus_per_node=2), latency={"data": 0.0, "expert": 0.0}
    )
    paired = dataclasses.replace(plain, expert_overlap=True)

    def plan(topology, microbatches, peak):
        recipe = sk.Recipe(microbatches=microbatches)
        return sk.plan(
            long_batch,
            mesh,
            "ep",
            estimator="analytic",
            topology=topology,
            recipe=recipe,
            peak_flops=peak,
        ).cost

    t_local = 64 * 64 // 8 // 2
    busiest = experts.load_imbalance(trace_step(long_batch, None).moe_calls[E], 4, t_local)
    row = D_MODEL * 4 * busiest
    wire = int(t_local * K * row * 3 / 4)  # whole bytes on the wire
    one = plain.collective_time("all_to_all", wire, 4, ("expert",), mesh)
    exchanges = 4 * 2 * one  # four buffers a micro-batch, two micro-batches
    # ample compute: every exchange hides
    before, after = plan(plain, 2, 1e7), plan(paired, 2, 1e7)
    assert after.comm_time_s == pytest.approx(before.comm_time_s)
    assert after.compute_time_s == pytest.approx(before.compute_time_s)
    assert before.step_time_s - after.step_time_s == pytest.approx(exchanges)
    # compute of 1.2 exchanges: the backward's half hides under a third of it only
    flops = before.compute_time_s * 1e7
    before, after = (plan(t, 2, flops / (1.2 * exchanges)) for t in (plain, paired))
    compute, share = after.compute_time_s, plain.overlap
    assert share * compute / 3 < exchanges / 2
    assert before.hidden_comm_s + exchanges / 2 + share * compute / 3 < share * compute
    gained = before.step_time_s - after.step_time_s
    assert gained == pytest.approx(exchanges / 2 + share * compute / 3)
    single = plan(paired, 1, None)
    assert single.step_time_s == pytest.approx(plan(plain, 1, None).step_time_s)


def _sampled_imbalance(e, k, n_ep, t_local, groups=None, trials=2000, seed=0):
    """The busiest device's rows over the mean, averaged over sampled calls of
    uniform (group-limited) routing: ``n_ep * t_local`` tokens, ``k`` distinct
    experts each, ``e / n_ep`` contiguous experts a device."""
    rng = np.random.default_rng(seed)
    tokens = n_ep * t_local
    if groups is None:
        chosen = np.argsort(rng.random((trials, tokens, e), np.float32), -1)[..., :k]
    else:
        g, gk = groups
        per = e // g
        kept = np.argsort(rng.random((trials, tokens, g), np.float32), -1)[..., :gk]
        slots = np.argsort(rng.random((trials, tokens, gk * per), np.float32), -1)[..., :k]
        chosen = np.take_along_axis(kept, slots // per, -1) * per + slots % per
    device = chosen // (e // n_ep)
    loads = np.stack([(device == d).sum((1, 2)) for d in range(n_ep)], -1)
    return float((loads.max(-1) / (t_local * k)).mean())


@pytest.mark.parametrize(
    ("e", "k", "n_ep", "t_local", "groups"),
    [(16, 2, 4, 64, None), (32, 4, 8, 32, None), (16, 4, 8, 32, (4, 2))],
)
def test_the_load_imbalance_is_sampled_uniform_routings(e, k, n_ep, t_local, groups):
    """Forced balancing routes uniformly (Megatron-LM replaces the logits by
    standard-normal noise): the priced busiest device, the mean plus Blom's
    expected maximum of n_ep normals in standard deviations of the per-token
    (hypergeometric, or group-mixture) counts, is what sampled calls show, within
    15% of the excess over balanced (the normal approximation misses a little of
    the counts' skew at a few hundred rows a device)."""
    call = experts.MoeCall(e, n_ep * t_local, k, 8, 8, 4, 1.0, groups=groups)
    priced = experts.load_imbalance(call, n_ep, t_local)
    sampled = _sampled_imbalance(e, k, n_ep, t_local, groups)
    assert priced > 1.0
    assert priced - 1 == pytest.approx(sampled - 1, rel=0.15)


def test_the_load_imbalance_shrinks_with_the_tokens_and_a_group_limit_raises_it():
    """No expert parallelism, no imbalance; 16 times the tokens a device, a quarter
    of the excess (it falls as 1 / sqrt(T_local)); a group limit concentrating a
    token's experts in fewer devices' groups varies a device's rows more."""
    call = experts.MoeCall(256, 4096, 8, 8, 8, 4, 1.0)
    assert experts.load_imbalance(call, 1, 4096) == 1.0
    small, large = (experts.load_imbalance(call, 64, t) - 1 for t in (256, 4096))
    assert large == pytest.approx(small / 4)
    limited = experts.load_imbalance(call._replace(groups=(8, 4)), 64, 4096)
    assert limited > 1 + large
    # a limit that does not map onto the devices is left out (unlimited)
    odd = experts.load_imbalance(call._replace(groups=(128, 4)), 64, 4096)
    assert odd == pytest.approx(1 + large)


def test_an_overlapped_exchange_on_sms_of_its_own_slows_the_compute(long_batch):
    """``Topology(exchange_sms=20)`` under the 1F1B overlap: the compute runs on the
    other SMs while the exchanges run, so it grows by 20 / 132 of their time (the
    link times are the bytes' and the exchanges all overlapped); without the
    overlap, or with one micro-batch, it is unchanged."""
    import dataclasses

    mesh = sk.abstract_mesh(data=2, expert=4)
    plain = dataclasses.replace(
        sk.Topology.h100(gpus_per_node=2), latency={"data": 0.0, "expert": 0.0}
    )
    paired = dataclasses.replace(plain, expert_overlap=True)
    held = dataclasses.replace(paired, exchange_sms=20)

    def cost(topology, microbatches=2):
        recipe = sk.Recipe(microbatches=microbatches)
        return sk.plan(
            long_batch, mesh, "ep", estimator="analytic", topology=topology, recipe=recipe
        ).cost

    t_local = 64 * 64 // 8 // 2
    busiest = experts.load_imbalance(trace_step(long_batch, None).moe_calls[E], 4, t_local)
    one = plain.collective_time(
        "all_to_all", int(t_local * K * D_MODEL * 4 * busiest * 3 / 4), 4, ("expert",), mesh
    )
    exchanges = 4 * 2 * one
    grown = cost(held).compute_time_s - cost(paired).compute_time_s
    assert grown == pytest.approx(exchanges * 20 / 132)
    unpaired = dataclasses.replace(plain, exchange_sms=20)
    assert cost(unpaired).compute_time_s == pytest.approx(cost(plain).compute_time_s)
    assert cost(held, 1).compute_time_s == pytest.approx(cost(paired, 1).compute_time_s)


@pytest.mark.parametrize("mesh_axes", [{"data": 2, "expert": 4}, {"data": 8}])
def test_a_fixed_cost_per_moe_call_is_added_once_a_layer_and_micro_batch(long_batch, mesh_axes):
    """``Topology(moe_call_s=...)`` (priced only: an eager framework's fixed cost per
    MoE layer launch) adds its seconds to the compute once per routed-experts call
    and micro-batch, with or without expert parallelism; the collectives are
    unchanged."""
    import dataclasses

    mesh = sk.abstract_mesh(**mesh_axes)
    plain = sk.Topology.h100()
    held = dataclasses.replace(plain, moe_call_s=2e-3)
    calls = sum(c.calls for c in trace_step(long_batch, None).moe_calls.values())

    def cost(topology):
        return sk.plan(
            long_batch,
            mesh,
            "ep" if "expert" in mesh_axes else "dp",
            estimator="analytic",
            topology=topology,
            recipe=sk.Recipe(microbatches=2),
        ).cost

    grown = cost(held).compute_time_s - cost(plain).compute_time_s
    assert calls >= 1 and grown == pytest.approx(2e-3 * calls * 2)
    assert cost(held).comm_bytes == cost(plain).comm_bytes


def test_transposes_price_an_expert_weights_collectives_over_a_later_dim():
    """transposes_s: a pass reading and writing the whole buffer of each all-gather
    and reduce-scatter over an axis on a dim after the expert dim; none over the
    expert dim, none once a device holds one expert, none without an expert dim."""
    from types import SimpleNamespace as Ns

    topo = sk.Topology.h100()
    ctx = Ns(sizes={"data": 8, "model": 2}, topology=topo)
    g = Ns(logical=("layers", "expert", "embed", "mlp"), shape=(4, 8, 256, 512))
    colls = [
        Ns(kind="all_gather", payload=4e6, axes=("data",)),
        Ns(kind="reduce_scatter", payload=4e6, axes=("data",)),
        Ns(kind="all_reduce", payload=1e6, axes=("data",)),  # no layout of its own
        Ns(kind="all_gather", payload=2e6, axes=("model",)),  # over the expert dim
    ]
    over = lambda *dims: Ns(params=dims, opt=dims)  # noqa: E731
    fsdp = over((), ("model",), ("data",), ())
    assert experts.transposes_s(ctx, g, fsdp, colls) == pytest.approx(2 * 8e6 / topo.hbm_bandwidth)
    # an activation's collective (tensor parallelism's) over such an axis moves no weight
    sp_rs = Ns(kind="reduce_scatter", payload=3e6, axes=("data",))
    assert experts.transposes_s(ctx, g, fsdp, [*colls, sp_rs], [sp_rs]) == pytest.approx(
        2 * 8e6 / topo.hbm_bandwidth
    )
    assert experts.transposes_s(ctx, g, over((), ("data",), (), ()), colls[:2]) == 0.0
    zero = Ns(params=((), (), (), ()), opt=((), (), ("data",), ()))  # ZeRO: the state's dim
    assert experts.transposes_s(ctx, g, zero, colls[:1]) == pytest.approx(
        2 * 4e6 / topo.hbm_bandwidth
    )
    one_each = Ns(sizes={"data": 8, "expert": 8}, topology=topo)
    assert experts.transposes_s(one_each, g, over((), ("expert",), ("data",), ()), colls) == 0.0
    dense = Ns(logical=("embed", "mlp"), shape=(256, 512))
    assert experts.transposes_s(ctx, dense, over(("data",), ()), colls) == 0.0


def _expert_gathers(plan, info):
    """(gather dim, layout) of each all-gather of a whole expert weight in the
    compiled train step of ``plan``."""
    import re

    import optax

    from spmdkit.step.master import opt_init

    opt = optax.adam(1e-3)
    params = sk.init_sharded(info, plan)
    init = opt_init(opt, plan.recipe)
    state = jax.jit(init, out_shardings=plan.opt_shardings(jax.eval_shape(init, params)))(params)
    step = sk.jit(sk.train_step(info, opt, plan), plan)
    text = step.lower(params, state, info.batch).compile().as_text()
    pat = r"f32\[4,(?:64,192|192,64)\]\{([\d,]+)\} all-gather\(.*?dimensions=\{(\d)\}"
    return [(int(d), lay) for lay, d in re.findall(pat, text)]


@pytest.mark.slow
def test_xla_gathers_an_expert_weight_over_a_later_dim_in_a_transposed_layout():
    """What transposes_s prices: XLA:CPU lays an expert weight ``[E, D, F]``
    gathered over ``D`` or ``F`` out with that dim major (its experts inside, which
    no batched GEMM reads in place); gathered over ``E`` it keeps the default
    layout. And the analytic model charges the first, not the second."""
    from spmdkit.models import get_model

    spec = get_model("moe")
    cfg = spec.config("tiny")
    batch = spec.batch(cfg, 8, np.random.default_rng(0))
    info = sk.describe(spec, config=cfg, batch=batch)
    mesh = sk.make_mesh(data=4)
    fsdp = sk.plan(info, mesh, "fsdp", estimator="analytic")
    ep = sk.plan(info, mesh, "ep", estimator="analytic")
    later = _expert_gathers(fsdp, info)
    assert later and all(d > 0 and lay.split(",")[-1] == str(d) for d, lay in later)
    first = _expert_gathers(ep, info)
    assert first and all(d == 0 and lay == "2,1,0" for d, lay in first)
    free = {}
    for name in ("fsdp", "ep"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(experts, "transposes_s", lambda *a: 0.0)
            free[name] = sk.plan(info, mesh, name, estimator="analytic").cost.compute_time_s
    assert fsdp.cost.compute_time_s > free["fsdp"] and ep.cost.compute_time_s == free["ep"]

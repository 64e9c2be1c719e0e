"""The analytic cost model, per parameter group: what each layout moves and keeps."""

import pytest

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.planner.analytic import CostContext, GroupLayout, group_cost, param_groups, total_cost
from spmdkit.planner.trace import trace_step
from spmdkit.spec import axis_sizes
from spmdkit.topology import DEFAULT_TOPOLOGY
from tests.plan_model import toy_batch, toy_init, toy_loss


@pytest.fixture(scope="module")
def model(amesh):
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    trace = trace_step(info, None)
    groups = {g.key: g for g in param_groups(info, trace)}
    ctx = CostContext(amesh, axis_sizes(amesh), DEFAULT_TOPOLOGY, trace, 1e12, 1.0)
    return groups, ctx


def test_layers_share_a_group(model):
    groups, _ = model
    up = groups["mixers/*/up"]
    assert up.paths == ("mixers/0/up", "mixers/1/up") and up.count == 2
    assert up.nbytes == 32 * 64 * 4 and up.opt_bytes == 2 * up.nbytes  # adam: mu, nu


def test_data_parallel_all_reduces_the_grads(model):
    groups, ctx = model
    up = groups["mixers/*/up"]
    c = group_cost(ctx, up, GroupLayout(((), ()), ((), ())), ("data", "model"), ())
    assert dict(c.comm_bytes) == {"all_reduce": 2 * up.nbytes}
    assert c.params == c.grads == 2 * up.nbytes and c.tp_weight == 0


def test_fsdp_gathers_and_scatters_the_same_bytes(model):
    groups, ctx = model
    up = groups["mixers/*/up"]
    c = group_cost(
        ctx,
        up,
        GroupLayout((("data", "model"), ()), (("data", "model"), ())),
        ("data", "model"),
        (),
    )
    assert dict(c.comm_bytes) == {"all_gather": 2 * up.nbytes, "reduce_scatter": 2 * up.nbytes}
    assert c.params == 2 * up.nbytes / 8


def test_fsdp_gathered_once_and_held_as_the_pipeline_runs_it(model):
    from dataclasses import replace

    from spmdkit.step.recipe import Recipe

    groups, ctx = model
    up = groups["mixers/*/up"]
    layout = GroupLayout((("data", "model"), ()), (("data", "model"), ()))
    ctx = replace(ctx, recipe=Recipe(microbatches=4), memo={})
    per_mb = group_cost(ctx, up, layout, ("data", "model"), ())
    once = group_cost(replace(ctx, gather_once=True), up, layout, ("data", "model"), ())
    # per micro-batch: 4 gathers and 4 reduce-scatters; once: one gather, one reduce-scatter
    assert dict(per_mb.comm_bytes) == {
        "all_gather": 4 * 2 * up.nbytes,
        "reduce_scatter": 4 * 2 * up.nbytes,
    }
    assert dict(once.comm_bytes) == {"all_gather": 2 * up.nbytes, "reduce_scatter": 2 * up.nbytes}
    assert once.hidden_s == 0 < per_mb.hidden_s  # before the first tick, after the last
    # the gathered weights and their full-size gradient accumulators, less the shards
    assert per_mb.gathered == 0
    assert once.gathered == 2 * (2 * up.nbytes - 2 * up.nbytes / 8)
    assert once.accumulators == 2 * up.nbytes
    assert once.params == per_mb.params == 2 * up.nbytes / 8
    # bf16 compute (fp32 params): the weights gathered in bf16, the accumulators
    # and their reduce-scatter in fp32 (as Megatron-LM's main gradients)
    bf16 = replace(ctx, recipe=Recipe(microbatches=4, compute_dtype="bfloat16"), memo={})
    half = group_cost(replace(bf16, gather_once=True), up, layout, ("data", "model"), ())
    assert dict(half.comm_bytes) == {"all_gather": up.nbytes, "reduce_scatter": 2 * up.nbytes}
    assert half.accumulators == 2 * up.nbytes
    local = 2 * up.nbytes / 8
    assert half.gathered == 7 * local / 2 + (2 * up.nbytes - local)


def test_tensor_parallel_moves_activations_and_splits_compute(model):
    groups, ctx = model
    up = groups["mixers/*/up"]
    dp = group_cost(ctx, up, GroupLayout(((), ()), ((), ())), ("data",), ())
    tp = group_cost(ctx, up, GroupLayout(((), ("model",)), ((), ("model",))), ("data",), ())
    tokens_local = ctx.trace.tokens / 2
    activations = 2 * tokens_local * 32 * 4  # per layer, tokens × embed
    grads = 2 * up.nbytes / 4  # each shard's grad, summed over the data axis
    assert dict(tp.comm_bytes) == {"all_reduce": activations + grads}
    assert tp.compute_s == pytest.approx(dp.compute_s / 4) and tp.tp_weight > 0


def test_zero1_scatters_the_grads_and_gathers_the_updated_params(model):
    """ZeRO-1 as the step runs it: the gradients reduce-scattered into the
    optimizer state's shard (hidden under the backward, as FSDP's), the updated
    parameters all-gathered (exposed); no all-reduce. Once per micro-batch (the
    accumulator is kept at the shard), once in a pipeline."""
    from dataclasses import replace

    from spmdkit.step.recipe import Recipe

    groups, ctx = model
    up = groups["mixers/*/up"]
    plain = group_cost(ctx, up, GroupLayout(((), ()), ((), ())), ("data", "model"), ())
    layout = GroupLayout(((), ()), ((), ("data", "model")))
    zero1 = group_cost(ctx, up, layout, ("data", "model"), ())
    assert dict(plain.comm_bytes) == {"all_reduce": 2 * up.nbytes}
    assert dict(zero1.comm_bytes) == {"all_gather": 2 * up.nbytes, "reduce_scatter": 2 * up.nbytes}
    assert zero1.opt == plain.opt / 8
    n = 8  # each of the group's 2 members gathered on its own
    gather = 2 * ctx.topology.collective_time(
        "all_gather", int(up.nbytes * (n - 1) / n), n, ("data", "model"), ctx.mesh
    )
    assert zero1.hidden_s == pytest.approx(zero1.comm_s - gather)  # the scatter hides
    assert zero1.hidden_s < plain.hidden_s  # half an all-reduce's wire
    mb = replace(ctx, recipe=Recipe(microbatches=4), memo={})
    per_mb = group_cost(mb, up, layout, ("data", "model"), ())
    once = group_cost(replace(mb, gather_once=True), up, layout, ("data", "model"), ())
    assert dict(per_mb.comm_bytes)["reduce_scatter"] == 4 * 2 * up.nbytes
    assert dict(once.comm_bytes)["reduce_scatter"] == 2 * up.nbytes
    # a tensor-parallel weight's: reduce-scattered flat, all-reduced by a pipeline
    tp = GroupLayout(((), ("model",)), (("data",), ("model",)))
    flat = group_cost(ctx, up, tp, ("data",), ())
    piped = group_cost(replace(ctx, gather_once=True, memo={}), up, tp, ("data",), ())
    assert dict(flat.comm_bytes)["reduce_scatter"] == 2 * up.nbytes / 4
    assert "reduce_scatter" not in dict(piped.comm_bytes)
    assert dict(piped.comm_bytes)["all_reduce"] > dict(flat.comm_bytes)["all_reduce"]


def test_total_adds_the_groups(model):
    groups, ctx = model
    gs = list(groups.values())
    layout = [GroupLayout(((),) * len(g.shape), ((),) * len(g.shape)) for g in gs]
    cost = total_cost(ctx, gs, layout, ("data", "model"), ())
    assert cost.memory["params"] == sum(g.nbytes * g.count for g in gs)
    assert set(cost.comm_bytes) == {"all_reduce"} and cost.estimator == "analytic"
    # gradient all-reduces overlap with compute, up to the topology's overlap share
    assert cost.step_time_s == pytest.approx(
        cost.compute_time_s + cost.comm_time_s - cost.hidden_comm_s
    )
    assert 0 < cost.hidden_comm_s <= ctx.topology.overlap * cost.compute_time_s + 1e-15


# -- the recipe's terms ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(amesh):
    """Tiny Llama with scanned layers, at a sequence long enough for attention to count."""
    from spmdkit.models import get_model

    info = describe(get_model("llama"), config="tiny_scan", batch_size=8)
    trace = trace_step(info, None)
    groups = param_groups(info, trace)
    ctx = CostContext(amesh, axis_sizes(amesh), DEFAULT_TOPOLOGY, trace, None, 1.0)
    return groups, ctx


def _fsdp(groups):
    out = []
    for g in groups:
        dims = [()] * len(g.shape)
        i = max(range(len(g.shape)), key=lambda i: g.shape[i]) if g.shape else None
        if i is not None and g.shape[i] % 8 == 0:
            dims[i] = ("data", "model")
        out.append(GroupLayout(tuple(dims), tuple(dims)))
    return out


def _cost(llama, recipe, choice=None):
    from dataclasses import replace

    groups, ctx = llama
    return total_cost(
        replace(ctx, recipe=recipe), groups, choice or _fsdp(groups), ("data", "model"), ()
    )


def test_the_trace_finds_the_layer_scan(llama):
    _, ctx = llama
    t = ctx.trace
    assert t.layers == 2  # tiny_scan: two stacked layers
    assert 0 < t.layer_carry < t.layer_resid  # a layer keeps more than its input
    assert 0 < t.layer_dots < t.layer_resid
    assert 0 < t.attn_fwd_flops < t.attn_flops < t.flops


def test_remat_keeps_less_and_recomputes_more(amesh):
    """On 4 layers: a policy keeps its values in every layer and the recomputed
    layer's whole set besides, so on 2 layers ``dots`` (69% of a layer's residuals
    with the two-residual SwiGLU) holds more than ``none``."""
    from spmdkit.models import get_model
    from spmdkit.step.recipe import Recipe

    info = describe(get_model("llama"), config="tiny_pipe", batch_size=8)
    trace = trace_step(info, None)
    ctx = CostContext(amesh, axis_sizes(amesh), DEFAULT_TOPOLOGY, trace, None, 1.0)
    llama = (param_groups(info, trace), ctx)
    none, dots, full = (_cost(llama, Recipe(remat=r)) for r in ("none", "dots", "full"))
    acts = [c.memory["activations"] for c in (none, dots, full)]
    assert acts[0] > acts[1] > acts[2] > 0
    assert none.compute_time_s < dots.compute_time_s < full.compute_time_s


def test_bf16_compute_halves_activations_and_gathers_and_runs_faster(llama):
    from spmdkit.step.recipe import Recipe

    fp32, bf16 = _cost(llama, Recipe()), _cost(llama, Recipe(compute_dtype="bfloat16"))
    # the logits and their gradient stay float32 (the loss upcasts); the rest halves
    logits = 2 * llama[1].trace.resid_peak / 8  # 8 batch shards
    half = (fp32.memory["activations"] - logits) / 2 + logits
    assert bf16.memory["activations"] == pytest.approx(half, rel=1e-6)
    assert bf16.comm_bytes["all_gather"] == pytest.approx(fp32.comm_bytes["all_gather"] / 2, 1e-6)
    assert bf16.memory["compute_copy"] == pytest.approx(fp32.memory["params"] / 2, rel=1e-6)
    # fp32 matmuls run as TF32 (half the bf16 peak); memory-bound work moves half
    # the bytes (the fp32 master weights' update does not shrink)
    assert 0.5 * fp32.compute_time_s < bf16.compute_time_s < 0.6 * fp32.compute_time_s


def test_microbatches_split_activations_and_repeat_fsdp_collectives(llama):
    from spmdkit.step.recipe import Recipe

    one, two = _cost(llama, Recipe()), _cost(llama, Recipe(microbatches=2))
    assert two.memory["activations"] == pytest.approx(one.memory["activations"] / 2, rel=1e-6)
    assert two.comm_bytes["all_gather"] == pytest.approx(2 * one.comm_bytes["all_gather"], 1e-6)
    # smaller GEMMs re-read the weights: never faster (tiny shapes: memory bound)
    assert two.compute_time_s >= one.compute_time_s


def test_offload_moves_optimizer_state_over_the_host_link(llama):
    from spmdkit.step.recipe import Recipe

    dev, host = _cost(llama, Recipe()), _cost(llama, Recipe(offload_opt=True))
    opt = dev.memory["opt_state"] - llama[1].trace.opt_other_bytes
    assert host.memory["opt_state"] == 0
    assert host.comm_bytes["host_offload"] == pytest.approx(2 * opt, rel=1e-6)
    extra = 2 * opt / llama[1].topology.host_bandwidth
    assert host.step_time_s == pytest.approx(dev.step_time_s + extra, rel=1e-6)


def test_zero2_reduce_scatters_and_shards_the_grads(llama):
    from spmdkit.step.recipe import Recipe

    groups, _ = llama
    rep = [((),) * len(g.shape) for g in groups]
    opt = _fsdp(groups)
    zero1 = [GroupLayout(r, o.opt) for r, o in zip(rep, opt, strict=True)]
    zero2 = [GroupLayout(r, o.opt, grads_sharded=o.opt != r) for r, o in zip(rep, opt, strict=True)]
    c1, c2 = _cost(llama, Recipe(), zero1), _cost(llama, Recipe(), zero2)
    assert c2.memory["grads"] < c1.memory["grads"] == c1.memory["params"]
    # both reduce-scatter the grads into the optimizer's shard (ZeRO-1's only
    # consumer of a gradient is the update there); ZeRO-2 also keeps them there
    assert c2.comm_bytes == c1.comm_bytes and c1.comm_bytes["reduce_scatter"] > 0
    assert c1.comm_bytes.get("all_reduce", 0) < c1.comm_bytes["reduce_scatter"] / 10


def test_zero1_accumulates_the_micro_batches_grads_in_the_state_shard():
    """Tiny Llama, ``zero1`` on ``data=8``: with two micro-batches the step
    reduce-scatters each one's gradient into the optimizer state's shard and sums
    it there (the propagated step's reduce-scatters double), so the analytic
    gradient is the shard's, and the temporaries agree with propagation's; one
    micro-batch's gradient is whole until the step's reduce-scatter."""
    from spmdkit.models import get_model

    info = describe(get_model("llama"), config="tiny", batch_size=16)
    mesh = sk.abstract_mesh(data=8)
    plans = {
        (m, est): sk.plan(info, mesh, "zero1", recipe=sk.Recipe(microbatches=m), estimator=est).cost
        for m in (1, 2)
        for est in ("analytic", "propagate")
    }
    one, two = plans[1, "analytic"], plans[2, "analytic"]
    assert one.memory["grads"] == one.memory["params"]
    assert two.memory["grads"] == pytest.approx(one.memory["grads"] / 8, rel=1e-3)
    scattered = [plans[m, "propagate"].comm_bytes["reduce_scatter"] for m in (1, 2)]
    assert scattered[1] == 2 * scattered[0]
    temps = two.memory["grads"] + two.memory["activations"]
    held = plans[2, "propagate"].memory["temporaries"]
    assert 0.6 * held < temps < 1.4 * held
    # the whole gradient would hold more than twice what the step holds
    assert one.memory["grads"] + two.memory["activations"] > 2 * held


def test_sequence_parallel_attention_is_split_once_by_the_model_axis():
    """Megatron-SP gathers the sequence before attention, which runs on the local
    heads: the model axis splits attention's FLOPs once, as under megatron."""
    import spmdkit as sk
    from spmdkit.models import get_model

    info = describe(get_model("llama"), config="tiny_scan", batch_size=8)
    assert trace_step(info, None).attn_flops > 0
    mesh = sk.abstract_mesh(data=4, model=2)  # every weight splits over the 2 KV heads
    times = {
        s: sk.plan(info, mesh, s, estimator="analytic").cost.compute_time_s
        for s in ("megatron", "megatron_sp")
    }
    # the sequence split also divides the memory-bound work of the norms and
    # elementwise chains on their local tokens (a few %), not attention again
    assert 0.93 * times["megatron"] < times["megatron_sp"] <= times["megatron"]


def test_attention_is_priced_as_the_kernel_that_runs(llama):
    """The models' "auto" attention runs cuDNN's fused kernel on a GPU: causal, it
    skips the masked blocks, and its backward does not rerun the forward."""
    from dataclasses import replace

    from spmdkit.step.recipe import Recipe
    from spmdkit.topology import Topology

    _, ctx = llama
    t = ctx.trace
    assert t.attn_fused_fwd_flops == t.attn_causal_fwd_flops == t.attn_fwd_flops > 0
    topo = Topology.h100()
    fused = t.attention_flops(Recipe(), topo)
    share = topo.causal_share(t.seq_len)
    assert fused == pytest.approx(t.attn_flops * share * 7 / 9)
    # the blockwise fallback computes every block the trace counted
    fallback = replace(t, attn_fused_fwd_flops=0.0, attn_causal_fwd_flops=0.0)
    assert fallback.attention_flops(Recipe(), topo) == t.attn_flops
    # recompute adds the forward once more, as the same kernel runs it
    full = t.attention_flops(Recipe(remat="full"), topo)
    assert full == pytest.approx(fused + t.attn_fwd_flops * share)


def test_plain_attention_is_priced_by_its_score_traffic(amesh):
    """Attention without a fused kernel writes and reads its ``b·h·S·S`` scores in
    device memory: the trace counts them, and on an H100 the step pays their
    traffic beyond the FLOPs' time (the batched dots by a roofline, the softmax
    by its bytes); the fused kernel's trace counts none."""
    from dataclasses import replace

    from models.llama import LlamaConfig
    from spmdkit.models import get_model
    from spmdkit.step.recipe import Recipe
    from spmdkit.topology import Topology

    def trace(attention):
        cfg = LlamaConfig(scan_layers=True, seq_len=1024, attention=attention)
        info = describe(get_model("llama"), config=cfg, batch_size=8)
        return cfg, info, trace_step(info, None)

    cfg, info, plain = trace("xla")
    scores = 8 * cfg.n_heads * cfg.seq_len**2 * cfg.n_layers
    assert plain.attn_plain_scores == plain.attn_plain_live == scores
    assert plain.attn_plain_fwd_flops == plain.attn_fwd_flops > 0
    flops, dots, softmax = plain.plain_attention(Recipe())
    assert (dots, softmax) == (7 * scores, 7 * scores)
    assert flops == pytest.approx(plain.attention_flops(Recipe(), Topology.h100()))
    # a layer recomputed runs the forward's two passes of each kind once more
    assert plain.plain_attention(Recipe(remat="full"))[1:] == (9 * scores, 9 * scores)
    fused = trace("auto")[2]
    assert fused.attn_plain_scores == 0 and fused.plain_attention(Recipe()) == (0, 0, 0)

    topo = Topology.h100(stack="xla")
    groups = param_groups(info, plain)
    ctx = CostContext(amesh, axis_sizes(amesh), topo, plain, None, 1.0)
    args = (groups, _fsdp(groups), ("data", "model"), ())
    priced = total_cost(ctx, *args).compute_time_s
    flops_only = replace(ctx, trace=replace(plain, attn_plain_scores=0.0), memo={})
    extra = priced - total_cost(flops_only, *args).compute_time_s
    # float32 parameters: the matmuls run as TF32, the scores 4 bytes an element
    split, itemsize = 8, 4
    dots_s = dots * itemsize / split / topo.hbm_bandwidth
    flops_s = topo.compute_time(0.0, flops / split, "tfloat32")
    softmax_s = softmax * itemsize / split / topo.hbm_bandwidth
    assert dots_s > flops_s  # the dots contract head_dim: bound by their traffic
    assert extra == pytest.approx(dots_s - flops_s + softmax_s)
    # one layer's P, dP and dS live at once while its backward runs
    held = total_cost(ctx, *args).memory["attention_scores"]
    assert held == pytest.approx(3 * scores / cfg.n_layers * itemsize / split)
    flops_only = replace(flops_only, trace=replace(flops_only.trace, attn_plain_live=0.0), memo={})
    assert "attention_scores" not in total_cost(flops_only, *args).memory
    # the blockwise version moves every block's scores but holds one key block's
    blockwise = trace("blockwise")[2]
    assert blockwise.attn_plain_scores == scores
    assert blockwise.attn_plain_live == scores * 512 // cfg.seq_len


def test_memory_bound_work_is_priced_by_bytes_over_hbm(llama):
    """The fusions' bytes and the optimizer update take time at HBM bandwidth;
    a stack that fuses less (eager PyTorch) moves more of them."""
    from dataclasses import replace

    from spmdkit.step.recipe import Recipe
    from spmdkit.topology import Topology

    groups, ctx = llama
    t = ctx.trace
    assert t.elementwise_bytes(Recipe(remat="full")) > t.elementwise_bytes(Recipe()) > 0
    slow = replace(ctx, topology=Topology.h100(stack="xla"), memo={})
    fast = replace(slow, topology=replace(slow.topology, fusion_traffic=1e-12), memo={})
    args = (groups, _fsdp(groups), ("data", "model"), ())
    t_slow, t_fast = total_cost(slow, *args), total_cost(fast, *args)
    assert t_slow.compute_time_s > t_fast.compute_time_s
    eager = replace(slow, topology=replace(slow.topology, fusion_traffic=3.0), memo={})
    extra = total_cost(eager, *args).compute_time_s - t_slow.compute_time_s
    assert extra == pytest.approx(2 * (t_slow.compute_time_s - t_fast.compute_time_s), rel=0.05)


@pytest.mark.parametrize(
    ("axes", "remat"),
    [({"pipe": 2, "data": 2, "model": 8}, "full"), ({"pipe": 4, "data": 1, "model": 8}, "none")],
)
def test_tensor_parallel_bytes_match_megatron_lm(axes, remat):
    """On a Megatron mesh (TP 8 in the node, pipe and data across), the planner's
    tensor-parallel bytes per device and step equal Narayanan et al. 2021 §3: per
    layer and micro-batch, 2 all-reduces of b·s·h activations forward and 2
    backward, plus the recomputed forward's 2 under full recompute."""
    from dataclasses import replace

    import spmdkit as sk
    from models.llama import LlamaConfig
    from spmdkit.models import get_model
    from spmdkit.pipeline import Pipeline
    from spmdkit.planner.analytic import column_siblings, tensor_parallel_bytes
    from spmdkit.step.recipe import Recipe

    cfg = LlamaConfig(
        vocab=1024, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64,
        d_mlp=1536, seq_len=256, scan_layers=True,
    )  # fmt: skip
    batch, p, m = 16, axes["pipe"], 4
    mesh = sk.abstract_mesh(**axes)
    recipe = Recipe(remat=remat, compute_dtype="bfloat16", microbatches=m)
    pipe = Pipeline(stages=p, microbatches=m)
    info = describe(get_model("llama"), config=cfg, batch_size=batch)
    plain = replace(recipe, microbatches=1)  # the pipeline's micro-batches
    planned = sk.plan(info, mesh, "megatron", pipeline=pipe, recipe=plain, estimator="analytic")
    trace = trace_step(info, None)
    layer_groups = [g for g in param_groups(info, trace) if g.shape[0] == cfg.n_layers]
    stage = [replace(g, shape=(g.shape[0] // p, *g.shape[1:])) for g in layer_groups]
    choice = []
    for g in stage:  # the planned layouts, without the pipe axis (the stage's view)
        spec = tuple(planned.params[g.paths[0]]) + (None,) * len(g.shape)
        dims = tuple(
            tuple(a for a in (s if isinstance(s, tuple) else (s,)) if a and a != "pipe")
            for s in spec[: len(g.shape)]
        )
        choice.append(GroupLayout(dims, dims))
    # q, k, v, o, gate, up, down: all seven on the model axis
    assert sum(1 for d in choice if any("model" in x for x in d.params)) == 7
    ctx = CostContext(
        mesh, axis_sizes(mesh), DEFAULT_TOPOLOGY, trace, None, 1.0,
        recipe=recipe, gather_once=True, siblings=column_siblings(layer_groups),
    )  # fmt: skip
    planner = tensor_parallel_bytes(ctx, stage, choice, ("data",), ())
    b = batch // axes["data"] // m  # sequences per micro-batch
    per_layer = (4 + (2 if remat == "full" else 0)) * b * cfg.seq_len * cfg.d_model * 2
    megatron = cfg.n_layers // p * m * per_layer
    assert planner == pytest.approx(megatron, rel=0.05)


def test_named_policies_are_priced_by_what_the_layer_keeps(llama):
    """Tiny Llama's layer under each named policy, as jax differentiates it: the
    saved bytes are the tagged projections the backward reads (save_qkv_proj: q, k,
    v; mlpwo is never read, so save_dot_except_mlpwi keeps what save_dot_except_mlp
    does), fewer kept means more recomputed, and the offload form keeps the same
    bytes on the host and moves them over the host link twice per step."""
    from spmdkit.planner.levers import remat_choices
    from spmdkit.step.recipe import Recipe

    t = llama[1].trace
    named = t.layer_named
    saved = {r: t.saved_bytes(Recipe(remat=r)) for r in ("save_qkv_proj", "save_out_proj")}
    assert saved["save_qkv_proj"] == (
        named["query_proj"] + named["key_proj"] + named["value_proj"],
        0,
    )
    assert saved["save_out_proj"] == (named["out_proj"], 0)
    mlp = t.saved_bytes(Recipe(remat="save_dot_except_mlp"))
    assert t.saved_bytes(Recipe(remat="save_dot_except_mlpwi")) == mlp
    order = ("minimal", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj", "full")
    recomputed = [t.recompute_flops(Recipe(remat=r))[0] for r in order]
    assert recomputed == sorted(recomputed) and recomputed[0] < recomputed[-1]
    host = Recipe(remat="save_qkv_proj", remat_offload=True)
    assert t.saved_bytes(host) == (0, saved["save_qkv_proj"][0])
    on_device, offloaded = _cost(llama, Recipe(remat="save_qkv_proj")), _cost(llama, host)
    assert offloaded.memory["activations"] < on_device.memory["activations"]
    assert offloaded.comm_bytes["host_activations"] > 0
    assert offloaded.step_time_s >= on_device.step_time_s
    choices = remat_choices(t)
    assert ("save_dot_except_mlpwi", False, 1) in choices  # its own saving
    assert ("save_dot_except_mlp", False, 1) not in choices  # as save_dot_except_mlpwi
    assert ("save_qkv_proj", True, 1) in choices and ("full", True, 1) not in choices
    assert ("full", False, 2) not in choices  # two layers: every second is one of two


def test_every_kth_layer_recomputes_a_kth_of_the_layers(llama):
    """remat_every=2: half the layers keep what full keeps, the others all their
    residuals; half the recompute."""
    from spmdkit.step.recipe import Recipe

    t = llama[1].trace
    full, half = (t.activation_bytes(Recipe(remat="full", remat_every=k)) for k in (1, 2))
    per_layer = t.layer_resid - min(t.layer_carry, t.layer_resid)
    assert half - full == pytest.approx(t.layers / 2 * per_layer)
    assert full < half
    mm = t.recompute_flops(Recipe(remat="full"))[0]
    assert t.recompute_flops(Recipe(remat="full", remat_every=2))[0] == pytest.approx(mm / 2)


def _tp_layouts(g, sizes):
    """A group's layout with the model axis on its last dim that takes it, and its
    ZeRO variants (state, then state and grads, over the data axis too)."""
    ndim = len(g.shape)
    dims = [()] * ndim
    for i in reversed(range(ndim)):
        if g.shape[i] % sizes["model"] == 0:
            dims[i] = ("model",)
            break
    opt = list(dims)
    for i in range(ndim):
        if g.shape[i] % (sizes["data"] * (sizes["model"] if dims[i] else 1)) == 0:
            opt[i] = (*dims[i], "data")
            break
    dims, opt = tuple(dims), tuple(opt)
    return [GroupLayout(dims, dims), GroupLayout(dims, opt), GroupLayout(dims, opt, True)]


def test_a_memo_shared_by_recipes_gives_each_its_own_cost(llama):
    """Recipes (remat policies, dtypes, master weights) and a layout's ZeRO variants
    share the memo's entries where their costs agree: every cost looked up in the
    shared memo equals the one computed alone, and remat's rerun forward still
    changes a row-parallel weight's."""
    from dataclasses import replace

    from spmdkit.planner.analytic import column_siblings
    from spmdkit.step.recipe import Recipe

    groups, ctx = llama
    ctx = replace(ctx, siblings=column_siblings(groups))
    recipes = [
        Recipe(),
        Recipe(remat="full"),
        Recipe(remat="dots", compute_dtype="bfloat16"),
        Recipe(remat="full", compute_dtype="bfloat16"),
        Recipe(compute_dtype="bfloat16", master_weights="optimizer"),
    ]
    shared: dict = {}
    costs = {}
    for r in recipes:
        for g in groups:
            for lay in _tp_layouts(g, ctx.sizes):
                warm = group_cost(replace(ctx, recipe=r, memo=shared), g, lay, ("data",), ())
                alone = group_cost(replace(ctx, recipe=r, memo={}), g, lay, ("data",), ())
                assert warm == alone, (r, g.key, lay)
                costs[r, g.key, lay] = warm
    rows = [g for g in groups if g.logical and g.logical[-1] == "embed" and "layers" in g.logical]
    lay = _tp_layouts(rows[0], ctx.sizes)[0]
    plain, full = (costs[r, rows[0].key, lay] for r in recipes[:2])
    assert full.tp_bytes > plain.tp_bytes and full.comm_s > plain.comm_s

"""auto with pipelines: pipe degrees, meshes, configurations, and the plans it returns."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.introspect import describe
from spmdkit.models import get_model
from spmdkit.models.llama import LlamaConfig
from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.planner import OverBudgetError, Plan, PlanError, plan
from spmdkit.planner.pipeline.search import (
    UNEVEN_VIRTUAL,
    pipe_meshes,
    pipeline_configs,
    split_mesh,
    with_ends,
)
from spmdkit.util import divisors


def test_split_mesh_keeps_the_device_order() -> None:
    mesh = sk.make_mesh(data=4, model=2)
    split = split_mesh(mesh, 2)
    assert split.axis_names == ("pipe", "data", "model")
    assert dict(split.shape) == {"pipe": 2, "data": 2, "model": 2}
    assert list(np.asarray(split.devices).flat) == list(np.asarray(mesh.devices).flat)
    assert split_mesh(sk.abstract_mesh(data=64, model=8), 8).axis_names == ("pipe", "data", "model")
    with pytest.raises(PipelineError, match="divide"):
        split_mesh(sk.abstract_mesh(data=6), 4)


def test_pipe_degrees_divide_the_data_axis_up_to_the_layers() -> None:
    """A degree that does not divide the layers is tried too (uneven layouts),
    one above the layer count is not (a device would run no layer)."""
    degrees = [dict(m.shape)["pipe"] for m in pipe_meshes(sk.abstract_mesh(data=16, model=8), 12)]
    assert degrees == [2, 4, 8]
    given = sk.abstract_mesh(pipe=4, data=2)
    assert pipe_meshes(given, 8) == [given]


def test_pipe_degrees_of_a_126_layer_model() -> None:
    def degrees(**axes: int) -> list[int]:
        return [dict(m.shape)["pipe"] for m in pipe_meshes(sk.abstract_mesh(**axes), 126)]

    assert {2, 3, 6, 7, 9, 14, 18} <= set(degrees(data=252, model=2))
    assert 252 not in degrees(data=252, model=2)  # more stages than layers
    # 7 and 14 do not split 72; 4, 8, 12, 24, 36 and 72 split it but not 126
    assert degrees(data=72, model=8) == [2, 3, 4, 6, 8, 9, 12, 18, 24, 36, 72]


def test_pipe_degrees_that_do_not_divide_the_layers_get_balanced_layouts() -> None:
    """DeepSeek-V3's 58 MoE layers over 8 stages: every configuration has an uneven
    layout whose chunks (8 · v of them) sum to 58 and differ by at most one layer,
    as do the devices' layers; interleaved with 2 to UNEVEN_VIRTUAL (4) virtual stages."""
    configs = pipeline_configs(8, 58, 64)
    assert configs and all(c.uneven for c in configs)
    for c in configs:
        assert len(c.layout) == c.chunks and sum(c.layout) == 58
        assert max(c.layout) - min(c.layout) <= 1
        assert max(c.device_layers(58)) - min(c.device_layers(58)) <= 1
        assert c.check_layers(58) == max(c.layout)
    assert {c.virtual for c in configs if c.schedule == "interleaved"} == {2, 3, 4}
    assert {c.schedule for c in configs if c.microbatches < 8} == {"fthenb"}
    pp8x4 = next(c for c in configs if c.virtual == 4)
    assert pp8x4.layout == (1, 1, 1) + (2,) * 26 + (1, 1, 1)
    # at most UNEVEN_VIRTUAL virtual stages, and no more chunks than layers
    assert max(c.virtual for c in pipeline_configs(3, 100, 3)) == UNEVEN_VIRTUAL
    assert sorted({c.virtual for c in pipeline_configs(4, 9, 4)}) == [1, 2]
    assert pipeline_configs(16, 12, 16) == []  # more stages than layers


def test_uneven_layouts_rebalanced_for_the_end_stages() -> None:
    """with_ends takes layers off the chunks of a first or last stage with work of
    its own; even configurations stay as they are."""
    configs = pipeline_configs(8, 58, 64)
    light = with_ends(configs, 58, (3.5, 1.5))
    pp8x4 = next(c for c in light if c.virtual == 4)
    assert pp8x4.layout[0] == 0 and pp8x4.layout[-1] == 0 and sum(pp8x4.layout) == 58
    work = [n + e for n, e in zip(pp8x4.device_layers(58), (3.5, *[0] * 6, 1.5), strict=True)]
    assert max(work) == 8  # the fewest the busiest device can run: 8 layers
    assert [c.microbatches for c in light] == [c.microbatches for c in configs]
    even = pipeline_configs(4, 8, 16)
    assert with_ends(even, 8, (3.0, 3.0)) == even


def test_auto_pipelines_uneven_layouts_where_no_degree_divides_the_layers() -> None:
    """9 layers on data=4: neither 2 nor 4 divides them, so auto used to cost no
    pipeline and nothing fit 8 GB (unpipelined plans need about 13.6). It now
    pipelines 9 layers unevenly and fits."""
    cfg = LlamaConfig(
        n_layers=9, d_model=2048, d_mlp=8192, n_heads=16, n_kv_heads=4, head_dim=128,
        seq_len=2048, vocab=1024, scan_layers=True,
    )  # fmt: skip
    info = describe(get_model("llama"), config=cfg, batch_size=16)
    kw = dict(estimator="analytic", recipe=sk.Recipe(), memory_budget=8e9)
    with pytest.raises(OverBudgetError):
        plan(info, sk.abstract_mesh(data=4), "auto", **kw)
    p = plan(info, sk.abstract_mesh(data=4), "auto", pipeline="auto", **kw)
    assert p.pipeline is not None and p.pipeline.uneven
    assert sum(p.pipeline.layout) == 9 and p.pipeline.stages in (2, 4)
    assert p.cost.peak_bytes <= 8e9


def test_every_micro_batch_count_that_divides_the_replica_batch() -> None:
    """63 sequences per replica over 9 stages: every divisor, not only m = 1."""
    configs = pipeline_configs(9, 126, 63)
    assert sorted({c.microbatches for c in configs}) == [1, 3, 7, 9, 21, 63]
    assert {c.schedule for c in configs if c.microbatches < 9} == {"fthenb"}
    # interleaved with any divisor of the 14 layers per stage, where 9 divides m
    virtual = {(c.microbatches, c.virtual) for c in configs if c.schedule == "interleaved"}
    assert virtual == {(m, v) for m in (9, 63) for v in (2, 7, 14)}
    assert divisors(126) == [1, 2, 3, 6, 7, 9, 14, 18, 21, 42, 63, 126]


def test_auto_pipelines_63_sequences_in_more_than_one_micro_batch() -> None:
    """63 sequences over 9 stages used to get one micro-batch (an 89% bubble, and
    every sequence's activations held at once); under a 6 GB budget that only a
    9-stage pipeline meets, auto now runs them one sequence per micro-batch."""
    cfg = LlamaConfig(
        n_layers=9, d_model=2048, d_mlp=8192, n_heads=16, n_kv_heads=4, head_dim=128,
        seq_len=2048, vocab=1024, scan_layers=True,
    )  # fmt: skip
    info = describe(get_model("llama"), config=cfg, batch_size=63)
    p = plan(
        info,
        sk.abstract_mesh(data=9),
        "auto",
        estimator="analytic",
        recipe=sk.Recipe(),
        pipeline="auto",
        memory_budget=6e9,
    )
    assert p.pipeline == Pipeline(9, 63, "1f1b")
    assert p.cost.peak_bytes <= 6e9


def test_configurations() -> None:
    configs = [c.short() for c in pipeline_configs(4, 8, 16)]
    assert configs == [
        "pp4 fthenb m1",
        "pp4 fthenb m2",
        "pp4 1f1b m4",
        "pp4x2 interleaved m4",
        "pp4 1f1b m8",
        "pp4x2 interleaved m8",
        "pp4 1f1b m16",
        "pp4x2 interleaved m16",
    ]
    asked = Pipeline(4, 8, "1f1b")
    assert pipeline_configs(4, 8, 16, asked) == [asked]
    assert pipeline_configs(4, 8, 4, asked) == []  # 8 micro-batches do not split 4


@pytest.fixture(scope="module")
def tiny():
    return describe(get_model("llama"), config="tiny_scan", batch_size=16)


def _plan(info, budget: float | None = None, **kw) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan(
            info, sk.abstract_mesh(data=8), "auto", estimator="analytic", memory_budget=budget, **kw
        )


def test_auto_pipelines_within_the_budget(tiny) -> None:
    budget = 0.6e6
    flat = _plan(tiny, budget)
    piped = _plan(tiny, budget, pipeline="auto")
    assert flat.pipeline is None and not any("pp" in n for n, _ in flat.alternatives)
    assert piped.pipeline is not None
    assert piped.cost.peak_bytes <= budget
    assert piped.cost.step_time_s <= flat.cost.step_time_s
    # the data axis became pipe × data; the layer stacks are split over the stages
    assert dict(piped.mesh.shape) == {"pipe": 2, "data": 4}
    assert piped.params["layers/mlp/up"][0] == "pipe"
    table = piped.params["embed/embedding"]
    assert table == P() or "pipe" not in str(table)
    assert "stages: memory/device d0" in piped.table()
    # deterministic, and the JSON keeps the pipeline and the per-stage memory
    assert _plan(tiny, budget, pipeline="auto") == piped
    back = Plan.from_json(piped.to_json())
    assert back.pipeline == piped.pipeline
    assert back.cost.stage_memory == piped.cost.stage_memory


def test_auto_with_a_given_pipeline(tiny) -> None:
    asked = Pipeline(2, 4, "1f1b")
    p = _plan(tiny, pipeline=asked)
    assert p.pipeline == asked
    assert all("pp2 1f1b m4" in n for n, _ in p.alternatives)


def test_bad_pipeline_requests(tiny) -> None:
    with pytest.raises(PipelineError, match="divisible by 4"):
        _plan(tiny, pipeline=Pipeline(4, 4, "1f1b"))  # 2 layers
    with pytest.raises(PlanError, match="pipeline is None"):
        _plan(tiny, pipeline="yes")
    with pytest.raises(PipelineError, match="micro-batches from the pipeline"):
        _plan(tiny, pipeline="auto", recipe=sk.Recipe(microbatches=2))
    with pytest.raises(PipelineError, match="equal the mesh"):
        plan(tiny, sk.abstract_mesh(pipe=2, data=4), "auto", pipeline=Pipeline(1, 2, "fthenb"))
    looped = describe(get_model("llama"), config="tiny", batch_size=16)
    with pytest.raises(PipelineError, match="stacked in one scan"):
        _plan(looped, pipeline=Pipeline(2, 2, "1f1b"))
    flat = _plan(looped, pipeline="auto")  # nothing to pipeline: flat, and said so
    assert flat.pipeline is None
    assert [n for n in flat.notes if n.kind == "dropped" and "no layer stack" in n.message]


def test_a_batch_norm_cnn_asked_for_pipelines() -> None:
    """The zoo's linen ResNet (BatchNorm, no layer stack): a pipelined preset is the
    typed error at sk.plan; auto with pipeline='auto' returns a flat plan and a
    note that says why none was costed."""
    from tests.zoo.models import ZOO

    case = ZOO["resnet"]
    info = describe(case.model(), loss=case.loss, batch=case.batch(), init_args=case.init_args())
    kw = {"estimator": "analytic", "recipe": sk.Recipe()}
    with pytest.raises(PipelineError, match="stack and scan the layers"):
        plan(info, sk.abstract_mesh(pipe=2, data=4), "fsdp", pipeline=Pipeline(2, 2), **kw)
    p = plan(info, sk.abstract_mesh(data=8), "auto", pipeline="auto", **kw)
    assert p.pipeline is None and "pipe" not in p.mesh.axis_names
    (note,) = [n for n in p.notes if "pipeline='auto' costed no pipelined plan" in n.message]
    assert note.kind == "dropped" and "ResNet has no layer stack" in note.message


@pytest.mark.slow
def test_propagate_calibrates_the_pipelined_candidates(tiny) -> None:
    """Slow: the whole auto with propagation (about 5 s of CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(tiny, sk.abstract_mesh(data=8), "auto", memory_budget=0.6e6, pipeline="auto")
    costs = [c for n, c in p.alternatives if "+pp" in n]
    if p.pipeline is not None:
        costs.append(p.cost)
    assert costs
    # costed analytically, then scaled by propagating the same layouts without the pipe
    assert {c.estimator for c in costs} == {"analytic+propagate"}
    assert all(c.stage_memory for c in costs)


@pytest.mark.slow
def test_an_auto_pipelined_plan_runs_and_equals_one_device() -> None:
    """auto's pipelined plan (its mesh split from data=8) runs through the executor
    (slow: compiles the pipelined step). auto's layout reduces gradients in another
    order than one device (measured: at most 1.2e-6 of a leaf's largest gradient,
    over a handful of elements), hence atol 1e-5 of the largest."""
    import jax
    import jax.numpy as jnp

    info = describe(get_model("llama"), config="tiny_pipe", batch_size=8)
    rng = np.random.default_rng(0)
    batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, 200, s.shape), s.dtype), info.batch)
    params = info.init_fn()
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(info.loss_fn))(params, batch)
    asked = Pipeline(2, 4, "1f1b")
    p = plan(
        info, sk.make_mesh(data=8), "auto", pipeline=asked, recipe=sk.Recipe(), estimator="analytic"
    )
    assert p.pipeline == asked and dict(p.mesh.shape)["pipe"] == 2
    step = sk.jit(
        sk.value_and_grad(info.loss_fn, p), p.on(split_mesh(sk.make_mesh(data=8), 2)), enforce=False
    )
    loss, grads = step(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))


@pytest.mark.slow
def test_auto_pipelines_a_layer_combining_rows_only_without_batch_axes() -> None:
    """MoE's router statistics combine a micro-batch's rows: auto costs its
    pipelined candidates only with the batch off the other axes, unless the
    requested pipeline computes them per device's rows (the executor refuses
    them otherwise, and the plan would not run)."""
    moe = describe(get_model("moe"), config="tiny_pipe", batch_size=16)
    got = _plan(moe, pipeline="auto")
    piped = [n for n, _ in got.alternatives if "+pp" in n]
    assert piped and all("batch=-" in n for n in piped), piped
    (note,) = [n for n in got.notes if "only without the batch" in n.message]
    assert "reduce_sum over the rows" in note.message and "local_statistics" in note.fix
    asked = Pipeline(2, 4, "1f1b", local_statistics=True)
    batched = [n for n, _ in _plan(moe, pipeline=asked).alternatives if "batch=-" not in n]
    assert any("+pp" in n for n in batched)


def test_auto_pipelines_experts_per_device_statistics_when_allowed() -> None:
    """``SearchOptions(allow_local_statistics=True)``: auto's pipelined candidates
    may split the batch of a step whose router combines a micro-batch's rows, their
    pipelines computing the statistics per device's rows; and on a mesh with an
    expert axis the tensor-parallel presets are also pipelined with the experts on
    it and the batch over it and the data axis (Megatron-LM's pipelined EP)."""
    from spmdkit.planner.options import CostModel, SearchOptions
    from spmdkit.planner.search import planner_for

    info = describe(get_model("qwen3_moe"), config="small", batch_size=16)
    mesh = sk.abstract_mesh(data=4, expert=2)

    def piped(allow: bool) -> tuple[list, list]:
        opts = SearchOptions(pipeline="auto", allow_local_statistics=allow)
        planner = planner_for(info, mesh, None, CostModel(estimator="analytic"), opts)
        return planner.problem.groups, planner.pipes.pipelined("auto", None, None)

    def shards(c) -> int:
        return int(np.prod([dict(c.mesh.shape)[a] for a in c.activation["batch"]]))

    _, off = piped(False)
    assert off and not any(shards(c) > 1 for c in off)
    assert not any(c.pipeline.local_statistics for c in off)
    groups, on = piped(True)
    split = [c for c in on if shards(c) > 1]
    assert split and all(c.pipeline.local_statistics for c in split)
    ep = [c for c in split if c.rules is not None and ("expert", ("expert",)) in c.rules.entries]
    assert ep
    i = next(i for i, g in enumerate(groups) if g.key.endswith("moe/w_gate"))
    for c in ep:
        assert c.activation["batch"] == ("data", "expert")
        assert c.choice[i].params[1] == ("expert",)  # (layers, expert, embed, mlp)


def test_auto_pipelines_the_tensor_parallel_presets(tiny) -> None:
    """Besides the searched layouts, auto costs megatron, megatron_sp and tp_fsdp
    pipelined (Megatron-LM's pipelines keep tensor parallelism in the node)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(
            tiny,
            sk.abstract_mesh(data=4, model=2),
            "auto",
            estimator="analytic",
            recipe=sk.Recipe(),  # one recipe: every candidate among the 12 alternatives
            pipeline=Pipeline(2, 4, "1f1b"),
        )
    names = {n.split("+")[0] for n, _ in p.alternatives} | {p.chosen}
    assert {"megatron", "megatron_sp", "tp_fsdp"} <= names
    assert all(c.stage_memory for _, c in p.alternatives)
    # and with the distributed optimizer: the state also over the data axis (pipe 2 × data 2)
    opt = {n.split("+pp")[0]: c.memory["opt_state"] for n, c in p.alternatives}
    assert opt["megatron_sp+zero1"] == pytest.approx(opt["megatron_sp"] / 2, rel=0.05)
    assert opt["megatron+zero1"] == pytest.approx(opt["megatron"] / 2, rel=0.05)


def _layer_bytes(records, layers: int, axis: str, inside: bool = False) -> int:
    """Payload bytes of the collectives over ``axis`` in the layer loops (scans of
    ``layers`` steps) of ``records``, each body × its trip count."""
    total = 0
    for r in records:
        here = inside or (r.primitive == "scan" and r.repeat == layers)
        if here:
            for a in r.reshards:
                total += sum(c.payload_bytes for c in a.plan.collectives if axis in c.axes)
        total += r.repeat * _layer_bytes(r.body, layers, axis, here)
    return total


@pytest.mark.parametrize(("remat", "reruns"), [("none", 0), ("full", 1)])
def test_propagated_tensor_parallel_bytes_match_megatron_lm(remat, reruns, monkeypatch) -> None:
    """The propagate estimator's twin of a Megatron plan (TP 8, pipe and data
    across; an H100 target, whose XLA sums a layer's q, k, v and its gate and up
    input gradients before one all-reduce) moves Narayanan et al. 2021 §3's
    tensor-parallel bytes: per layer and micro-batch, 2 all-reduces of b·s·h
    activations forward and 2 backward. Under full recompute the formula adds the
    rerun forward's 2, of which XLA runs 1: the layer's output (after the MLP's
    all-reduce) is not read by its own backward, so jax's recompute leaves that
    reduction out (PyTorch's checkpoint reruns it). The analytic count:
    tests/planner/test_analytic.py."""
    import spmdkit.planner.candidates as candidates

    cfg = LlamaConfig(
        vocab=1024, d_model=256, n_layers=6, n_heads=8, n_kv_heads=8, head_dim=32,
        d_mlp=768, seq_len=128, scan_layers=True,
    )  # fmt: skip
    batch, m = 16, 2
    info = describe(get_model("llama"), config=cfg, batch_size=batch)
    twins = []
    propagate = candidates.propagate
    monkeypatch.setattr(
        candidates, "propagate", lambda *a, **k: twins.append(propagate(*a, **k)) or twins[-1]
    )
    recipe = sk.Recipe(remat=remat, compute_dtype="bfloat16")
    mesh = sk.abstract_mesh(pipe=2, data=2, model=8)
    plan(info, mesh, "megatron", pipeline=Pipeline(stages=2, microbatches=m), recipe=recipe)
    (twin,) = twins  # one stage's work on the model axis, every micro-batch of the step
    activation = batch // 2 // m * cfg.seq_len * cfg.d_model * 2  # b·s·h, bf16
    micro = cfg.n_layers * 2 * m  # the twin: every layer, m × data shards micro-batches
    megatron = micro * (4 + 2 * reruns) * activation  # no recompute: what XLA runs
    xla = megatron - micro * reruns * activation
    assert _layer_bytes(twin.records, cfg.n_layers, "model") == pytest.approx(xla, rel=0.05)


# -- context axes inside a pipeline: the token check at plan time --------------------


@pytest.fixture(scope="module")
def cp_llamas() -> tuple:
    """A 2-layer Llama (64 tokens, 8 sequences) with its mean loss, and the same
    with a masked mean (``ignore_index``: the devices' masked means averaged are not
    the global one, so a pipelined step refuses it with the sequence or the batch
    split over other axes)."""
    import dataclasses

    import spmdkit.nn as sknn

    def masked(model, batch):
        return sknn.cross_entropy(model(batch["tokens"]), batch["targets"], ignore_index=0)

    cfg = LlamaConfig(seq_len=64, n_layers=2, scan_layers=True)
    spec = get_model("llama")
    mean = describe(spec, config=cfg, batch_size=8)
    return mean, describe(dataclasses.replace(spec, loss=masked), config=cfg, batch_size=8)


_CP_MESH = {"pipe": 2, "context": 4}


def test_a_pipelined_context_plan_the_step_would_refuse_raises_when_planned(cp_llamas) -> None:
    """The executor's token check (spmdkit.pipeline.context_parallel) runs at sk.plan: a
    masked-mean loss asked for a pipeline with the sequence over a context axis is
    the typed error before anything compiles; the mean loss plans as before."""
    mean, masked = cp_llamas
    mesh = sk.abstract_mesh(**_CP_MESH)
    kw = {"rules": {"seq": "context"}, "pipeline": Pipeline(2, 2), "estimator": "analytic"}
    with pytest.raises(PipelineError, match=r"(?s)plan\(pipeline=\.\.\.\).*masked mean.*flat plan"):
        plan(masked, mesh, "dp", **kw)
    ok = plan(mean, mesh, "dp", **kw)
    assert ok.pipeline == Pipeline(2, 2) and ok.context.axes == ("context",)


def test_auto_leaves_refused_pipelined_context_plans_out_with_a_note(cp_llamas) -> None:
    """auto costs no pipelined candidate whose step would refuse its context axes
    and says so in a ``dropped`` note; for the mean loss it costs them (the same
    presets pipelined with the context axis are among its runner-ups)."""
    mean, masked = cp_llamas
    mesh = sk.abstract_mesh(**_CP_MESH)
    kw = {"rules": {"seq": "context"}, "pipeline": "auto", "estimator": "analytic",
          "recipe": sk.Recipe()}  # fmt: skip
    got = plan(masked, mesh, "auto", **kw)
    assert got.pipeline is None or got.context is None
    (note,) = [n for n in got.notes if "pipelined context-parallel" in n.message]
    assert note.kind == "dropped" and "masked mean" in note.message
    assert not [n for n, _ in got.alternatives if n.startswith("megatron+pp")]
    fine = plan(mean, mesh, "auto", **kw)
    assert not [n for n in fine.notes if "pipelined context-parallel" in n.message]
    assert [n for n, _ in fine.alternatives if n.startswith("megatron+pp")]


def test_a_loss_that_is_not_a_mean_over_the_rows_keeps_pipelines_off_batch_axes(cp_llamas):
    """With the batch over an axis beside the pipe axis, each device's loss is on its
    rows of a micro-batch: a masked mean is the typed error at sk.plan, planned
    without batch axes it runs; auto keeps its pipelined candidates off batch axes
    and says why."""
    mean, masked = cp_llamas
    kw = {"pipeline": Pipeline(2, 2), "estimator": "analytic"}
    with pytest.raises(PipelineError, match=r"(?s)mean over the rows.*masked mean"):
        plan(masked, sk.abstract_mesh(pipe=2, data=4), "dp", **kw)
    assert plan(masked, sk.abstract_mesh(pipe=2, model=2), "megatron", **kw).pipeline
    assert plan(mean, sk.abstract_mesh(pipe=2, data=4), "dp", **kw).activation["batch"]
    got = _plan(masked, pipeline="auto", recipe=sk.Recipe())
    piped = [n for n, _ in got.alternatives if "+pp" in n]
    assert piped and all("batch=-" in n or n.startswith("megatron") for n in piped), piped
    (note,) = [n for n in got.notes if "only without the batch" in n.message]
    assert note.kind == "dropped" and "masked mean" in note.message
    assert "combine" not in note.message  # its layers keep the rows apart


def test_auto_pipelines_with_the_sequence_on_a_context_axis(cp_llamas) -> None:
    """On a pipe mesh with a context axis, auto costs each stage with the sequence
    on it as well as with it as one more data axis: the searched layouts, and the
    tensor-parallel presets with Megatron-LM's context parallelism (under
    megatron_sp the sequence over the context and the tensor axes), priced as the
    explicit pipelined plan with that rule is."""
    from spmdkit.planner.search import planner_for

    mean, _ = cp_llamas
    mesh = sk.abstract_mesh(pipe=2, context=2, model=2)
    costs = sk.CostModel(topology=sk.Topology.h100(), estimator="analytic")
    planner = planner_for(mean, mesh, None, costs)
    got = planner.pipes.pipelined_on(mesh, planner.pipes.stages(), sk.Recipe(), None)
    cp = {(c.name, c.activation["seq"]): c for c in got if c.context}
    assert all(c.context == ("context",) for c in cp.values())
    assert ("megatron_sp", ("context", "model")) in cp and ("megatron", ("context",)) in cp
    assert any(name.startswith("searched[") and "context=2" in name for name, _ in cp)
    assert any(not c.context and c.name == "megatron_sp" for c in got)  # the plain one too
    c = cp[("megatron_sp", ("context", "model"))]
    explicit = plan(
        mean, mesh, "megatron_sp", rules={"seq": ("context", "model")}, pipeline=c.pipeline,
        estimator="analytic",
    )  # fmt: skip
    assert explicit.context.axes == ("context",)
    assert c.cost.step_time_s == pytest.approx(explicit.cost.step_time_s, rel=1e-6)
    assert c.cost.peak_bytes == pytest.approx(explicit.cost.peak_bytes, rel=1e-6)


def test_auto_splits_a_pipe_meshs_data_axis_for_context_where_it_would_unpipelined() -> None:
    """Two sequences on eight devices: pipe=2 leaves data=4, which the batch does not
    fill, so auto also costs the stages on pipe × data × context meshes (as it
    splits the data axis for context parallelism without pipelines)."""
    from spmdkit.planner.search import planner_for

    cfg = LlamaConfig(seq_len=64, n_layers=2, scan_layers=True)
    info = describe(get_model("llama"), config=cfg, batch_size=2)
    costs = sk.CostModel(topology=sk.Topology.h100(), estimator="analytic")
    planner = planner_for(info, sk.abstract_mesh(data=8), None, costs)
    got = planner.pipes.pipelined("auto", sk.Recipe(), None)
    meshes = {tuple(dict(c.mesh.shape).items()) for c in got if c.context}
    assert meshes == {
        (("pipe", 2), ("data", 2), ("context", 2)),
        (("pipe", 2), ("data", 1), ("context", 4)),
    }
    assert any(c.context and c.name.startswith("searched[batch=-,context=4]") for c in got)


def test_a_requested_uneven_layout_is_kept_as_asked() -> None:
    """auto and a preset given an uneven pipeline cost that layout, not one
    rebalanced for the end stages (only auto's own layouts are)."""
    cfg = LlamaConfig(
        n_layers=9, d_model=256, d_mlp=1024, n_heads=4, n_kv_heads=4, head_dim=64,
        seq_len=128, vocab=32000, scan_layers=True,
    )  # fmt: skip
    info = describe(get_model("llama"), config=cfg, batch_size=8)
    asked = Pipeline(2, 4, "1f1b", layout=(4, 5))  # not what auto would balance
    for strategy in ("auto", "megatron"):
        mesh = sk.abstract_mesh(pipe=2, data=2)
        p = plan(info, mesh, strategy, estimator="analytic", pipeline=asked)
        assert p.pipeline == asked, strategy

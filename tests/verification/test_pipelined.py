"""plan.verify on a pipelined step: the pipeline's collective permutes predicted exactly,
its peak memory within ±20%; tensor-parallel stages' collectives predicted and counted
as the schedule runs them."""

from __future__ import annotations

import pytest

import spmdkit as sk
from spmdkit.introspect.model import describe
from spmdkit.models import get_model
from spmdkit.pipeline import Pipeline
from spmdkit.pipeline.facts import FORWARD_SCOPE, HEAD_SCOPE, branch_runs, permute_count
from spmdkit.verification.compiled import CompiledReport, report
from spmdkit.verification.hlo import HloCollective
from spmdkit.verification.pipelined import counted_by_schedule
from tests.pipeline.steps import model, shared, unenforced_step
from tests.sampling import full


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_verify_predicts_the_pipeline_permutes(schedule):
    info = describe(get_model("llama"), config="tiny_pipe", batch_size=8)
    pipe = Pipeline(stages=2, microbatches=4, schedule=schedule)
    plan = sk.plan(info, sk.make_mesh(pipe=2, data=2), "dp", pipeline=pipe)
    # sk.jit's default, enforced path: its body replays the program, so the
    # pipeline's facts must come from the step itself
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan)
    rows = {r[0]: r for r in plan.verify(step, info.abstract_params, info.batch).rows}
    _, predicted, compiled, ok = rows["collective_permute"]
    assert ok and predicted == compiled > 0
    rep = report(step.compile(info.abstract_params, info.batch))
    runs = sum(rep.runs(c) for c in rep.collectives if c.op_name.endswith("ppermute"))
    assert runs == permute_count(pipe)


#: (model, mesh, strategy, schedule, virtual stages): the acceptance meshes, one
#: schedule each (the whole matrix's figures are in the issue notes). Each is a case of
#: CI's sample of tests/pipeline/test_execute.py's schedule matrix, whose compiled step
#: it reads (tests/pipeline/steps.py).
_MEMORY_CASES = [
    ("llama", {"pipe": 4, "data": 2}, "dp", "fthenb", 1),
    ("gpt", {"pipe": 2}, "dp", "interleaved", 2),
    # 1F1B's one-tick runs, which XLA unrolls (its adds once held several ticks'
    # weight gradients: -26% before they moved inside the tick's branch)
    ("llama", {"pipe": 2}, "dp", "1f1b", 1),
    # FSDP + TP stages, GPipe: 0.785 on jax 0.10.2 (4.22 MB against 5.37) while a
    # backward tick's working set was not counted, 0.872 with it (4.69 against 5.37)
    ("llama", {"pipe": 2, "data": 2, "model": 2}, "fsdp", "gpipe", 1),
]

#: Known misses of the pipelined peak (model, strategy, schedule) -> the least
#: predicted/compiled ratio it must keep, so a regression still fails (none today).
_PEAK_MISSES: dict = {}


def _pipe(schedule: str, stages: int, virtual: int) -> Pipeline:
    return Pipeline(stages=stages, microbatches=4, schedule=schedule, virtual=virtual)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "axes", "strategy", "schedule", "virtual"),
    [
        pytest.param(*case, marks=shared(*case[:3], _pipe(case[3], case[1]["pipe"], case[4])))
        for case in _MEMORY_CASES
    ],
)
def test_verify_predicts_the_pipelined_peak(name, axes, strategy, schedule, virtual):
    info = model(name, 16)[0]
    pipe = _pipe(schedule, axes["pipe"], virtual)
    step = unenforced_step(name, axes, strategy, pipe)  # sk.jit(..., enforce=False)
    plan = step.plan
    rows = {r[0]: r for r in plan.verify(step, info.abstract_params, info.batch).rows}
    _, predicted, compiled, ok = rows["peak memory"]
    floor = _PEAK_MISSES.get((name, strategy, schedule))
    if floor is None:
        assert ok, (predicted, compiled)
    else:  # within tolerance on some jax versions (0.12's heap packs tighter)
        assert ok or floor <= predicted / compiled, (predicted, compiled)


def test_branch_collectives_count_as_the_schedule_runs_them():
    """The compiled HLO runs a tick's lax.switch on every tick of its loop; a
    collective under a forward, backward or head scope runs only on the ticks
    of that action (m·v forwards and backwards per device, m heads)."""
    pipe = Pipeline(stages=2, microbatches=4, schedule="1f1b")
    work, ticks = branch_runs(pipe)[FORWARD_SCOPE]
    assert (work, ticks) == (4, 10)

    def col(name: str, op_name: str) -> HloCollective:
        shape = ((4, 4),)
        return HloCollective("all_reduce", shape, ("f32",), 64, 2, ((0, 1),), op_name, name=name)

    rep = CompiledReport(
        collectives=[
            col("stage", f"jit(f)/shard_map/while/body/{FORWARD_SCOPE}/dot_general"),
            col("head", f"jit(f)/while/body/{FORWARD_SCOPE}/{HEAD_SCOPE}/dot_general"),
            col("sum", "jit(f)/shard_map/psum"),
        ],
        argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0, peak_bytes=0,
        flops=None, executions={"stage": 20, "head": 10, "sum": 1},
    )  # fmt: skip
    counted = counted_by_schedule(rep, pipe)
    # 20 loop runs (10 ticks × a 2-layer scan) → 4 forwards × 2 layers
    assert [counted.runs(c) for c in rep.collectives] == [8, 4, 1]
    assert counted.bytes_by_kind() == {"all_reduce": 64 * 13}


#: megatron stages: the model axis automatic inside the pipeline (tensor parallel);
#: CI's sample leaves out gpt's interleaved (its schedule runs in CI's schedule matrix)
_TP_CASES = [
    ("gpt", {"pipe": 2, "model": 4}, "1f1b"),
    full("gpt", {"pipe": 2, "model": 4}, "interleaved"),
    ("llama", {"pipe": 2, "data": 2, "model": 2}, "gpipe"),
    ("moe", {"pipe": 2, "data": 2, "model": 2}, "fthenb"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "axes", "schedule"), _TP_CASES)
def test_tensor_parallel_stages_verify(name, axes, schedule):
    """The stages' collectives over the automatic model axis (read off the
    unpipelined step's layer scans), their residuals at the plan's layouts, the
    stage gradients' sums at their layouts, and the compiled branches counted by
    the schedule: every collective kind within ±10%, the peak within ±20%."""
    info = describe(get_model(name), config="tiny_pipe", batch_size=16)
    v = 2 if schedule == "interleaved" else 1
    pipe = Pipeline(
        stages=2, microbatches=4, schedule=schedule, virtual=v, local_statistics=name == "moe"
    )
    plan = sk.plan(info, sk.make_mesh(**axes), "megatron", pipeline=pipe)
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan)
    rows = plan.verify(step, info.abstract_params, info.batch).rows
    assert all(r[3] for r in rows), rows
    assert dict((r[0], r[1]) for r in rows)["all_reduce"] > 0


#: the distributed optimizer pipelined: (strategy, mesh); CI runs ZeRO-1 over
#: pipe × data (its gradients reduce-scattered inside the pipeline)
_SHARDED_OPT_CASES = [
    ("zero1", {"pipe": 2, "data": 4}),
    pytest.param("megatron+zero1", {"pipe": 2, "data": 2, "model": 2}, marks=pytest.mark.full),
    pytest.param("megatron_sp+zero1", {"pipe": 2, "data": 2, "model": 2}, marks=pytest.mark.full),
]

#: What plan.verify misses today, asserted so a fix shows up here: megatron_sp's
#: stages, pipelined, run collectives the prediction does not carry (the plain
#: megatron_sp pipeline's value_and_grad misses alike on main: all_gather 512 B
#: predicted vs 293.5 KiB compiled, all_to_all 0 vs 56 KiB, permutes 32 vs 24
#: KiB): inside the pipeline's shard_map the model axis is automatic and XLA lays
#: the stage's sequence-parallel activations out itself.
_SHARDED_OPT_PIPE_MISSES = {
    "megatron_sp+zero1": {"all_gather", "all_to_all", "collective_permute", "collectives total"}
}


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "axes"), _SHARDED_OPT_CASES)
def test_sharded_optimizer_pipelines_verify(strategy, axes):
    """A pipelined train step whose optimizer state is sharded over the data axis:
    every collective kind within ±10%, the peak within ±20%. The pipeline
    reduce-scatters each weight's gradient into its optimizer shard where the
    weight has no tensor-parallel axis (ZeRO-1's whole stack: at least 90% of
    those gradients' bytes, :func:`~tests.verification.test_planned.scattered_grad_bytes`),
    and all-reduces a tensor-parallel one (megatron's: the update slices it)."""
    import jax
    import optax

    from tests.verification.test_planned import scattered_grad_bytes

    info = describe(get_model("llama"), config="tiny_pipe", batch_size=8)
    pipe = Pipeline(stages=2, microbatches=2, schedule="1f1b")
    opt = optax.adam(1e-3)
    plan = sk.plan(info, sk.make_mesh(**axes), strategy, pipeline=pipe, optimizer=opt)
    step = sk.jit(sk.train_step(info, opt, plan), plan)
    args = (info.abstract_params, jax.eval_shape(opt.init, info.abstract_params), info.batch)
    verified = plan.verify(step, *args)
    missed = {r[0] for r in verified.rows if not r[3]}
    assert missed == _SHARDED_OPT_PIPE_MISSES.get(strategy, set()), str(verified)
    scattered = report(step.compile(*args)).bytes_by_kind().get("reduce_scatter", 0)
    if strategy == "zero1":
        assert scattered >= 0.9 * scattered_grad_bytes(plan) > 0
    else:
        assert scattered < 0.1 * scattered_grad_bytes(plan)
    # and the step's numbers are one device's (the scattered shards updated in
    # place); adam's first step moves a weight by lr·g/(|g|+eps), so a gradient
    # near eps summed in another order moves it by another fraction of lr (1e-3)
    import numpy as np

    spec = get_model("llama")
    params = info.init_fn()
    batch = spec.batch(spec.config("tiny_pipe"), 8, np.random.default_rng(0))
    state = (params, opt.init(params), batch)
    got = jax.device_get(step(*step.place(*state))[0])
    want = jax.jit(sk.train_step(info, opt, sk.Recipe()))(*state)[0]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=5e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "virtual", "layout"),
    # CI's sample: 1F1B (the interleaved layout runs in the executor's test)
    [("1f1b", 1, (4, 2)), full("interleaved", 2, (2, 1, 1, 2))],
)
def test_verify_predicts_an_uneven_layout(schedule, virtual, layout):
    """Issue 44: six layers in unequal chunks on pipe=2 x data=4. The layers that
    change device move by ppermute (and their gradients back), priced once each as
    propagation sees them, beside the schedule's permutes: every collective exact,
    the peak within tolerance."""
    from models.llama import LlamaConfig

    config = LlamaConfig(n_layers=6, scan_layers=True)
    info = describe(get_model("llama"), config=config, batch_size=16)
    pipe = Pipeline(stages=2, microbatches=4, schedule=schedule, virtual=virtual, layout=layout)
    plan = sk.plan(info, sk.make_mesh(pipe=2, data=4), "dp", pipeline=pipe)
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
    rows = {r[0]: r for r in plan.verify(step, info.abstract_params, info.batch).rows}
    for kind in ("collective_permute", "all_reduce", "collectives total"):
        _, predicted, compiled, ok = rows[kind]
        assert ok and predicted == compiled > 0, (kind, predicted, compiled)
    # the moves are permutes (XLA ran a padded concatenation of the stack as
    # all-to-alls and permutes of several times its bytes)
    assert "all_to_all" not in rows and "all_gather" not in rows
    assert rows["peak memory"][3], rows["peak memory"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "virtual", "layout"),
    # CI's sample: 1F1B (the interleaved layout runs in the executor's test)
    [("1f1b", 1, (3, 4)), full("interleaved", 2, (1, 2, 2, 0))],
)
def test_verify_predicts_a_stack_the_pipe_axis_does_not_divide(schedule, virtual, layout):
    """Issue 44: five or seven layers on pipe=2 x data=4, stored split over the pipe
    axis on a dim it divides (spmdkit.pipeline.stored). Each chunk's layers reach
    its device by one all-to-all (their gradients back by another), priced as
    propagation sees them: every collective exact, the peak within tolerance."""
    from models.llama import LlamaConfig

    config = LlamaConfig(n_layers=sum(layout), scan_layers=True)
    info = describe(get_model("llama"), config=config, batch_size=16)
    pipe = Pipeline(stages=2, microbatches=4, schedule=schedule, virtual=virtual, layout=layout)
    plan = sk.plan(info, sk.make_mesh(pipe=2, data=4), "dp", pipeline=pipe)
    assert plan.params["layers/mlp/up"][0] is None  # the layers off the pipe axis
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
    rows = {r[0]: r for r in plan.verify(step, info.abstract_params, info.batch).rows}
    for kind in ("all_to_all", "collective_permute", "all_reduce", "collectives total"):
        _, predicted, compiled, ok = rows[kind]
        assert ok and predicted == compiled > 0, (kind, predicted, compiled)
    assert "all_gather" not in rows
    assert rows["peak memory"][3], rows["peak memory"]


def test_a_chunks_routed_experts_stay_split_over_the_batch_axes():
    """Expert parallelism over the data axis (the ``ep`` preset on pipe 2 x data 4):
    the pipeline gathers a chunk's weights over the batch axes at its input but for
    the routed experts' ``expert`` dim, which stays split (a device runs its own
    experts), so the chunk a device computes with holds a quarter of each expert
    weight and every other stacked weight whole over ``data``."""
    import math

    import numpy as np

    from spmdkit.verification.pipelined import chunk_weight_bytes

    info = describe(get_model("qwen3_moe"), config="tiny", batch_size=16)
    pipe = Pipeline(stages=2, microbatches=2, schedule="1f1b", local_statistics=True)
    plan = sk.plan(
        info, sk.abstract_mesh(pipe=2, data=4), "ep", pipeline=pipe, estimator="analytic"
    )
    assert tuple(plan.params["layers/moe/w_gate"]) == ("pipe", "data")
    want = 0.0
    for shape, dtype, logical in plan.info.values():
        if logical and logical[0] == "layers":
            split = 2 * (4 if "expert" in logical else 1)  # pipe, then the experts over data
            want += math.prod(shape) * np.dtype(dtype).itemsize / split
    assert any("expert" in (names or ()) for _, _, names in plan.info.values())
    assert chunk_weight_bytes(plan, ("data",)) == pytest.approx(want)
    assert chunk_weight_bytes(plan) == pytest.approx(want)

"""The pipelined executor: loss and grads equal the single-device run, for every schedule."""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit as sk
from spmdkit.introspect.model import describe
from spmdkit.models import get_model
from spmdkit.pipeline import Pipeline, PipelineError, build_schedule
from spmdkit.pipeline.execute import pipelined_value_and_grad
from spmdkit.pipeline.tables import build_tables, forward_ticks
from spmdkit.step.recipe import RecipeError
from spmdkit.verification.compiled import report
from spmdkit.verification.hlo import parse_collectives
from tests.pipeline.steps import model as _model
from tests.pipeline.steps import reference, shared, unenforced_step
from tests.sampling import full, latin, sampled


def _check(
    name: str,
    axes: dict,
    pipe: Pipeline,
    strategy: str = "dp",
    rows: int = 16,
    enforce: bool = False,
) -> sk.PlannedFunction:
    """The pipelined step's loss and grads equal one device's (the unenforced step
    built once per process: tests/pipeline/steps.py)."""
    info, params, batch = _model(name, rows)
    if enforce:
        plan = sk.plan(info, sk.make_mesh(**axes), strategy, pipeline=pipe)
        step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan)
    else:
        step = unenforced_step(name, axes, strategy, pipe, rows)
    _assert_equal(step(params, batch), reference(name, rows))
    return step


#: llama (16 rows) on pipe=2 x data=2 x model=2, fsdp, 4 micro-batches: the enforced-step
#: and tick-branch tests and the schedule matrix's cases there read one compiled step
_FSDP_AXES = {"pipe": 2, "data": 2, "model": 2}


def _fsdp_pipe(schedule: str) -> Pipeline:
    return Pipeline(stages=2, microbatches=4, schedule=schedule)


def _assert_equal(got, want) -> None:
    """Loss and grads equal: fp32 rtol 1e-5, with an absolute floor of 1e-5 of the
    largest gradient entry (the micro-batches sum in another order, and GPT's key
    biases have a gradient that is exactly zero in exact arithmetic: rounding noise
    of 1e-10 here)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(ref_grads))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.slow
@pytest.mark.filterwarnings("error:.*no sharding rule")
def test_1f1b_on_two_stages_equals_one_device():
    """Through sk.jit's default (enforced) path, every equation of the step with a
    rule (the embedding's cotangents are ``unstack``ed: the transpose of the
    micro-batches' ``stack``)."""
    pipe = Pipeline(stages=2, microbatches=2, schedule="1f1b")
    _check("llama", {"pipe": 2}, pipe, rows=8, enforce=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(s, marks=shared("llama", _FSDP_AXES, "fsdp", _fsdp_pipe(s)))
        for s in ("1f1b", "gpipe")
    ],
)
def test_the_enforced_step_runs_the_stages_sharded_like_the_plain_one(schedule):
    """sk.jit's default enforced replay on pipe × data × model (fsdp): equal to one
    device, and the compiled step computes what the unenforced one does (the
    replay used to pin the pipeline's operands replicated over data and model,
    taking the shard_map's specs for every axis, and every device computed the
    whole micro-batch: 4x the flops; then GPipe's residuals, the forward
    shard_map's outputs, stayed pinned replicated: 2.9x)."""
    step = _check("llama", _FSDP_AXES, _fsdp_pipe(schedule), "fsdp", enforce=True)
    assert step.enforce
    _, params, batch = _model("llama", 16)
    # sk.jit(step.fn, step.plan, enforce=False)
    loose = unenforced_step("llama", _FSDP_AXES, "fsdp", _fsdp_pipe(schedule))
    assert loose.plan.pipeline == step.plan.pipeline and not loose.enforce
    # step.compile: the executable the call above ran (compiled once, not again)
    flops = [f.compile(params, batch).cost_analysis()["flops"] for f in (step, loose)]
    assert flops[0] == pytest.approx(flops[1], rel=0.05)


#: (mesh, virtual stages, strategy on the other axes). fsdp on the 3-axis mesh: the
#: stage's weights sharded over data and model, gathered inside the pipeline.
_MESHES = [
    ({"pipe": 2, "data": 2, "model": 2}, 1, "fsdp"),
    ({"pipe": 4, "data": 2}, 1, "dp"),
    ({"pipe": 2}, 2, "dp"),
]


_SCHEDULES = ["gpipe", "fthenb", "1f1b", "interleaved"]
_NAMES = ["gpt", "llama"]
#: Every schedule x mesh x model. CI's sample (tests/sampling.py) takes the cases where
#: each schedule runs on each mesh with one of the two models, alternating, whose steps
#: the fsdp tests above and tests/verification/test_pipelined.py's peak cases compile
#: too (each case is marked with the step it shares: tests/pipeline/steps.py), less
#: the five of :data:`_SCHEDULES_LEFT_OUT`: 7 of 24, every schedule on one or two
#: meshes, every mesh with two or three schedules, both models; the models' layers
#: differ, their pipelines do not.
_SCHEDULE_CASES = [
    (schedule, i, name) for schedule in _SCHEDULES for i in range(len(_MESHES)) for name in _NAMES
]
#: (schedule, mesh) pairs of the alternation that compile steps of their own (the
#: costliest) and whose schedule and mesh the sample runs elsewhere.
_SCHEDULES_LEFT_OUT = {("gpipe", 1), ("fthenb", 0), ("fthenb", 2), ("1f1b", 2), ("interleaved", 0)}


def _schedule_pipe(schedule: str, mesh: int) -> Pipeline | None:
    """The pipeline of a matrix case; None where its stages do not divide 4 layers."""
    axes, virtual, _ = _MESHES[mesh]
    p = axes["pipe"]
    v = 1 if schedule == "1f1b" else max(virtual, 2) if schedule == "interleaved" else virtual
    return None if 4 % (p * v) else Pipeline(p, microbatches=4, schedule=schedule, virtual=v)


def _schedule_params() -> list:
    sample = {
        case
        for case in latin(_SCHEDULES, range(len(_MESHES)), _NAMES[::-1])
        if case[:2] not in _SCHEDULES_LEFT_OUT
    }
    cases = sampled(_SCHEDULE_CASES, sample)
    for k, (schedule, i, name) in enumerate(_SCHEDULE_CASES):
        pipe = _schedule_pipe(schedule, i)
        if pipe is not None:
            mark = shared(name, _MESHES[i][0], _MESHES[i][2], pipe)
            cases[k] = pytest.param(*cases[k].values, marks=[*cases[k].marks, mark])
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "mesh", "name"),
    _schedule_params(),
    ids=[f"{s}-axes{i}-{_MESHES[i][1]}-{_MESHES[i][2]}-{n}" for s, i, n in _SCHEDULE_CASES],
)
def test_every_schedule_equals_one_device(schedule, mesh, name):
    axes, _, strategy = _MESHES[mesh]
    pipe = _schedule_pipe(schedule, mesh)
    if pipe is None:
        pytest.skip(f"{axes['pipe']} stages x 2 chunks do not divide 4 layers")
    _check(name, axes, pipe, strategy)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule"), [("gpt", "1f1b"), ("llama", "gpipe")])
def test_megatron_on_pipe_data_model_equals_one_device(name, schedule):
    """Tensor-parallel stages with a data axis beside them: the vocab-parallel
    head's cross-entropy inside the pipeline (a gather along the model-sharded
    class dim aborted XLA's SPMD partitioner inside the partially manual
    shard_map; the reference now selects the target by a class mask)."""
    pipe = Pipeline(stages=2, microbatches=4, schedule=schedule)
    _check(name, {"pipe": 2, "data": 2, "model": 2}, pipe, "megatron")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule"), [("gpt", "gpipe"), ("llama", "1f1b")])
def test_sequence_parallel_stages_equal_one_device(name, schedule):
    """megatron_sp (the sequence split over the model axis between the tensor-parallel
    blocks) inside the stages, a data axis beside them."""
    pipe = Pipeline(stages=2, microbatches=4, schedule=schedule)
    _check(name, {"pipe": 2, "data": 2, "model": 2}, pipe, "megatron_sp")


def test_tables_hold_what_the_schedule_holds():
    pipe = Pipeline(stages=4, microbatches=8, schedule="1f1b")
    sched = build_schedule(pipe)
    t = build_tables(sched)
    assert t.n_stash == max(sched.peak_in_flight)
    kinds = t.fields["kind"]
    assert (kinds == 1).sum() == (kinds == 2).sum() == pipe.microbatches * pipe.chunks
    gp = build_schedule(Pipeline(stages=4, microbatches=8, schedule="gpipe"))
    assert build_tables(gp).n_stash == 8  # every micro-batch held at the end of the forwards
    assert forward_ticks(gp) == 8 + 4 - 1


def test_a_loss_without_a_layer_scan_is_typed():
    info = describe(get_model("llama"), config="tiny", batch_size=4)
    mesh = sk.make_mesh(pipe=2)
    f = pipelined_value_and_grad(info.loss_fn, Pipeline(stages=2, microbatches=2), mesh)
    with pytest.raises(PipelineError, match="scan"):
        jax.eval_shape(f, info.abstract_params, info.batch)


def _layers(params: dict, batch: dict) -> tuple:
    """A layer stack whose stage input is a tuple: the hidden state and a per-row
    gate, both carried (and both changed) by every layer."""
    h = batch["x"] @ params["emb"]
    g = jax.nn.sigmoid(batch["x"][:, 0])

    def layer(c: tuple, w: jax.Array) -> tuple:
        h, g = c
        return (jnp.tanh(h @ w) * g[:, None], g * 0.9 + 0.05), None

    return jax.lax.scan(layer, (h, g), params["layers"])[0]


def _scanned_loss(params: dict, batch: dict) -> jax.Array:
    h, g = _layers(params, batch)
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2) + jnp.mean(g)


@pytest.mark.parametrize(
    ("schedule", "virtual", "axes"),
    [
        ("gpipe", 1, {"pipe": 2}),
        ("1f1b", 1, {"pipe": 2}),
        ("interleaved", 2, {"pipe": 2}),
        ("fthenb", 1, {"pipe": 2, "data": 2}),
    ],
)
@pytest.mark.slow
def test_tuple_stage_inputs_and_the_last_stages_outputs_in_row_order(schedule, virtual, axes):
    """A tuple stage input (hidden state and a per-row gate), and
    ``Pipeline(return_output=True)``: ``((loss, outputs), grads)``, the outputs
    the layer stack's final carried values for every example, in the batch's row
    order (micro-batches are strided rows), equal to the unpipelined stack's."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    params = {"emb": f32(6, 8), "layers": f32(4, 8, 8) * 0.5, "head": f32(8, 3)}
    batch = {"x": f32(16, 6), "y": f32(16, 3)}
    pipe = Pipeline(
        stages=2, microbatches=4, schedule=schedule, virtual=virtual, return_output=True
    )
    batch_axes = ("data",) if "data" in axes else ()
    n = int(np.prod(list(axes.values())))
    devices = np.array(jax.devices()[:n]).reshape(tuple(axes.values()))
    mesh = jax.sharding.Mesh(devices, tuple(axes))  # automatic axes, no context mesh
    f = pipelined_value_and_grad(_scanned_loss, pipe, mesh, batch_axes)
    (loss, outputs), grads = jax.jit(f)(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(_scanned_loss)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(outputs, _layers(params, batch), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_return_output_is_refused_by_the_training_step():
    info = describe(get_model("llama"), config="tiny_pipe", batch_size=4)
    pipe = Pipeline(stages=2, microbatches=2, return_output=True)
    plan = sk.plan(info, sk.abstract_mesh(pipe=2), "dp", pipeline=pipe)
    with pytest.raises(RecipeError, match="return_output=False"):
        sk.train_step(info.loss_fn, optax.adam(1e-3), plan)


def _moe_reference(info, params, batch, groups):
    """The mean over ``groups`` (row index arrays) of the loss on those rows, and its
    gradient: what a pipeline computes when every micro-batch (or every device's
    rows of one) runs the whole loss, its load-balancing statistics included. The
    groups are of one size: a scan over them compiles the loss once, not once per
    group (the parameters ride in its carry, unchanged: flax modules are not closed
    over across trace levels)."""
    rows = np.stack(groups)

    def loss(p, b):
        grouped = jax.tree.map(lambda x: x[rows], b)  # (groups, rows of one, ...)
        _, values = jax.lax.scan(lambda q, g: (q, info.loss_fn(q, g)), p, grouped)
        return jnp.mean(values)

    return jax.jit(jax.value_and_grad(loss))(params, batch)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("axes", "strategy", "schedule", "virtual", "local"),
    [
        # experts over the automatic model axis inside the stages; the batch over data
        # (CI's sample, tests/sampling.py: the first; a pipe-only mesh's whole-batch
        # statistics run in test_moe_on_one_pipe_axis_equals_the_micro_batched_loss, the
        # other schedules' stages in CI's schedule matrix)
        ({"pipe": 2, "data": 2, "model": 2}, "megatron", "1f1b", 1, True),
        full({"pipe": 2, "data": 2, "model": 2}, "megatron", "interleaved", 2, True),
        full({"pipe": 2, "data": 2, "model": 2}, "tp_fsdp", "fthenb", 1, True),
        # the batch over every axis but pipe (experts gathered with the stage's weights)
        full({"pipe": 2, "data": 2, "model": 2}, "ep", "gpipe", 1, True),
        # no batch axis: the statistics are the whole micro-batch's
        full({"pipe": 2, "model": 4}, "megatron", "1f1b", 1, False),
    ],
)
def test_moe_stages_equal_the_micro_batched_loss(axes, strategy, schedule, virtual, local):
    """MoE's load-balancing loss, summed over the layers in the scan's carry from the
    constant 0, starts from it for every micro-batch and crosses the stages with it.
    The pipelined loss and grads equal the mean of the loss over the micro-batches
    (micro-batch j: rows j, j+m, ...) or, with ``local_statistics``, over each
    device's rows of each micro-batch (contiguous parts of its rows)."""
    info, params, batch = _moe("tiny_pipe", 16)
    m = 4
    pipe = Pipeline(
        stages=axes["pipe"], microbatches=m, schedule=schedule, virtual=virtual,
        local_statistics=local,
    )  # fmt: skip
    plan = sk.plan(info, sk.make_mesh(**axes), strategy, pipeline=pipe)
    shards = int(np.prod([axes[a] for a in plan.activation.get("batch", ()) if a != "pipe"]))
    assert (shards > 1) == local
    groups = [part for j in range(m) for part in np.split(np.arange(j, 16, m), shards)]
    ref_loss, ref_grads = _moe_reference(info, params, batch, groups)
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
    _assert_equal(step(params, batch), (ref_loss, ref_grads))
    # the full batch's statistics differ: the reference is not trivially the same
    full_loss = jax.jit(info.loss_fn)(params, batch)
    assert abs(float(full_loss) - float(ref_loss)) > 1e-5


def _moe(config: str, batch_size: int):
    info = describe(get_model("moe"), config=config, batch_size=batch_size)
    rng = np.random.default_rng(0)
    batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, 200, s.shape), s.dtype), info.batch)
    return info, info.init_fn(), batch


@pytest.mark.slow
def test_moe_on_one_pipe_axis_equals_the_micro_batched_loss():
    """The constant-started carry (MoE's load-balancing sum) on a pipe-only mesh:
    every micro-batch runs the whole loss, as with sk.value_and_grad's micro-batches."""
    info, params, batch = _moe("tiny_scan", 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("pipe",))
    f = pipelined_value_and_grad(info.loss_fn, Pipeline(stages=2, microbatches=2), mesh)
    micro = sk.value_and_grad(info.loss_fn, sk.Recipe(microbatches=2))
    _assert_equal(jax.jit(f)(params, batch), jax.jit(micro)(params, batch))


@pytest.mark.slow
def test_a_layer_that_combines_rows_needs_local_statistics():
    """With a batch axis beside the pipe axis each device runs its stages on its own
    rows: MoE's router statistics (a mean over the micro-batch's tokens) would be
    its rows' alone, so that is a typed error unless asked for."""
    info = describe(get_model("moe"), config="tiny_scan", batch_size=8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "data"))
    pipe = Pipeline(stages=2, microbatches=2)
    f = pipelined_value_and_grad(info.loss_fn, pipe, mesh, ("data",))
    with pytest.raises(PipelineError, match=r"reduce_sum over the rows.*local_statistics=True"):
        jax.eval_shape(f, info.abstract_params, info.batch)
    pipe = Pipeline(stages=2, microbatches=2, local_statistics=True)
    f = pipelined_value_and_grad(info.loss_fn, pipe, mesh, ("data",))
    jax.eval_shape(f, info.abstract_params, info.batch)


def test_aux_arrays_are_typed():
    info = describe(get_model("llama"), config="tiny_pipe", batch_size=4)
    mesh = sk.abstract_mesh(pipe=2)
    plan = sk.plan(info, mesh, "dp", pipeline=Pipeline(stages=2, microbatches=2))

    def loss(p, b):
        value = info.loss_fn(p, b)
        return value, {"twice": 2 * value}

    f = sk.value_and_grad(loss, plan, has_aux=True)
    with pytest.raises(RecipeError, match="no aux arrays"):
        jax.eval_shape(f, info.abstract_params, info.batch)


# -- the compiled tick: only its own branch runs ---------------------------------------

_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALLS = re.compile(r"\b(?:body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            current = comps.setdefault(m["name"], [])
        elif current is not None:
            current.append(line)
    return comps


def _branches(line: str) -> list[str]:
    return [b.strip().lstrip("%") for g in _BRANCHES.findall(line) for b in g.split(",")]


def _reach(comps: dict, roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += _CALLS.findall(line) + _branches(line)
    return seen


def _lines(comps: dict, names: set[str], op: str) -> list[str]:
    pattern = re.compile(rf"= \S+ {op}\(")
    return [line for name in names for line in comps[name] if pattern.search(line)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(s, marks=shared("llama", _FSDP_AXES, "fsdp", _fsdp_pipe(s)))
        for s in ("gpipe", "1f1b")
    ],
)
def test_a_tick_runs_only_its_own_branch_on_a_mesh_with_other_axes(schedule):
    """pipe=2 × data=2 × model=2, fsdp: each tick is a conditional on the tick
    table's action whose idle branch computes nothing, whose forward and backward
    branches hold the stage's matmuls (the backward's more), and no matmul of the
    tick loop sits outside a branch (a masked tick computes both and selects). The
    collectives inside the branches stay within one pipe stage (every device of a
    stage takes the same branch) and none is a collective permute (XLA:CPU's
    permute meets all devices: inside a branch it would deadlock)."""
    _, params, batch = _model("llama", 16)
    step = unenforced_step("llama", _FSDP_AXES, "fsdp", _fsdp_pipe(schedule))
    text = step.compile(params, batch).as_text()
    comps = _computations(text)
    conds = [line for lines in comps.values() for line in lines if " conditional(" in line]
    ticks = [_branches(line) for line in conds]
    kinds = [b for b in ticks if len(b) == (2 if schedule == "gpipe" else 3)]
    assert kinds, "no conditional on the tick's action"
    in_branches: set[str] = set()
    forward = 0
    for branches in ticks:
        in_branches |= _reach(comps, branches)
    for branches in kinds:
        dots = [len(_lines(comps, _reach(comps, [b]), "dot")) for b in branches]
        if dots[1] > 0:
            forward += 1
            assert dots[0] == 0, dots  # idle
            assert schedule == "gpipe" or dots[2] > dots[1], dots  # backward > forward
    assert forward >= 1
    loop = [
        line
        for name in comps.keys() - in_branches
        for line in _lines(comps, {name}, "dot")
        if "shard_map/while" in line
    ]
    assert loop == [], f"{len(loop)} stage matmuls of the tick loop run outside the branches"
    header = text.splitlines()[0]
    inside = [line for name in in_branches for line in comps[name]]
    stages = [set(range(0, 4)), set(range(4, 8))]  # partition ids: pipe is the major axis
    for c in parse_collectives("\n".join([header, *inside])):
        assert c.kind != "collective_permute", c.op_name
        for group in c.replica_groups:
            assert any(set(group) <= s for s in stages), (c, group)


# -- gradients reduced once per step ----------------------------------------------------


def _collective_runs(axes: dict, strategy: str, schedule: str, m: int) -> dict[str, int]:
    """Runs per step of each collective kind over more than one device (loop trip
    counts included) in the compiled pipelined step, ``m`` micro-batches of 4 rows."""
    info = describe(get_model("gpt"), config="tiny_pipe", batch_size=4 * m)
    pipe = Pipeline(stages=axes["pipe"], microbatches=m, schedule=schedule)
    plan = sk.plan(info, sk.make_mesh(**axes), strategy, pipeline=pipe)
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan)
    rep = report(step, info.abstract_params, info.batch)
    runs: dict[str, int] = {}
    for c in rep.collectives:
        if c.group_size > 1 and c.kind != "collective_permute":
            runs[c.kind] = runs.get(c.kind, 0) + rep.runs(c)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("axes", "strategy", "schedule"),
    [({"pipe": 4, "data": 2}, "dp", "1f1b"), ({"pipe": 2, "data": 2, "model": 2}, "fsdp", "gpipe")],
)
def test_gradients_are_reduced_once_per_step_whatever_the_micro_batches(axes, strategy, schedule):
    """The batch axes are manual inside the pipeline: a device accumulates its
    stages' weight gradients over the micro-batches and they are summed over the
    data axes once, at the end of the step; fsdp weights are gathered once, at
    the pipeline's input. So the compiled step runs as many all-reduces,
    reduce-scatters and all-gathers for 8 micro-batches as for 4 (main: the
    weight gradients were all-reduced inside every backward tick, and fsdp's
    gathers ran per tick: 4.09 MB of all-reduce for GPT 1F1B on pipe=4 x data=2)."""
    four, eight = (_collective_runs(axes, strategy, schedule, m) for m in (4, 8))
    assert four == eight
    assert four.get("all_reduce", 0) <= 4


def _stage_gradient_bytes(strategy: str, schedule: str) -> tuple[dict, float]:
    """Compiled collective bytes by kind of a pipelined llama step on pipe=2 x
    data=4, and the stacked layer weights' bytes on one device of a stage."""
    info, params, batch = _model("llama", 8)
    ref = reference("llama", 8)
    pipe = Pipeline(stages=2, microbatches=2, schedule=schedule)
    plan = sk.plan(info, sk.make_mesh(pipe=2, data=4), strategy, pipeline=pipe)
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
    _assert_equal(step(params, batch), ref)
    by_kind: dict[str, float] = {}
    for c in parse_collectives(step.compile(params, batch).as_text()):
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.payload_bytes
    stacked = sum(x.nbytes for x in jax.tree.leaves(params["layers"])) / 2
    return by_kind, stacked


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_fsdp_stage_gradients_are_reduce_scattered(schedule):
    """FSDP weights split over the batch axes: a stage's gradients leave the
    pipeline reduce-scattered to the plan's layout (1F1B scatters its
    accumulators itself; GPipe's are autodiff's transpose of gathering the weights
    inside), not all-reduced and sliced (twice the bytes: main before). What
    all-reduces remain are the embedding lookup's, the loss's, the head's and the
    embedding cotangents' over the pipe axis (and GPipe's head gradients over
    every device: its shared weights enter replicated)."""
    by_kind, stacked = _stage_gradient_bytes("fsdp", schedule)
    assert by_kind.get("reduce_scatter", 0) >= stacked
    assert by_kind.get("all_reduce", 0) < 0.5 * stacked, by_kind


@pytest.mark.slow
def test_data_parallel_stage_gradients_are_all_reduced():
    """Weights replicated over the batch axes (dp): their gradients are all-reduced."""
    by_kind, stacked = _stage_gradient_bytes("dp", "1f1b")
    assert by_kind.get("all_reduce", 0) >= stacked
    assert by_kind.get("reduce_scatter", 0) < 0.1 * stacked, by_kind


@pytest.mark.slow
def test_bf16_stage_gradients_accumulate_in_float32():
    """Under bf16 compute (fp32 master weights) the stages' gradients accumulate
    over the micro-batches in float32 and reach the fp32 parameters without a
    bf16 rounding, as sk.value_and_grad's micro-batches do (and Megatron-LM's
    main gradients): on one pipe axis the two compute the same sums (main:
    accumulated in bf16, 7.8e-4 apart in norm)."""
    info, params, batch = _model("llama", 8)
    bf16 = sk.Recipe(compute_dtype="bfloat16")
    micro = jax.jit(
        sk.value_and_grad(info.loss_fn, sk.Recipe(compute_dtype="bfloat16", microbatches=4))
    )
    want = micro(params, batch)[1]
    pipe = Pipeline(stages=2, microbatches=4, schedule="1f1b")
    plan = sk.plan(info, sk.make_mesh(pipe=2), "dp", pipeline=pipe, recipe=bf16)
    got = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)(params, batch)[1]
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(got))
    diff = sum(
        float(jnp.sum((g - w) ** 2))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )
    norm = sum(float(jnp.sum(w**2)) for w in jax.tree.leaves(want))
    assert (diff / norm) ** 0.5 < 1e-5


# CI's slow step leaves this out (SPMDKIT_FULL_SWEEP=1 runs it): the stage gradients' float32
# accumulation stays in CI's sample (test_bf16_stage_gradients_accumulate_in_float32)
@pytest.mark.full
@pytest.mark.slow
def test_gpipe_accumulates_bf16_gradients_in_float32():
    """GPipe's gradients are autodiff's transpose of its forward ticks: it runs with
    the fp32 parameters of the bf16 casts and casts them where a tick reads them,
    so the transpose sums the micro-batches' gradients in float32. Measured on
    the head at m=32 against sk.value_and_grad's fp32 accumulation: 8.0e-4 apart
    in norm (6.6e-3 when GPipe ran the bf16 casts and summed in bf16). GPipe's
    whole-program autodiff rounds bf16 activations differently from the per-chunk
    vjps (the embedding's gradient, which sums nothing over ticks, stays 1e-2
    apart), so only the head, whose sum dominates, is checked tightly."""
    m = 32
    info, params, batch = _model("llama", m)
    bf16 = sk.Recipe(compute_dtype="bfloat16")
    micro = sk.value_and_grad(info.loss_fn, sk.Recipe(compute_dtype="bfloat16", microbatches=m))
    want = jax.jit(micro)(params, batch)[1]
    pipe = Pipeline(stages=2, microbatches=m, schedule="gpipe")
    plan = sk.plan(info, sk.make_mesh(pipe=2), "dp", pipeline=pipe, recipe=bf16)
    got = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)(params, batch)[1]
    head = float(
        jnp.linalg.norm(got["lm_head"] - want["lm_head"]) / jnp.linalg.norm(want["lm_head"])
    )
    assert got["lm_head"].dtype == jnp.float32
    assert head < 2e-3


# -- a backward's gradients leave the tick's switch, not the accumulators --------------


def _switches(jaxpr) -> list:
    """The three-branch ``cond`` equations (a tick's idle / forward / backward) in
    ``jaxpr`` and every jaxpr nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond" and len(eqn.params["branches"]) == 3:
            found.append(eqn)
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(item, "jaxpr", item)  # a closed jaxpr's own
                if hasattr(sub, "eqns"):
                    found += _switches(sub)
    return found


@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("interleaved", 2)])
@pytest.mark.slow
def test_the_switch_returns_one_chunks_gradients_and_reads_the_accumulators(schedule, virtual):
    """A backward's chunk gradients are the tick's ``lax.switch`` result and are
    added to the accumulators after it: were the accumulators the result, XLA
    would copy all ``v`` chunks of them (a conditional's result is not its
    operand's buffer; main before: +6.2 MB, 72.8 → 79.0 MB, on a weights-heavy
    Llama interleaved over pipe=2). The switch reads the accumulators (the
    backward adds ``0 · acc[slot, 0]`` to its gradients), so it waits for the
    previous tick's addition: without that, XLA ran several unrolled 1F1B ticks'
    backwards before their additions (151.7 MB against 61.7)."""
    info, params, batch = _model("llama", 8)
    pipe = Pipeline(stages=2, microbatches=2, schedule=schedule, virtual=virtual)
    plan = sk.plan(info, sk.make_mesh(pipe=2), "dp", pipeline=pipe)
    closed = jax.make_jaxpr(sk.value_and_grad(info.loss_fn, plan))(params, batch)
    chunk = Counter(
        (x.shape[0] // (2 * virtual), *x.shape[1:]) for x in jax.tree.leaves(params["layers"])
    )
    acc = Counter({(virtual, *s): n for s, n in chunk.items()})
    switches = _switches(closed.jaxpr)
    assert switches
    for eqn in switches:
        outs = Counter(tuple(v.aval.shape) for v in eqn.outvars)
        ins = Counter(tuple(v.aval.shape) for v in eqn.invars)
        assert not outs & acc, "the accumulators are the switch's result"
        assert outs & chunk == chunk, "a chunk's gradients are not the switch's result"
        # the weights (as many, the same shapes) and the accumulators
        assert ins & (acc + acc) == acc + acc, "the switch does not read the accumulators"


def test_an_uneven_layout_pads_each_chunk_to_the_largest():
    """The stacked weights as the executor lays them out under an uneven layout:
    ``[p, v, largest chunk, ...]``, chunk ``j · p + d`` at ``[d, j]``, its layers
    first and zeros after; undone, the padding is dropped and the stack is whole."""
    from spmdkit.pipeline.chunk import chunk_count_table
    from spmdkit.pipeline.execute import regroup_layers, ungroup_layers

    pipe = Pipeline(
        stages=2, microbatches=4, schedule="interleaved", virtual=2, layout=(0, 3, 2, 1)
    )
    x = jnp.arange(6.0)[:, None] + 1  # layers 1..6
    y = regroup_layers(x, pipe)
    assert y.shape == (2, 2, 3, 1)
    # device 0 runs chunks 0 (none) and 2 (layers 4, 5); device 1 chunks 1 (1-3) and 3 (6)
    np.testing.assert_array_equal(y[..., 0], [[[0, 0, 0], [4, 5, 0]], [[1, 2, 3], [6, 0, 0]]])
    np.testing.assert_array_equal(chunk_count_table(pipe), [[0, 2], [3, 1]])
    np.testing.assert_array_equal(ungroup_layers(y, pipe), x)
    assert chunk_count_table(Pipeline(stages=2, microbatches=4, layout=(2, 2))) is None


def _six_layers(name: str) -> tuple:
    """``(info, params, batch)`` of the zoo model with 6 stacked layers and 16 rows."""
    from models.gpt import GPTConfig
    from models.llama import LlamaConfig

    config = (GPTConfig if name == "gpt" else LlamaConfig)(n_layers=6, scan_layers=True)
    info = describe(get_model(name), config=config, batch_size=16)
    rng = np.random.default_rng(0)
    batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, 200, s.shape), s.dtype), info.batch)
    return info, info.init_fn(), batch


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "schedule", "virtual", "layout", "strategy"),
    [
        # CI's sample: 1F1B's layout runs in verify's test of it
        full("gpt", "1f1b", 1, (4, 2), "dp"),
        ("llama", "interleaved", 2, (2, 1, 1, 2), "fsdp"),
        ("llama", "gpipe", 1, (1, 5), "dp"),
    ],
)
def test_an_uneven_layout_runs_as_on_one_device(name, schedule, virtual, layout, strategy):
    """Issue 44: six layers in chunks of unequal layer counts on pipe=2 x data=4: every
    chunk's slice padded to the largest chunk's layers, the padded layers skipped.
    Loss and grads equal one device's, and the grads have the parameters' shapes."""
    info, params, batch = _six_layers(name)
    pipe = Pipeline(stages=2, microbatches=4, schedule=schedule, virtual=virtual, layout=layout)
    plan = sk.plan(info, sk.make_mesh(pipe=2, data=4), strategy, pipeline=pipe)
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
    got = step(params, batch)
    for g, p in zip(jax.tree.leaves(got[1]), jax.tree.leaves(params), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
    _assert_equal(got, jax.jit(jax.value_and_grad(info.loss_fn))(params, batch))


def _odd_layers(name: str, n: int) -> tuple:
    """``(info, params, batch)`` of the zoo model with ``n`` stacked layers, 16 rows."""
    from models.gpt import GPTConfig
    from models.llama import LlamaConfig

    config = (GPTConfig if name == "gpt" else LlamaConfig)(n_layers=n, scan_layers=True)
    info = describe(get_model(name), config=config, batch_size=16)
    rng = np.random.default_rng(0)
    batch = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, 200, s.shape), s.dtype), info.batch)
    return info, info.init_fn(), batch


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "schedule", "virtual", "layout", "strategy"),
    [
        # CI's sample: 1F1B's layout runs in verify's test of it
        full("gpt", "1f1b", 1, (3, 4), "dp"),
        ("llama", "interleaved", 2, (1, 2, 2, 0), "fsdp"),
        ("llama", "gpipe", 1, (2, 3), "dp"),
    ],
)
def test_a_stack_the_pipe_axis_does_not_divide_runs_as_on_one_device(
    name, schedule, virtual, layout, strategy
):
    """Issue 44: 7 or 5 layers over pipe=2 x data=4. The stack is stored split over
    the pipe axis on another dim (jax places no array on a split that does not
    divide), the parameters and gradients keep the model's shapes, and loss and
    grads equal one device's."""
    info, params, batch = _odd_layers(name, sum(layout))
    pipe = Pipeline(stages=2, microbatches=4, schedule=schedule, virtual=virtual, layout=layout)
    plan = sk.plan(info, sk.make_mesh(pipe=2, data=4), strategy, pipeline=pipe)
    stacked = [k for k, (shape, _, names) in plan.info.items() if names and names[0] == "layers"]
    assert stacked
    for k in stacked:  # the layers off the pipe axis, another dim on it
        spec = tuple(plan.params[k])
        assert not spec or spec[0] is None, (k, spec)
        assert "pipe" in str(spec) or len(plan.info[k][0]) == 1, (k, spec)
    step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan, enforce=False)
    got = step(params, batch)
    for g, p in zip(jax.tree.leaves(got[1]), jax.tree.leaves(params), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
    _assert_equal(got, jax.jit(jax.value_and_grad(info.loss_fn))(params, batch))

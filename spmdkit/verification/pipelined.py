"""The prediction of a pipelined step: its point-to-point sends and held residuals.

Propagation (:mod:`spmdkit.propagation`) takes the pipeline's ``shard_map`` as
given: it prices the step outside it and predicts no ``ppermute`` and none of
the memory the schedule holds. :func:`pipelined_prediction` adds both from the
facts the traced gradient reports (:func:`spmdkit.pipeline.facts.traced_pipelines`):

- collective permutes: :func:`~spmdkit.pipeline.facts.permute_count` of them,
  each one micro-batch's stage output on one device (its batch rows split over
  the plan's batch axes);
- the gradient sums the executor runs once per step are the ``psum`` calls of
  its ``shard_map`` bodies, which propagation prices itself; the stage weights'
  gathers are the reshards of the ``shard_map``'s operands;
- memory: the pipeline's buffers (:func:`spmdkit.pipeline.memory.stage_buffers`),
  sized from the traced facts and the plan (a chunk's weights: the stacked
  parameters' bytes on one device over ``v``, routed experts split over the
  batch axes staying split; a backward's working set: chunk 0's forward and
  backward propagated, less its residual set), on top of the propagated step.
  Under expert parallelism over the batch axes a chunk's residual set and
  working set are read off the per-device programs the stages run
  (:func:`~spmdkit.pipeline.facts.expert_local_program`): the global trace's
  routed experts are regions whose kept buffers are empty stand-ins.
  Propagation takes a ``shard_map``'s out_specs as given, so it counts GPipe's
  residuals (the forward ``shard_map``'s outputs,
  :func:`~spmdkit.pipeline.memory.residual_outputs`) unsharded over the axes
  other than the pipe axis; that count is replaced by the model's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit import jaxprs
from spmdkit.pipeline.facts import (
    BACKWARD_SCOPE,
    FORWARD_SCOPE,
    HEAD_SCOPE,
    PipelineFacts,
    backward_probe,
    branch_runs,
    expert_local_program,
    permute_count,
    pullback_probe,
    residual_probe,
    traced_pipelines,
)
from spmdkit.pipeline.memory import StageSizes, residual_outputs, stage_buffers
from spmdkit.pipeline.schedule import Pipeline
from spmdkit.planner.experts import reruns_exchange
from spmdkit.planner.plans import Plan
from spmdkit.propagation import Propagation, propagate
from spmdkit.propagation.memory import program_temp_bytes
from spmdkit.spec import axis_sizes
from spmdkit.verification.compiled import CompiledReport

__all__ = [
    "chunk_weight_bytes",
    "context_exchange",
    "counted_by_schedule",
    "expert_exchange",
    "pipelined_prediction",
    "stage_collectives",
]


def chunk_weight_bytes(
    plan: Plan, gathered: tuple[str, ...] = (), *, computed: bool = False
) -> float:
    """One chunk's stacked weights on one device: the parameters whose first
    logical dim is ``layers``, as the plan stores them (``gathered``: except
    over these axes, which the pipeline's ``shard_map`` gathers them over, but
    on a routed expert weight's ``expert`` dim, which stays split over them:
    expert parallelism, :func:`~spmdkit.pipeline.layouts.expert_splits`;
    ``computed``: in the recipe's compute dtype, as the stages use them), over
    the virtual stages."""
    pipe = plan.pipeline
    if pipe is None:
        return 0.0
    sizes = axis_sizes(plan.mesh)
    total = 0.0
    for path, (shape, dtype, logical) in plan.info.items():
        if not logical or logical[0] != "layers" or path not in plan.params:
            continue
        shards = 1
        for dim, entry in enumerate(plan.params[path]):
            kept = dim < len(logical) and logical[dim] == "expert"
            for axis in (entry,) if isinstance(entry, str) else entry or ():
                shards *= 1 if axis in gathered and not kept else sizes[axis]
        cast = computed and plan.recipe.compute_dtype and np.issubdtype(dtype, np.floating)
        item = np.dtype(dtype).itemsize
        item = plan.recipe.weight_itemsize(item) if cast else item
        total += math.prod(shape) * item / shards
    return total / pipe.virtual


def pipelined_prediction(plan: Plan, body: Callable, prop: Propagation, *args: Any) -> Propagation:
    """``prop`` with the pipeline's sends and held memory added (module docstring).

    Args:
      plan: the pipelined plan.
      body: the compiled step's function (traced once more, abstractly: its
        pipelined gradients' facts are markers in the program, :func:`traced_pipelines`).
      prop: the propagated prediction.
      *args: the step's arguments.
    """

    traced = jax.make_jaxpr(body)(*args)
    seen = traced_pipelines(traced)
    if not seen:
        return prop
    mesh_sizes = axis_sizes(plan.mesh)
    # a device's share of a micro-batch: its rows, and its tokens under context parallelism
    shards = math.prod(mesh_sizes[a] for a in plan.activation.get("batch", ()))
    shards *= math.prod(mesh_sizes[a] for a in _context_axes(plan, seen[0]))
    counted = _propagated_outputs(traced.jaxpr, seen[0].pipe.axis, mesh_sizes)
    comm = dict(prop.comm_bytes_by_kind)
    # propagation prices a shard_map body's ppermutes once each, not per tick:
    # the schedule's count below replaces that
    priced = _propagated_permutes(traced.jaxpr, seen[0].pipe.axis)
    if priced:
        comm["collective_permute"] = max(0, comm.get("collective_permute", 0) - priced)
    extra = 0.0
    for facts in seen:
        pipe = facts.pipe
        carry = facts.carry_bytes / shards
        comm["collective_permute"] = comm.get("collective_permute", 0) + int(
            permute_count(pipe) * carry
        )
        gathered = chunk_weight_bytes(plan, facts.batch_axes)
        computed = chunk_weight_bytes(plan, facts.batch_axes, computed=True)
        residual, head = _residuals_per_device(plan, facts, shards)
        working = _backward_working_set(plan, facts, residual)
        sizes = StageSizes(
            residual=residual,
            head=head,
            carry=carry,
            weights=computed,
            working=working,
            read_slot=not _auto_axes(plan, facts),  # as the executor decides
        )
        held = stage_buffers(pipe, sizes)
        extra += sum(held.values())
        # the device's chunks' weights, gathered over the batch axes at the
        # pipeline's input, and their gradients' accumulators: held at that size
        # through the step (propagation sees the shard_map's operands and results
        # at the plan's size)
        extra += 2 * pipe.virtual * (gathered - chunk_weight_bytes(plan))
        # the gradients' accumulators are whole over the batch axes until the
        # step's end reduce-scatters them (propagation counts the shard_map's
        # results at their out_specs' size)
        extra += _scattered_outputs(traced.jaxpr, pipe.axis, mesh_sizes, facts.batch_axes)
        for kind, b in stage_collectives(plan, facts).items():
            comm[kind] = comm.get(kind, 0) + int(b)
        for kind, b in context_exchange(plan, facts).items():
            comm[kind] = comm.get(kind, 0) + int(b)
        for kind, b in expert_exchange(plan, facts).items():
            comm[kind] = comm.get(kind, 0) + int(b)
        if residual_outputs(pipe):
            extra -= counted.pop(0) if counted else 0.0
    mem = prop.memory
    memory = dataclasses.replace(
        mem, peak_bytes=int(mem.peak_bytes + extra), temp_bytes=int(mem.temp_bytes + extra)
    )
    return dataclasses.replace(
        prop, comm_bytes_by_kind=comm, memory=memory, memory_materialized=None
    )


def _propagated_permutes(jaxpr: Any, axis: str, inside: bool = False) -> int:
    """The ``collective_permute`` bytes propagation prices for the pipeline's
    ``shard_map`` bodies over ``axis``: each ``ppermute`` over ``axis`` in them
    once, its operand's bytes (the walk of
    :meth:`~spmdkit.propagation.records.Recorder._manual_collectives`)."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "shard_map":
            if _runs_ticks(eqn, axis):
                body = jaxprs.open_jaxpr(jaxprs.shard_map_body(eqn))[0]
                total += _propagated_permutes(body, axis, True)
            continue
        if inside:
            if name == "ppermute":
                axes = eqn.params.get("axis_name")
                axes = (axes,) if isinstance(axes, str) else tuple(axes)
                if axis in axes:
                    total += sum(
                        math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.invars
                    )
                continue
            body = jaxprs.call_body(eqn)
            if body is not None:
                total += _propagated_permutes(jaxprs.open_jaxpr(body)[0], axis, True)
            continue
        for sub in jaxprs.sub_jaxprs(eqn):
            total += _propagated_permutes(jaxprs.open_jaxpr(sub)[0], axis)
    return total


def _runs_ticks(eqn: Any, axis: str) -> bool:
    """Is ``eqn`` (a ``shard_map``) the pipeline's, or its transpose: manual over
    ``axis``, its body scanning the schedule's ticks? An uneven layout's layer
    moves (:func:`~spmdkit.pipeline.execute.regroup_layers`) are manual over it
    too, with no scan: propagation prices their permutes once each, as they run."""
    if axis not in jaxprs.manual_axes(eqn):
        return False
    body = jaxprs.open_jaxpr(jaxprs.shard_map_body(eqn))[0]
    return any(e.primitive.name == "scan" for e in body.eqns)


def _pipeline_shard_maps(jaxpr: Any, axis: str) -> Iterator[Any]:
    """The ``shard_map`` equations manual over ``axis`` in ``jaxpr`` and the
    bodies of its other equations, in program order (not inside them)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            if _runs_ticks(eqn, axis):
                yield eqn
            continue
        for sub in jaxprs.sub_jaxprs(eqn):
            yield from _pipeline_shard_maps(jaxprs.open_jaxpr(sub)[0], axis)


def _split_bytes(v: Any, spec: Any, sizes: dict[str, int]) -> float:
    """One device's bytes of a ``shard_map`` result split over the axes its spec names."""
    named = [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]
    return math.prod(v.aval.shape) * v.aval.dtype.itemsize / math.prod(sizes[a] for a in named)


def _scattered_outputs(
    jaxpr: Any, axis: str, sizes: dict[str, int], batch: tuple[str, ...]
) -> float:
    """What the gradients that the pipeline's ``shard_map`` bodies over ``axis``
    reduce-scatter over ``batch`` axes hold on one device before their scatter,
    beyond their share after it (propagation counts the results at their
    out_specs' size; the accumulators are whole until the step's end)."""
    total = 0.0
    for eqn in _pipeline_shard_maps(jaxpr, axis):
        factors = _scatter_factors(jaxprs.open_jaxpr(jaxprs.shard_map_body(eqn))[0], sizes, batch)
        out_specs = jaxprs.shard_map_specs(eqn)[1]
        for v, spec, k in zip(eqn.outvars, out_specs, factors, strict=True):
            total += _split_bytes(v, spec, sizes) * (k - 1)
    return total


#: Primitives between a ``psum_scatter`` and a body's result that keep its size.
_PASS = frozenset({"broadcast_in_dim", "reshape", "psum", "convert_element_type", "squeeze"})


def _scatter_factors(body: Any, sizes: dict[str, int], batch: tuple[str, ...]) -> list[int]:
    """Per result of a ``shard_map`` body: the devices of the ``batch`` axes a
    ``psum_scatter`` it comes from splits it over (1: none)."""
    made = {o: e for e in body.eqns for o in e.outvars}
    out = []
    for res in body.outvars:
        k, v = 1, res
        while v in made:
            e = made[v]
            if e.primitive.name == "reduce_scatter":
                axes = e.params["axis_name"]
                axes = (axes,) if isinstance(axes, str) else tuple(axes)
                k *= math.prod(sizes[a] for a in axes if a in batch)
            elif e.primitive.name not in _PASS:
                break
            v = e.invars[0]
        out.append(k)
    return out


def _propagated_outputs(jaxpr: Any, axis: str, sizes: dict[str, int]) -> list[float]:
    """Per ``shard_map`` over ``axis`` with more than one output (a forward that
    returns residuals), in program order: its non-scalar outputs' bytes on one
    device as propagation counts them (split over the axes their out_specs name)."""
    return [
        sum(
            _split_bytes(v, spec, sizes)
            for v, spec in zip(eqn.outvars, jaxprs.shard_map_specs(eqn)[1], strict=True)
            if v.aval.shape
        )
        for eqn in _pipeline_shard_maps(jaxpr, axis)
        if len(eqn.outvars) > 1
    ]


def counted_by_schedule(compiled: CompiledReport, pipe: Pipeline) -> CompiledReport:
    """``compiled`` with the collectives of a tick's actions counted as the
    schedule runs them.

    The compiled HLO runs each tick's ``lax.switch`` in a loop over the ticks and
    does not say which branch a tick takes, so a branch's collectives count once
    per tick (:func:`~spmdkit.verification.compiled.executions`). A device runs
    ``m·v`` chunk forwards and backwards among those ticks and, on the last
    stage, ``m`` heads (:func:`~spmdkit.pipeline.facts.branch_runs`): a
    collective under one of those scopes (the executor's ``jax.named_scope``
    names, in its op name) counts that share of its loops' runs.
    """
    runs = branch_runs(pipe)
    out = dict(compiled.executions)
    for c in compiled.collectives:
        scope = next((s for s in (HEAD_SCOPE, FORWARD_SCOPE, BACKWARD_SCOPE) if s in c.op_name), "")
        if scope:
            work, ticks = runs[scope]
            out[c.name] = compiled.runs(c) * work / ticks
    return dataclasses.replace(compiled, executions=out)


def _context_axes(plan: Plan, facts: PipelineFacts) -> tuple[str, ...]:
    """The plan's context axes the pipeline's ``shard_map`` makes manual (its
    stages run on a device's tokens of each micro-batch)."""
    axes = plan.context.axes if plan.context is not None else ()
    return tuple(a for a in axes if a in facts.batch_axes)


def _auto_axes(plan: Plan, facts: PipelineFacts) -> set[str]:
    """The mesh axes (size > 1) the pipeline's ``shard_map`` leaves automatic."""
    sizes = axis_sizes(plan.mesh)
    manual = {facts.pipe.axis, *facts.batch_axes}
    return {a for a, n in sizes.items() if n > 1 and a not in manual}


def _unpipelined_specs(plan: Plan, facts: PipelineFacts) -> tuple:
    """In-specs of the step's arguments (params, batch, rest) with the plan's
    layouts less the pipe axis (the unpipelined step the stages run pieces of)."""
    axis = facts.pipe.axis
    params, batch, *rest = facts.args

    def drop(entry: Any) -> Any:
        if isinstance(entry, tuple):
            return tuple(a for a in entry if a != axis) or None
        return None if entry == axis else entry

    param_specs = jax.tree.map(
        lambda spec: P(*(drop(e) for e in spec)),
        plan.param_specs(params),
        is_leaf=lambda x: isinstance(x, P),
    )
    return (param_specs, plan.batch_specs(batch), *(None for _ in rest))


def _residuals_per_device(plan: Plan, facts: PipelineFacts, shards: int) -> tuple[float, float]:
    """One chunk's and the head's residual sets on one device: the global sets
    over the batch's shards; with automatic axes inside the stages (tensor
    parallel), as the plan lays them out there, by propagating the residuals as
    a function of the step's arguments."""
    if facts.local_residual_bytes is not None and not _auto_axes(plan, facts):
        # expert parallelism: the per-device program's set (the global trace's
        # routed experts hold only stand-ins for what theirs keep)
        return float(facts.local_residual_bytes), facts.head_bytes / shards
    if not _auto_axes(plan, facts) or facts.loss_fn is None:
        return facts.residual_bytes / shards, facts.head_bytes / shards
    params, batch, *rest = facts.args
    sizes = []
    for head in (False, True):
        probe = residual_probe(facts.loss_fn, facts.pipe, *rest, head=head)
        prop = propagate(
            probe, params, batch, in_specs=_unpipelined_specs(plan, facts)[:2], mesh=plan.mesh
        )
        sizes.append(float(sum(s.local_bytes(plan.mesh) for s in prop.out_specs)))
    return sizes[0], sizes[1]


def _backward_working_set(plan: Plan, facts: PipelineFacts, residual: float) -> float:
    """A backward's working set on one device beyond the residual set it reads
    (:attr:`~spmdkit.pipeline.memory.StageSizes.working`): chunk 0's forward and
    backward for micro-batch 0 (:func:`~spmdkit.pipeline.facts.backward_probe`)
    propagated with the plan's layouts less the pipe axis, its temporaries' peak
    less ``residual``. The probe slices its chunk's weights out of the whole
    stack; the executor does too with virtual stages (a device's ``v`` chunks
    are one stack), but without them a stage's weights are its own shard,
    read in place: that slice is taken off (GPipe's stash holds the sliced
    weights per forward tick already)."""
    if facts.loss_fn is None:
        return 0.0
    sliced = chunk_weight_bytes(plan) if facts.pipe.virtual == 1 else 0.0
    if facts.experts is not None and not _auto_axes(plan, facts):
        return _expert_working_set(plan, facts, residual, sliced)
    params, batch, *rest = facts.args
    prop = propagate(
        backward_probe(facts.loss_fn, facts.pipe, *rest),
        params,
        batch,
        in_specs=_unpipelined_specs(plan, facts)[:2],
        mesh=plan.mesh,
    )
    return max(float(prop.memory.temp_bytes) - residual - sliced, 0.0)


def _expert_working_set(plan: Plan, facts: PipelineFacts, residual: float, sliced: float) -> float:
    """:func:`_backward_working_set` under expert parallelism, from the per-device
    programs the stages run (:func:`~spmdkit.pipeline.facts.expert_local_program`;
    propagation prices the routed experts' regions, not those programs), by
    liveness (:func:`~spmdkit.propagation.memory.program_temp_bytes`): a
    backward tick's temporaries (:func:`~spmdkit.pipeline.facts.pullback_probe`:
    the chunk's vjp rebuilt from its stash, a recomputed forward included; with
    XLA:CPU's workspaces on a CPU mesh) less the weights it slices, plus a
    forward tick's beyond the residual set it stashes
    (:func:`~spmdkit.pipeline.facts.residual_probe`'s program less its results).
    Both count: the forward and the backward are branches of the tick's
    ``lax.switch``, and on XLA:CPU the compiled peak of a recomputing policy
    (whose forward tick makes and drops what its backward makes again) holds
    both branches' temporaries (measured on the tiny routed models)."""
    loss_fn, pipe, experts = facts.loss_fn, facts.pipe, facts.experts
    assert loss_fn is not None and experts is not None
    cpu = _on_cpu(plan.mesh)

    def forward(env: list[tuple[str, int]], rest: tuple) -> Callable:
        return residual_probe(loss_fn, pipe, *rest, axis_env=env)

    fwd = expert_local_program(forward, facts.args, experts)
    stash = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in fwd.out_avals]

    def backward(env: list[tuple[str, int]], rest: tuple) -> Callable:
        return pullback_probe(loss_fn, pipe, *rest, axis_env=env)

    bwd = expert_local_program(backward, facts.args, experts, stash)
    # the forward's without XLA:CPU's workspaces: a forward tick's program is
    # the layers' forward alone, whose copies XLA fuses (compiled alone, its
    # temporaries match this count; the backward's exceed the count without them)
    made = max(float(program_temp_bytes(fwd)) - residual, 0.0)
    return max(float(program_temp_bytes(bwd, cpu=cpu)) - sliced, 0.0) + made


def _on_cpu(mesh: Any) -> bool:
    """Whether ``mesh`` is a device mesh of CPU devices (False for an abstract one)."""
    try:
        return bool(mesh.devices.flat[0].platform == "cpu")
    except (AttributeError, IndexError, ValueError):  # AbstractMesh: ValueError
        return False


def stage_collectives(plan: Plan, facts: PipelineFacts) -> dict[str, float]:
    """The collectives the pipeline's stages run over the automatic axes (a
    tensor-parallel ``model`` axis: the mesh's axes other than the pipe axis and
    the manual batch axes), per device: propagation takes the pipeline's
    ``shard_map`` as given and does not see inside it.

    They are read off the unpipelined step with the plan's layouts (the loss
    the pipeline runs, differentiated, propagated with the plan's specs less
    the pipe axis): its layer scans' collectives over those axes, over ``p``
    (a device runs ``L / p`` of the layers, for all its rows), and the head's
    and loss's (the equations between the forward and the backward layer scan),
    which the last stage runs whole. Per kind, payload bytes (empty when the
    stages have no automatic axis).
    """
    auto = _auto_axes(plan, facts)
    if not auto or facts.loss_fn is None:
        return {}
    pipe = facts.pipe
    prop = propagate(
        jax.value_and_grad(facts.loss_fn),
        *facts.args,
        in_specs=_unpipelined_specs(plan, facts),
        mesh=plan.mesh,
    )
    scans = [
        i for i, r in enumerate(prop.records) if r.primitive == "scan" and r.repeat == facts.layers
    ]
    if len(scans) < 2:
        return {}
    out: dict[str, float] = {}
    manual = set(facts.batch_axes)

    def add(records: Any, share: float) -> None:
        for r in records:
            for a in r.reshards:
                # a step gathering over the manual batch axes first (an op that
                # needs its operand whole) does not run in the stage, whose rows
                # stay split over them: the later steps move that much less
                grown = 1
                for c in a.plan.collectives:
                    if c.kind == "all_gather" and c.axes and set(c.axes) <= manual:
                        grown *= c.group_size
                    elif c.axes and set(c.axes) <= auto:
                        out[c.kind] = out.get(c.kind, 0.0) + c.payload_bytes * share / grown
            gathered = _kv_gathered_over_auto(r, auto, _context_axes(plan, facts), plan.mesh)
            if gathered:
                out["all_gather"] = out.get("all_gather", 0.0) + gathered * share
            add(r.body, share * r.repeat)

    add([prop.records[scans[0]], prop.records[scans[-1]]], 1 / pipe.stages)
    add(prop.records[scans[0] + 1 : scans[-1]], 1.0)
    return out


def _kv_gathered_over_auto(r: Any, auto: set[str], context: tuple[str, ...], mesh: Any) -> float:
    """The bytes XLA all-gathers over the stage's automatic axes around a
    ``gather_kv`` attention's K/V exchange over the manual context axes
    (``r``: the op's record in the unpipelined step, or its gradient's).

    The exchange lowers to collectives replicated over the automatic axes, so
    XLA first gathers K and V whole over them (a tensor-parallel stage's K/V
    heads): in the forward, a device's tokens of them; in the backward, the
    gradients of the gathered K and V (every token) before their reduce-scatter
    over the context axes. Per call, the gathered arrays' bytes on a device."""
    if r.op != "attention" or r.attrs.get("strategy") != "gather_kv" or len(r.inputs) < 3:
        return 0.0
    total = 0.0
    for kv in r.inputs[1:3]:
        if not set(context) & set(kv.dims[1]):
            continue
        if not any(set(d) & auto for d in kv.dims):
            continue
        dims = []
        for i, d in enumerate(kv.dims):
            drop = auto | (set(context) if r.backward and i == 1 else set())
            dims.append(tuple(a for a in d if a not in drop))
        total += kv.replace(dims=tuple(dims)).local_bytes(mesh)
    return total


#: The collective that transposes each kind (a stage's backward pass of
#: attention's K/V exchange is autodiff's transpose of its forward).
_TRANSPOSE = {"all_gather": "reduce_scatter", "collective_permute": "collective_permute"}


def context_exchange(plan: Plan, facts: PipelineFacts) -> dict[str, float]:
    """Attention's K/V exchange in a context-parallel pipeline's stages, per
    device and kind: each layer's forward collectives as its stage traced them
    (:attr:`~spmdkit.pipeline.facts.PipelineFacts.context_bytes`: one micro-batch's,
    a device's rows), their transposes in the backward, and the forward's again
    where the recipe recomputes the layer, for the ``L / p`` layers a device
    runs of each of the ``m`` micro-batches."""
    pipe = facts.pipe
    runs = pipe.microbatches * facts.layers / pipe.stages
    rerun = 2 if plan.recipe.remat != "none" else 1
    out: dict[str, float] = {}
    for kind, nbytes in facts.context_bytes:
        out[kind] = out.get(kind, 0.0) + nbytes * runs * rerun
        back = _TRANSPOSE.get(kind, kind)
        out[back] = out.get(back, 0.0) + nbytes * runs
    return out


def expert_exchange(plan: Plan, facts: PipelineFacts) -> dict[str, float]:
    """The routed experts' token exchange in an expert-parallel pipeline's stages,
    per device and kind: each layer's forward all-to-alls as its stage traced them
    (:attr:`~spmdkit.pipeline.facts.PipelineFacts.expert_bytes`: one micro-batch's,
    a device's rows), the transposes of the tokens' two in the backward (the
    per-expert counts have no cotangent), and the forward's again where the recipe
    recomputes the layer, for the ``L / p`` layers a device runs of each of the
    ``m`` micro-batches."""
    pipe = facts.pipe
    runs = pipe.microbatches * facts.layers / pipe.stages
    rerun = 2 if reruns_exchange(plan.recipe) else 1
    out: dict[str, float] = {}
    for kind, nbytes, transposed in facts.expert_bytes:
        out[kind] = out.get(kind, 0.0) + nbytes * runs * (rerun + transposed)
    return out

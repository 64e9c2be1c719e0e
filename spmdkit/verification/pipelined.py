"""The prediction of a pipelined step: its point-to-point sends and held residuals.

Propagation (:mod:`spmdkit.propagation`) takes the pipeline's ``shard_map`` as
given: it prices the step outside it and predicts no ``ppermute`` and none of
the memory the schedule holds. :func:`pipelined_prediction` adds both from the
facts the traced gradient reports (:func:`spmdkit.pipeline.execute.pipelines_traced`):

- collective permutes: :func:`~spmdkit.pipeline.execute.permute_count` of them,
  each one micro-batch's stage output on one device (its batch rows split over
  the plan's batch axes);
- the gradient sums the executor runs once per step are the ``psum`` calls of
  its ``shard_map`` bodies, which propagation prices itself; the stage weights'
  gathers are the reshards of the ``shard_map``'s operands;
- memory: the pipeline's buffers (:func:`spmdkit.pipeline.memory.stage_buffers`),
  sized from the traced facts and the plan (a chunk's weights: the stacked
  parameters' bytes on one device over ``v``), on top of the propagated step.
  Propagation takes a ``shard_map``'s out_specs as given, so it counts GPipe's
  residuals (the forward ``shard_map``'s outputs,
  :func:`~spmdkit.pipeline.memory.residual_outputs`) unsharded over the axes
  other than the pipe axis; that count is replaced by the model's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from spmdkit.pipeline.execute import permute_count, pipelines_traced
from spmdkit.pipeline.memory import StageSizes, residual_outputs, stage_buffers
from spmdkit.planner.plans import Plan
from spmdkit.propagation import Propagation
from spmdkit.propagation.graph import inline_body, open_jaxpr
from spmdkit.spec import axis_sizes

__all__ = ["chunk_weight_bytes", "pipelined_prediction"]


def chunk_weight_bytes(plan: Plan, gathered: tuple[str, ...] = ()) -> float:
    """One chunk's stacked weights on one device: the parameters whose first
    logical dim is ``layers``, as the plan stores them (``gathered``: except
    over these axes, which the pipeline's ``shard_map`` gathers them over),
    over the virtual stages."""
    pipe = plan.pipeline
    if pipe is None:
        return 0.0
    sizes = axis_sizes(plan.mesh)
    total = 0.0
    for path, (shape, dtype, logical) in plan.info.items():
        if not logical or logical[0] != "layers" or path not in plan.params:
            continue
        shards = 1
        for entry in plan.params[path]:
            for axis in (entry,) if isinstance(entry, str) else entry or ():
                shards *= 1 if axis in gathered else sizes[axis]
        total += math.prod(shape) * np.dtype(dtype).itemsize / shards
    return total / pipe.virtual


def pipelined_prediction(plan: Plan, body: Callable, prop: Propagation, *args: Any) -> Propagation:
    """``prop`` with the pipeline's sends and held memory added (module docstring).

    Args:
      plan: the pipelined plan.
      body: the compiled step's function (traced once more, abstractly).
      prop: the propagated prediction.
      *args: the step's arguments.
    """

    def fresh(*a: Any) -> Any:
        # a new function: the step was traced before, and jax caches traces by function
        return body(*a)

    with pipelines_traced() as seen:
        traced = jax.make_jaxpr(fresh)(*args)
    if not seen:
        return prop
    mesh_sizes = axis_sizes(plan.mesh)
    shards = math.prod(mesh_sizes[a] for a in plan.activation.get("batch", ()))
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
        sizes = StageSizes(
            residual=facts.residual_bytes / shards,
            head=facts.head_bytes / shards,
            carry=carry,
            weights=gathered,
        )
        held = stage_buffers(pipe, sizes)
        extra += sum(held.values())
        # the device's chunks' weights, gathered over the batch axes at the
        # pipeline's input, and their gradients' accumulators: held at that size
        # through the step (propagation sees the shard_map's operands and results
        # at the plan's size)
        extra += 2 * pipe.virtual * (gathered - chunk_weight_bytes(plan))
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
            if axis in _manual_axes(eqn.params):
                total += _propagated_permutes(open_jaxpr(eqn.params["jaxpr"])[0], axis, True)
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
            body = inline_body(eqn)
            if body is not None:
                total += _propagated_permutes(open_jaxpr(body)[0], axis, True)
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _propagated_permutes(inner, axis)
    return total


def _propagated_outputs(jaxpr: Any, axis: str, sizes: dict[str, int]) -> list[float]:
    """Per ``shard_map`` over ``axis`` with more than one output (a forward that
    returns residuals), in program order: its non-scalar outputs' bytes on one
    device as propagation counts them (split over the axes their out_specs name)."""
    out: list[float] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            manual = _manual_axes(eqn.params)
            if axis in manual and len(eqn.outvars) > 1:
                total = 0.0
                for v, spec in zip(eqn.outvars, eqn.params["out_specs"], strict=True):
                    if not v.aval.shape:
                        continue
                    split = math.prod(
                        sizes[a] for e in spec for a in ((e,) if isinstance(e, str) else e or ())
                    )
                    total += math.prod(v.aval.shape) * v.aval.dtype.itemsize / split
                out.append(total)
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(_propagated_outputs(inner, axis, sizes))
    return out


def _manual_axes(params: dict) -> frozenset:
    for key in ("newly_manual_axes", "manual_axes", "axis_names"):
        if params.get(key) is not None:
            return frozenset(params[key])
    return frozenset()

"""The prediction of a pipelined step: its point-to-point sends and held residuals.

Propagation (:mod:`spmdkit.propagation`) takes the pipeline's ``shard_map`` as
given: it prices the step outside it and predicts no ``ppermute`` and none of
the memory the schedule holds. :func:`pipelined_prediction` adds both from the
facts the traced gradient reports (:func:`spmdkit.pipeline.execute.pipelines_traced`):

- collective permutes: :func:`~spmdkit.pipeline.execute.permute_count` of them,
  each one micro-batch's stage output on one device (its batch rows split over
  the plan's batch axes);
- memory: the pipeline's buffers that live inside its ``shard_map``
  (:func:`spmdkit.pipeline.memory.stage_buffers`, the kinds
  :func:`~spmdkit.pipeline.memory.inside_pipeline` names: the explicit
  schedules' stash, inboxes and one tick's residuals; for GPipe one tick's,
  its held residuals being the forward ``shard_map``'s outputs, which
  propagation counts), sized from the traced facts and the plan (a chunk's
  weights: the stacked parameters' bytes on one device over ``v``), masked
  as the executor runs on this mesh
  (:func:`~spmdkit.pipeline.execute.runs_masked`), on top of the propagated step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from spmdkit.pipeline.execute import permute_count, pipelines_traced, runs_masked
from spmdkit.pipeline.memory import StageSizes, inside_pipeline, stage_buffers
from spmdkit.planner.plans import Plan
from spmdkit.propagation import Propagation
from spmdkit.spec import axis_sizes

__all__ = ["chunk_weight_bytes", "pipelined_prediction"]


def chunk_weight_bytes(plan: Plan) -> float:
    """One chunk's stacked weights on one device: the parameters whose first
    logical dim is ``layers``, as the plan stores them, over the virtual stages."""
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
                shards *= sizes[axis]
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
        jax.make_jaxpr(fresh)(*args)
    if not seen:
        return prop
    sizes = axis_sizes(plan.mesh)
    shards = math.prod(sizes[a] for a in plan.activation.get("batch", ()))
    comm = dict(prop.comm_bytes_by_kind)
    extra = 0.0
    for facts in seen:
        pipe = facts.pipe
        carry = facts.carry_bytes / shards
        comm["collective_permute"] = comm.get("collective_permute", 0) + int(
            permute_count(pipe) * carry
        )
        sizes = StageSizes(
            residual=facts.residual_bytes / shards,
            head=facts.head_bytes / shards,
            carry=carry,
            weights=chunk_weight_bytes(plan),
        )
        held = stage_buffers(pipe, sizes, masked=runs_masked(pipe, plan.mesh))
        extra += sum(held[k] for k in inside_pipeline(pipe))
    mem = prop.memory
    memory = dataclasses.replace(
        mem, peak_bytes=int(mem.peak_bytes + extra), temp_bytes=int(mem.temp_bytes + extra)
    )
    return dataclasses.replace(
        prop, comm_bytes_by_kind=comm, memory=memory, memory_materialized=None
    )

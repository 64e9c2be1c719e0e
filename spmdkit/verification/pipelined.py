"""The prediction of a pipelined step: its point-to-point sends and held residuals.

Propagation (:mod:`spmdkit.propagation`) takes the pipeline's ``shard_map`` as
given: it prices the step outside it and predicts no ``ppermute`` and none of
the memory the schedule holds. :func:`pipelined_prediction` adds both from the
facts the traced gradient reports (:func:`spmdkit.pipeline.execute.pipelines_traced`):

- collective permutes: :func:`~spmdkit.pipeline.execute.permute_count` of them,
  each one micro-batch's stage output on one device (its batch rows split over
  the plan's batch axes);
- memory: the residual sets the schedule holds
  (:func:`spmdkit.pipeline.memory.peak_bytes`: GPipe's per forward tick with the
  head's, the stash's in-flight micro-batches otherwise) and the micro-batches'
  embeddings (the pre part's outputs, held through the pipeline), on top of the
  propagated step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from spmdkit.pipeline.execute import permute_count, pipelines_traced
from spmdkit.pipeline.memory import peak_bytes
from spmdkit.planner.plans import Plan
from spmdkit.propagation import Propagation
from spmdkit.spec import axis_sizes

__all__ = ["pipelined_prediction"]


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
        extra += peak_bytes(pipe, facts.residual_bytes / shards, facts.head_bytes / shards)
        extra += pipe.microbatches * carry
    mem = prop.memory
    memory = dataclasses.replace(
        mem, peak_bytes=int(mem.peak_bytes + extra), temp_bytes=int(mem.temp_bytes + extra)
    )
    return dataclasses.replace(
        prop, comm_bytes_by_kind=comm, memory=memory, memory_materialized=None
    )

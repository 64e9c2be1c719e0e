"""Pipelined plans: a strategy on the other mesh axes, the stacked layers over the pipe axis.

``sk.plan(model, mesh, "<preset>", pipeline=Pipeline(...))`` plans in two steps:

1. :func:`pipeline_submesh` checks the request (the mesh has the pipeline's
   axis with ``stages`` devices; the model has stacked layers, a leading
   ``layers`` dim that ``stages · virtual`` divides; no recipe micro-batches:
   the pipeline has its own) and returns the mesh without the pipe axis.
2. The strategy is planned on that smaller mesh as usual (data, fsdp, tensor,
   sequence, expert layouts), then :func:`pipelined_plan` puts it back on the
   whole mesh: every parameter whose first logical dim is ``layers`` gets the
   pipe axis on that dim (its optimizer state and gradient too), so device
   ``d`` of the pipe axis holds layers ``[d·L/p, (d+1)·L/p)``; everything else
   is replicated over the pipe axis (the embedding and the head run outside the
   layer stack); the batch is laid out as on the smaller mesh, replicated over
   the pipe axis; :attr:`~spmdkit.planner.plans.Plan.pipeline` is set. With the
   batch over other axes, a layer that combines a micro-batch's rows (a MoE
   router's statistics) is a typed error here, before anything compiles,
   unless the pipeline asks for ``local_statistics``.

With ``virtual > 1`` chunk ``c`` runs on device ``c mod p`` (round-robin);
the executor (:mod:`spmdkit.pipeline.execute`) regroups the stored layers into
that order inside the step.

The plan's :class:`~spmdkit.planner.plans.Cost` is the pipeline's: ``sk.plan``
re-costs the layouts pipelined (:mod:`spmdkit.planner.pipeline.cost`, calibrated by
propagation under the default estimator: ``_Planner.pipelined_plan_cost`` in
:mod:`spmdkit.planner.search`).

Example::

    >>> mesh = sk.abstract_mesh(pipe=2, data=2, model=2)
    >>> p = sk.plan(get_model("llama"), mesh, "megatron", config="tiny_pipe",
    ...             pipeline=sk.Pipeline(stages=2, microbatches=4))
    >>> p.params["layers/attn/wq"]
    PartitionSpec('pipe', None, 'model')
"""

from __future__ import annotations

import math
from dataclasses import replace

import jax
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from spmdkit.flax.model import ModelInfo
from spmdkit.mesh import abstract_mesh
from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.pipeline.facts import rows_combined, rows_error
from spmdkit.planner.logical import LogicalRules, RulesLike
from spmdkit.planner.plans import Plan
from spmdkit.recipe import Recipe
from spmdkit.spec import MeshLike, axis_sizes

__all__ = [
    "LAYER_NAME",
    "PLACEHOLDER_AXIS",
    "layer_rules",
    "pipeline_submesh",
    "pipelined_plan",
    "stacked_paths",
]

#: The logical name of the stacked-layer dim the pipe axis splits.
LAYER_NAME = "layers"

#: The one-device axis the smaller mesh gets when the pipe axis was the only
#: axis (a plan needs a mesh with an axis); dropped from the plan's specs.
PLACEHOLDER_AXIS = "_pipe_rest"


def stacked_paths(info: ModelInfo) -> dict[str, int]:
    """Param path → layer count of every parameter stacked on a leading ``layers`` dim."""
    return {
        p.path: p.shape[0]
        for p in info.params
        if p.logical and p.shape and p.logical[0] == LAYER_NAME
    }


def _check_model(info: ModelInfo, pipe: Pipeline) -> None:
    stacked = stacked_paths(info)
    if not stacked:
        raise PipelineError(
            op="plan(pipeline=...)",
            must=f"the model's layers are stacked on a leading {LAYER_NAME!r} dim "
            f"(the pipe axis {pipe.axis!r} splits that dim)",
            given=f"{info.name}: no parameter has a {LAYER_NAME!r} dim (layers unstacked, "
            "e.g. a python list of blocks)",
            fix="stack and scan the layers (scan_layers=True in the reference models, "
            "nnx.scan / jax.lax.scan over stacked params), or plan without pipeline=",
        )
    counts = sorted(set(stacked.values()))
    if len(counts) > 1:
        raise PipelineError(
            op="plan(pipeline=...)",
            must=f"every {LAYER_NAME!r} dim has the same length (one layer stack)",
            given=f"layer dims of lengths {counts}",
            fix="pipeline one layer stack; name other stacked dims otherwise",
        )
    pipe.check_layers(counts[0], op="plan(pipeline=...)")


def _check_batch(info: ModelInfo, pipe: Pipeline) -> None:
    for leaf in jax.tree.leaves(info.batch):
        shape = getattr(leaf, "shape", ())
        if shape and shape[0] % pipe.microbatches:
            raise PipelineError(
                op="plan(pipeline=...)",
                must="every batch field's leading dim divides into the pipeline's micro-batches",
                given=f"a batch field of shape {tuple(shape)}, microbatches={pipe.microbatches}",
                fix=f"use a batch size that is a multiple of {pipe.microbatches}",
            )


def _check_local_batch(info: ModelInfo, pipe: Pipeline, shards: int) -> None:
    """Each device's rows split evenly into the micro-batches (else XLA would
    replicate the uneven micro-batches: never silently)."""
    for leaf in jax.tree.leaves(info.batch):
        shape = getattr(leaf, "shape", ())
        if shape and (shape[0] // shards) % pipe.microbatches:
            raise PipelineError(
                op="plan(pipeline=...)",
                must="each device's batch rows divide into the pipeline's micro-batches",
                given=f"batch {shape[0]} over {shards} batch shards, "
                f"microbatches={pipe.microbatches}",
                fix=f"use a batch size that is a multiple of {shards * pipe.microbatches}, "
                "or fewer micro-batches",
            )


def pipeline_submesh(
    mesh: MeshLike, pipe: object, info: ModelInfo, recipe: Recipe | None
) -> AbstractMesh:
    """The mesh without the pipe axis, after checking the request (module docstring).

    Raises:
      PipelineError: ``pipe`` is not a :class:`~spmdkit.pipeline.Pipeline`; the mesh
        has no such axis or its size is not ``stages``; the model has no stacked
        layers, or ``stages · virtual`` does not divide them; the recipe has
        micro-batches; the batch does not divide into the micro-batches.
    """
    if not isinstance(pipe, Pipeline):
        raise PipelineError(
            op="plan(pipeline=...)",
            must="pipeline is a spmdkit.Pipeline",
            given=type(pipe).__name__,
            fix="pass pipeline=sk.Pipeline(stages=2, microbatches=4, schedule='1f1b')",
        )
    sizes = axis_sizes(mesh)
    if pipe.axis not in sizes:
        raise PipelineError(
            op="plan(pipeline=...)",
            must=f"the mesh has the pipeline's axis {pipe.axis!r}",
            given=f"mesh axes {sizes}",
            fix=f"add the axis (e.g. sk.make_mesh({pipe.axis}={pipe.stages}, data=...)) or "
            f"pass Pipeline(axis=...) naming one of {tuple(sizes)}",
        )
    if sizes[pipe.axis] != pipe.stages:
        raise PipelineError(
            op="plan(pipeline=...)",
            must=f"the pipe axis {pipe.axis!r} has one device per stage",
            given=f"{pipe.axis}={sizes[pipe.axis]}, stages={pipe.stages}",
            fix=f"pass Pipeline(stages={sizes[pipe.axis]}, ...) or resize the mesh",
        )
    if recipe is not None and recipe.microbatches > 1:
        raise PipelineError(
            op="plan(pipeline=...)",
            must="micro-batches are the pipeline's (Pipeline.microbatches), not the recipe's",
            given=f"recipe microbatches={recipe.microbatches}",
            fix=f"pass Pipeline(microbatches={recipe.microbatches}, ...) and a recipe "
            "with microbatches=1",
        )
    _check_model(info, pipe)
    _check_batch(info, pipe)
    rest = {a: s for a, s in sizes.items() if a != pipe.axis}
    return abstract_mesh(**(rest or {PLACEHOLDER_AXIS: 1}))


def layer_rules(rules: RulesLike | None) -> LogicalRules:
    """``rules`` (or none) with the ``layers`` dim kept off the other axes first: the
    pipe axis alone splits it (the other axes shard the layers' own dims).

    Example::

        >>> layer_rules(None).entries
        (('layers', None),)
    """
    table = LogicalRules.coerce([(LAYER_NAME, None)])
    return table if rules is None else LogicalRules.coerce(rules).prepend(table)


def _entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for e in tuple(spec):
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        out.append(tuple(a for a in axes if a != PLACEHOLDER_AXIS))
    return out + [()] * (ndim - len(out))


def _spec(entries: list[tuple[str, ...]]) -> P:
    parts: list = [None if not e else e[0] if len(e) == 1 else e for e in entries]
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def _with_pipe(spec: P, ndim: int, axis: str | None) -> P:
    """``spec`` with the placeholder axis dropped and ``axis`` first on dim 0."""
    entries = _entries(spec, ndim)
    if axis is not None and ndim:
        entries[0] = (axis, *entries[0])
    return _spec(entries)


def model_rows_combined(info: ModelInfo) -> str:
    """The model's first layer equation that combines a batch's rows, else ``""``
    (:func:`~spmdkit.pipeline.facts.rows_combined`; once per model): what a
    pipeline with batch axes refuses unless ``local_statistics``."""
    return info.memo(
        ("pipeline.rows_combined",),
        lambda: rows_combined(info.loss_fn, info.abstract_params, info.batch),
    )


def pipelined_plan(info: ModelInfo, mesh: MeshLike, pipe: Pipeline, base: Plan) -> Plan:
    """``base`` (planned on :func:`pipeline_submesh`) put back on ``mesh`` with the
    stacked layers over the pipe axis (module docstring).

    Example::

        >>> sub = pipeline_submesh(mesh, pipe, info, None)
        >>> p = pipelined_plan(info, mesh, pipe, sk.plan(info, sub, "fsdp"))
        >>> p.pipeline.short()
        'pp2 1f1b m4'
    """
    stacked = stacked_paths(info)
    ndims = {p.path: len(p.shape) for p in info.params}
    sizes = axis_sizes(mesh)
    for path in stacked:
        axes = _entries(base.params[path], ndims[path])[0]
        if stacked[path] % (pipe.stages * math.prod(sizes[a] for a in axes)):
            raise PipelineError(
                op="plan(pipeline=...)",
                must=f"the {LAYER_NAME!r} dim splits over the pipe axis and the axes the "
                "strategy put on it",
                given=f"{path}: {stacked[path]} layers over {pipe.axis}={pipe.stages} x {axes}",
                fix=f"keep {LAYER_NAME!r} off the other axes (rules=[('layers', None)])",
            )

    def table(specs: dict[str, P]) -> dict[str, P]:
        return {
            path: _with_pipe(
                spec, ndims.get(path, len(spec)), pipe.axis if path in stacked else None
            )
            for path, spec in specs.items()
        }

    activation = {
        name: tuple(a for a in axes if a != PLACEHOLDER_AXIS)
        for name, axes in base.activation.items()
    }
    batch = activation.get("batch", ())
    _check_local_batch(info, pipe, math.prod(sizes[a] for a in batch))
    if math.prod(sizes[a] for a in batch) > 1 and not pipe.local_statistics:
        mixed = model_rows_combined(info)
        if mixed:
            raise rows_error(mixed, batch, "plan(pipeline=...)")
    return replace(
        base,
        mesh=mesh,
        params=table(dict(base.params)),
        opt=table(dict(base.opt)),
        grads=table(dict(base.grads)),
        activation=activation,
        pipeline=pipe,
    )

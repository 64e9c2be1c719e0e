"""Pipelined plans: a strategy on the other mesh axes, the stacked layers over the pipe axis.

``sk.plan(model, mesh, "<preset>", pipeline=Pipeline(...))`` is one computation:

1. :func:`pipeline_submesh` checks the request (the mesh has the pipeline's
   axis with ``stages`` devices; the model has stacked layers, a leading
   ``layers`` dim that ``stages · virtual`` divides, or that the pipeline's
   ``layout`` sums to (the layer scan's stack, when the model has several: the
   others run on the end stages); no recipe micro-batches:
   the pipeline has its own) and returns the mesh without the pipe axis.
2. The planner, on the whole mesh, lays the strategy's rule tables out on that
   smaller mesh (data, fsdp, tensor, sequence, expert layouts) with the ``layers``
   dim kept off its axes (:func:`layer_rules`), then puts every parameter whose
   first logical dim is ``layers`` on the pipe axis on that dim (its optimizer
   state and gradient too), so device ``d`` of the pipe axis holds layers
   ``[d·L/p, (d+1)·L/p)``; everything else is replicated over the pipe axis (the
   embedding and the head run outside the layer stack); the batch is laid out as
   on the smaller mesh, replicated over the pipe axis. The same candidate is
   costed as a pipeline (:mod:`spmdkit.planner.pipeline.cost`, calibrated by
   propagation under the default estimator) and becomes the plan, with
   :attr:`~spmdkit.planner.plans.Plan.pipeline` set
   (``PipelinePlanner.pipelined_strategy`` in :mod:`spmdkit.planner.pipeline.search`).
   :func:`check_pipeline_batch` runs first: with the batch over other axes, a
   layer that combines a micro-batch's rows (a MoE router's statistics) is a
   typed error, before anything compiles, unless the pipeline asks for
   ``local_statistics``, and a loss that is not a mean over the rows
   (:func:`model_rows_loss`) is one too. With the sequence over context axes too, the model's
   layers may mix tokens only through attention and its loss must be a mean over
   the tokens (:func:`model_tokens_refused`, what the executor refuses: the
   typed error at plan time; auto leaves such pipelined candidates out, with a
   ``dropped`` note).

With ``virtual > 1`` chunk ``c`` runs on device ``c mod p`` (round-robin);
the executor (:mod:`spmdkit.pipeline.execute`) regroups the stored layers into
that order inside the step.

Example::

    >>> mesh = sk.abstract_mesh(pipe=2, data=2, model=2)
    >>> p = sk.plan(get_model("llama"), mesh, "megatron", config="tiny_pipe",
    ...             pipeline=sk.Pipeline(stages=2, microbatches=4))
    >>> p.params["layers/attn/wq"]
    PartitionSpec('pipe', None, 'model')
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AbstractMesh

from spmdkit.context_parallel import PIPELINED_STRATEGIES, ContextShard
from spmdkit.introspect.model import ModelInfo
from spmdkit.mesh import abstract_mesh
from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.pipeline.context_parallel import rows_loss_combined, rows_loss_error
from spmdkit.pipeline.facts import rows_error, rows_split, split_rows_combined, tokens_refused
from spmdkit.pipeline.layer_scan import find_layer_scan
from spmdkit.pipeline.stored import stack_dim
from spmdkit.planner.logical import LogicalRules, RulesLike
from spmdkit.planner.naming import infer_names
from spmdkit.planner.plans import Plan
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.step.recipe import Recipe

__all__ = [
    "LAYER_NAME",
    "PLACEHOLDER_AXIS",
    "layer_rules",
    "check_pipeline_batch",
    "check_pipelined",
    "model_rows_loss",
    "model_tokens_refused",
    "pipeline_submesh",
    "pipelined_stack",
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


def pipelined_stack(info: ModelInfo) -> int:
    """The layer count of the stack the pipe axis splits: the layer scan's
    (:func:`~spmdkit.pipeline.layer_scan.find_layer_scan`), 0 when the loss has
    none; once per model. Other stacks (DeepSeek's dense layers before its MoE
    stack) run where their parameters are used: before the scan on the first
    stage, after it on the last."""

    def find() -> int:
        closed = jax.make_jaxpr(info.loss_fn)(info.abstract_params, info.batch)
        scan = find_layer_scan(closed.jaxpr)
        return scan.length if scan is not None else 0

    return info.memo(("pipeline.stack",), find)


def _check_model(info: ModelInfo, pipe: Pipeline) -> None:
    stacked = stacked_paths(info)
    if not stacked:
        raise PipelineError(
            op="plan(pipeline=...)",
            must=f"the model's layers are stacked on a leading {LAYER_NAME!r} dim "
            f"(the pipe axis {pipe.axis!r} splits that dim)",
            given=f"{info.name}: {_why_unstacked(info)}",
            fix="stack and scan the layers (scan_layers=True in the reference models, "
            "nnx.vmap + nnx.scan / jax.lax.scan over stacked params), name the stacked dim "
            f"{LAYER_NAME!r} where the model names it otherwise (sk.plan(..., names="
            f"{{'<path glob>': ({LAYER_NAME!r}, ...)}})), or plan without pipeline=",
        )
    counts = sorted(set(stacked.values()))
    layers = counts[0] if len(counts) == 1 else pipelined_stack(info)
    if layers not in counts:
        raise PipelineError(
            op="plan(pipeline=...)",
            must=f"one of the {LAYER_NAME!r} stacks is the layer scan the pipe axis splits",
            given=f"layer dims of lengths {counts}, the loss's layer scan of {layers}",
            fix="scan the stack to pipeline over its stacked parameters; name other "
            "stacked dims otherwise",
        )
    pipe.check_layers(layers, op="plan(pipeline=...)")


def _why_unstacked(info: ModelInfo) -> str:
    """Why no parameter has a leading ``layers`` dim: names (the model's or
    ``names=``) that call a dim the layer scan runs over something else, or no
    parameter that a scan in the loss runs over at all."""
    roles = infer_names(info)  # a scan's sliced dim is inferred as 'layers'
    named_otherwise = [
        f"{p.path} {tuple(p.shape)} named {p.logical}"
        for p in info.params
        if p.path in roles and roles[p.path].names[:1] == (LAYER_NAME,)
    ]
    if named_otherwise:
        shown = "; ".join(named_otherwise[:3])
        more = f" and {len(named_otherwise) - 3} more" if len(named_otherwise) > 3 else ""
        return (
            f"a scan in the loss runs over the leading dim of {len(named_otherwise)} "
            f"parameter(s), but their names (the model's, or names=) call that dim "
            f"otherwise: {shown}{more}"
        )
    return (
        f"no parameter is stacked: none is named {LAYER_NAME!r} and no scan in the loss "
        "runs over a parameter's leading dim (layers unstacked, e.g. a python list of "
        "blocks called in a for loop)"
    )


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
    ``info`` comes with every parameter named (``naming.apply_names``): an
    unannotated model's stacked dim is ``layers`` only once its names are inferred.

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


def model_rows_combined(info: ModelInfo) -> str:
    """The model's first layer equation that combines a batch's rows, else ``""``
    (:func:`~spmdkit.pipeline.facts.rows_combined`; once per model): what a
    pipeline with batch axes refuses unless ``local_statistics``."""

    def find() -> str:
        split = _rows_split(info)
        return "" if split is None else split_rows_combined(split[0], split[2])

    return info.memo(("pipeline.rows_combined",), find)


def model_rows_loss(info: ModelInfo) -> str:
    """What makes the model's loss not a mean over the batch's rows, else ``""``
    (:func:`~spmdkit.pipeline.facts.rows_loss_refused`; once per model): what a
    pipeline with batch axes refuses."""

    def find() -> str:
        split = _rows_split(info)
        return "" if split is None else rows_loss_combined(*split)

    return info.memo(("pipeline.rows_loss",), find)


def _rows_split(info: ModelInfo) -> tuple | None:
    """:func:`~spmdkit.pipeline.facts.rows_split` of the model, traced once."""
    return info.memo(
        ("pipeline.rows_split",),
        lambda: rows_split(info.loss_fn, info.abstract_params, info.batch),
    )


def model_tokens_refused(
    info: ModelInfo,
    mesh: MeshLike,
    pipe: Pipeline,
    batch_axes: tuple[str, ...],
    context: tuple[str, ...],
) -> str:
    """What a pipelined plan with the sequence over the ``context`` axes would have
    its step refuse (:func:`~spmdkit.pipeline.facts.tokens_refused`: a layer that
    mixes tokens other than through attention, or a loss that is not a mean over
    the tokens), else ``""``; once per model and layout. The stages run
    ``gather_kv`` on the balanced order, as the plan's context says.

    Raises:
      PipelineError: the batch does not divide into the micro-batches, devices and
        context shards.
    """
    sizes = axis_sizes(mesh)
    batch_axes = tuple(a for a in batch_axes if a != pipe.axis)
    context = tuple(
        a for a in context if a != pipe.axis and a not in batch_axes and sizes.get(a, 1) > 1
    )
    if not context:
        return ""
    shards = math.prod(sizes[a] for a in batch_axes)
    shard = ContextShard(context, tuple(sizes[a] for a in context), True, PIPELINED_STRATEGIES[0])
    seq = {k: tuple(v).index("seq") for k, v in info.batch_axes.items() if "seq" in tuple(v or ())}
    key = ("pipeline.tokens_refused", pipe.microbatches, batch_axes, shards, context, shard.sizes)
    return info.memo(
        key,
        lambda: tokens_refused(
            info.loss_fn, info.abstract_params, info.batch, pipe, (batch_axes, shards), shard, seq
        ),
    )


def check_pipeline_batch(
    info: ModelInfo, mesh: MeshLike, pipe: Pipeline, batch_axes: tuple[str, ...]
) -> None:
    """Check what a pipelined layout with the batch over ``batch_axes`` asks of the
    model (module docstring): each device's rows divide into the micro-batches, no
    layer combines a micro-batch's rows across the batch axes unless the pipeline
    computes its statistics per device, and the loss is a mean over the rows.

    Raises:
      PipelineError: one does not hold.
    """
    sizes = axis_sizes(mesh)
    shards = math.prod(sizes[a] for a in batch_axes)
    _check_local_batch(info, pipe, shards)
    if shards > 1 and not pipe.local_statistics:
        mixed = model_rows_combined(info)
        if mixed:
            raise rows_error(mixed, batch_axes, "plan(pipeline=...)")
    problem = model_rows_loss(info) if shards > 1 else ""
    if problem:
        raise rows_loss_error(problem, batch_axes, "plan(pipeline=...)")


def check_pipelined(info: ModelInfo, plan: Plan) -> None:
    """Check that a pipelined plan's stacked parameters split their ``layers`` dim
    over the pipe axis and only where it divides (a user rule table could put the
    dim on other axes too).

    Raises:
      PipelineError: a ``layers`` dim that does not split over its axes.
    """
    pipe = plan.pipeline
    assert pipe is not None
    sizes = axis_sizes(plan.mesh)
    stacks = stacked_paths(info)
    split = pipelined_stack(info) if len(set(stacks.values())) > 1 else None
    for path, layers in stacks.items():
        if split is not None and layers != split:
            continue  # a stack run before or after the pipelined one, on an end stage
        spec = tuple(plan.params[path])
        first = spec[0] if spec else None
        axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
        # an uneven layout's stack the pipe axis does not divide is stored split on
        # another dim (spmdkit.pipeline.stored); it runs where one takes the axis
        moved = pipe.uneven and not axes and stack_dim(plan.params[path], pipe.axis) is not None
        uneven = pipe.uneven and axes == (pipe.axis,)
        if moved:
            continue
        if pipe.axis not in axes or (layers % math.prod(sizes[a] for a in axes) and not uneven):
            raise PipelineError(
                op="plan(pipeline=...)",
                must=f"the {LAYER_NAME!r} dim splits over the pipe axis and the axes the "
                "strategy put on it",
                given=f"{path}: {layers} layers over {axes or 'no axis'}",
                fix=f"keep {LAYER_NAME!r} off the other axes (rules=[('layers', None)])",
            )

"""What auto searches when asked for pipelines: pipe degrees, meshes, configurations.

``sk.plan(model, mesh, "auto", pipeline="auto")`` costs pipelined candidates
beside the usual ones (:mod:`spmdkit.planner.search`); this module says which:

- **Pipe degrees and meshes** (:func:`pipe_meshes`): a mesh with a ``pipe``
  axis is used as it is (its size is the degree). A mesh without one has its
  data axis (the axis named ``data``, else the first axis with more than one
  device) split into ``pipe × data`` for every degree ``p ≥ 2`` that divides
  that axis and is at most the layer count: ``data=64, model=8`` gives
  ``pipe=8, data=8, model=8`` among others. The pipe axis goes right before the
  data axis (major to it), so with the topology's node heuristic it spans nodes
  and its sends use the inter-node link. The plan's mesh then has the ``pipe``
  axis: build the devices' mesh the same way, ``sk.make_mesh(pipe=8, data=8,
  model=8)`` (the same devices in the same order as ``data=64, model=8``),
  or take it from ``plan.mesh``'s axis names and sizes.
- **Context axes in the stages**: on a pipe mesh with a ``context`` axis (the
  one given, or its data axis split where auto tries context parallelism
  unpipelined: :func:`~spmdkit.planner.context_parallel.context_meshes`), each stage's
  layouts are costed both with the sequence on it (two load-balanced chunks per
  device; under ``megatron_sp`` on the tensor axes too, as Megatron-LM's
  ``--context-parallel-size`` with sequence parallelism runs) and with it as
  one more data axis. So NeMo's Llama 3.1 70B layout (TP 4 × PP 4 × CP 2) is
  among what ``sk.plan(..., "auto", pipeline="auto")`` costs on
  ``data=8, context=2, model=4``.
- **Configurations** (:func:`pipeline_configs`): every micro-batch count ``m``
  that divides each data-parallel replica's batch (63 sequences over 9 stages:
  1, 3, 7, 9, 21 and 63); for ``m ≥ p`` 1F1B and, where ``p`` divides ``m``,
  interleaved 1F1B with any ``v ≥ 2`` virtual stages that divides the layers per
  stage; for ``m < p`` (1F1B needs ``m ≥ p``) F-then-B with input release. GPipe is never proposed:
  it has F-then-B's bubble and holds more (:mod:`spmdkit.planner.pipeline.cost`),
  and F-then-B has 1F1B's bubble and holds more where 1F1B runs.
- **Uneven layouts**: a degree that does not divide the layer count (DeepSeek-V3's
  58 MoE layers over 8 stages) gets the same schedules with an uneven
  :attr:`~spmdkit.pipeline.Pipeline.layout` (:func:`~spmdkit.pipeline.balanced_layout`),
  interleaved with ``2 ≤ v ≤`` :data:`UNEVEN_VIRTUAL` virtual stages (at most the
  layers per stage). Once a stage's layouts are known, the layouts are rebalanced
  for the end stages' own work (:func:`with_ends`: what runs before the stack on
  the first, the head on the last, in layers by the cost model), so the first
  and last chunks hold fewer layers, as Megatron-LM's DeepSeek-V3 layout does.
  A degree that divides the layers keeps its even layouts.
- **Expert parallelism in the stages**: for a step with expert-parallel
  ``moe_experts`` calls on a mesh with an expert-role axis (``expert``, ``ep``)
  whose size divides every expert count, the tensor-parallel presets are also
  pipelined with the experts over that axis and the batch over it and the data
  axes (:meth:`PipelinePlanner.expert_rules`): Megatron-LM's EP without expert
  tensor parallelism, whose pipelined runs (GPT-OSS 120B: PP 4 × EP 8) keep each
  stage's experts on their EP ranks rather than gathering them as FSDP weights.
- **Row statistics**: a layer that combines a micro-batch's rows (an MoE
  router's load-balancing statistics) keeps the batch of every pipelined
  candidate unsplit, unless ``SearchOptions(allow_local_statistics=True)``: then
  the pipelines that split it compute them per device's rows
  (``Pipeline(local_statistics=True)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from jax.sharding import AbstractMesh

from spmdkit.mesh import abstract_mesh, data_axis, split_axis
from spmdkit.pipeline import Pipeline, PipelineError, balanced_layout
from spmdkit.pipeline.context_parallel import tokens_error
from spmdkit.planner.analytic import (
    CostContext,
    GroupLayout,
    ParamGroup,
    total_cost,
)
from spmdkit.planner.candidates import (
    Candidate,
    activation_layout,
    batch_axis_choices,
    preset_tables,
    propagate_cost,
    rules_choice,
    search_layouts,
)
from spmdkit.planner.context_parallel import CONTEXT_AXIS, context_axes, context_meshes
from spmdkit.planner.expert_mesh import expert_counts, expert_placement
from spmdkit.planner.logical import (
    BATCH_NAMES,
    PRESETS,
    SHARDED_OPT_PRESETS,
    LogicalRules,
    RulesLike,
    UnknownLogicalAxisError,
    preset_rules,
)
from spmdkit.planner.notes import PlanNote
from spmdkit.planner.pipeline.cost import (
    StageSplit,
    end_layers,
    param_stages,
    pipeline_cost,
    stage_groups,
)
from spmdkit.planner.pipeline.plan import (
    PLACEHOLDER_AXIS,
    check_pipeline_batch,
    layer_rules,
    model_rows_combined,
    model_rows_loss,
    model_tokens_refused,
)
from spmdkit.planner.plans import Cost, Dims
from spmdkit.planner.problem import Problem
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.step.recipe import PLAIN, Recipe
from spmdkit.util import divisors

__all__ = [
    "PipelinePlanner",
    "PIPE_AXIS",
    "UNEVEN_VIRTUAL",
    "data_axis",
    "pipe_meshes",
    "pipeline_configs",
    "reference",
    "split_mesh",
    "with_ends",
]

#: The cost of a candidate not costed yet (never ranked).
_NO_COST = Cost(0.0, 0.0, 0.0, {}, {})

#: Pipelined candidates are also kept at their best within this share of the
#: budget (their analytic memory is calibrated upwards by propagation).
_PIPE_HEADROOM = 0.7

#: The presets auto also pipelines (:meth:`PipelinePlanner.pipelined_on`): the tensor-
#: parallel ones, and Megatron's with the distributed optimizer (its state sharded
#: over the data and context axes, as the published Megatron-LM pipelines run).
_TP_PRESETS = ("megatron", "megatron_sp", "tp_fsdp", *SHARDED_OPT_PRESETS)

#: The texts of the two reasons a pipelined candidate may not split its batch
#: (:meth:`PipelinePlanner.batch_refused`).
_LAYER_WHY = "a layer would combine a device's rows alone (`{}`)"
_LOSS_WHY = (
    "the devices' losses averaged are the micro-batch's only for a mean over the rows (given {})"
)

#: The mesh axis pipelined plans put their stages on.
PIPE_AXIS = "pipe"

#: The most virtual stages auto interleaves an uneven layout with (a degree that
#: does not divide the layers: :func:`pipeline_configs`); Megatron-Bridge runs
#: DeepSeek-V3's 58 MoE layers as 8 stages of 4 virtual ones.
UNEVEN_VIRTUAL = 4


def split_mesh(mesh: MeshLike, stages: int, axis: str = PIPE_AXIS) -> MeshLike:
    """``mesh`` with its data axis (:func:`data_axis`) split into ``axis × data``.

    The devices keep their order (a ``Mesh``'s device array is reshaped), so
    ``split_mesh(make_mesh(data=8, model=2), 2)`` is ``make_mesh(pipe=2, data=4,
    model=2)``.

    Args:
        mesh: a ``Mesh`` or ``AbstractMesh`` without ``axis``.
        stages: the pipe axis's size; it must divide the data axis.
        axis: the new axis's name.

    Raises:
        PipelineError: no data axis, or ``stages`` does not divide it.

    Example::

        >>> split_mesh(abstract_mesh(data=64, model=8), 8).axis_names
        ('pipe', 'data', 'model')
    """
    sizes = axis_sizes(mesh)
    data = data_axis(mesh)
    if data is None or sizes[data] % stages:
        raise PipelineError(
            op="plan",
            must=f"a mesh without a '{axis}' axis has a data axis that {stages} stages divide",
            given=str(sizes),
            fix=f"add a '{axis}' axis to the mesh (sk.make_mesh({axis}={stages}, ...)) "
            "or pick stages that divide the data axis",
        )
    return split_axis(mesh, data, axis, stages, major=True)


def pipe_meshes(mesh: MeshLike, layers: int, stages: int | None = None) -> list[MeshLike]:
    """The meshes auto pipelines over (module docstring), smallest degree first.

    Args:
        mesh: the mesh given to ``plan``.
        layers: the stacked layer count (degrees are at most it; one that does
            not divide it pipelines uneven layouts: :func:`pipeline_configs`).
        stages: a fixed degree (a given :class:`~spmdkit.pipeline.Pipeline`), or
            None for every degree.
    """
    sizes = axis_sizes(mesh)
    if PIPE_AXIS in sizes:
        return [mesh] if sizes[PIPE_AXIS] > 1 else []
    if stages is not None:
        return [split_mesh(mesh, stages)]
    data = data_axis(mesh)
    if data is None or layers < 2:
        return []
    return [
        split_mesh(mesh, p) for p in range(2, min(sizes[data], layers) + 1) if sizes[data] % p == 0
    ]


def _seq_choices(inner: Mapping[str, int], seq_len: int) -> list[tuple[str, ...]]:
    """The sequence's axes a pipelined stage is costed with: none, and the context
    axis (:data:`~spmdkit.planner.context_parallel.CONTEXT_AXIS`) when the mesh has one of
    more than one device whose chunks (two per device, load-balanced) split the
    sequence."""
    n = inner.get(CONTEXT_AXIS, 1)
    return [()] + ([(CONTEXT_AXIS,)] if n > 1 and seq_len % (2 * n) == 0 else [])


def pipeline_configs(
    stages: int, layers: int, local_batch: int, request: Pipeline | None = None
) -> list[Pipeline]:
    """The configurations auto costs for one degree (module docstring).

    Args:
        stages: the pipe axis's size.
        layers: the stacked layer count.
        local_batch: one data-parallel replica's batch (micro-batches divide it).
        request: a fixed configuration: just it, when it fits these.

    Returns:
        Valid configurations, fewest micro-batches first (then fewest virtual stages).

    Example:
        >>> [c.short() for c in pipeline_configs(9, 126, 63)][:4]
        ['pp9 fthenb m1', 'pp9 fthenb m3', 'pp9 fthenb m7', 'pp9 1f1b m9']
    """
    if request is not None:
        fits = sum(request.layout) == layers if request.layout else layers % request.chunks == 0
        ok = request.stages == stages and fits and local_batch % request.microbatches == 0
        return [request] if ok else []
    even = layers % stages == 0
    if even:
        virtual = [v for v in divisors(layers // stages) if v > 1]
    else:  # an uneven layout per virtual count (balanced_layout)
        virtual = list(range(2, min(UNEVEN_VIRTUAL, layers // stages) + 1))
    lay = {v: None if even else balanced_layout(layers, stages, v) for v in (1, *virtual)}
    out: list[Pipeline] = []
    for m in divisors(local_batch) if layers >= stages else []:
        if m < stages:
            out.append(Pipeline(stages, m, "fthenb", layout=lay[1]))
            continue
        out.append(Pipeline(stages, m, "1f1b", layout=lay[1]))
        if m % stages == 0:
            out += [Pipeline(stages, m, "interleaved", virtual=v, layout=lay[v]) for v in virtual]
    return out


def with_ends(
    configs: Sequence[Pipeline], layers: int, ends: tuple[float, float]
) -> list[Pipeline]:
    """``configs`` with each uneven layout (:func:`pipeline_configs`' for a degree
    that does not divide the layers) rebalanced for the end stages' extra work
    (``ends``: the first and the last device's, in layers:
    :func:`~spmdkit.planner.pipeline.cost.end_layers`), so the first and last
    chunks take fewer layers where they run the embedding or the head; even
    configurations unchanged.

    Example:
        >>> with_ends(pipeline_configs(3, 8, 3), 8, (2.0, 0.0))[1].short()
        'pp3 1f1b m3 layout 1-4-3'
    """
    layouts = {  # one per virtual stage count: the configurations differ in m
        c.virtual: balanced_layout(layers, c.stages, c.virtual, ends) for c in configs if c.uneven
    }
    return [replace(c, layout=layouts[c.virtual]) if c.uneven else c for c in configs]


def reference(configs: Sequence[Pipeline]) -> Pipeline:
    """The configuration layouts are searched under: the most micro-batches
    (the smallest bubble and activations), 1F1B where it runs."""
    most = max(c.microbatches for c in configs)
    top = [c for c in configs if c.microbatches == most]
    return next((c for c in top if c.schedule == "1f1b"), top[0])


# -- one plan() call ----------------------------------------------------------------------------


def _on_pipe(g: ParamGroup, layout: GroupLayout, axis: str = PIPE_AXIS) -> GroupLayout:
    """A stage group's layout on the whole stack: its layer dim over the pipe axis too."""
    i = g.logical.index("layers") if g.logical and "layers" in g.logical else 0

    def put(dims: Dims) -> Dims:
        return tuple((axis, *d) if k == i else d for k, d in enumerate(dims))

    return GroupLayout(put(layout.params), put(layout.opt), layout.grads_sharded)


def _mesh_without(sizes: Mapping[str, int], axes: Iterable[str]) -> AbstractMesh:
    """The abstract mesh of ``sizes`` without ``axes`` (a one-device placeholder
    axis when none is left: a plan needs a mesh with an axis)."""
    drop = set(axes)
    return abstract_mesh(
        **({a: s for a, s in sizes.items() if a not in drop} or {PLACEHOLDER_AXIS: 1})
    )


def _without(layout: GroupLayout, axes: tuple[str, ...]) -> GroupLayout:
    """A layout with ``axes`` taken off its parameters and optimizer state."""

    def drop(dims: Dims) -> Dims:
        return tuple(tuple(a for a in d if a not in axes) for d in dims)

    return GroupLayout(drop(layout.params), drop(layout.opt), layout.grads_sharded)


def _with_context_meshes(mesh: Any, trace: Any) -> list[Any]:
    """``mesh``, and unless it has a context axis already, each of its meshes with the
    data axis split for context parallelism (:func:`context_meshes`)."""
    if CONTEXT_AXIS in axis_sizes(mesh):
        return [mesh]
    return [mesh, *context_meshes(mesh, trace.batch_size, trace.seq_len)]


@dataclass(frozen=True, eq=False)
class PipelinePlanner:
    """The pipeline half of one :func:`~spmdkit.planner.plan` call: which groups
    live on which stage, the pipelined candidates per pipe degree, recipe and
    batch axes (searched under the reference configuration, then every
    configuration costed with their layouts), and their costs calibrated by
    propagating a twin that runs one stage's work. A collaborator of
    :class:`spmdkit.planner.search._Planner`, which calls :meth:`pipelined`,
    :meth:`pipelined_strategy`, :meth:`calibrated`, :meth:`analytic_cost`,
    :meth:`stages` and :meth:`refused_notes`.

    Attributes:
      problem: what the plan call plans (the only thing it reads of the planner).
      memos: group-cost memos per pipe mesh, shared by its recipes (a cache).
      refused_steps: label → (context axes, problem) of the pipelined candidates
        auto left out because their step would be refused (:meth:`refused`).
      refused_batches: batch axes → why no pipelined candidate splits the batch
        over them (a layer combines rows, or the loss is not a mean over them:
        :meth:`batch_refused`).
      why_none: why ``pipeline="auto"`` costed no pipelined candidate at all
        (the last reason counts; empty: it costed some).
    """

    problem: Problem
    memos: dict = field(default_factory=dict)
    refused_steps: dict = field(default_factory=dict)
    refused_batches: dict = field(default_factory=dict)
    why_none: list[str] = field(default_factory=list)

    def stages(self) -> tuple[str, ...] | None:
        """Per group, where it lives in a pipeline
        (:func:`~spmdkit.planner.pipeline.cost.param_stages`); None when the model
        has no stacked layers to pipeline."""
        trace = self.problem.ctx.trace
        if trace.layers < 2:
            return None
        found = self.problem.info.memo(
            ("planner.stages", trace.layers),
            lambda: param_stages(
                self.problem.info.loss_fn,
                self.problem.info.abstract_params,
                self.problem.info.batch,
                trace.layers,
            ),
        )
        where = tuple(found.get(g.paths[0], "first") for g in self.problem.groups)
        for g, w in zip(self.problem.groups, where, strict=True):
            dim = g.logical.index("layers") if g.logical and "layers" in g.logical else 0
            if w == "layers" and (not g.shape or g.shape[dim] != trace.layers):
                return None
        return where if "layers" in where else None

    def pipelined(
        self, request: Pipeline | str, fixed: Recipe | None, extra: RulesLike | None = None
    ) -> list[Candidate]:
        """Pipelined candidates (:mod:`spmdkit.planner.pipeline.search`): per pipe degree,
        recipe and batch axes, the layouts searched under the reference
        configuration, then every configuration costed with them; the best kept."""
        fixed_pipe = request if isinstance(request, Pipeline) else None
        where = self.stages()
        if where is None:
            if fixed_pipe is None:
                self.why_none.append(
                    f"{self.problem.info.name} has no layer stack to split into stages (no layer "
                    "scan whose stacked parameters lead with the layer count)"
                )
                return []
            raise PipelineError(
                op="plan",
                must="a pipelined model has its layers stacked in one scan (nnx.scan, "
                "flax.linen.scan or jax.lax.scan over a params stack)",
                given=f"{self.problem.info.name}: no layer scan whose stacked "
                "parameters lead with the layer count",
                fix="scan the layers (e.g. scan_layers=True in the reference models), or "
                "plan without pipeline=",
            )
        if fixed_pipe is not None and fixed_pipe.axis != PIPE_AXIS:
            raise PipelineError(
                op="plan",
                must=f"auto pipelines over the '{PIPE_AXIS}' axis",
                given=f"Pipeline(axis={fixed_pipe.axis!r})",
                fix=f"pass Pipeline(axis='{PIPE_AXIS}', ...) and name the mesh axis so",
            )
        if fixed is not None and fixed.microbatches != 1:
            raise PipelineError(
                op="plan",
                must="a pipelined plan takes its micro-batches from the pipeline",
                given=f"recipe microbatches={fixed.microbatches}",
                fix="pass microbatches=1 in the recipe and Pipeline(microbatches=...)",
            )
        if fixed is not None and fixed.remat_every != 1:
            raise PipelineError(
                op="plan",
                must="a pipelined plan recomputes every layer of its stages alike",
                given=f"recipe remat_every={fixed.remat_every}",
                fix="pass remat_every=1 with pipeline=, or plan without a pipeline",
            )
        # the stage cost model prices remat per layer, on the device
        recipes = {
            (r.remat, r.compute_dtype, r.master_weights, r.save_names): r
            for r in self.problem.recipes(fixed)[0]
            if fixed is not None or (r.remat_every == 1 and not r.remat_offload)
        }
        base = [replace(r, microbatches=1) for r in recipes.values()]
        layers = self.problem.ctx.trace.layers
        stages = fixed_pipe.stages if fixed_pipe is not None else None
        if fixed_pipe is not None:
            fixed_pipe.check_layers(layers, op="plan")
        out: list[Candidate] = []
        meshes = pipe_meshes(self.problem.mesh, layers, stages)
        if not meshes:
            self.why_none.append(
                f"no pipe degree of 2 or more divides the mesh's data axis "
                f"({axis_sizes(self.problem.mesh)}) and is at most the {layers} layers"
            )
        # and each with its data axis split for context parallelism where auto
        # tries it unpipelined (long sequences, a batch short of the data axis)
        meshes = [m for pm in meshes for m in _with_context_meshes(pm, self.problem.ctx.trace)]
        for mesh in meshes:
            for r in base:
                out += self.pipelined_on(mesh, where, r, fixed_pipe, extra)
        refused = self.refused_steps
        if fixed_pipe is not None and not out and refused:
            axes, problem = next(iter(refused.values()))
            raise tokens_error(problem, axes, "plan(pipeline=...)")
        return out

    def tokens_problem(self, c: Candidate) -> str:
        """What the step of ``c``, a pipelined candidate, would refuse for its
        context axes (:func:`~spmdkit.planner.pipeline.plan.model_tokens_refused`)."""
        if not c.context or c.pipeline is None or c.mesh is None:
            return ""
        batch = tuple(c.activation.get("batch", ()))
        return model_tokens_refused(self.problem.info, c.mesh, c.pipeline, batch, c.context)

    def refused(self, c: Candidate) -> bool:
        """auto: ``c`` is a pipelined context-parallel candidate whose step would be
        refused (:meth:`tokens_problem`); recorded for :meth:`refused_notes`."""
        try:
            problem = self.tokens_problem(c)
        except PipelineError as e:  # its shards do not divide the batch: cannot run
            problem = e.given
        if problem:
            self.refused_steps[c.label] = (c.context, problem)
        return bool(problem)

    def batch_refused(self, batch_axes: tuple[str, ...], local_stats: bool) -> bool:
        """auto: no pipelined candidate may split its batch over ``batch_axes``: a
        layer combines a micro-batch's rows (unless ``local_stats``,
        :func:`~spmdkit.planner.pipeline.plan.model_rows_combined`) or the loss is
        not a mean over the rows (:func:`~spmdkit.planner.pipeline.plan.model_rows_loss`);
        recorded for :meth:`refused_notes`."""
        mixed = "" if local_stats else model_rows_combined(self.problem.info)
        problem = model_rows_loss(self.problem.info)
        why = [_LAYER_WHY.format(mixed)] if mixed else []
        why += [_LOSS_WHY.format(problem)] if problem else []
        if why:
            self.refused_batches[batch_axes] = "; ".join(why)
        return bool(why)

    def refused_notes(self) -> list[PlanNote]:
        """``dropped`` notes: auto was asked for pipelines and costed none (the
        model has no layer stack, no pipe degree divides the mesh and the layers),
        or left pipelined candidates out because their step would be refused
        (:meth:`refused`)."""
        if self.why_none:
            none = self.why_none[-1]
            return [
                PlanNote(
                    "dropped",
                    f"pipeline='auto' costed no pipelined plan: {none}; the plan is flat.",
                    "scan the layers over stacked parameters (nnx.scan, flax.linen.scan, "
                    "jax.lax.scan; scan_layers=True in the reference models), or plan "
                    "without pipeline=",
                )
            ]
        notes = []
        loss = self.refused_batches
        if loss:
            axes = sorted({a for ax in loss for a in ax})
            notes.append(
                PlanNote(
                    "dropped",
                    f"auto costed pipelined plans only without the batch over {axes}: "
                    "each device would run its stages and the loss on its own rows of "
                    f"a micro-batch, and {next(iter(loss.values()))}.",
                    "for a layer's statistics, pass pipeline=Pipeline(..., "
                    "local_statistics=True) to have them computed per device's rows; for "
                    "the loss, make it a mean over the rows (a mask normalized over the "
                    "whole batch before the step); or keep the plans without batch axes",
                )
            )
        refused = self.refused_steps
        if not refused:
            return notes
        problem = next(iter(refused.values()))[1]
        shown = ", ".join(list(refused)[:3]) + (", ..." if len(refused) > 3 else "")
        return [
            *notes,
            PlanNote(
                "dropped",
                f"auto left {len(refused)} pipelined context-parallel candidate(s) out "
                f"({shown}): a pipelined stage runs on each device's tokens, "
                "so no layer may mix tokens but through attention and the loss must be "
                f"a mean over the tokens; given {problem}.",
                "keep the flat plans (context parallelism as global SPMD, correct for any "
                "layer and loss), or make the loss a mean over the tokens "
                "(docs/context-parallel.md) to have pipelines with context axes costed",
            ),
        ]

    def pipelined_on(
        self,
        mesh: MeshLike,
        where: tuple[str, ...],
        recipe: Recipe,
        request: Pipeline | None,
        extra: RulesLike | None = None,
    ) -> list[Candidate]:
        """The best pipelined candidate per batch-axes choice on one mesh with a pipe
        axis, and the tensor-parallel presets' (``extra`` rules first) pipelined."""
        sizes = axis_sizes(mesh)
        p = sizes[PIPE_AXIS]
        if request is not None and request.stages != p:
            raise PipelineError(
                op="plan",
                must=f"the pipeline's stages equal the mesh's '{PIPE_AXIS}' axis",
                given=f"stages={request.stages}, {PIPE_AXIS}={p}",
                fix=f"pass Pipeline(stages={p}, ...) or a mesh with {PIPE_AXIS}={request.stages}",
            )
        trace = self.problem.ctx.trace
        inner = {a: s for a, s in sizes.items() if a != PIPE_AXIS}
        ctx = replace(
            self.problem.ctx, mesh=mesh, sizes=sizes, recipe=recipe, memo=self.pipe_memo(mesh)
        )
        groups = stage_groups(self.problem.groups, where, p)
        out = []
        # a layer combining a micro-batch's rows (MoE's router statistics) runs
        # pipelined only without batch axes, unless the request computes it per
        # device's rows (the executor refuses it otherwise)
        local_stats = self.local_statistics(request)
        for seq_ax in _seq_choices(inner, trace.seq_len):
            others = {a: s for a, s in inner.items() if a not in seq_ax}
            sctx = replace(ctx, context=seq_ax) if seq_ax else ctx
            for batch_ax in batch_axis_choices(others, trace.batch_size):
                shards = math.prod(inner[a] for a in batch_ax)
                if shards > 1 and self.batch_refused(batch_ax, local_stats):
                    continue
                configs = pipeline_configs(p, trace.layers, trace.batch_size // shards, request)
                configs = self.with_statistics(configs, request, shards)
                if not configs:
                    continue
                found = self.pipe_search(
                    sctx, groups, where, (batch_ax, seq_ax), configs, inner, request
                )
                for choice, cost, pipe in found:
                    full = [
                        _on_pipe(g, lay) if w == "layers" else lay
                        for g, lay, w in zip(self.problem.groups, choice, where, strict=True)
                    ]
                    act = {n: () for n in BATCH_NAMES}
                    act["batch"], act["seq"] = batch_ax, seq_ax
                    name = f"searched[batch={','.join(batch_ax) or '-'}" + "".join(
                        f",{a}={inner[a]}" for a in seq_ax
                    )
                    c = Candidate(name + "]", full, act, None, cost, recipe, pipe, mesh, seq_ax)
                    if not self.refused(c):  # only a context-parallel one can be
                        out.append(c)
        return out + self.pipelined_presets(mesh, recipe, request, extra)

    def pipelined_presets(
        self,
        mesh: MeshLike,
        recipe: Recipe,
        request: Pipeline | None,
        extra: RulesLike | None,
    ) -> list[Candidate]:
        """The tensor-parallel presets' layouts (``extra`` rules first) on the axes of
        ``mesh`` other than the pipe axis, pipelined: Megatron-LM's pipelines keep
        tensor parallelism inside the node, which the per-group search (each group's
        layout on its own) can miss; it covers the data-parallel and FSDP layouts
        itself. With a context axis, each also with Megatron-LM's context
        parallelism: the sequence over the context axis (and the tensor axes under
        sequence parallelism), unless ``extra`` places the sequence."""
        sizes = axis_sizes(mesh)
        inner = {a: s for a, s in sizes.items() if a != PIPE_AXIS}
        sub = _mesh_without(sizes, (PIPE_AXIS,))
        seq_len = self.problem.ctx.trace.seq_len
        extra = None if extra is None else LogicalRules.coerce(extra)
        given = extra is not None and any(n == "seq" for n, _ in extra.entries)
        out = []
        variants = [(n, ep) for ep in (None, *self.expert_rules(inner, extra)) for n in _TP_PRESETS]
        for name, ep in variants:
            for cp in [()] if given else _seq_choices(inner, seq_len):
                base = rules = extra if ep is None else ep
                if cp:
                    spec = preset_rules(name, sub).resolve(("seq",), (seq_len,), sub)
                    sp = spec[0] if len(spec) else None
                    sp = (sp,) if isinstance(sp, str) else tuple(sp or ())
                    rules = LogicalRules((("seq", (*cp, *(a for a in sp if a not in cp))),))
                    rules = rules if base is None else base.prepend(rules)
                try:
                    tables = preset_tables(name, rules, sub, self.problem.aliases)
                    c = self.pipelined_table(name, tables, mesh, recipe, request)
                except UnknownLogicalAxisError:
                    continue
                if c is not None and not self.refused(c):
                    out.append(c)
        return out

    def pipe_search(
        self,
        ctx: CostContext,
        groups: list[ParamGroup],
        where: tuple[str, ...],
        axes: tuple[tuple[str, ...], tuple[str, ...]],
        configs: list[Pipeline],
        inner: dict[str, int],
        request: Pipeline | None = None,
    ) -> list[tuple[list[GroupLayout], Cost, Pipeline]]:
        """Stage layouts searched under the reference configuration
        (:func:`~spmdkit.planner.pipeline.search.reference`, honouring the budget), then
        the best configuration with them, ``(choice, cost, pipeline)``, and the best
        within :data:`_PIPE_HEADROOM` of the budget when that is another one (the
        analytic model's memory is calibrated upwards later, :meth:`calibrated`).
        ``axes``: the batch axes and the context axes the sequence is split over.
        Uneven layouts are rebalanced for the end stages (:func:`with_ends`) unless
        they are the ``request``'s."""
        layers = ctx.trace.layers
        batch_ax, seq_ax = axes
        ref = reference(configs)
        rctx = replace(ctx, recipe=replace(ctx.recipe, microbatches=ref.microbatches))

        def cost_of(pipe: Pipeline, choice: Sequence[GroupLayout]) -> Cost:
            split = StageSplit(pipe, where, layers)
            return pipeline_cost(rctx, groups, choice, batch_ax, seq_ax, split)

        choice, _ = search_layouts(
            rctx,
            groups,
            batch_ax,
            seq_ax,
            self.problem.budget,
            total=lambda _c, _g, ch, _b, _s: cost_of(ref, ch),
            sizes=inner,
        )
        if ref.uneven and request is None:  # the end stages' work: fewer layers there
            ends = end_layers(
                rctx, groups, choice, batch_ax, seq_ax, StageSplit(ref, where, layers)
            )
            configs = with_ends(configs, layers, ends)
        costed = self.costed_configs(configs, lambda pipe: cost_of(pipe, choice))
        cost, i, pipe = min(costed, key=lambda x: (*self.problem.rank_cost(x[0]), x[1]))
        tight = self.problem.budget * _PIPE_HEADROOM
        cost2, i2, pipe2 = min(costed, key=lambda x: (*self.problem.rank_cost(x[0], tight), x[1]))
        out = [(choice, cost, pipe)]
        return out if i2 == i else [*out, (choice, cost2, pipe2)]

    def costed_configs(
        self, configs: Sequence[Pipeline], cost_of: Callable[[Pipeline], Cost]
    ) -> list[tuple[Cost, int, Pipeline]]:
        """``(cost, index, pipeline)`` of the configurations worth costing, by a
        cost-guided pruning of the micro-batch counts.

        The counts are costed from the most down, every schedule and virtual stage
        count of a count together. Fewer micro-batches hold more per device (each
        is larger; 1F1B holds ``p`` of them whatever ``m``), and the step time
        falls then rises as ``m`` shrinks (the bubble ``(p − 1)/(v·m)`` grows, the
        per-micro-batch latencies shrink). So once a count's best step time is
        above the count before's, a smaller count can rank first (:meth:`rank`,
        against the budget or :data:`_PIPE_HEADROOM` of it) neither by fitting
        faster than what fits already nor, where nothing fits, by holding less:
        the rest are not costed."""
        by_count: dict[int, list[tuple[int, Pipeline]]] = {}
        for i, pipe in enumerate(configs):
            by_count.setdefault(pipe.microbatches, []).append((i, pipe))
        budgets = (self.problem.budget, self.problem.budget * _PIPE_HEADROOM)
        out: list[tuple[Cost, int, Pipeline]] = []
        fits = [math.inf for _ in budgets]  # the fastest step that fits each budget
        above = math.inf
        for m in sorted(by_count, reverse=True):
            row = [(cost_of(pipe), i, pipe) for i, pipe in by_count[m]]
            out += row
            for k, b in enumerate(budgets):
                fits[k] = min([fits[k], *(c.step_time_s for c, _, _ in row if c.peak_bytes <= b)])
            step = min(c.step_time_s for c, _, _ in row)
            if step > above and all(f == math.inf or f <= step for f in fits):
                break
            above = step
        return sorted(out, key=lambda x: x[1])

    def analytic_cost(self, c: Candidate) -> Cost:
        """A candidate's analytic cost (its memory by kind), whatever re-costed it:
        a pipelined one's by :meth:`pipelined_cost`, another's by ``total_cost``."""
        if c.pipeline is not None:
            return self.pipelined_cost(c, [_without(lay, (c.pipeline.axis,)) for lay in c.choice])
        batch, seq = c.activation.get("batch", ()), c.activation.get("seq", ())
        ctx = self.problem.at(c.recipe)
        if c.context:
            ctx = replace(
                ctx,
                mesh=c.mesh or ctx.mesh,
                sizes=axis_sizes(c.mesh or ctx.mesh),
                context=c.context,
                memo={},
            )
        return total_cost(ctx, self.problem.groups, c.choice, batch, seq)

    def pipe_memo(self, mesh: MeshLike) -> dict:
        """The group-cost memo of one pipe mesh (shared by its recipes)."""
        return self.memos.setdefault(tuple(axis_sizes(mesh).items()), {})

    def calibrated(self, c: Candidate) -> Candidate:
        """A pipelined candidate whose analytic communication and memory are scaled by
        propagated / analytic of its twin, propagated through the train step.

        The twin is one stage's work as the executor runs it: the whole stack on the
        mesh without the pipe axis and without the batch axes (a stage's rows stay
        on their device; the weights are gathered over the batch axes once per step
        and held), the pipeline's micro-batches as accumulation steps of the rows
        one device runs per micro-batch (``m × batch shards`` of them). So the twin
        re-runs per micro-batch exactly the collectives a stage re-runs per
        micro-batch (tensor-parallel reductions, gathers over the other axes), and
        none the executor runs once per step. The propagator does not trace the
        stage program itself; the twin carries the layouts' collectives and
        buffers."""
        assert c.pipeline is not None and c.mesh is not None
        axis = c.pipeline.axis
        batch, seq = c.activation.get("batch", ()), c.activation.get("seq", ())
        sizes = axis_sizes(c.mesh)
        mesh = _mesh_without(sizes, (axis, *batch))
        choice = [_without(lay, (axis,)) for lay in c.choice]
        shards = math.prod(sizes[a] for a in batch)
        recipe = replace(c.recipe, microbatches=c.pipeline.microbatches * shards)
        ctx = replace(
            self.problem.ctx,
            mesh=mesh,
            sizes=axis_sizes(mesh),
            recipe=recipe,
            memo=self.pipe_memo(mesh),
            context=context_axes(seq),
        )
        stage = [_without(lay, batch) for lay in choice]
        analytic = total_cost(ctx, self.problem.groups, stage, (), seq)
        act = {n: () if n == "batch" else v for n, v in c.activation.items()}
        twin = Candidate(c.name, stage, act, None, analytic, recipe, mesh=mesh)
        prop = propagate_cost(
            self.problem.info,
            self.problem.optimizer,
            self.problem.make_plan(c.name, twin, None),
            ctx,
            analytic,
        )
        comm = prop.comm_time_s / analytic.comm_time_s if analytic.comm_time_s else 1.0
        mem = prop.peak_bytes / analytic.peak_bytes if analytic.peak_bytes else 1.0
        return c._replace(cost=self.pipelined_cost(c, choice, (comm, mem)))

    def pipelined_cost(
        self,
        c: Candidate,
        choice: list[GroupLayout],
        calibration: tuple[float, float] | None = None,
    ) -> Cost:
        """:func:`~spmdkit.planner.pipeline.cost.pipeline_cost` of a pipelined candidate
        (its cost not read) whose layouts off the pipe axis are ``choice``."""
        pctx, groups, split = self.stage_view(c)
        batch, seq = c.activation.get("batch", ()), c.activation.get("seq", ())
        return pipeline_cost(pctx, groups, choice, batch, seq, split, calibration=calibration)

    def stage_view(self, c: Candidate) -> tuple[CostContext, list[ParamGroup], StageSplit]:
        """A pipelined candidate's cost context (its mesh, recipe and context axes),
        its groups as the busiest pipe-axis device holds them, and its split."""
        assert c.pipeline is not None and c.mesh is not None
        where = self.stages()
        assert where is not None
        pctx = replace(
            self.problem.ctx,
            mesh=c.mesh,
            sizes=axis_sizes(c.mesh),
            recipe=c.recipe,
            memo=self.pipe_memo(c.mesh),
            context=context_axes(c.activation.get("seq", ())),
        )
        layers = self.problem.ctx.trace.layers
        held = max(c.pipeline.device_layers(layers)) if c.pipeline.uneven else None
        groups = stage_groups(self.problem.groups, where, c.pipeline.stages, held)
        return pctx, groups, StageSplit(c.pipeline, where, layers)

    def pipelined_strategy(
        self,
        strategy: str | RulesLike,
        extra: RulesLike | None,
        recipe: Recipe | None,
        pipe: Pipeline,
    ) -> tuple[str, Candidate, Cost]:
        """A preset or rule table pipelined with ``pipe`` over this planner's mesh:
        its candidate (:meth:`pipelined_table`) and that candidate's cost, calibrated
        by propagation (:meth:`calibrated`) under the propagate estimator. What
        ``sk.plan(..., "<preset>", pipeline=pipe)`` returns is this candidate's plan:
        the layouts and the cost are one computation.

        Raises:
          PipelineError: each device's rows do not divide into the micro-batches, or
            a layer combines the rows the batch axes split
            (:func:`~spmdkit.planner.pipeline.plan.check_pipeline_batch`).
        """
        sub = _mesh_without(self.problem.ctx.sizes, (pipe.axis,))
        if isinstance(strategy, str):
            tables = preset_tables(strategy, extra, sub, self.problem.aliases)
        else:
            table = LogicalRules.coerce(strategy)
            table = table if extra is None else table.prepend(extra)
            tables = (table, table)
        batch = activation_layout(layer_rules(tables[0]), sub, self.problem.ctx.trace).get(
            "batch", ()
        )
        check_pipeline_batch(
            self.problem.info,
            self.problem.mesh,
            pipe,
            tuple(a for a in batch if a != PLACEHOLDER_AXIS),
        )
        name = strategy if isinstance(strategy, str) else "rules"
        c = self.pipelined_table(name, tables, self.problem.mesh, recipe or PLAIN, pipe)
        assert c is not None  # check_pipeline_batch refused what pipelined_table drops
        problem = self.tokens_problem(c)
        if problem:
            raise tokens_error(problem, c.context, "plan(pipeline=...)")
        return name, c, self.calibrated(c).cost if self.problem.estimator == "propagate" else c.cost

    def local_statistics(self, request: Pipeline | None) -> bool:
        """Whether a pipelined candidate may split the batch although a layer
        combines a micro-batch's rows: the request says so, else auto when asked
        (:attr:`~spmdkit.planner.options.SearchOptions.allow_local_statistics`)."""
        if request is not None:
            return request.local_statistics
        return self.problem.options.allow_local_statistics

    def with_statistics(
        self, configs: list[Pipeline], request: Pipeline | None, shards: int
    ) -> list[Pipeline]:
        """``configs``, computing a layer's row statistics per device's rows where
        auto was allowed to (:meth:`local_statistics`, no request) and the batch
        is split over ``shards > 1`` devices of a model with such a layer."""
        if request is not None or shards <= 1 or not self.local_statistics(None):
            return configs
        if not model_rows_combined(self.problem.info):
            return configs
        return [replace(c, local_statistics=True) for c in configs]

    def expert_rules(
        self, inner: Mapping[str, int], extra: LogicalRules | None
    ) -> list[LogicalRules]:
        """The rules that put the experts on the stage mesh's expert-role axes
        (``inner``: the mesh's axes but the pipe axis) and the batch over them and
        the data axes, ahead of ``extra``: when the step has expert-parallel
        ``moe_experts`` calls, those axes (more than one device) divide every
        expert count, and ``extra`` places neither the experts nor the batch, that
        table and, where every expert count divides them too, one with the experts
        over the model axes as well (EP across the TP ranks, as the flat
        candidates and Megatron-Bridge's DeepSeek-V3 run: EP 64 over TP 2 x EP 32);
        else none."""
        counts = expert_counts(self.problem.ctx.trace)
        out: list[LogicalRules] = []
        for over_model in (False, True):
            rules = expert_placement(dict(inner), counts, extra, over_model=over_model)
            if rules is not None and rules not in out:
                out.append(rules)
        return out

    def pipelined_table(
        self,
        name: str,
        tables: tuple[LogicalRules, LogicalRules],
        mesh: MeshLike,
        recipe: Recipe,
        request: Pipeline | None,
    ) -> Candidate | None:
        """A rule table's layouts on the axes other than the pipe axis (the ``layers``
        dim kept off them), pipelined over ``mesh``'s pipe axis: with ``request``,
        that configuration, else every configuration auto tries for the table's
        batch axes, the best kept (analytic cost). None when no configuration splits
        the table's per-replica batch, or when its batch axes would mix the rows a
        layer combines (MoE router statistics) and the request does not compute them
        per device."""
        axis = request.axis if request is not None else PIPE_AXIS
        where = self.stages()
        assert where is not None
        sizes = axis_sizes(mesh)
        inner = {a: s for a, s in sizes.items() if a != axis}
        sub = _mesh_without(sizes, (axis,))
        rules, opt_rules = (layer_rules(t) for t in tables)
        preset = name if name in PRESETS or name in SHARDED_OPT_PRESETS else None
        choice = [
            _without(lay, (PLACEHOLDER_AXIS,))
            for lay in rules_choice(rules, opt_rules, self.problem.groups, sub, preset)
        ]
        act = {
            n: tuple(a for a in v if a in inner)
            for n, v in activation_layout(rules, sub, self.problem.ctx.trace).items()
        }
        shards = math.prod(inner[a] for a in act.get("batch", ()))
        if shards > 1 and self.batch_refused(act.get("batch", ()), self.local_statistics(request)):
            return None
        configs = pipeline_configs(
            sizes[axis],
            self.problem.ctx.trace.layers,
            self.problem.ctx.trace.batch_size // shards,
            request,
        )
        configs = self.with_statistics(configs, request, shards)
        full = [
            _on_pipe(g, lay, axis) if w == "layers" else lay
            for g, lay, w in zip(self.problem.groups, choice, where, strict=True)
        ]
        if not configs:
            return None

        def cost_of(pipe: Pipeline) -> Cost:
            c = Candidate(name, full, act, rules, _NO_COST, recipe, pipe, mesh)
            return self.pipelined_cost(c, choice)

        ref = reference(configs)
        if ref.uneven and request is None:  # the end stages' work: fewer layers there
            pctx, groups, split = self.stage_view(
                Candidate(name, full, act, rules, _NO_COST, recipe, ref, mesh)
            )
            batch, seq = act.get("batch", ()), act.get("seq", ())
            ends = end_layers(pctx, groups, choice, batch, seq, split)
            configs = with_ends(configs, self.problem.ctx.trace.layers, ends)
        costed = self.costed_configs(configs, cost_of)
        cost, _, pipe = min(costed, key=lambda x: (*self.problem.rank_cost(x[0]), x[1]))
        cp = context_axes(act.get("seq", ()))
        return Candidate(name, full, act, rules, cost, recipe, pipe, mesh, context=cp)

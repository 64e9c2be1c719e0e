"""The search: :func:`plan`, and the planner that costs the candidates and picks one.

The step is traced once per model (:mod:`spmdkit.planner.trace`), the candidate
layouts are built and costed by :mod:`spmdkit.planner.candidates`, pipelined
candidates by :mod:`spmdkit.planner.pipeline` (mixed into the planner).

:func:`plan` turns a model (anything :func:`spmdkit.introspect.model` reads) and a
mesh into a :class:`~spmdkit.planner.plans.Plan`.

Estimators
----------
``estimator="propagate"`` (the default) propagates a plan's specs through the
traced train step (forward, backward, optimizer update) with the rule registry
(:mod:`spmdkit.propagation`): per-equation reshards, collectives, bytes, FLOPs and
a liveness memory estimate. It is exact to the rules but costs a propagation per
candidate, so ``auto`` searches with the analytic model and re-costs only the
presets and its three best searched candidates with it.

``estimator="analytic"``: the per-parameter model of
:mod:`spmdkit.planner.analytic` only, on one abstract trace of the train step per
model (:func:`trace_step`, memoized on the ``ModelInfo``).

Auto search
-----------
``strategy="auto"`` costs every preset, then, for every choice of batch axes,
picks per parameter group (parameters of the same role in different layers) the
layout — any assignment of mesh axes to its dims that divides — with the lowest
step time; if the total exceeds the per-device memory budget, it trades time for
memory group by group (best Δtime/Δbytes first, including ZeRO-1 and ZeRO-2
optimizer/gradient sharding); a step with ``moe_experts`` calls on a mesh without an expert
axis is also searched with its data axis split ``data × expert``
(:mod:`spmdkit.planner.expert_mesh`). The fastest of the presets and these searched plans
that fit the budget wins; ties keep the earlier candidate, so the search is deterministic.
When none fits, :func:`plan` raises an
:class:`~spmdkit.planner.logical.OverBudgetError` naming the closest candidates
and what would make one fit (:mod:`spmdkit.planner.budget`); with
``allow_over_budget=True`` the one needing the least memory is chosen, with a
warning.

Recipes
-------
Each candidate is a layout *and* a :class:`~spmdkit.step.recipe.Recipe`. Unless
``recipe=`` fixes one, auto costs every preset and searched layout under each
remat policy (``none``, ``dots``, ``full`` and MaxText's named policies that keep
something of their own, :func:`~spmdkit.planner.levers.remat_choices`, when the
model has a layer scan; their offload forms with the optimizer's) and
compute dtype (the parameters', or bf16 on fp32 master weights; float8 and bf16
parameters with the fp32 master in the optimizer state only when allowed,
:mod:`spmdkit.planner.levers`), growing the
micro-batch count (every divisor of the batch up to 16) only until some plan
fits within :data:`_FLAT_HEADROOM` of the budget; optimizer offload is tried
only when nothing fits without it. The three best candidates and the presets
within twice the budget are re-costed by propagating :func:`train_step` for
their recipe (the step ``sk.train_step`` builds and ``train`` runs), then
more while the best is one not re-costed yet (:meth:`_Planner.recosted`). With
pipelines searched, when a pipelined plan fits and every unpipelined one needs
over twice the budget, those keep their analytic cost (re-costing makes none
of them fit).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from spmdkit.introspect.model import ModelInfo, describe
from spmdkit.pipeline import Pipeline
from spmdkit.planner.analytic import (
    CostContext,
    GroupLayout,
    column_siblings,
    param_flops,
    param_groups,
    total_cost,
)
from spmdkit.planner.budget import Budget, faster_fits, over_budget_error, shrink_rest
from spmdkit.planner.candidates import (
    Candidate,
    activation_layout,
    batch_axis_choices,
    group_choices,
    preset_choice,
    propagate_costed,
    rules_choice,
    search_layouts,
    table_choice,
    with_sharded,
)
from spmdkit.planner.context_parallel import CONTEXT_AXIS, context_axes, context_meshes
from spmdkit.planner.expert_mesh import ExpertPlanner
from spmdkit.planner.logical import (
    BATCH_NAMES,
    PRESETS,
    LogicalRules,
    PlanError,
    RulesLike,
)
from spmdkit.planner.measured import measured_choice
from spmdkit.planner.naming import apply_names, check_placement, infer_names
from spmdkit.planner.notes import (
    RECOST_OVER_BUDGET,
    PlanNote,
    absent_axes_note,
    dropped_note,
    floored_reasons,
    mesh_split_note,
    not_recosted,
    priced_only_note,
    recipe_note,
    refuse_typod_axes,
    replicated_note,
)
from spmdkit.planner.options import CostModel, SearchOptions, given
from spmdkit.planner.pipeline.plan import check_pipelined, pipeline_submesh
from spmdkit.planner.pipeline.search import PipelinePlanner
from spmdkit.planner.plans import Plan, PyTree, noted
from spmdkit.planner.problem import Problem
from spmdkit.planner.provenance import Provenance
from spmdkit.planner.rule_export import RuleTable
from spmdkit.planner.trace import trace_step
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.step.recipe import PLAIN, Recipe
from spmdkit.topology import Topology, topology_for
from spmdkit.util import fmt_bytes, gc_paused

if TYPE_CHECKING:
    from optax import GradientTransformation


__all__ = [
    "H100_MEMORY",
    "plan",
    "planner_for",
]

#: Per-device memory of one H100 (bytes); the default memory budget.
H100_MEMORY = 80 * 2**30


def plan(
    model: object,
    mesh: MeshLike,
    strategy: str | RulesLike = "auto",
    *,
    config: object = None,
    batch: PyTree = None,
    batch_size: int = 8,
    loss: Callable | None = None,
    batch_axes: Mapping[str, tuple] | None = None,
    optimizer: GradientTransformation | None = None,
    rules: RulesLike | None = None,
    memory_budget: float | None = None,
    topology: Topology | None = None,
    peak_flops: float | None = None,
    init_args: tuple = (),
    estimator: str = "propagate",
    recipe: Recipe | None = None,
    names: Mapping[str, tuple | None] | None = None,
    strict: bool = False,
    axis_names: tuple[str, ...] = (),
    pipeline: Pipeline | str | None = None,
    aliases: Mapping[str, str] | None = None,
    allow_fp8: bool = False,
    allow_master_weights: bool = False,
    allow_over_budget: bool = False,
    cost_model: CostModel | None = None,
    options: SearchOptions | None = None,
) -> Plan:
    """Plan a model's train step on a mesh.

    Traces forward + backward + optimizer state abstractly (once per model; no
    FLOPs, no device memory), then costs the strategy (module docstring).

    Args:
      model: a model spec (``spmdkit.models.get_model(name)``), an NNX module, a
        function returning one, a linen module, or a ``ModelInfo``.
      mesh: a ``Mesh`` (to run) or ``AbstractMesh`` (to plan).
      strategy: ``"auto"``, a preset name (:data:`PRESETS`), a logical-rule
        table (``LogicalRules``, pairs, or a mapping), or a table a plan exported
        (:meth:`Plan.to_rules`: that plan's layouts, read as flax reads the table,
        overrides included, so auto's choice can be kept and planned again).
      config: for a model spec, a size name in its ``configs`` (``"tiny"``,
        ``"8b"``) or a config object (default: the first config).
      batch: example or abstract batch (required unless ``model`` is a spec).
      batch_size: batch size for a model spec.
      loss: ``loss(model, batch)`` (required unless ``model`` is a spec).
      batch_axes: batch field → logical names per dim.
      optimizer: an optax optimizer (default ``optax.adam``), for optimizer-state sizes.
      rules: extra logical rules that take priority over the preset's (e.g. for
        logical names outside :data:`PARAM_NAMES`).
      memory_budget: per-device bytes (default: 80 GiB, one H100).
      topology: link model for collectives, and the device's peak FLOP/s per
        dtype, achievable efficiencies and overlap (the calibrated step-time model).
        Default: :func:`~spmdkit.topology.topology_for` the mesh (a mesh of CPU
        devices is priced as CPU devices, of GPUs by their kind, an abstract
        mesh on H100 nodes); the plan table names it (``plan.topology``).
      peak_flops: per-device FLOP/s for the compute term, overriding the
        topology's per-dtype achievable rates (ideal-peak accounting).
      init_args: linen only, ``module.init`` arguments after the rng.
      estimator: ``"propagate"`` (default): the plan's cost (and auto's final
        ranking of the presets and its best searched candidates) comes from
        propagating the specs through the traced train step
        (``spmdkit.propagation``); ``"analytic"``: the per-parameter model only
        (:mod:`spmdkit.planner.analytic`), fastest.
      recipe: the step's levers (:class:`~spmdkit.step.recipe.Recipe`: remat,
        compute dtype, micro-batches, optimizer offload). For a preset or rule
        table, default: the plain step. For ``"auto"``, default: searched with
        the layouts (remat none/dots/full, the params' dtype or bf16 compute,
        micro-batches until a plan fits, optimizer offload when nothing else
        fits); given, it is fixed.
      names: path glob → logical names, overriding the model's (fewer names than
        dims: the trailing dims unnamed, as flax pads); parameters without names
        get names inferred from their role in the traced step
        (:mod:`spmdkit.planner.naming`).
      strict: a plan with notes (``plan.notes``: an idle mesh axis, a batch off
        the axes its rule asks for, a recipe auto chose, ...) raises
        :class:`~spmdkit.planner.notes.PlanNoteError` instead of being returned
        (without it, each note is warned once as a
        :class:`~spmdkit.planner.notes.PlanNoteWarning`), and a tensor-parallel
        preset that leaves a weight off the model axes raises instead of warning.
      axis_names: collective axis names the model uses as if under ``pmap``
        (``nn.BatchNorm(axis_name="batch")``), bound around the loss
        (:func:`spmdkit.introspect.model.bind_axis_names`).
      pipeline: with a preset or rule table, a :class:`~spmdkit.pipeline.Pipeline`
        pipelines the stacked layers over ``pipeline.axis``: the strategy is
        planned on the other axes and the ``layers`` dim goes on the pipe axis
        (:mod:`spmdkit.planner.pipeline.plan`). With ``"auto"``: ``"auto"`` also
        costs pipelined plans (pipe degree, virtual stages, micro-batches and
        schedule searched with the layouts and recipes; a mesh without a ``pipe``
        axis has its data axis split into ``pipe × data``,
        :mod:`spmdkit.planner.pipeline.search`), a ``Pipeline`` searches layouts and
        recipes for that pipeline. ``None`` (default): no pipelines.
      aliases: logical name → logical name treated alike, so that another
        project's names meet the presets' (``{"q_heads": "heads"}``) or a rule
        table's: in every rule table, a name of a pair with no entry takes the
        other's (:meth:`~spmdkit.planner.logical.LogicalRules.aliased`). MaxText's
        ``activation_batch`` / ``activation_length`` are always aliases of
        ``batch`` / ``seq`` (:data:`~spmdkit.planner.logical.ACTIVATION_ALIASES`).
        A rule table's (or ``rules``') mesh axes that ``mesh`` lacks are dropped,
        with a plan note (:meth:`~spmdkit.planner.logical.LogicalRules.on_mesh`),
        unless one is a near miss of a mesh axis (a typo: ``"modle"``).
      allow_fp8: with ``"auto"``, also try ``Recipe(compute_dtype="float8")``
        (weight matmuls on float8 operands, :mod:`spmdkit.step.fp8`). Off by default:
        float8 changes numerics, so auto never picks it unasked. A fixed
        ``recipe=Recipe(compute_dtype="float8")`` needs no flag.
      allow_master_weights: with ``"auto"``, also try each narrower compute
        dtype with ``master_weights="optimizer"`` (bf16 parameters, the fp32
        master in the optimizer state, :mod:`spmdkit.step.master`). Off by default:
        the plan's step then takes bf16 parameters, not the caller's fp32 ones
        (:mod:`spmdkit.planner.levers`).
      allow_over_budget: with ``"auto"``, when no candidate fits
        ``memory_budget``, return the closest (with a warning) instead of
        raising :class:`~spmdkit.planner.logical.OverBudgetError`.
      cost_model: ``topology``, ``estimator``, ``memory_budget`` and
        ``peak_flops`` as one value (:class:`~spmdkit.planner.options.CostModel`),
        instead of those keywords.
      options: ``pipeline``, ``aliases``, ``allow_fp8``,
        ``allow_master_weights``, ``allow_over_budget`` and ``strict`` as one
        value (:class:`~spmdkit.planner.options.SearchOptions`), instead of those
        keywords.

    Returns:
      The :class:`Plan`.

    Raises:
      PlanError: unknown strategy, a ``names`` glob matching nothing, or (``strict``)
        a weight a tensor-parallel preset replicates; PlanNoteError (``strict``): the
        plan has notes; OverBudgetError (a PlanError): ``"auto"`` found no candidate
        within the memory budget (it names the closest and what would make one fit);
        UnknownLogicalAxisError: a logical name has no rule (auto included);
        PipelineError: a pipeline the mesh or model cannot run; PlanError:
        ``allow_fp8`` on a device without float8 matmuls; UnknownAxisError: a rule
        table names a near miss of a mesh axis (it says which); PlanError: an
        option out of range, or given both in ``cost_model``/``options`` and as a
        keyword.

    Example::

        >>> from spmdkit.models import get_model
        >>> mesh = sk.abstract_mesh(data=64, model=8)
        >>> p = sk.plan(get_model("llama"), mesh, config="8b", batch_size=512)
        >>> print(p)  # doctest: +SKIP
    """
    costs = given(cost_model, CostModel(topology, estimator, memory_budget, peak_flops))
    opts = given(
        options,
        SearchOptions(
            pipeline, aliases, allow_fp8, allow_master_weights, allow_over_budget, strict
        ),
    )
    mesh = _check_mesh(mesh)
    info = describe(
        model,
        config=config,
        batch=batch,
        batch_size=batch_size,
        loss=loss,
        batch_axes=batch_axes,
        init_args=init_args,
        axis_names=axis_names,
    )
    info = _batch_names(info, opts.alias_map)
    if isinstance(strategy, RuleTable):
        return _exported(info, mesh, strategy, rules, recipe, names, optimizer, costs, opts)
    strategy, rules, absent = _foreign_tables(strategy, rules, mesh, opts.alias_map)
    if opts.pipeline is not None and strategy != "auto":
        out = _pipelined_preset(info, mesh, strategy, rules, recipe, names, optimizer, costs, opts)
        return noted(out, _priced(out, absent, costs), strict=opts.strict)
    _check_recipe(recipe)
    named, names_from = apply_names(info, names, lambda: infer_names(info))
    planner = planner_for(named, mesh, optimizer, costs, opts)
    if strategy == "auto":
        out = planner.auto_plan(rules, recipe, opts.pipeline, opts.allow_over_budget)
    elif isinstance(strategy, str):
        out = planner.final(strategy, planner.preset(strategy, rules, recipe or PLAIN))
        out = replace(out, notes=tuple(mesh_split_note(mesh, out.mesh)))
    else:
        table = strategy if rules is None else strategy.prepend(rules)
        out = planner.final("rules", planner.table(table.aliased(opts.alias_map), recipe or PLAIN))
    out = replace(out, names_from=names_from)
    if isinstance(strategy, str) and strategy != "auto":
        check_placement(out, lambda: infer_names(info), strict=opts.strict)
    return noted(out, _priced(out, [*absent, *out.notes], costs), strict=opts.strict)


def _priced(out: Plan, notes: list[PlanNote], costs: CostModel) -> list[PlanNote]:
    """``notes`` and the ``priced_only`` note of a plan priced on a topology whose
    expert exchange the executor does not run (:func:`priced_only_note`)."""
    return [*notes, *priced_only_note(costs.topology, out.cost)]


def _exported(
    info: ModelInfo,
    mesh: MeshLike,
    table: RuleTable,
    rules: RulesLike | None,
    recipe: Recipe | None,
    names: Mapping[str, tuple | None] | None,
    optimizer: GradientTransformation | None,
    costs: CostModel,
    opts: SearchOptions,
) -> Plan:
    """A plan from an exported table (:meth:`Plan.to_rules`): its layouts read as
    flax reads the table, overrides applied (:func:`table_choice`)."""
    if rules is not None or opts.pipeline is not None:
        raise PlanError(
            op="plan(strategy=RuleTable)",
            must="an exported table is the whole layout: no extra rules=, no pipeline=",
            given=f"rules={rules!r}, pipeline={opts.pipeline!r}",
            fix="add the rules to the table (or pass table.rules with rules= as a plain "
            "table); for a pipeline, pass table.rules with pipeline=",
        )
    _check_recipe(recipe)
    named, names_from = apply_names(info, names, lambda: infer_names(info))
    planner = planner_for(named, mesh, optimizer, costs, opts)
    choice = table_choice(table, planner.problem.groups, mesh)
    # flax replicates a name its table lacks; spmdkit's tables say so explicitly
    named_here = {n for g in planner.problem.groups for n in g.logical or () if n}
    absent = sorted(named_here - {n for n, _ in table.rules})
    rules_read = LogicalRules((*table.rules, *((n, None) for n in absent)))
    cand = planner.costed("rules", choice, rules_read, recipe or PLAIN)
    out = replace(planner.final("rules", cand), names_from=names_from)
    return noted(out, list(out.notes), strict=opts.strict)


def _pipelined_preset(
    info: ModelInfo,
    mesh: MeshLike,
    strategy: str | LogicalRules,
    rules: LogicalRules | None,
    recipe: Recipe | None,
    names: Mapping[str, tuple | None] | None,
    optimizer: GradientTransformation | None,
    costs: CostModel,
    opts: SearchOptions,
) -> Plan:
    """A preset or rule table pipelined with ``opts.pipeline`` (a
    :class:`~spmdkit.pipeline.Pipeline`), checked as it will run."""
    named, names_from = apply_names(info, names, lambda: infer_names(info))
    pipeline_submesh(mesh, opts.pipeline, named, recipe)
    planner = planner_for(named, mesh, optimizer, costs, opts)
    name, c, cost = planner.pipes.pipelined_strategy(strategy, rules, recipe, opts.pipeline)
    out = replace(planner.problem.make_plan(name, c, cost), names_from=names_from)
    check_pipelined(named, out)
    check_placement(out, lambda: infer_names(info), strict=opts.strict)
    return out


def _foreign_tables(
    strategy: str | RulesLike, rules: RulesLike | None, mesh: MeshLike, aliases: dict[str, str]
) -> tuple[str | LogicalRules, LogicalRules | None, list[PlanNote]]:
    """The strategy (a rule table coerced) and the extra ``rules`` with the mesh
    axes ``mesh`` lacks dropped and aliased, and an ``absent_axes`` note for what
    was dropped (rule tables from other projects name axes this mesh lacks)."""
    dropped: dict[str, tuple[str, ...]] = {}

    def fit(table: RulesLike) -> LogicalRules:
        out, gone = LogicalRules.coerce(table).on_mesh(mesh)
        for axis, names in gone.items():
            dropped[axis] = tuple(dict.fromkeys((*dropped.get(axis, ()), *names)))
        return out.aliased(aliases)

    if not isinstance(strategy, str):
        strategy = fit(strategy)
    rules = None if rules is None else fit(rules)
    refuse_typod_axes(dropped, mesh)
    return strategy, rules, absent_axes_note(dropped, mesh)


def _batch_names(info: ModelInfo, aliases: Mapping[str, str]) -> ModelInfo:
    """``info`` with its batch fields' dim names that alias a planner batch name
    (``activation_batch`` → ``batch``) given that name."""
    canon = {a: b for a, b in aliases.items() if b in BATCH_NAMES and a not in BATCH_NAMES}
    canon |= {b: a for a, b in aliases.items() if a in BATCH_NAMES and b not in BATCH_NAMES}
    renamed = {
        path: tuple(canon.get(n, n) if n is not None else None for n in names)
        for path, names in info.batch_axes.items()
    }
    if renamed == dict(info.batch_axes):
        return info
    # a fresh memo: the traced step reads the batch size off these names
    return replace(info, batch_axes=renamed, _memo={})


def _check_recipe(recipe: object) -> None:
    if recipe is not None and not isinstance(recipe, Recipe):
        raise PlanError(
            op="plan",
            must="recipe is a spmdkit.Recipe or None",
            given=type(recipe).__name__,
            fix="pass recipe=sk.Recipe(remat='full', compute_dtype='bfloat16', ...)",
        )


def _check_mesh(mesh: object) -> MeshLike:
    if not hasattr(mesh, "axis_names") or not hasattr(mesh, "axis_sizes"):
        raise PlanError(
            op="plan",
            must="mesh is a jax Mesh or AbstractMesh",
            given=type(mesh).__name__,
            fix="pass sk.make_mesh(data=2, model=4) or sk.abstract_mesh(data=64, model=8)",
        )
    return mesh


#: A preset whose analytic peak is over this many budgets is not re-costed by
#: propagation in auto (the two estimates differ by far less than that).
_RECOST_OVER_BUDGET = RECOST_OVER_BUDGET

#: Auto adds micro-batches to a recipe until a plan fits within this share of the
#: budget (:meth:`_Planner.analytic_candidates`).
_FLAT_HEADROOM = 0.85

#: At most this many pipelined candidates are calibrated by propagation per plan
#: (:meth:`_Planner.recosted_pipelines`).
_RECOST_PIPELINES = 4

#: At most this many more candidates are re-costed by propagation in auto when
#: the best so far is one the analytic model alone priced (:meth:`recosted`).
_RECOST_MORE = 6


@dataclass
class _Planner:
    """One :func:`plan` call's search: the candidates of every preset, rule table and
    searched layout costed and ranked. What it plans is one :class:`Problem` value,
    read by it and by its two collaborators, each called for its candidates: the
    pipeline planner (:class:`PipelinePlanner`) and the expert-mesh planner
    (:class:`ExpertPlanner`). The rest of its fields are the search's own state."""

    problem: Problem
    pipes: PipelinePlanner
    experts: ExpertPlanner
    #: the meshes auto tries context parallelism on (:meth:`context_meshes`)
    memos: dict = field(default_factory=dict)
    #: :meth:`propagated` per layout and recipe: candidates that lay every array
    #: out alike (``dp`` and ``ep`` on a model without experts) propagate once
    recost_memo: dict = field(default_factory=dict)
    #: auto: preset → (why, its figure) it has no candidate left after costing
    #: (:meth:`auto`)
    dropped: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: auto: label → candidate not propagated because its step floor is above a
    #: plan already re-costed (:meth:`recosted`)
    floored: dict[str, Candidate] = field(default_factory=dict)
    #: auto: every candidate as the analytic model costed it (:meth:`auto`)
    analytic: list[Candidate] = field(default_factory=list)

    def costed(
        self,
        name: str,
        choice: list[GroupLayout],
        rules: LogicalRules | None,
        recipe: Recipe = PLAIN,
    ) -> Candidate:
        """A rule table's candidate, costed analytically under ``recipe``."""
        act = activation_layout(rules, self.problem.mesh, self.problem.ctx.trace)
        cp = context_axes(act.get("seq", ()))
        ctx = (
            self.problem.context_ctx(self.problem.mesh, recipe, cp)
            if cp
            else self.problem.at(recipe)
        )
        cost = total_cost(
            ctx, self.problem.groups, choice, act.get("batch", ()), act.get("seq", ())
        )
        return Candidate(name, choice, act, rules, cost, recipe, context=cp)

    def preset(self, name: str, extra: RulesLike | None, recipe: Recipe = PLAIN) -> Candidate:
        """A preset's candidate (``extra`` rules take priority); ``ep`` on a split
        mesh where the experts would be replicated (:mod:`~spmdkit.planner.expert_mesh`)."""
        if name == "ep" and (split := self.experts.ep_mesh()) is not None:
            return self.experts.split_ep(split, extra, recipe)
        problem = self.problem
        rules, choice = preset_choice(
            self.memos, name, extra, problem.mesh, problem.groups, problem.aliases
        )
        return self.costed(name, choice, rules, recipe)

    def table(self, table: LogicalRules, recipe: Recipe = PLAIN) -> Candidate:
        """A user rule table's candidate."""
        return self.costed(
            "rules",
            rules_choice(table, table, self.problem.groups, self.problem.mesh, None),
            table,
            recipe,
        )

    def searched(self, recipe: Recipe = PLAIN) -> list[Candidate]:
        """The searched candidate for each choice of batch axes."""
        out: list[Candidate] = []
        if self.problem.ctx.sizes.get(CONTEXT_AXIS, 1) > 1 and self.context_meshes():
            # the user's context axis holds the sequence (:meth:`context_searched`)
            return out
        ctx = self.problem.at(recipe)
        for batch_ax in batch_axis_choices(
            self.problem.ctx.sizes, self.problem.ctx.trace.batch_size
        ):
            if not self.problem.fits_batch(recipe, batch_ax):
                continue
            choice, cost = search_layouts(
                ctx, self.problem.groups, batch_ax, (), self.problem.budget
            )
            act = {n: () for n in BATCH_NAMES}
            act["batch"] = batch_ax
            name = f"searched[batch={','.join(batch_ax) or '-'}]"
            out.append(Candidate(name, choice, act, None, cost, recipe))
        return out

    def context_searched(self, recipe: Recipe = PLAIN) -> list[Candidate]:
        """The searched context-parallel candidates (:mod:`spmdkit.planner.context_parallel`):
        per mesh with a context axis (the plan's, or its data axis split) and
        choice of batch axes among the others, the layouts searched with the
        sequence on the context axis."""
        out = []
        trace = self.problem.ctx.trace
        for mesh in self.context_meshes():
            ctx = self.problem.context_ctx(mesh, recipe)
            degree = ctx.sizes[CONTEXT_AXIS]
            others = {a: s for a, s in ctx.sizes.items() if a != CONTEXT_AXIS}
            for batch_ax in batch_axis_choices(others, trace.batch_size):
                local = trace.batch_size // math.prod(ctx.sizes[a] for a in batch_ax)
                if local % recipe.microbatches or local < recipe.microbatches:
                    continue
                choice, cost = search_layouts(
                    ctx, self.problem.groups, batch_ax, (CONTEXT_AXIS,), self.problem.budget
                )
                act = {n: () for n in BATCH_NAMES}
                act["batch"], act["seq"] = batch_ax, (CONTEXT_AXIS,)
                name = f"searched[batch={','.join(batch_ax) or '-'},{CONTEXT_AXIS}={degree}]"
                at = None if mesh is self.problem.mesh else mesh
                cp = (CONTEXT_AXIS,)
                out.append(Candidate(name, choice, act, None, cost, recipe, mesh=at, context=cp))
        return out

    def context_meshes(self) -> list[MeshLike]:
        """The meshes auto tries context parallelism on (memoized per plan)."""
        key = ("context", "meshes")
        if key not in self.memos:
            trace = self.problem.ctx.trace
            self.memos[key] = context_meshes(self.problem.mesh, trace.batch_size, trace.seq_len)
        return self.memos[key]

    def with_choices(self, out: Plan, c: Candidate) -> Plan:
        """``out`` with the layouts the search costed per group for candidate ``c``
        (at its batch and sequence axes) in its provenance; a pipelined one as is."""
        if c.pipeline is not None:
            return out
        ctx = self.problem.at(c.recipe)
        if c.context or c.mesh is not None:
            ctx = self.problem.context_ctx(out.mesh, c.recipe, c.context)
        batch, seq = c.activation.get("batch", ()), c.activation.get("seq", ())
        choices = group_choices(ctx, self.problem.groups, c.choice, batch, seq)
        have = out.provenance if out.provenance is not None else Provenance()
        return replace(out, provenance=have.with_groups(choices))

    def propagated(self, c: Candidate) -> Candidate:
        """The candidate with its cost from propagating it through the train step
        (a pipelined one keeps its analytic cost: the stage program is not traced)."""
        if c.pipeline is not None:
            return c
        p = self.problem.make_plan(c.name, c, None)
        a = c.cost
        key = (
            *(tuple(t.items()) for t in (p.params, p.opt, p.activation, p.grads, p.state)),
            c.recipe,
            (a.compute_time_s, a.comm_time_s, a.hidden_comm_s, a.comm_bytes.get("host_offload")),
        )
        hit = self.recost_memo.get(key)
        if hit is None:
            at = self.problem.at(c.recipe)
            if c.context or c.mesh is not None:
                at = self.problem.context_ctx(p.mesh, c.recipe, c.context)
            hit = self.recost_memo[key] = propagate_costed(
                self.problem.info, self.problem.optimizer, p, at, a
            )
        return c._replace(cost=hit[0], provenance=hit[1])

    def final(self, strategy: str, c: Candidate) -> Plan:
        """The plan of one candidate, re-costed by the chosen estimator."""
        if self.problem.estimator == "analytic":
            return self.problem.make_plan(strategy, c, c.cost)
        done = self.propagated(c)
        return self.problem.make_plan(strategy, done, done.cost)

    def candidates(self, recipe: Recipe, extra: RulesLike | None) -> list[Candidate]:
        """Every preset and searched candidate under one recipe."""
        out: list[Candidate] = []
        for name in PRESETS:
            # a logical name without a rule raises here, as in the presets: the
            # searched layouts never read names, so auto would replicate it silently
            c = self.preset(name, extra, recipe)
            if self.problem.fits_batch(recipe, c.activation.get("batch", ()), c.mesh):
                out.append(c)
        out += self.experts.dense_presets(extra, recipe)
        out += self.searched(recipe) + self.experts.searched(recipe)
        return out + self.context_searched(recipe)

    def analytic_candidates(self, extra: RulesLike | None, fixed: Recipe | None) -> list[Candidate]:
        """Candidates over the recipes (:meth:`recipes`): per remat policy and
        compute dtype, micro-batch counts grow only until some plan fits within
        :data:`_FLAT_HEADROOM` of the budget, or more cannot help (what they
        shrink leaves every plan over it, or the last count saved no memory)."""
        out: list[Candidate] = []
        for recipes in self.problem.recipes(fixed):
            fits = False
            done: set[tuple] = set()
            # per recipe key, the smallest peak of the last count costed, and
            # each candidate's peak there
            smallest: dict[tuple, float] = {}
            peaks: dict[tuple, dict[str, float]] = {}
            room = _FLAT_HEADROOM * self.problem.budget
            for r in recipes:
                key = (r.remat, r.remat_offload, r.remat_every, r.compute_dtype, r.master_weights)
                if key in done:
                    continue
                cands = self.candidates(r, extra)
                out += cands
                if not cands:
                    # no layout splits its rows into this many micro-batches; a
                    # larger count (one row a micro-batch per replica at most)
                    # only where some replica's rows still outnumber it
                    if r.microbatches >= self.problem.ctx.trace.batch_size:
                        done.add(key)
                    continue
                least = min(c.cost.peak_bytes for c in cands)
                before = peaks.get(key, {})
                peaks[key] = {c.name: c.cost.peak_bytes for c in cands}
                if any(c.cost.peak_bytes <= self.problem.budget for c in cands):
                    fits = True
                # more micro-batches until one fits with headroom: propagation
                # prices the step's memory above the analytic model (Llama-3 8B on
                # 8 GPUs: +12%), and auto re-costs the favourites (:meth:`recosted`);
                # past that, while a faster plan could still fit (:func:`faster_fits`)
                # and the last count shrank one of them
                if any(c.cost.peak_bytes <= room for c in cands):
                    faster = faster_fits(cands, room)
                    if not any(c.cost.peak_bytes < before.get(c.name, math.inf) for c in faster):
                        done.add(key)
                # more micro-batches that saved no memory: none will (the
                # count follows the memory need, with no fixed cap)
                elif least >= smallest.get(key, math.inf):
                    done.add(key)
                smallest[key] = least
                # more micro-batches shrink the activations and the expert
                # exchange's buffers only (and what they hide, opt_update): where
                # the rest of every candidate is over the budget, no count fits
                # (a 1T model on 3,072 devices: 8 counts saved; when nothing
                # fits, the closest is then among the counts costed)
                if cands and all(shrink_rest(c.cost) > self.problem.budget for c in cands):
                    done.add(key)
            if fits:
                break
        return out

    def auto(
        self,
        extra: RulesLike | None,
        fixed: Recipe | None,
        pipeline: Pipeline | str | None = None,
    ) -> tuple[Candidate, list[Candidate]]:
        """Every candidate (module docstring), best first: the winner and the
        runner-ups (one per name and recipe). ``pipeline``: ``"auto"`` adds
        pipelined candidates, a :class:`~spmdkit.pipeline.Pipeline` costs only
        candidates with it."""
        if isinstance(pipeline, Pipeline):
            return self.ranked(
                self.recosted_pipelines(self.pipes.pipelined(pipeline, fixed, extra))
            )
        with gc_paused():  # the analytic search's memos: millions of small objects
            candidates = self.analytic = self.analytic_candidates(extra, fixed)
            piped = self.pipes.pipelined(pipeline, fixed, extra) if pipeline is not None else []
        self.dropped = {
            n: ("their batch layouts split into none of the micro-batch counts tried", "")
            for n in PRESETS
            if all(c.name != n for c in candidates)
        }
        far = _RECOST_OVER_BUDGET * self.problem.budget
        if (
            self.problem.estimator == "propagate"
            and any(c.cost.peak_bytes <= self.problem.budget for c in piped)
            and all(c.cost.peak_bytes > far for c in candidates)
        ):
            # No unpipelined plan comes near the budget and a pipelined one fits:
            # they keep their analytic cost (a propagation takes seconds at the
            # sizes that need pipelines, and re-costing makes none fit).
            return self.ranked(self.recosted_pipelines(piped) + candidates)
        if self.problem.estimator == "propagate":
            # The three best candidates and the presets (plain recipe, or the fixed
            # one), re-costed on the traced step; a preset the analytic model puts
            # far over the budget is left out (no re-costing makes it fit).
            base = fixed or PLAIN
            ranked = sorted(
                range(len(candidates)), key=lambda i: (*self.problem.rank(candidates[i]), i)
            )
            keep = set(ranked[:3])
            keep |= {
                i
                for i, c in enumerate(candidates)
                if c.recipe == base
                and c.name in PRESETS
                and c.cost.peak_bytes <= _RECOST_OVER_BUDGET * self.problem.budget
            }
            before = candidates
            candidates = self.recosted(candidates, keep)
            self.dropped |= not_recosted(before, candidates, self.problem.budget, base)
            floors = {
                c.name: self.problem.floor(c)
                for c in self.floored.values()
                if c.recipe == base and c.name in self.dropped and c.name in PRESETS
            }
            self.dropped |= floored_reasons(floors)
        if pipeline is not None:
            candidates += self.recosted_pipelines(piped)
        return self.ranked(candidates)

    def recosted(
        self,
        candidates: list[Candidate],
        first: set[int],
        recost: Callable[[Candidate], Candidate] | None = None,
        limit: int = _RECOST_MORE,
    ) -> list[Candidate]:
        """The candidates ``first`` re-costed (``recost``, default
        :meth:`propagated`), then, while the best of all is one not re-costed yet
        (ranked as if the largest re-costed/analytic factors of step time and
        memory seen so far at its micro-batch count applied to it), that one too
        (at most ``limit`` more); only the re-costed ones are kept. Where every
        analytic favourite turns out over the budget once propagated, this goes on
        to the candidates that fit (e.g. full recompute) instead of returning the
        smallest plan that cannot run.

        With propagation (``recost`` None), ``first`` goes best-first and a
        candidate whose :func:`~spmdkit.planner.candidates.step_floor` is above the
        step of a re-costed plan that fits is not propagated (:attr:`floored`): it
        would rank below that plan whatever propagation said (small models, where
        one collective's latency outweighs the step's compute, skip most presets)."""
        floors = recost is None  # a floor bounds what propagation gives, nothing else
        recost = recost or self.propagated
        done: dict[int, Candidate] = {}
        skipped: set[int] = set()

        def can_win(i: int) -> bool:
            """False where :func:`step_floor` proves ``i`` slower than a plan that fits
            and is re-costed already (so it would rank below it, fitting or not)."""
            if not floors:
                return True
            fit = [
                c.cost.step_time_s
                for c in done.values()
                if c.cost.peak_bytes <= self.problem.budget
            ]
            if not fit or self.problem.floor(candidates[i]) <= min(fit):
                return True
            skipped.add(i)
            self.floored[candidates[i].label] = candidates[i]
            return False

        # the analytic favourites first: the floors of the others then prune most
        for i in sorted(first, key=lambda i: (*self.problem.rank(candidates[i]), i)):
            if can_win(i):
                done[i] = recost(candidates[i])
        # per micro-batch count: FSDP's per-micro-batch collectives move the
        # propagated/analytic ratio, which says nothing of another count's
        scales: dict[int, tuple[float, float]] = {}

        def grow(i: int) -> None:
            before, after = candidates[i].cost, done[i].cost
            m = candidates[i].recipe.microbatches
            old = scales.get(m, (1.0, 1.0))
            scales[m] = (
                max(old[0], after.step_time_s / max(before.step_time_s, 1e-30)),
                max(old[1], after.peak_bytes / max(before.peak_bytes, 1)),
            )

        for i in done:
            grow(i)

        def key(i: int) -> tuple:
            if i in done:
                return (*self.problem.rank(done[i]), i)
            if i in skipped:
                return (True, math.inf, math.inf, i)
            scale = scales.get(candidates[i].recipe.microbatches, (1.0, 1.0))
            return (*self.problem.rank_cost(candidates[i].cost, scale=scale), i)

        for _ in range(limit):
            top = min(range(len(candidates)), key=key)
            if top in done or top in skipped:
                break
            if can_win(top):  # a pruned one uses up its turn, as its propagation would
                done[top] = recost(candidates[top])
                grow(top)
        return [done[i] for i in sorted(done)]

    def recosted_pipelines(self, candidates: list[Candidate]) -> list[Candidate]:
        """With the propagate estimator, pipelined candidates calibrated by
        propagation (:meth:`PipelinePlanner.calibrated`), best first, until the best
        of them is a calibrated one (at most :data:`_RECOST_PIPELINES`,
        :meth:`recosted`); only the calibrated ones are kept, so they compete with
        propagated candidates on the same footing."""
        if self.problem.estimator != "propagate" or not candidates:
            return candidates
        return self.recosted(list(candidates), set(), self.pipes.calibrated, _RECOST_PIPELINES)

    def timed(
        self, best: Candidate, others: list[Candidate], recost: Callable | None
    ) -> tuple[Candidate, list[Candidate], list[PlanNote]]:
        """With a step timer (``options.measure``) and a ``best`` that fits: the
        fastest measured candidate, the runner-ups and the ``measured`` note
        (:func:`~spmdkit.planner.measured.measured_choice`); else as given."""
        timer, budget = self.problem.options.measure, self.problem.budget
        if timer is None or best.cost.peak_bytes > budget:
            return best, others, []
        return measured_choice(
            best,
            others,
            sorted([*self.floored.values(), *self.analytic], key=self.problem.rank),
            budget=budget,
            limit=self.problem.options.measure_candidates,
            build=lambda c: self.with_choices(self.problem.make_plan("auto", c, c.cost), c),
            recost=recost,
            timer=timer,
        )

    def ranked(self, candidates: list[Candidate]) -> tuple[Candidate, list[Candidate]]:
        """The best candidate and the runner-ups (one per label), by :meth:`rank`."""
        ranked = sorted(
            range(len(candidates)), key=lambda i: (*self.problem.rank(candidates[i]), i)
        )
        best = candidates[ranked[0]]
        seen = {best.label}
        others = []
        for i in ranked[1:]:
            if candidates[i].label not in seen:
                seen.add(candidates[i].label)
                others.append(candidates[i])
        return best, others

    def auto_plan(
        self,
        extra: RulesLike | None,
        fixed: Recipe | None,
        pipeline: Pipeline | str | None = None,
        allow_over_budget: bool = False,
    ) -> Plan:
        """``strategy="auto"``'s plan: the best candidate, the others as
        alternatives. When none fits the budget, an :class:`OverBudgetError`
        (:mod:`spmdkit.planner.budget`), or with ``allow_over_budget`` the closest,
        with a warning."""
        best, others = self.auto(extra, fixed, pipeline)
        recost = self.propagated if self.problem.estimator == "propagate" else None
        others = with_sharded(
            best, others, self.analytic, self.problem.rank, self.problem.budget, recost
        )
        best, others, timed = self.timed(best, others, recost)
        if best.cost.peak_bytes > self.problem.budget:
            if not allow_over_budget:
                budget = Budget(
                    bytes=self.problem.budget,
                    devices=math.prod(self.problem.ctx.sizes.values()),
                    batch_size=self.problem.ctx.trace.batch_size,
                    analytic=self.pipes.analytic_cost,
                    pipelines=pipeline is None and self.pipes.stages() is not None,
                )
                raise over_budget_error(budget, [best, *others])
            warnings.warn(
                f"plan(strategy='auto'): no candidate fits the memory budget of "
                f"{fmt_bytes(self.problem.budget)} per device; chose {best.label!r}, the smallest "
                f"({fmt_bytes(best.cost.peak_bytes)}). Add devices, shard more axes, or lower "
                "the activation memory (a smaller batch per device, longer sequences "
                "split over devices).",
                stacklevel=3,  # the caller of plan()
            )
        out = self.with_choices(self.problem.make_plan("auto", best, best.cost), best)
        shown = others[:12]
        sharded = next((c for c in others if c.sharded), None)
        if not best.sharded and sharded is not None and sharded not in shown:
            shown = [*others[:11], sharded]  # the runner-ups always show a sharded plan
        alternatives = tuple((c.label, c.cost) for c in shown)
        notes: list[PlanNote] = [
            *mesh_split_note(self.problem.mesh, out.mesh),
            *self.pipes.refused_notes(),
            *timed,
        ]
        if not best.sharded:
            versus = None if sharded is None else (sharded.label, sharded.cost.step_time_s)
            devices, name = (
                math.prod(self.problem.ctx.sizes.values()),
                self.problem.ctx.topology.name,
            )
            notes += replicated_note(devices, best.cost.step_time_s, versus, name)
        if fixed is None:
            plain = [
                c.cost.step_time_s
                for c in (best, *others)
                if c.recipe.is_default
                and c.pipeline is None
                and c.cost.peak_bytes <= self.problem.budget
            ]
            floors = [
                self.problem.floor(c)
                for c in self.floored.values()
                if c.recipe.is_default and c.pipeline is None
            ]
            notes += recipe_note(
                best.recipe,
                best.cost.step_time_s,
                min(plain, default=None),
                min(floors, default=None),
            )
        if not isinstance(pipeline, Pipeline):
            names = {c.name for c in (best, *shown)}
            cut = {c.name for c in others[12:]} - names
            reasons = {n: ("ranked below the 12 runner-ups shown", "") for n in PRESETS if n in cut}
            reasons |= {n: why for n, why in self.dropped.items() if n not in names}
            notes += dropped_note({n: reasons[n] for n in PRESETS if n in reasons})
        return replace(out, alternatives=alternatives, chosen=best.name, notes=tuple(notes))


def planner_for(
    info: ModelInfo,
    mesh: MeshLike,
    optimizer: GradientTransformation | None = None,
    cost_model: CostModel | None = None,
    options: SearchOptions | None = None,
) -> _Planner:
    """The planner one :func:`plan` call builds (the model traced once, its
    parameter groups, the cost context on ``mesh``, as one :class:`Problem`) with its
    collaborators; tests and benchmarks call them to see the candidates a search
    costs (``planner.pipes.pipelined_on``, ``planner.pipes.pipelined``).
    ``cost_model`` None: ``CostModel()`` (the topology
    :func:`~spmdkit.topology.topology_for` the mesh); ``options`` None:
    ``SearchOptions()``.
    """
    costs = CostModel() if cost_model is None else cost_model
    options = SearchOptions() if options is None else options
    topology = topology_for(mesh) if costs.topology is None else costs.topology
    trace = trace_step(info, optimizer)
    groups = param_groups(info, trace)
    raw = sum(param_flops(g, trace) * g.count for g in groups)
    matmul = trace.flops - trace.attn_flops
    peak_flops = costs.peak_flops
    ctx = CostContext(
        mesh=mesh,
        sizes=axis_sizes(mesh),
        topology=topology,
        trace=trace,
        peak_flops=None if peak_flops is None else float(peak_flops),
        flops_scale=(matmul / raw) if raw and matmul > 0 else 1.0,
        siblings=column_siblings(groups),
    )
    budget = float(H100_MEMORY if costs.memory_budget is None else costs.memory_budget)
    problem = Problem(mesh, info, optimizer, groups, ctx, budget, costs.estimator, options)
    return _Planner(problem, PipelinePlanner(problem), ExpertPlanner.of(problem))

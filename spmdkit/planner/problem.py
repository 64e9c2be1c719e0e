"""What one :func:`~spmdkit.planner.plan` call plans, as one value its collaborators read.

A :class:`Problem` is the model described and traced, its parameter groups, the
mesh, the cost context every candidate is costed in, the memory budget, the
estimator and the search options. The planner (:mod:`spmdkit.planner.search`)
and its collaborators, the pipeline planner
(:class:`~spmdkit.planner.pipeline.search.PipelinePlanner`) and the expert-mesh
planner (:class:`~spmdkit.planner.expert_mesh.ExpertPlanner`), each hold the
same problem and read it, never each other's fields. What follows from the
problem alone lives here too: the cost context under a recipe or on another
mesh (:meth:`Problem.at`, :meth:`Problem.context_ctx`), whether a batch splits
into micro-batches, how two costs rank against the budget, the recipes auto
tries, and a candidate's :class:`~spmdkit.planner.plans.Plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import jax
from jax.sharding import PartitionSpec as P

from spmdkit.introspect.model import ModelInfo
from spmdkit.pipeline.stored import stored_stack_specs
from spmdkit.planner.analytic import CostContext, ParamGroup
from spmdkit.planner.candidates import Candidate, context_record, state_layout, step_floor
from spmdkit.planner.context_parallel import CONTEXT_AXIS
from spmdkit.planner.levers import auto_recipes, check_fp8
from spmdkit.planner.options import SearchOptions
from spmdkit.planner.plans import Cost, Plan, dims_spec
from spmdkit.planner.provenance import Provenance
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.step.recipe import Recipe
from spmdkit.step.remat_scan import check_remat_every
from spmdkit.util import path_str

if TYPE_CHECKING:
    from optax import GradientTransformation

__all__ = ["Problem"]


@dataclass(frozen=True, eq=False)
class Problem:
    """One :func:`~spmdkit.planner.plan` call's model, mesh and cost model
    (:func:`~spmdkit.planner.search.planner_for` builds it).

    Attributes:
      mesh: the mesh given to ``plan``.
      info: the described model (names applied).
      optimizer: the optimizer (None: ``optax.adam``'s state sizes).
      groups: the parameter groups (parameters of one role in different layers).
      ctx: the cost context on ``mesh`` under the plain recipe.
      budget: per-device bytes.
      estimator: ``"propagate"`` or ``"analytic"``.
      options: the search options (levers allowed, aliases).
      memos: group-cost memos per mesh for :meth:`context_ctx` (a cache: the
        candidates of one mesh share it, whoever builds them).
    """

    mesh: MeshLike
    info: ModelInfo
    optimizer: GradientTransformation | None
    groups: list[ParamGroup]
    ctx: CostContext
    budget: float
    estimator: str
    options: SearchOptions = field(default_factory=SearchOptions)
    memos: dict = field(default_factory=dict)

    @property
    def aliases(self) -> dict[str, str]:
        """Logical names treated alike in every rule table (``SearchOptions.alias_map``)."""
        return self.options.alias_map

    @property
    def batch_size(self) -> int | None:
        """The global batch size: the ``batch`` dim of the first batch field that
        names one (None: no field does)."""
        for kp, leaf in jax.tree_util.tree_flatten_with_path(self.info.batch)[0]:
            names = tuple(self.info.batch_axes.get(path_str(kp)) or ())
            if "batch" in names and names.index("batch") < len(leaf.shape):
                return int(leaf.shape[names.index("batch")])
        return None

    def at(self, recipe: Recipe) -> CostContext:
        """The cost context under ``recipe`` (sharing the memo)."""
        return self.ctx if recipe == self.ctx.recipe else replace(self.ctx, recipe=recipe)

    def context_ctx(
        self, mesh: MeshLike, recipe: Recipe, axes: tuple[str, ...] = (CONTEXT_AXIS,)
    ) -> CostContext:
        """The cost context of candidates on ``mesh`` (a context-parallel or split
        one) with the sequence split over ``axes`` (its own memo per mesh) under
        ``recipe``."""
        memo = self.memos.setdefault(("context", tuple(axis_sizes(mesh).items())), {})
        return replace(
            self.ctx, mesh=mesh, sizes=axis_sizes(mesh), recipe=recipe, context=axes, memo=memo
        )

    def fits_batch(self, recipe: Recipe, batch_axes: tuple[str, ...], mesh: object = None) -> bool:
        """Whether each data-parallel replica's batch (on ``mesh``, default the
        plan's) splits into the micro-batches."""
        sizes = self.ctx.sizes if mesh is None else axis_sizes(mesh)
        shards = math.prod(sizes[a] for a in batch_axes)
        local = self.ctx.trace.batch_size // max(shards, 1)
        return local % recipe.microbatches == 0 and local >= recipe.microbatches

    def rank(self, c: Candidate) -> tuple[bool, float, float]:
        """Plans that fit: fastest first; none fits: the one nearest to fitting (the
        fastest of plans that cannot run is no answer)."""
        return self.rank_cost(c.cost)

    def rank_cost(
        self, cost: Cost, budget: float | None = None, scale: tuple[float, float] = (1.0, 1.0)
    ) -> tuple[bool, float, float]:
        """:meth:`rank` of a cost (against ``budget``, default the plan's), its step
        time and memory multiplied by ``scale``."""
        step, peak = cost.step_time_s * scale[0], cost.peak_bytes * scale[1]
        over = peak > (self.budget if budget is None else budget)
        return (over, peak if over else step, step)

    def floor(self, c: Candidate) -> float:
        """:func:`~spmdkit.planner.candidates.step_floor` of a candidate on its mesh
        (a context-parallel one's has the context axis); 0 for a pipelined one,
        which keeps its analytic cost."""
        if c.pipeline is not None:
            return 0.0
        mesh = self.mesh if c.mesh is None else c.mesh
        return step_floor(c.cost, c.activation.get("batch", ()), mesh, self.ctx.topology)

    def recipes(self, fixed: Recipe | None) -> list[list[Recipe]]:
        """The recipes auto tries, in rounds (:func:`~spmdkit.planner.levers.auto_recipes`),
        or the fixed one."""
        if fixed is not None:
            check_remat_every(fixed.remat_every, self.ctx.trace.layers, op="plan")
            return [[fixed]]
        if self.options.allow_fp8:
            check_fp8(self.ctx.topology, self.ctx.peak_flops)
        return auto_recipes(
            self.ctx.trace,
            self.groups,
            allow_fp8=self.options.allow_fp8,
            allow_master_weights=self.options.allow_master_weights,
            topology=self.ctx.topology,
        )

    def make_plan(self, strategy: str, c: Candidate, cost: Cost | None) -> Plan:
        """The :class:`Plan` of a candidate (every member of each group laid out alike)."""
        params: dict[str, P] = {}
        opt: dict[str, P] = {}
        grads: dict[str, P] = {}
        for g, layout in zip(self.groups, c.choice, strict=True):
            for path in g.paths:
                params[path] = dims_spec(layout.params)
                opt[path] = dims_spec(layout.opt)
                if layout.grads_sharded:
                    grads[path] = dims_spec(layout.opt)
        order = [p.path for p in self.info.params]
        mesh = self.mesh if c.mesh is None else c.mesh
        if c.pipeline is not None:
            _store_stacks(self.info, (params, opt, grads), c.pipeline.axis, axis_sizes(mesh))
        state, state_from = state_layout(self.info, params, c.rules, mesh)
        return Plan(
            mesh=mesh,
            params={p: params[p] for p in order},
            opt={p: opt[p] for p in order},
            activation=c.activation,
            strategy=strategy,
            rules=c.rules,
            info={
                p.path: (p.shape, p.dtype, p.logical) for p in (*self.info.params, *self.info.state)
            },
            batch_axes=dict(self.info.batch_axes),
            cost=cost,
            recipe=c.recipe,
            grads={p: grads[p] for p in order if p in grads},
            pipeline=c.pipeline,
            state=state,
            state_from=state_from,
            batch_size=self.batch_size,
            memory_budget=self.budget,
            context=context_record(c, cost, mesh),
            topology=self.ctx.topology.name,
            provenance=replace(
                c.provenance or Provenance(),
                pinned=tuple(g.key for g in self.groups if g.pinned is not None),
            ),
        )


def _store_stacks(info: ModelInfo, specs: tuple[dict, dict, dict], axis: str, sizes: dict) -> None:
    """Re-lay, in place, the stacked parameters whose ``layers`` dim the pipe axis
    splits but does not divide (an uneven layout's) on a dim it does, their optimizer
    state and gradients alike (:func:`~spmdkit.pipeline.stored.stored_stack_specs`)."""
    params, opt, grads = specs
    for p in info.params:
        if p.path not in params or not p.shape:
            continue
        got = stored_stack_specs(
            (params[p.path], opt[p.path], grads.get(p.path)), p.shape, axis, sizes
        )
        params[p.path], opt[p.path] = got[0], got[1]
        if got[2] is not None:
            grads[p.path] = got[2]

"""Expert parallelism on a mesh without an ``expert`` axis: the data axis split.

A step that calls :func:`spmdkit.ops.moe_experts` runs its experts expert-parallel
over the mesh axes on their ``expert`` dim (:mod:`spmdkit.planner.experts`). A
mesh with an axis named ``expert`` (or ``ep``, ``experts``) offers that axis; a
mesh with only a data axis (``data=64``) offers the whole axis, whose size the
expert count (8) need not divide, and the op then replicates the experts on
every device. As context parallelism splits the data axis into
``data × context`` (:mod:`spmdkit.planner.context_parallel`), auto here splits it into
``data × expert`` (:func:`expert_meshes`; the ``expert`` part minor, so the
all-to-alls stay inside a node where it can), for every degree ``e ≥ 2`` that
divides both the data axis and every ``moe_experts`` call's expert count
(``data=64`` with 8 experts: ``e`` of 2, 4 and 8):

- **searched** (:meth:`ExpertPlanner.searched`): per split mesh, the
  layouts are searched with the batch over every axis the data axis was (``data ×
  expert``) and over any other batch axes chosen; the experts go on the
  ``expert`` part where the search finds that fastest, and the dense layers are
  searched as on the mesh given (the ``expert`` part is one more data axis for them).
- **the ep preset** (:meth:`ExpertPlanner.split_ep`): ``ep`` puts the experts on
  the mesh's expert-role axes; where there is no axis of that role name and the
  expert count is not divided by them (the experts would be replicated), the
  preset runs on the mesh split at the largest degree instead.
- **the tensor-parallel presets with expert parallelism**
  (:meth:`ExpertPlanner.dense_presets`, named ``<preset>+ep``): Megatron-LM's MoE
  layout, on the plan's mesh where it has an axis of the expert role's names and on
  each split mesh: the dense weights as the preset lays them out (``megatron``,
  ``megatron_sp``, ``tp_fsdp`` and the distributed optimizer's ``+zero1`` forms),
  the experts over the expert axes and, where every expert count divides them
  too, the model axes (expert parallelism across the tensor-parallel ranks), the
  batch over the data and expert axes (:func:`expert_placement`). The per-group
  search lays each group out on its own and so misses what sequence
  parallelism and tensor parallelism save together.

The plan then carries the split mesh (``plan.mesh``; ``sk.jit``, ``sk.init_sharded``
and ``train`` run on it, as for a context-parallel or pipelined plan) and a
``mesh_split`` note says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from spmdkit.mesh import data_axis
from spmdkit.planner.analytic import total_cost
from spmdkit.planner.candidates import (
    Candidate,
    activation_layout,
    batch_axis_choices,
    preset_choice,
    search_layouts,
)
from spmdkit.planner.context_parallel import CONTEXT_AXIS, context_axes, split_context
from spmdkit.planner.logical import (
    BATCH_NAMES,
    ROLE_NAMES,
    SHARDED_OPT_PRESETS,
    LogicalRules,
    RulesLike,
    axis_roles,
)
from spmdkit.planner.problem import Problem
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.step.recipe import PLAIN, Recipe

__all__ = [
    "DENSE_PRESETS",
    "EXPERT_AXIS",
    "ExpertPlanner",
    "expert_counts",
    "expert_meshes",
    "expert_placement",
]

#: The mesh axis a split data axis gives the experts.
EXPERT_AXIS = "expert"

#: The presets auto also costs with the experts expert-parallel
#: (:meth:`ExpertPlanner.dense_presets`): the tensor-parallel ones.
DENSE_PRESETS = ("megatron", "megatron_sp", "tp_fsdp", *SHARDED_OPT_PRESETS)


def expert_counts(trace: Any) -> tuple[int, ...]:
    """The expert counts of the traced step's expert-parallel ``moe_experts`` calls
    (those whose strategy is not ``"local"``)."""
    calls = getattr(trace, "moe_calls", None) or {}
    return tuple(sorted(e for e, c in calls.items() if c.strategy != "local"))


def expert_meshes(mesh: MeshLike, counts: tuple[int, ...]) -> list[MeshLike]:
    """The meshes auto tries expert parallelism on beside ``mesh`` (module
    docstring), smallest degree first: none when ``mesh`` has an axis of the
    expert role's names, no data axis, or no expert counts.

    Example::

        >>> [m.axis_sizes for m in expert_meshes(abstract_mesh(data=64), (8,))]
        [(32, 2), (16, 4), (8, 8)]
    """
    sizes = axis_sizes(mesh)
    data = data_axis(mesh)
    if not counts or data is None or any(a in ROLE_NAMES["expert"] for a in sizes):
        return []
    g = math.gcd(sizes[data], *counts)
    return [split_context(mesh, e, EXPERT_AXIS) for e in range(2, g + 1) if g % e == 0]


def expert_placement(
    sizes: dict[str, int],
    counts: tuple[int, ...],
    extra: LogicalRules | None,
    over_model: bool = False,
) -> LogicalRules | None:
    """The rules that put the experts on the expert-role axes of a mesh of axis
    ``sizes`` (axes named for the role only, more than one device) and the batch
    over them and the data axes, ahead of ``extra``; with ``over_model``, the
    experts over the model-role axes too where every expert count divides them
    all (the batch stays off them). None when there are no expert ``counts``,
    the expert axes do not divide every count, or ``extra`` places the experts
    or the batch.

    Example::

        >>> expert_placement({"data": 16, "expert": 32, "model": 2}, (256,), None, True)
        LogicalRules((('expert', ('expert', 'model')), ('batch', ('data', 'expert'))))
    """
    placed = extra is not None and any(n in ("expert", "batch") for n, _ in extra.entries)
    if not counts or placed:
        return None
    ep = tuple(a for a in sizes if a in ROLE_NAMES["expert"] and sizes[a] > 1)
    size = math.prod(sizes[a] for a in ep)
    if not ep or any(e % size for e in counts):
        return None
    names = tuple(sizes)
    roles = axis_roles(_NamedAxes(names))
    data = {*roles["data"], *roles["fsdp"], *ep} - {*roles["model"], CONTEXT_AXIS} | set(ep)
    batch = tuple(a for a in names if a in data)
    model = tuple(a for a in names if a in roles["model"] and a not in ep and sizes[a] > 1)
    wide = math.prod(sizes[a] for a in model) * size
    if over_model and model and all(e % wide == 0 for e in counts):
        ep = tuple(a for a in names if a in (*ep, *model))
    rules = LogicalRules((("expert", ep), ("batch", batch)))
    return rules if extra is None else extra.prepend(rules)


@dataclass(frozen=True)
class _NamedAxes:
    """Axis names alone, as :func:`~spmdkit.planner.logical.axis_roles` reads a mesh."""

    axis_names: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class ExpertPlanner:
    """The planner's expert-parallel candidates on split meshes (module docstring):
    a collaborator of :class:`spmdkit.planner.search._Planner`, which calls
    :meth:`searched` and, for the ``ep`` preset, :meth:`ep_mesh` and :meth:`split_ep`.

    Attributes:
      problem: what the plan call plans (it reads the mesh, the traced step, the
        groups, the budget and the aliases).
      meshes: :func:`expert_meshes` of the plan's mesh and traced step.
      memo: the ``ep`` preset's tables and layouts per split mesh (a cache).
    """

    problem: Problem
    meshes: tuple[MeshLike, ...]
    memo: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, problem: Problem) -> ExpertPlanner:
        """The expert-mesh planner of ``problem``."""
        counts = expert_counts(problem.ctx.trace)
        return cls(problem, tuple(expert_meshes(problem.mesh, counts)))

    def searched(self, recipe: Recipe = PLAIN) -> list[Candidate]:
        """The searched candidates on each split mesh: the batch over the data axis's
        parts (and any other batch axes chosen), the layouts searched."""
        problem = self.problem
        out: list[Candidate] = []
        data = data_axis(problem.mesh)
        for mesh in self.meshes:
            ctx = problem.context_ctx(mesh, recipe, ())
            degree = ctx.sizes[EXPERT_AXIS]
            need = {EXPERT_AXIS} | ({data} if ctx.sizes[data] > 1 else set())
            for batch_ax in batch_axis_choices(ctx.sizes, ctx.trace.batch_size):
                local = ctx.trace.batch_size // math.prod(ctx.sizes[a] for a in batch_ax)
                if not need <= set(batch_ax) or local % recipe.microbatches:
                    continue
                choice, cost = search_layouts(ctx, problem.groups, batch_ax, (), problem.budget)
                act = {n: () for n in BATCH_NAMES}
                act["batch"] = batch_ax
                name = f"searched[batch={','.join(batch_ax)},{EXPERT_AXIS}={degree}]"
                out.append(Candidate(name, choice, act, None, cost, recipe, mesh=mesh))
        return out

    def ep_mesh(self) -> MeshLike | None:
        """The split mesh the ``ep`` preset runs on (module docstring), or None
        where it runs on the plan's."""
        if not self.meshes:
            return None
        ctx = self.problem.ctx
        n = math.prod(ctx.sizes[a] for a in axis_roles(self.problem.mesh)["expert"])
        if all(e % n == 0 for e in expert_counts(ctx.trace)):
            return None
        return self.meshes[-1]

    def split_ep(self, mesh: MeshLike, extra: RulesLike | None, recipe: Recipe) -> Candidate:
        """The ``ep`` preset's candidate on the split ``mesh``."""
        problem = self.problem
        rules, choice = preset_choice(self.memo, "ep", extra, mesh, problem.groups, problem.aliases)
        act = activation_layout(rules, mesh, problem.ctx.trace)
        ctx = problem.context_ctx(mesh, recipe, ())
        cost = total_cost(ctx, problem.groups, choice, act.get("batch", ()), act.get("seq", ()))
        return Candidate("ep", choice, act, rules, cost, recipe, mesh=mesh)

    def dense_presets(self, extra: RulesLike | None, recipe: Recipe) -> list[Candidate]:
        """:data:`DENSE_PRESETS` with the experts expert-parallel (module docstring),
        named ``<preset>+ep`` (``+ep[expert=<degree>]`` on a split mesh), on the
        plan's mesh and each split mesh (one
        candidate per distinct layout, the batch splitting into the micro-batches)."""
        problem = self.problem
        trace = problem.ctx.trace
        out: list[Candidate] = []
        seen: set[tuple] = set()
        for mesh in (problem.mesh, *self.meshes):
            rules = self._placement(mesh, extra)
            if rules is None:
                continue
            degree = axis_sizes(mesh).get(EXPERT_AXIS, 1)
            for name in DENSE_PRESETS:
                table, choice = preset_choice(
                    self.memo, name, rules, mesh, problem.groups, problem.aliases
                )
                act = activation_layout(table, mesh, trace)
                key = (tuple(mesh.axis_names), tuple(choice), tuple(act.items()))
                batch = act.get("batch", ())
                if key in seen or not problem.fits_batch(recipe, batch, mesh):
                    continue
                seen.add(key)
                cp = context_axes(act.get("seq", ()))
                at = None if mesh is problem.mesh else mesh
                ctx = (
                    problem.at(recipe)
                    if at is None and not cp
                    else problem.context_ctx(mesh, recipe, cp)
                )
                cost = total_cost(ctx, problem.groups, choice, batch, act.get("seq", ()))
                label = f"{name}+ep" if at is None else f"{name}+ep[{EXPERT_AXIS}={degree}]"
                out.append(Candidate(label, choice, act, table, cost, recipe, mesh=at, context=cp))
        return out

    def _placement(self, mesh: MeshLike, extra: RulesLike | None) -> LogicalRules | None:
        """:func:`expert_placement` on ``mesh`` (experts over the model axes too where
        they divide), one table per mesh and ``extra`` (the presets' layouts are
        memoized on the table's identity)."""
        key = ("placement", id(mesh), id(extra))
        hit = self.memo.get(key)
        if hit is None or hit[0] is not mesh or hit[1] is not extra:
            given = None if extra is None else LogicalRules.coerce(extra)
            counts = expert_counts(self.problem.ctx.trace)
            rules = expert_placement(axis_sizes(mesh), counts, given, over_model=True)
            hit = self.memo[key] = (mesh, extra, rules)
        return hit[2]

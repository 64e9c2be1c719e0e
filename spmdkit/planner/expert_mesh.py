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
from spmdkit.planner.context_parallel import split_context
from spmdkit.planner.logical import BATCH_NAMES, ROLE_NAMES, RulesLike, axis_roles
from spmdkit.planner.problem import Problem
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.step.recipe import PLAIN, Recipe

__all__ = ["EXPERT_AXIS", "ExpertPlanner", "expert_counts", "expert_meshes"]

#: The mesh axis a split data axis gives the experts.
EXPERT_AXIS = "expert"


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

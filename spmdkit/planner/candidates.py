"""Candidates: the layouts the planner considers, and their cost by propagation.

A :class:`Candidate` is one costed layout (a layout per parameter group, the
activations' batch axes, the rule table it came from, its recipe and pipeline).
The candidate layouts are the presets' rule tables, a user's rules, and the
searched ones (:func:`search_layouts`: per group, the fastest layout that
divides; over the memory budget, trades time for memory group by group).
:func:`propagate_cost` costs a candidate by propagating the traced step at its
layouts; :func:`state_layout` lays out a model's mutable state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.introspect.model import ModelInfo, ParamInfo
from spmdkit.pipeline import Pipeline
from spmdkit.planner import experts
from spmdkit.planner.analytic import (
    CostContext,
    GroupCost,
    GroupLayout,
    ParamGroup,
    StepTrace,
    cost_levers,
    group_cost,
    total_cost,
)
from spmdkit.planner.context_parallel import PIPELINED_STRATEGIES, context_axes
from spmdkit.planner.logical import (
    BATCH_NAMES,
    SHARDED_OPT_PRESETS,
    LogicalRules,
    PlanError,
    RulesLike,
    preset_rules,
)
from spmdkit.planner.plans import ContextParallel, Cost, Dims, Plan, spec_dims
from spmdkit.planner.provenance import (
    MAX_OPTIONS,
    GroupChoice,
    LayoutOption,
    Provenance,
    from_propagation,
)
from spmdkit.planner.trace import step_arguments, train_step
from spmdkit.propagation import propagate
from spmdkit.propagation.graph import trace_with_tree
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.step.recipe import PLAIN, Recipe
from spmdkit.topology import Topology

if TYPE_CHECKING:
    from optax import GradientTransformation

    from spmdkit.planner.rule_export import RuleTable

__all__ = [
    "Activation",
    "Candidate",
    "activation_layout",
    "batch_axis_choices",
    "budget_moves",
    "context_record",
    "group_choices",
    "layout_options",
    "preset_choice",
    "preset_tables",
    "propagate_cost",
    "propagate_costed",
    "recost_step",
    "rules_choice",
    "search_layouts",
    "state_layout",
    "step_floor",
    "with_sharded",
]


#: Activations per batch dim: ``batch``, ``seq``, ... → mesh axes.
Activation = dict[str, tuple[str, ...]]


class Candidate(NamedTuple):
    """One costed layout the planner considers.

    Attributes:
      name: the preset name, ``"rules"``, or ``"searched[batch=...]"``.
      choice: one :class:`~spmdkit.planner.analytic.GroupLayout` per parameter group.
      activation: batch logical name → mesh axes.
      rules: the logical-rule table the layout came from (None when searched).
      cost: its estimated cost.
      recipe: the recipe it is costed with.
      pipeline: pipelined candidates: the pipeline (``choice`` then puts the
        layer dim of the stacked params on its axis).
      mesh: pipelined candidates: the mesh with the pipe axis; context-parallel
        ones: the mesh with the context axis (None: the plan's).
      context: context-parallel candidates: the axes the sequence is split over
        (:mod:`spmdkit.planner.context_parallel`); empty otherwise.
      provenance: where its propagated cost comes from, tensor by tensor
        (:mod:`spmdkit.planner.provenance`); None until propagated.
    """

    name: str
    choice: list[GroupLayout]
    activation: Activation
    rules: LogicalRules | None
    cost: Cost
    recipe: Recipe = PLAIN
    pipeline: Pipeline | None = None
    mesh: MeshLike | None = None
    context: tuple[str, ...] = ()
    provenance: Provenance | None = None

    @property
    def label(self) -> str:
        """The name with the recipe (and pipeline), e.g. ``fsdp+remat=full, bf16``."""
        out = self.name if self.recipe.is_default else f"{self.name}+{self.recipe.short()}"
        return out if self.pipeline is None else f"{out}+{self.pipeline.short()}"

    @property
    def sharded(self) -> bool:
        """Whether it splits anything over a mesh axis: the batch or sequence, a
        parameter, its optimizer state, or pipeline stages (else every device
        computes the same step)."""
        if self.pipeline is not None or self.context or any(self.activation.values()):
            return True
        return any(any(layout.params) or any(layout.opt) for layout in self.choice)


def _fp8_state(info: ModelInfo, exclude: tuple[str, ...]) -> dict:
    """The abstract amax histories of delayed float8 scaling for ``info``'s step
    (none for the matmuls ``exclude`` keeps in bfloat16)."""
    from spmdkit.step.grad import init_fp8_state

    key = () if info.abstract_key is None else (info.abstract_key,)
    return jax.eval_shape(
        lambda p, b, *k: init_fp8_state(info, p, b, *k, exclude=exclude),
        info.abstract_params,
        info.batch,
        *key,
    )


def _carried(
    info: ModelInfo, candidate: Plan, optimizer: GradientTransformation | None
) -> tuple[tuple, tuple, tuple]:
    """The step's carried arguments before the batch: ``(specs, abstract values,
    roles)`` of the params, the optimizer state (bf16 params and their fp32
    master in it under ``master_weights="optimizer"``), and the model's state
    (batch statistics) or delayed float8 scaling's amax histories (replicated)."""
    params, opt = step_arguments(info, optimizer, candidate.recipe)
    carried = (candidate.param_specs(params), candidate.opt_specs(opt))
    args = (params, opt)
    roles: tuple[str, ...] = ("params", "opt_state")
    if info.has_state:  # the model's batch statistics: in and out of the step, no grads
        carried += (candidate.state_specs(info.abstract_state),)
        args += (info.abstract_state,)
        roles += ("state",)
    elif candidate.recipe.fp8_scaling == "delayed":
        abstract = _fp8_state(info, candidate.recipe.fp8_exclude)
        carried += (jax.tree.map(lambda _: P(), abstract),)
        args += (abstract,)
        roles += ("state",)
    return carried, args, roles


def propagate_cost(
    info: ModelInfo,
    optimizer: GradientTransformation | None,
    candidate: Plan,
    ctx: CostContext,
    analytic: Cost,
) -> Cost:
    """Cost of a plan by propagating its specs through the whole train step
    (forward, backward, optimizer update; params and optimizer state donated),
    with its recipe applied; ``analytic`` is the same plan's analytic cost, whose
    compute time and overlappable share of communication it keeps."""
    return propagate_costed(info, optimizer, candidate, ctx, analytic)[0]


def propagate_costed(
    info: ModelInfo,
    optimizer: GradientTransformation | None,
    candidate: Plan,
    ctx: CostContext,
    analytic: Cost,
) -> tuple[Cost, Provenance]:
    """:func:`propagate_cost`, and the plan's
    :class:`~spmdkit.planner.provenance.Provenance` read off the same propagation."""
    carried, args, roles = _carried(info, candidate, optimizer)
    in_specs = (*carried, candidate.batch_specs(info.batch))
    # The step hands back parameters, optimizer state (and model state) in the
    # layouts it took them in (the next step's inputs, and what sk.jit's
    # out_shardings ask for): ZeRO-1's all-gather of the updated parameters is
    # part of its cost.
    out_specs = (*carried, P())
    grad_specs = None
    if candidate.grads:
        # constraints inside the traced step need Auto axes (as sk.jit compiles)
        sizes = axis_sizes(ctx.mesh)
        auto = AbstractMesh(
            tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes)
        )
        grad_specs = jax.tree.map(
            lambda spec: NamedSharding(auto, spec),
            candidate.grad_specs(info.abstract_params),
            is_leaf=lambda x: isinstance(x, P),
        )
    # the step's key (a model drawing random numbers): an input, replicated
    key = () if info.abstract_key is None else (info.abstract_key,)
    closed, tree = _step_program(
        info, optimizer, candidate.recipe, grad_specs, (*args, info.batch, *key)
    )
    prop = propagate(
        closed,
        *args,
        info.batch,
        *key,
        out_tree=tree,
        in_specs=(*in_specs, *(P() for _ in key)),
        out_specs=out_specs,
        mesh=ctx.mesh,
        topology=ctx.topology,
        donate_argnums=tuple(range(len(args))),
        arg_roles=(*roles, "batch", *("key" for _ in key)),
    )
    # Compute time is the analytic model's (the traced FLOPs split by the layout,
    # at achievable rates, recomputation included); communication is the
    # propagated collectives, of which the analytic model's overlappable share
    # hides under compute; host offload traffic as the analytic model prices it.
    mem = prop.memory
    topology = ctx.topology
    combined = combined_latency(prop.records, topology, ctx.mesh)
    # the expert exchanges never hide, as the analytic model prices them (its
    # priced-only 1F1B overlap aside: the executor does not run it)
    exposed = 0.0 if topology.expert_overlap else exchange_time(prop.records)
    step, comm_s = recost_step(analytic, prop.comm_time_s - combined, topology, exposed)
    # temporaries that come back as fresh pages each step (XLA:CPU): the kernel's
    # work, on the device's share of the cores like its compute
    pages_s = topology.fresh_pages_time(mem.temp_bytes)
    step, compute = step + pages_s, analytic.compute_time_s + pages_s
    comm_bytes = {k: int(v) for k, v in sorted(prop.comm_bytes_by_kind.items())}
    for kind in ("host_offload", "host_activations"):
        if analytic.comm_bytes.get(kind):
            comm_bytes[kind] = int(analytic.comm_bytes[kind])
    cost = Cost(
        step_time_s=step,
        compute_time_s=compute,
        comm_time_s=comm_s,
        hidden_comm_s=comm_s - (step - compute),
        comm_bytes=comm_bytes,
        memory={
            "arguments": int(mem.argument_bytes),
            "outputs": int(mem.output_bytes - mem.alias_bytes),
            "temporaries": int(mem.temp_bytes),
        },
        estimator="propagate",
        ops=prop.region_strategies(),
    )
    n_params = len(jax.tree.leaves(args[0]))
    return cost, from_propagation(prop, args[0], args[1], opt_position=n_params)


def combined_latency(records: Sequence, topology: Topology, mesh: MeshLike) -> float:
    """The latency of the propagated all-reduces that the compiler combines
    (:attr:`~spmdkit.topology.Topology.combines_all_reduces`; 0 where it does
    not): of the top-level all-reduces of one group of axes in one pass (forward,
    backward), all but one, each priced its alpha (its latency, no bytes), at
    most what propagation priced it (an op's own collectives are priced on the
    default topology, :func:`spmdkit.engine.rule.op_collective`). A loop body's
    are not combined (not across iterations)."""
    if not topology.combines_all_reduces:
        return 0.0
    seen: set[tuple] = set()
    saved = 0.0
    for r in records:
        for a in r.reshards:
            for c in a.plan.collectives:
                if c.kind != "all_reduce" or c.group_size <= 1:
                    continue
                key = (c.axes, r.backward)
                if key in seen:
                    alpha = topology.collective_time("all_reduce", 0, c.group_size, c.axes, mesh)
                    saved += min(alpha, c.time_s)
                seen.add(key)
    return saved


def exchange_time(records: Sequence) -> float:
    """Seconds the routed experts' exchanges of propagated ``records`` take (the
    all-to-alls that know their routed rows, ``Collective.routed_bytes``; a loop
    body's times its trip count): the part of a step's collectives that sits on
    the critical path, never hidden under compute
    (the ``overlap`` constant of :mod:`spmdkit.topology`)."""
    total = 0.0
    for r in records:
        total += sum(
            c.time_s for a in r.reshards for c in a.plan.collectives if c.routed_bytes is not None
        )
        if r.body and r.repeat:
            total += r.repeat * exchange_time(r.body)
    return total


def _step_program(
    info: ModelInfo,
    optimizer: GradientTransformation | None,
    recipe: Recipe,
    grad_specs: object,
    args: tuple,
) -> tuple[object, object]:
    """The train step's jaxpr and output tree on ``args`` (:func:`trace_with_tree`),
    traced once per model, optimizer, recipe and argument shapes (the candidates
    of one recipe propagate the same program) unless gradient shardings constrain
    it."""
    step = train_step(info, optimizer, recipe, grad_specs)
    if grad_specs is not None:
        return trace_with_tree(step, *args)
    leaves, treedef = jax.tree.flatten(args)
    shapes = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
    key = ("planner.step_jaxpr", id(optimizer), recipe, treedef, shapes)
    return info.memo(key, lambda: trace_with_tree(step, *args))


def recost_step(
    analytic: Cost, collectives_s: float, topology: Topology, exposed_s: float = 0.0
) -> tuple[float, float]:
    """(step time, communication time) of a plan whose propagated collectives take
    ``collectives_s``: the analytic model's compute time, and of the collectives
    the analytic model's overlappable share hides under it, never the
    ``exposed_s`` of them that sit on the critical path (the routed experts'
    exchanges, :func:`exchange_time`); host offload traffic as the analytic model
    prices it. Never decreases as ``collectives_s`` grows while the hidden share
    is at most 1."""
    compute = analytic.compute_time_s
    share = _share(analytic)
    host = analytic.comm_bytes.get("host_offload", 0) / topology.host_bandwidth
    # offloaded activations move while the layers compute (the analytic model's)
    host_acts = analytic.comm_bytes.get("host_activations", 0) / topology.host_bandwidth
    hidden = min(collectives_s * share, max(collectives_s - exposed_s, 0.0)) + host_acts
    comm_s = collectives_s + host + host_acts
    return compute + topology.exposed_comm(hidden, comm_s - hidden, compute), comm_s


def _share(analytic: Cost) -> float:
    """The share of communication the analytic model hides under compute."""
    return analytic.hidden_comm_s / analytic.comm_time_s if analytic.comm_time_s else 0.0


def step_floor(
    analytic: Cost, batch_axes: tuple[str, ...], mesh: MeshLike, topology: Topology
) -> float:
    """A lower bound on the step time :func:`propagate_cost` gives a candidate
    whose analytic cost is ``analytic`` and whose batch is split over
    ``batch_axes``, without propagating: its compute time is the analytic
    model's, and where the batch is split over devices the step communicates at
    least once (the loss, replicated, reads every device's rows), so its
    collectives take at least one latency of the fastest mesh axis (an
    alpha-beta collective over two or more devices takes one latency or more,
    :meth:`~spmdkit.topology.Topology.collective_time`). Auto skips propagating a
    candidate whose floor is above a plan it has already propagated."""
    if _share(analytic) > 1.0:  # not monotone in the collectives' time: no floor
        return 0.0
    sizes = axis_sizes(mesh)
    split = any(sizes[a] > 1 for a in batch_axes)
    latency = min((topology.link((a,), mesh)[1] for a, n in sizes.items() if n > 1), default=0.0)
    return recost_step(analytic, latency if split else 0.0, topology)[0]


# -- the model's mutable state ----------------------------------------------------------------

#: Parameter names a module's statistics follow first (a norm's scale, then its bias).
_OWNER_ORDER = ("scale", "bias")


def _owner(path: str, shape: tuple[int, ...], params: Mapping[str, ParamInfo]) -> str | None:
    """The parameter a state leaf belongs to: one of its module (its parent path;
    for linen, the same module in the ``params`` collection) with its shape, a
    norm's ``scale`` or ``bias`` first."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    parents = {parent}
    _, _, module = parent.partition("/")
    if module:
        parents.add("params/" + module)
    hits = [
        q
        for q, p in params.items()
        if (q.rsplit("/", 1)[0] if "/" in q else "") in parents and tuple(p.shape) == shape
    ]

    def order(q: str) -> tuple[int, str]:
        leaf = q.rsplit("/", 1)[-1]
        return (_OWNER_ORDER.index(leaf) if leaf in _OWNER_ORDER else len(_OWNER_ORDER), q)

    return min(hits, key=order) if hits else None


def state_layout(
    info: ModelInfo, params: Mapping[str, P], rules: LogicalRules | None, mesh: MeshLike
) -> tuple[dict[str, P], dict[str, str]]:
    """Specs for the model's mutable state and where each came from.

    A state leaf (a norm's running mean) is laid out like the parameter of its
    module with its shape (the norm's scale: per-channel statistics follow the
    channels' layout, whatever the rules decided for them); a leaf with its own
    pin or logical names and no such parameter, by the pin or the rule table;
    otherwise it is replicated, and its row in the plan's table says so.

    Example::

        >>> specs, sources = state_layout(info, plan.params, plan.rules, mesh)
        >>> sources["batch_stats/BatchNorm_0/mean"]
        'like params/BatchNorm_0/scale'
    """
    by_path = info.by_path()
    specs: dict[str, P] = {}
    sources: dict[str, str] = {}
    for s in info.state:
        owner = _owner(s.path, tuple(s.shape), by_path)
        if owner is not None and owner in params:
            specs[s.path], sources[s.path] = params[owner], f"like {owner}"
        elif s.pinned is not None:
            specs[s.path], sources[s.path] = s.pinned, "pinned"
        elif s.logical is not None and rules is not None:
            specs[s.path] = rules.resolve(s.logical, s.shape, mesh, where=s.path)
            sources[s.path] = "rules"
        else:
            specs[s.path], sources[s.path] = P(), "replicated"
    return specs, sources


# -- candidate layouts ------------------------------------------------------------------------


def _layouts(g: ParamGroup, sizes: dict[str, int], limit: int = 400) -> list[Dims]:
    """Every assignment of the mesh axes to ``g``'s dims that divides (its pin only
    when pinned), at most ``limit``."""
    if g.pinned is not None:
        return [spec_dims(g.pinned, len(g.shape))]
    ndim = len(g.shape)
    axes = [a for a, s in sizes.items() if s > 1]
    out: list[Dims] = []
    for assign in itertools.product(range(-1, ndim), repeat=len(axes)):
        dims: list[tuple[str, ...]] = [()] * ndim
        for a, d in zip(axes, assign, strict=True):
            if d >= 0:
                dims[d] = (*dims[d], a)
        if all(g.shape[i] % math.prod(sizes[a] for a in dims[i]) == 0 for i in range(ndim)):
            out.append(tuple(dims))
        if len(out) >= limit:
            break
    return out or [((),) * ndim]


def _zero1(
    dims: Dims, shape: tuple[int, ...], batch_axes: tuple[str, ...], sizes: dict[str, int]
) -> Dims:
    """Optimizer dims: the param's dims plus the free batch axes on the largest dim they divide."""
    used = {a for d in dims for a in d}
    extra = tuple(a for a in batch_axes if a not in used and sizes[a] > 1)
    if not extra or not shape:
        return dims
    n_extra = math.prod(sizes[a] for a in extra)
    order = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in order:
        cur = math.prod(sizes[a] for a in dims[i])
        if shape[i] % (cur * n_extra) == 0:
            out = list(dims)
            out[i] = dims[i] + extra
            return tuple(out)
    return dims


def activation_layout(rules: LogicalRules, mesh: MeshLike, trace: StepTrace) -> Activation:
    """The mesh axes of each batch dim under ``rules``, read as flax reads a table
    (:meth:`~spmdkit.planner.logical.LogicalRules.resolve`) for an array carrying
    every batch name: the entries in table order, each giving its axes to its
    name unless the name is decided, an axis is held by another batch name or
    the axes do not divide the dim. A context axis the sequence's rule asks for
    is kept for the sequence (:mod:`spmdkit.planner.context_parallel`): the
    batch never takes it."""
    sizes = axis_sizes(mesh)
    dims = {"batch": trace.batch_size, "seq": trace.seq_len if trace.seq_len > 1 else None}

    def first_seq() -> tuple[str, ...]:
        for key, axes in rules.entries:
            if key != "seq":
                continue
            if axes is None:
                break
            if dims["seq"] and dims["seq"] % math.prod(sizes[a] for a in axes):
                continue
            return axes
        return ()

    reserved = set(context_axes(first_seq()))
    got: dict[str, tuple[str, ...]] = {}
    held: set[str] = set()
    for key, axes in rules.entries:
        if key not in BATCH_NAMES or key in got:
            continue
        if axes is None:
            got[key] = ()
            continue
        if held.intersection(axes) or (key == "batch" and reserved.intersection(axes)):
            continue
        if dims.get(key) and dims[key] % math.prod(sizes[a] for a in axes):
            continue
        got[key] = axes
        held.update(axes)
    return {name: got.get(name, ()) for name in BATCH_NAMES}


#: Strategies whose optimizer state is sharded as fsdp shards it, on the axes the
#: parameter leaves free (ZeRO-1/2; a tensor-parallel preset's distributed optimizer).
_ZERO = ("zero1", "zero2", *SHARDED_OPT_PRESETS)


def preset_tables(
    name: str,
    extra: RulesLike | None,
    mesh: MeshLike,
    aliases: Mapping[str, str] | None = None,
) -> tuple[LogicalRules, LogicalRules]:
    """A preset's rule tables for the parameters and for their optimizer state
    (ZeRO-1/2 and :data:`~spmdkit.planner.logical.SHARDED_OPT_PRESETS`: the fsdp
    table), ``extra`` rules first, ``aliases`` applied
    (:meth:`~spmdkit.planner.logical.LogicalRules.aliased`)."""
    rules = preset_rules(name, mesh)
    if extra is not None:
        rules = rules.prepend(extra)
    opt_rules = preset_rules("fsdp", mesh) if name in _ZERO else rules
    if extra is not None and name in _ZERO:
        opt_rules = opt_rules.prepend(extra)
    if aliases:
        rules, opt_rules = rules.aliased(aliases), opt_rules.aliased(aliases)
    return rules, opt_rules


def rules_choice(
    rules: LogicalRules,
    opt_rules: LogicalRules,
    groups: list[ParamGroup],
    mesh: MeshLike,
    preset: str | None,
) -> list[GroupLayout]:
    sizes = axis_sizes(mesh)
    every = tuple(a for a in mesh.axis_names if sizes[a] > 1)
    out = []
    for g in groups:
        if g.pinned is not None:
            out.append(_pinned(g))
            continue
        if g.logical is None:
            dims = _unannotated(g.shape, every if preset == "fsdp" else (), sizes)
            odims = _unannotated(
                g.shape, every if preset in ("fsdp", "zero1", "zero2") else (), sizes
            )
        else:
            dims = spec_dims(
                rules.resolve(g.logical, g.shape, mesh, where=g.paths[0]), len(g.shape)
            )
            odims = spec_dims(
                opt_rules.resolve(g.logical, g.shape, mesh, where=g.paths[0]), len(g.shape)
            )
            if preset in _ZERO:
                odims = _merge(dims, odims, g.shape, sizes)
        out.append(GroupLayout(dims, odims, grads_sharded=preset == "zero2" and odims != dims))
    return out


#: ``memo`` key prefix of a preset's tables and layouts (:func:`preset_choice`).
_PRESET_KEY = ("candidates", "preset_choice")


def preset_choice(
    memo: dict,
    name: str,
    extra: RulesLike | None,
    mesh: MeshLike,
    groups: list[ParamGroup],
    aliases: Mapping[str, str] | None = None,
) -> tuple[LogicalRules, list[GroupLayout]]:
    """A preset's parameter table and its layout per group (:func:`preset_tables`,
    :func:`rules_choice`), memoized in ``memo`` for these very ``extra``, ``mesh``
    and ``groups`` (one plan call's) and these ``aliases``: the same under every
    recipe the search costs the preset with. The layouts come back as a new list."""
    given = (extra, mesh, groups)
    key = (_PRESET_KEY, name, *map(id, given), tuple(sorted((aliases or {}).items())))
    hit = memo.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], given, strict=True)):
        rules, opt_rules = preset_tables(name, extra, mesh, aliases)
        hit = memo[key] = (given, rules, rules_choice(rules, opt_rules, groups, mesh, name))
    return hit[1], list(hit[2])


def _pinned(g: ParamGroup) -> GroupLayout:
    """A group the model pins in mesh axes: its pin, for the parameters and their
    optimizer state alike."""
    d = spec_dims(g.pinned, len(g.shape))
    return GroupLayout(d, d)


def table_choice(table: RuleTable, groups: list[ParamGroup], mesh: MeshLike) -> list[GroupLayout]:
    """The layouts an exported table (:meth:`Plan.to_rules`) gives each group, read
    as flax reads it (:meth:`RuleTable.spec`), its per-parameter overrides applied:
    the plan it was exported from, planned again (on another mesh with the same
    axis names too, where its layouts divide). A group the model pins keeps its pin.

    Raises:
      PlanError: the table names a mesh axis ``mesh`` lacks, or a layout does not
        divide a dim on ``mesh``; the fix is to pass ``table.rules`` as a plain rule
        table, which spmdkit fits to the mesh.
    """
    sizes = axis_sizes(mesh)
    missing = [a for a in table.mesh_axes if a not in sizes]
    if missing:
        raise PlanError(
            op="plan(strategy=RuleTable)",
            must="the mesh has every axis the exported table was made on",
            given=f"table axes {table.mesh_axes}, mesh axes {tuple(mesh.axis_names)}",
            fix="plan on a mesh with those axes, or pass table.rules as the strategy "
            "(a plain rule table: absent axes are dropped, layouts fitted)",
        )

    def dims_of(g: ParamGroup, overrides: Mapping[str, P], opt: bool) -> Dims:
        hit = next((overrides[p] for p in (g.key, *g.paths) if p in overrides), None)
        if hit is not None:
            dims = spec_dims(hit, len(g.shape))
        else:
            dims = spec_dims(table.spec(g.logical, opt=opt), len(g.shape))
        for d, (axes, n) in enumerate(zip(dims, g.shape, strict=True)):
            k = math.prod(sizes[a] for a in axes)
            if n % k:
                raise PlanError(
                    op="plan(strategy=RuleTable)",
                    must="each layout of the exported table divides its dims on this mesh",
                    given=f"{g.key} dim {d} of size {n} over {axes} ({k} shards)",
                    fix="pass table.rules as the strategy (a plain rule table: spmdkit "
                    "leaves off the axes a dim does not divide by)",
                )
        return dims

    out = []
    for g in groups:
        if g.pinned is not None:
            out.append(_pinned(g))
            continue
        dims = dims_of(g, table.overrides, opt=False)
        odims = dims_of(g, table.opt_overrides, opt=True)
        out.append(GroupLayout(dims, odims, grads_sharded=table.grads_sharded and odims != dims))
    return out


def _merge(dims: Dims, odims: Dims, shape: tuple[int, ...], sizes: dict[str, int]) -> Dims:
    """The parameter's dims plus the axes the optimizer's table adds (``odims``'
    axes the parameter leaves free), each on the dim the table puts it where the
    dim still divides, else on the largest dim that does (:func:`_zero1`), else
    left off (a tensor-parallel head dim of 4 over ``model=4`` takes no ``data=2``)."""
    used = {a for d in dims for a in d}
    out = list(dims)
    left: list[str] = []
    for i, o in enumerate(odims):
        add = tuple(a for a in o if a not in used)
        if add and shape[i] % math.prod(sizes[a] for a in (*out[i], *add)) == 0:
            out[i] = (*out[i], *add)
        else:
            left.extend(add)
    return _zero1(tuple(out), shape, tuple(left), sizes) if left else tuple(out)


def _unannotated(shape: tuple[int, ...], axes: tuple[str, ...], sizes: dict[str, int]) -> Dims:
    """fsdp for a param without names: every axis on its largest dim that divides."""
    dims: list[tuple[str, ...]] = [()] * len(shape)
    if not axes:
        return tuple(dims)
    for cand in (axes, *((a,) for a in axes)):
        n = math.prod(sizes[a] for a in cand)
        for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
            if shape[i] % n == 0:
                dims[i] = cand
                return tuple(dims)
    return tuple(dims)


def batch_axis_choices(sizes: dict[str, int], batch_size: int) -> list[tuple[str, ...]]:
    axes = [a for a, s in sizes.items() if s > 1]
    out = []
    for r in range(len(axes), -1, -1):
        for combo in itertools.combinations(axes, r):
            if batch_size % math.prod(sizes[a] for a in combo) == 0:
                out.append(combo)
    return out


#: ``CostContext.memo`` key prefix of a group's layouts and their costs (:func:`layout_options`).
_OPTIONS_KEY = ("candidates", "layout_options")
#: ``CostContext.memo`` key prefix of a group's layouts alone (shared by every recipe).
_ENUMERATED_KEY = ("candidates", "layouts")


def search_layouts(
    ctx: CostContext,
    groups: list[ParamGroup],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    budget: float,
    *,
    total: Callable[..., Cost] = total_cost,
    sizes: dict[str, int] | None = None,
) -> tuple[list[GroupLayout], Cost]:
    """The fastest layout per group, then, while over ``budget``, the move that
    saves memory at the least time per byte. ``total``: the cost of a whole
    choice (a pipelined one's for pipelines); ``sizes``: the mesh axes layouts
    may use (default: all)."""
    sizes = ctx.sizes if sizes is None else sizes
    found = [layout_options(ctx, g, batch_axes, seq_axes, sizes) for g in groups]
    options = [opts for opts, _ in found]
    ranked = [_ranked(ctx, costs) for _, costs in found]
    pick = [r.best for r in ranked]
    choice = [options[i][j] for i, j in enumerate(pick)]
    cost = total(ctx, groups, choice, batch_axes, seq_axes)
    # Over budget: trade time for memory, best Δtime per byte saved first.
    for _ in range(4 * len(groups) * 8):
        if cost.peak_bytes <= budget:
            break
        best_move = None
        for i, r in enumerate(ranked):
            for ratio, j in r.moves(pick[i]):
                if best_move is None or ratio < best_move[0]:
                    best_move = (ratio, i, j)
        if best_move is None:
            break
        _, i, j = best_move
        pick[i] = j
        choice[i] = options[i][j]
        cost = total(ctx, groups, choice, batch_axes, seq_axes)
    return choice, cost


class _Ranked:
    """One group's option costs as :func:`search_layouts` reads them: each
    option's time and memory, the fastest option (ties: the least memory, then
    the first), and the budget moves from each option (:func:`budget_moves`),
    computed once per option."""

    __slots__ = ("_moves", "best", "memories", "times")

    def __init__(self, costs: Sequence[GroupCost]) -> None:
        keys = [(c.time, c.memory, j) for j, c in enumerate(costs)]
        self.best: int = min(keys)[2]
        self.times = [t for t, _, _ in keys]
        self.memories = [m for _, m, _ in keys]
        self._moves: dict[int, list[tuple[float, int]]] = {}

    def moves(self, cur_j: int) -> list[tuple[float, int]]:
        """:func:`budget_moves` from option ``cur_j`` (memoized)."""
        out = self._moves.get(cur_j)
        if out is None:
            out = self._moves[cur_j] = _moves_from(self.times, self.memories, cur_j)
        return out


#: ``CostContext.memo`` key prefix of a group's ranked option costs (:func:`_ranked`).
_RANKED_KEY = ("candidates", "ranked")


def _ranked(ctx: CostContext, costs: list[GroupCost]) -> _Ranked:
    """``costs`` (a list :func:`layout_options` memoized in ``ctx``) ranked, memoized
    beside it: the planner searches the same options under many recipes and
    budgets."""
    key = (_RANKED_KEY, id(costs))
    hit = ctx.memo.get(key)
    if hit is not None and hit[0] is costs:
        return hit[1]
    out = _Ranked(costs)
    ctx.memo[key] = (costs, out)  # holding ``costs`` keeps its id this entry's
    return out


def layout_options(
    ctx: CostContext,
    g: ParamGroup,
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    sizes: dict[str, int],
) -> tuple[list[GroupLayout], list[GroupCost]]:
    """The layouts :func:`search_layouts` tries for ``g`` on the axes ``sizes`` and
    their costs, memoized in ``ctx`` (the planner searches the same group under
    many recipes that share its costs, :func:`~spmdkit.planner.analytic.cost_levers`)."""
    where = (tuple(sizes.items()), g.key, g.shape, batch_axes, seq_axes)
    key = (_OPTIONS_KEY, *where, cost_levers(ctx, g))
    hit = ctx.memo.get(key)
    if hit is not None:
        return hit
    # the layouts themselves do not depend on the recipe: enumerated once
    enum_key = (_ENUMERATED_KEY, *where, g.logical, g.pinned)
    opts = ctx.memo.get(enum_key)
    if opts is None:
        opts = ctx.memo[enum_key] = tuple(_enumerate(ctx, g, batch_axes, seq_axes, sizes))
    out = ctx.memo[key] = (
        list(opts),
        [group_cost(ctx, g, o, batch_axes, seq_axes) for o in opts],
    )
    return out


def _enumerate(
    ctx: CostContext,
    g: ParamGroup,
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    sizes: dict[str, int],
) -> list[GroupLayout]:
    """:func:`layout_options`' layouts of ``g``, in the order it costs them."""
    opts = []
    moe = experts.moe_call(g, ctx.trace) is not None
    for dims in _layouts(g, sizes):
        if moe and not experts.runs_as_priced(g, dims, (*batch_axes, *seq_axes)):
            continue
        opts.append(GroupLayout(dims, dims))
        z = _zero1(dims, g.shape, batch_axes, sizes)
        if z != dims:
            opts.append(GroupLayout(dims, z))
            opts.append(GroupLayout(dims, z, grads_sharded=True))
    return opts


def budget_moves(
    gcost: Callable[[int, int], GroupCost], i: int, cur_j: int, n: int
) -> list[tuple[float, int]]:
    """The moves of group ``i`` from its option ``cur_j`` that save memory, as
    ``(Δtime per byte saved, option)`` in option order; of a run of them, only
    those that could be picked (:func:`search_layouts` takes the first strictly
    smallest ratio): each one smaller than every one before it, or all of them
    where a ratio is not a number.

    Args:
      gcost: ``gcost(i, j)``, the cost of group ``i``'s option ``j``.
      i: the group.
      cur_j: its option now.
      n: its option count.
    """
    costs = [gcost(i, j) for j in range(n)]
    return _moves_from([c.time for c in costs], [c.memory for c in costs], cur_j)


def _moves_from(times: Sequence[float], memories: Sequence[float], cur_j: int) -> list:
    """:func:`budget_moves` on the options' times and memories."""
    cur_t, cur_m = times[cur_j], memories[cur_j]
    out = []
    for j, m in enumerate(memories):
        saved = cur_m - m
        if saved > 0:
            out.append(((times[j] - cur_t) / saved, j))
    if any(math.isnan(r) for r, _ in out):
        return out
    kept: list[tuple[float, int]] = []
    for r, j in out:
        if not kept or r < kept[-1][0]:
            kept.append((r, j))
    return kept


def with_sharded(
    best: Candidate,
    others: list[Candidate],
    analytic: list[Candidate],
    rank: Callable[[Candidate], tuple],
    budget: float,
    recost: Callable[[Candidate], Candidate] | None,
) -> list[Candidate]:
    """Auto's runner-ups (``others``, ranked by ``rank``), with the best sharded
    candidate of ``analytic`` (all it costed; those within ``budget`` first)
    among them, re-costed by ``recost`` and in its ranked place, when ``best``
    replicates everything and no runner-up is sharded: the plan then shows what
    splitting the step would cost."""
    if best.sharded or any(c.sharded for c in others):
        return others
    pool = [c for c in analytic if c.sharded and c.cost.peak_bytes <= budget]
    pool = pool or [c for c in analytic if c.sharded]
    if not pool:
        return others
    pick = min(pool, key=rank)
    return sorted([*others, pick if recost is None else recost(pick)], key=rank)


def context_record(c: Candidate, cost: Cost | None, mesh: MeshLike) -> ContextParallel | None:
    """A candidate's :class:`~spmdkit.planner.plans.ContextParallel`: its context
    axes, and the attention strategy its cost priced (the propagate estimator's
    choice for the forward regions, else the analytic model's)."""
    if not c.context:
        return None
    sizes = axis_sizes(mesh)
    ops = (cost or c.cost).ops.get("attention") or c.cost.ops.get("attention") or {}
    seq = [s for s in ops if s != "default"] or ["ring"]
    strategy = max(seq, key=lambda s: ops.get(s, 0))
    if c.pipeline is not None and strategy not in PIPELINED_STRATEGIES:
        strategy = PIPELINED_STRATEGIES[0]  # what a pipelined stage runs (and was priced)
    return ContextParallel(c.context, math.prod(sizes[a] for a in c.context), strategy)


def _layout_option(layout: GroupLayout, cost: GroupCost) -> LayoutOption:
    return LayoutOption(
        layout.params,
        layout.opt,
        layout.grads_sharded,
        float(cost.time),
        int(sum(n for _, n in cost.comm_bytes)),
        int(cost.memory),
    )


def group_choices(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> dict[str, GroupChoice]:
    """Per group, the layouts :func:`search_layouts` costs for it at these batch
    and sequence axes (memoized in ``ctx``, so after a search this costs nothing
    new), the chosen one and the fastest others."""
    out: dict[str, GroupChoice] = {}
    for g, chosen in zip(groups, choice, strict=True):
        options, costs = layout_options(ctx, g, batch_axes, seq_axes, ctx.sizes)
        picked = next((c for o, c in zip(options, costs, strict=True) if o == chosen), None)
        if picked is None:  # a rule table's layout the search does not enumerate
            picked = group_cost(ctx, g, chosen, batch_axes, seq_axes)
        ranked = sorted(
            (
                (c.time, c.memory, j)
                for j, (o, c) in enumerate(zip(options, costs, strict=True))
                if o != chosen
            )
        )
        others = tuple(_layout_option(options[j], costs[j]) for _, _, j in ranked[:MAX_OPTIONS])
        chosen_option = _layout_option(chosen, picked)
        out[g.key] = GroupChoice(chosen_option, others, len(options), tuple(batch_axes))
    return out

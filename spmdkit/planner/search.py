"""The search: trace a model's train step once, build candidate layouts, cost them, pick one.

:func:`plan` turns a model (anything :func:`spmdkit.flax.model` reads) and a
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
optimizer/gradient sharding). The fastest of the presets and these searched plans that fit the
budget wins; ties keep the earlier candidate, so the search is deterministic.
When none fits, the one needing the least memory is chosen, with a warning.

Recipes
-------
Each candidate is a layout *and* a :class:`~spmdkit.recipe.Recipe`. Unless
``recipe=`` fixes one, auto costs every preset and searched layout under each
remat policy (``none``, ``dots``, ``full`` when the model has a layer scan) and
compute dtype (the parameters', or bf16 on fp32 master weights), growing the
micro-batch count only until some plan fits within :data:`_FLAT_HEADROOM` of
the budget; optimizer offload is tried only when nothing fits without it. The
three best candidates and the presets within twice the budget are re-costed by
propagating :func:`train_step` for their recipe (the step ``sk.train_step``
builds and ``train`` runs), then more while the best is one not re-costed yet
(:meth:`_Planner.recosted`).
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit import jaxprs
from spmdkit.flax.model import ModelInfo, ParamInfo, describe, unbound_axis_error
from spmdkit.mesh import abstract_mesh
from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.pipeline.layer_scan import find_layer_scan
from spmdkit.planner.analytic import (
    CostContext,
    GroupCost,
    GroupLayout,
    ParamGroup,
    StepTrace,
    group_cost,
    param_flops,
    param_groups,
    total_cost,
)
from spmdkit.planner.logical import (
    BATCH_NAMES,
    PRESETS,
    LogicalRules,
    PlanError,
    RulesLike,
    UnknownLogicalAxisError,
    preset_rules,
)
from spmdkit.planner.naming import apply_names, check_placement, infer_names
from spmdkit.planner.pipecost import StageSplit, param_stages, pipeline_cost, stage_groups
from spmdkit.planner.pipelined import (
    PLACEHOLDER_AXIS,
    layer_rules,
    model_rows_combined,
    pipeline_submesh,
    pipelined_plan,
)
from spmdkit.planner.pipesearch import PIPE_AXIS, pipe_meshes, pipeline_configs, reference
from spmdkit.planner.plans import Cost, Dims, Plan, PyTree, dims_spec, spec_dims
from spmdkit.propagation import propagate
from spmdkit.recipe import PLAIN, Recipe
from spmdkit.region import FORWARD, REGIONS, forward_fn, grad_fn
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.topology import DEFAULT_TOPOLOGY, Topology
from spmdkit.util import contraction_flops, fmt_bytes, path_str

if TYPE_CHECKING:
    from optax import GradientTransformation

__all__ = [
    "H100_MEMORY",
    "Candidate",
    "plan",
    "propagate_cost",
    "state_layout",
    "trace_step",
    "train_step",
]

#: Per-device memory of one H100 (bytes); the default memory budget.
H100_MEMORY = 80 * 2**30

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
      mesh: pipelined candidates: the mesh with the pipe axis (None: the plan's).
    """

    name: str
    choice: list[GroupLayout]
    activation: Activation
    rules: LogicalRules | None
    cost: Cost
    recipe: Recipe = PLAIN
    pipeline: Pipeline | None = None
    mesh: MeshLike | None = None

    @property
    def label(self) -> str:
        """The name with the recipe (and pipeline), e.g. ``fsdp+remat=full, bf16``."""
        out = self.name if self.recipe.is_default else f"{self.name}+{self.recipe.short()}"
        return out if self.pipeline is None else f"{out}+{self.pipeline.short()}"


# -- tracing (once per model) -------------------------------------------------------------

_CONTRACTIONS = ("dot_general", "conv_general_dilated")


def _eqn_flops(eqn: JaxprEqn) -> float:
    name = eqn.primitive.name
    if name not in _CONTRACTIONS:
        return 0.0
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    return contraction_flops(name, eqn.params, lhs, rhs, eqn.outvars[0].aval.shape)


def _jaxpr_flops(jaxpr: Jaxpr, *, batched_only: bool = False) -> float:
    """Contraction FLOPs of a jaxpr, scans unrolled (``batched_only``: only dots
    with batch dims, i.e. attention's scores and values)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if not batched_only or (eqn.primitive.name == "dot_general" and _is_batched_dot(eqn)):
            total += _eqn_flops(eqn)
        mult = jaxprs.scan_length(eqn)
        for sub in _eqn_subs(eqn):
            total += mult * _jaxpr_flops(sub, batched_only=batched_only)
    return total


def _eqn_subs(eqn: JaxprEqn) -> Iterable[Jaxpr]:
    """The jaxprs inside an equation: its parameters' (scan, call, custom_vjp), or
    for a composite op's region the unsharded computation it stands for (so the
    attention region's dots count as the model's attention FLOPs, its grad region's
    recomputed forward included)."""
    for sub in jaxprs.sub_jaxprs(eqn):
        yield jaxprs.open_jaxpr(sub)[0]
    if eqn.primitive.name in REGIONS:
        avals = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars)
        p = eqn.params
        yield _region_jaxpr(eqn.primitive.name, p["op"], p["attrs"], p.get("diff"), avals)


@functools.lru_cache(maxsize=256)
def _region_jaxpr(prim: str, op: str, attrs: Any, diff: Any, avals: tuple) -> Jaxpr:
    fn = forward_fn(op, dict(attrs)) if prim == FORWARD else grad_fn(op, dict(attrs), diff)
    return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, d) for s, d in avals)).jaxpr


def _optimizer(optimizer: GradientTransformation | None) -> GradientTransformation:
    import optax  # loaded on first plan, not on ``import spmdkit``

    return optimizer if optimizer is not None else optax.adam(1e-3)


def _batch_dims(info: ModelInfo) -> tuple[int, int, int]:
    """``(batch size, seq length, tokens)`` from the first batch field's logical names."""
    leaves = jax.tree_util.tree_flatten_with_path(info.batch)[0]
    if not leaves:
        return 1, 1, 1
    kp, leaf = leaves[0]
    names = info.batch_axes.get(path_str(kp)) or ("batch",)
    shape = tuple(leaf.shape)
    batch = seq = 1
    tokens = 1
    for n, s in zip(names, shape, strict=False):
        if n == "batch":
            batch = s
        if n == "seq":
            seq = s
        if n in ("batch", "seq", "height", "width"):
            tokens *= s
    return batch, seq, max(tokens, 1)


def _nbytes(x: jax.ShapeDtypeStruct) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def _opt_bytes(info: ModelInfo, abstract_opt: PyTree) -> tuple[dict[str, int], int]:
    """Optimizer-state bytes per param path (leaves whose path ends with the
    param's and have its shape), and the bytes of the other leaves."""
    paths = [p.path for p in info.params]
    shapes = {p.path: p.shape for p in info.params}
    opt_bytes: dict[str, int] = dict.fromkeys(paths, 0)
    other = 0
    for kp, leaf in jax.tree_util.tree_flatten_with_path(abstract_opt)[0]:
        lp = path_str(kp)
        match = None
        for p in paths:
            hit = (lp == p or lp.endswith("/" + p)) and shapes[p] == tuple(leaf.shape)
            if hit and (match is None or len(p) > len(match)):
                match = p
        if match is None:
            other += _nbytes(leaf)
        else:
            opt_bytes[match] += _nbytes(leaf)
    return opt_bytes, other


class _LayerScan(NamedTuple):
    """What the model's layer scan tells the remat model (global batch)."""

    layers: int
    carry: float
    dots: float
    named: dict[str, float]
    fwd_flops: float


def _aval_bytes(v: Any) -> float:
    aval = v.aval
    return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def _is_batched_dot(eqn: JaxprEqn) -> bool:
    (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    return bool(lhs_batch)


def _body_facts(jaxpr: Jaxpr) -> tuple[float, dict[str, float], float]:
    """Weight-matmul output bytes, ``checkpoint_name`` bytes and batched-dot
    FLOPs of one scan body (nested calls and scans included)."""
    dots = attn = 0.0
    named: dict[str, float] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            if _is_batched_dot(eqn):
                attn += _eqn_flops(eqn)
            else:
                dots += _aval_bytes(eqn.outvars[0])
        elif name == "name" and "name" in eqn.params:
            tag = str(eqn.params["name"])
            named[tag] = named.get(tag, 0.0) + _aval_bytes(eqn.outvars[0])
        mult = jaxprs.scan_length(eqn)
        for sub in _eqn_subs(eqn):
            d, n, a = _body_facts(sub)
            dots += mult * d
            attn += mult * a
            for k, v in n.items():
                named[k] = named.get(k, 0.0) + mult * v
    return dots, named, attn


def _layer_scan(jaxpr: Jaxpr) -> tuple[_LayerScan | None, float]:
    """The facts of the layer scan in a forward jaxpr
    (:func:`~spmdkit.pipeline.layer_scan.find_layer_scan`, the scan the pipeline
    split and the recompute rewrite take) and the batched-dot FLOPs of the forward."""
    layer = find_layer_scan(jaxpr)
    best: _LayerScan | None = None
    attn_total = 0.0
    stack = [jaxpr]
    while stack:
        j = stack.pop()
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general" and _is_batched_dot(eqn):
                attn_total += _eqn_flops(eqn)
            if eqn.primitive.name != "scan":
                stack.extend(_eqn_subs(eqn))
                continue
            sc = jaxprs.scan(eqn)
            body, length = sc.jaxpr, sc.length
            flops = length * _jaxpr_flops(body)
            dots, named, attn = _body_facts(body)
            attn_total += length * attn
            carry = sum(_aval_bytes(v) for v in body.invars[sc.num_consts : sc.first_xs])
            if layer is not None and eqn is layer.eqn:
                best = _LayerScan(length, carry, dots, named, flops)
    return best, attn_total


def _trace_step(info: ModelInfo, optimizer: GradientTransformation | None) -> StepTrace:
    opt = _optimizer(optimizer)
    args = info.trace_args()
    try:
        closed = jax.make_jaxpr(jax.value_and_grad(info.scalar_loss))(*args)
    except NameError as e:
        raise (unbound_axis_error(e, "plan") or e) from e
    forward = jax.make_jaxpr(info.scalar_loss)(*args)

    def residuals(p: PyTree, b: PyTree, *state: PyTree) -> Callable:
        return jax.vjp(lambda p, b: info.scalar_loss(p, b, *state), p, b)[1]

    resid = jax.eval_shape(residuals, *args)
    resid_bytes = sum(_nbytes(x) for x in jax.tree.leaves(resid))
    param_bytes = sum(p.nbytes for p in info.params)
    batch_bytes = sum(_nbytes(x) for x in jax.tree.leaves(info.batch))
    abstract_opt = jax.eval_shape(opt.init, info.abstract_params)
    opt_bytes, other = _opt_bytes(info, abstract_opt)
    batch, seq, tokens = _batch_dims(info)
    dtypes = [np.dtype(p.dtype).itemsize for p in info.params if len(p.shape) >= 2]
    scan, attn_fwd = _layer_scan(forward.jaxpr)
    layer_resid = peak = 0.0
    if scan is not None:
        # Residuals stacked by the layer scan lead with its length; the stacked
        # parameters are among them (counted as parameters, not activations).
        stacked = sum(
            _nbytes(x) for x in jax.tree.leaves(resid) if x.ndim >= 2 and x.shape[0] == scan.layers
        )
        stacked_params = sum(p.nbytes for p in info.params if p.shape and p.shape[0] == scan.layers)
        layer_resid = max(stacked - stacked_params, 0) / scan.layers
        # The largest residual outside the layers (the logits) is live twice in
        # the backward pass: itself and its gradient.
        peak = max(
            (
                _nbytes(x)
                for x in jax.tree.leaves(resid)
                if not (x.ndim >= 2 and x.shape[0] == scan.layers)
            ),
            default=0,
        )
    attn_train = _jaxpr_flops(closed.jaxpr, batched_only=True)
    return StepTrace(
        flops=_jaxpr_flops(closed.jaxpr),
        resid_bytes=int(max(resid_bytes - param_bytes - batch_bytes, 0)),
        opt_bytes=opt_bytes,
        opt_other_bytes=other,
        tokens=tokens,
        batch_size=batch,
        seq_len=seq,
        act_itemsize=min(dtypes) if dtypes else 4,
        abstract_opt=abstract_opt,
        attn_flops=attn_train,
        layers=scan.layers if scan else 0,
        layer_resid=layer_resid,
        layer_carry=scan.carry if scan else 0.0,
        layer_dots=scan.dots if scan else 0.0,
        layer_named=scan.named if scan else {},
        layer_fwd_flops=scan.fwd_flops if scan else 0.0,
        attn_fwd_flops=attn_fwd,
        resid_peak=float(peak),
        state_bytes=sum(p.nbytes for p in info.state),
    )


def trace_step(info: ModelInfo, optimizer: GradientTransformation | None) -> StepTrace:
    """The model's train step traced abstractly (no FLOPs run, no device memory):
    FLOPs, residual bytes, optimizer state. Once per model and optimizer
    (``ModelInfo.memo``)."""
    return info.memo(("planner.trace", id(optimizer)), lambda: _trace_step(info, optimizer))


def train_step(
    info: ModelInfo,
    optimizer: GradientTransformation | None,
    recipe: Recipe = PLAIN,
    grad_specs: PyTree = None,
) -> Callable:
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` with
    the optimizer (default ``optax.adam``) and the recipe applied: the very
    function ``sk.train_step`` builds and ``sk.jit``/``train`` run
    (:func:`spmdkit.recipe.train_step`), so what is planned is what runs. A model
    with mutable state gets ``train_step(params, opt_state, state, batch) ->
    (params, opt_state, state, loss)``.
    ``grad_specs``: the gradients' shardings when the plan shards them (ZeRO-2).
    One function per model, optimizer and recipe (``ModelInfo.memo``), so
    propagations of it share jax's trace cache."""
    from spmdkit.recipe import train_step as recipe_step

    def make() -> Callable:
        return recipe_step(
            info.state_loss_fn if info.has_state else info.loss_fn,
            _optimizer(optimizer),
            recipe,
            grad_specs=grad_specs,
            has_state=info.has_state,
        )

    if grad_specs is not None:
        return make()
    return info.memo(("planner.step", id(optimizer), recipe), make)


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
    trace = ctx.trace
    carried = (candidate.param_specs(info.abstract_params), candidate.opt_specs(trace.abstract_opt))
    args = (info.abstract_params, trace.abstract_opt)
    roles: tuple[str, ...] = ("params", "opt_state")
    if info.has_state:  # the model's batch statistics: in and out of the step, no grads
        carried += (candidate.state_specs(info.abstract_state),)
        args += (info.abstract_state,)
        roles += ("state",)
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
    prop = propagate(
        train_step(info, optimizer, candidate.recipe, grad_specs),
        *args,
        info.batch,
        in_specs=in_specs,
        out_specs=out_specs,
        mesh=ctx.mesh,
        topology=ctx.topology,
        donate_argnums=tuple(range(len(args))),
        arg_roles=(*roles, "batch"),
    )
    # Compute time is the analytic model's (the traced FLOPs split by the layout,
    # at achievable rates, recomputation included); communication is the
    # propagated collectives, of which the analytic model's overlappable share
    # hides under compute; host offload traffic as the analytic model prices it.
    compute = analytic.compute_time_s
    share = analytic.hidden_comm_s / analytic.comm_time_s if analytic.comm_time_s else 0.0
    hidden = prop.comm_time_s * share
    host = analytic.comm_bytes.get("host_offload", 0) / ctx.topology.host_bandwidth
    comm_s = prop.comm_time_s + host
    step = compute + ctx.topology.exposed_comm(hidden, comm_s - hidden, compute)
    mem = prop.memory
    comm_bytes = {k: int(v) for k, v in sorted(prop.comm_bytes_by_kind.items())}
    if host:
        comm_bytes["host_offload"] = int(analytic.comm_bytes["host_offload"])
    return Cost(
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


def _activation(rules: LogicalRules, mesh: MeshLike, trace: StepTrace) -> Activation:
    sizes = axis_sizes(mesh)
    out: Activation = {}
    dims = {"batch": trace.batch_size, "seq": trace.seq_len if trace.seq_len > 1 else None}
    for name in BATCH_NAMES:
        chosen: tuple[str, ...] = ()
        for key, axes in rules.entries:
            if key != name:
                continue
            if axes is None:
                break
            if any(a in v for v in out.values() for a in axes):
                continue
            if dims.get(name) and dims[name] % math.prod(sizes[a] for a in axes):
                continue
            chosen = axes
            break
        out[name] = chosen
    return out


def _preset_tables(
    name: str, extra: RulesLike | None, mesh: MeshLike
) -> tuple[LogicalRules, LogicalRules]:
    """A preset's rule tables for the parameters and for their optimizer state
    (ZeRO-1/2: the fsdp table), ``extra`` rules first."""
    rules = preset_rules(name, mesh)
    if extra is not None:
        rules = rules.prepend(extra)
    opt_rules = preset_rules("fsdp", mesh) if name in ("zero1", "zero2") else rules
    if extra is not None and name in ("zero1", "zero2"):
        opt_rules = opt_rules.prepend(extra)
    return rules, opt_rules


def _rules_choice(
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
            d = spec_dims(g.pinned, len(g.shape))
            out.append(GroupLayout(d, d))
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
            if preset in ("zero1", "zero2"):
                odims = _merge(dims, odims)
        out.append(GroupLayout(dims, odims, grads_sharded=preset == "zero2" and odims != dims))
    return out


def _merge(dims: Dims, odims: Dims) -> Dims:
    used = {a for d in dims for a in d}
    return tuple(d + tuple(a for a in o if a not in used) for d, o in zip(dims, odims, strict=True))


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


def _batch_axis_choices(sizes: dict[str, int], batch_size: int) -> list[tuple[str, ...]]:
    axes = [a for a, s in sizes.items() if s > 1]
    out = []
    for r in range(len(axes), -1, -1):
        for combo in itertools.combinations(axes, r):
            if batch_size % math.prod(sizes[a] for a in combo) == 0:
                out.append(combo)
    return out


def _search(
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
    options: list[list[GroupLayout]] = []
    for g in groups:
        opts = []
        for dims in _layouts(g, sizes):
            opts.append(GroupLayout(dims, dims))
            z = _zero1(dims, g.shape, batch_axes, sizes)
            if z != dims:
                opts.append(GroupLayout(dims, z))
                opts.append(GroupLayout(dims, z, grads_sharded=True))
        options.append(opts)

    def gcost(i: int, o: GroupLayout) -> GroupCost:
        return group_cost(ctx, groups[i], o, batch_axes, seq_axes)

    pick = []
    for i, opts in enumerate(options):
        best = min(
            range(len(opts)), key=lambda j: (gcost(i, opts[j]).time, gcost(i, opts[j]).memory, j)
        )
        pick.append(best)
    choice = [options[i][j] for i, j in enumerate(pick)]
    cost = total(ctx, groups, choice, batch_axes, seq_axes)
    # Over budget: trade time for memory, best Δtime per byte saved first.
    for _ in range(4 * len(groups) * 8):
        if cost.peak_bytes <= budget:
            break
        best_move = None
        for i, opts in enumerate(options):
            cur = gcost(i, opts[pick[i]])
            for j, o in enumerate(opts):
                c = gcost(i, o)
                saved = cur.memory - c.memory
                if saved <= 0:
                    continue
                ratio = (c.time - cur.time) / saved
                if best_move is None or ratio < best_move[0]:
                    best_move = (ratio, i, j)
        if best_move is None:
            break
        _, i, j = best_move
        pick[i] = j
        choice[i] = options[i][j]
        cost = total(ctx, groups, choice, batch_axes, seq_axes)
    return choice, cost


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
_RECOST_OVER_BUDGET = 2.0

#: Auto adds micro-batches to a recipe until a plan fits within this share of the
#: budget (:meth:`_Planner.analytic_candidates`).
_FLAT_HEADROOM = 0.85

#: At most this many more candidates are re-costed by propagation in auto when
#: the best so far is one the analytic model alone priced (:meth:`recosted`).
_RECOST_MORE = 6

#: At most this many pipelined candidates are calibrated by propagation per plan.
_RECOST_PIPELINES = 4

#: The presets auto also pipelines (:meth:`_Planner.pipelined_on`).
_TP_PRESETS = ("megatron", "megatron_sp", "tp_fsdp")

#: The cost of a candidate not costed yet (never ranked).
_NO_COST = Cost(0.0, 0.0, 0.0, {}, {})

#: Pipelined candidates are also kept at their best within this share of the
#: budget (their analytic memory is calibrated upwards by propagation).
_PIPE_HEADROOM = 0.7

#: Micro-batch counts auto tries, smallest first (more only adds collectives).
_MICROBATCHES = (1, 2, 4, 8, 16)


@dataclass
class _Planner:
    """One :func:`plan` call: the model, its parameter groups, the mesh and the
    cost context every candidate is costed in."""

    mesh: MeshLike
    info: ModelInfo
    optimizer: GradientTransformation | None
    groups: list[ParamGroup]
    ctx: CostContext
    budget: float
    estimator: str
    pipe_memos: dict = field(default_factory=dict)

    def at(self, recipe: Recipe) -> CostContext:
        """The cost context under ``recipe`` (sharing the memo)."""
        return self.ctx if recipe == self.ctx.recipe else replace(self.ctx, recipe=recipe)

    def fits_batch(self, recipe: Recipe, batch_axes: tuple[str, ...]) -> bool:
        """Whether each data-parallel replica's batch splits into the micro-batches."""
        shards = math.prod(self.ctx.sizes[a] for a in batch_axes)
        local = self.ctx.trace.batch_size // max(shards, 1)
        return local % recipe.microbatches == 0 and local >= recipe.microbatches

    def costed(
        self,
        name: str,
        choice: list[GroupLayout],
        rules: LogicalRules | None,
        recipe: Recipe = PLAIN,
    ) -> Candidate:
        """A rule table's candidate, costed analytically under ``recipe``."""
        act = _activation(rules, self.mesh, self.ctx.trace)
        cost = total_cost(
            self.at(recipe), self.groups, choice, act.get("batch", ()), act.get("seq", ())
        )
        return Candidate(name, choice, act, rules, cost, recipe)

    def preset(self, name: str, extra: RulesLike | None, recipe: Recipe = PLAIN) -> Candidate:
        """A preset's candidate (``extra`` rules take priority)."""
        rules, opt_rules = _preset_tables(name, extra, self.mesh)
        return self.costed(
            name, _rules_choice(rules, opt_rules, self.groups, self.mesh, name), rules, recipe
        )

    def table(self, table: LogicalRules, recipe: Recipe = PLAIN) -> Candidate:
        """A user rule table's candidate."""
        return self.costed(
            "rules", _rules_choice(table, table, self.groups, self.mesh, None), table, recipe
        )

    def searched(self, recipe: Recipe = PLAIN) -> list[Candidate]:
        """The searched candidate for each choice of batch axes."""
        out = []
        ctx = self.at(recipe)
        for batch_ax in _batch_axis_choices(self.ctx.sizes, self.ctx.trace.batch_size):
            if not self.fits_batch(recipe, batch_ax):
                continue
            choice, cost = _search(ctx, self.groups, batch_ax, (), self.budget)
            act = {n: () for n in BATCH_NAMES}
            act["batch"] = batch_ax
            name = f"searched[batch={','.join(batch_ax) or '-'}]"
            out.append(Candidate(name, choice, act, None, cost, recipe))
        return out

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
        state, state_from = state_layout(
            self.info, params, c.rules, self.mesh if c.mesh is None else c.mesh
        )
        return Plan(
            mesh=self.mesh if c.mesh is None else c.mesh,
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
        )

    def propagated(self, c: Candidate) -> Candidate:
        """The candidate with its cost from propagating it through the train step
        (a pipelined one keeps its analytic cost: the stage program is not traced)."""
        if c.pipeline is not None:
            return c
        p = self.make_plan(c.name, c, None)
        return c._replace(
            cost=propagate_cost(self.info, self.optimizer, p, self.at(c.recipe), c.cost)
        )

    def final(self, strategy: str, c: Candidate) -> Plan:
        """The plan of one candidate, re-costed by the chosen estimator."""
        if self.estimator == "analytic":
            return self.make_plan(strategy, c, c.cost)
        return self.make_plan(strategy, c, self.propagated(c).cost)

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

    def recipes(self, fixed: Recipe | None) -> list[list[Recipe]]:
        """The recipes auto tries, in rounds: each round's micro-batch counts are
        tried smallest first and the next round (optimizer offload) only when no
        plan of the earlier ones fits."""
        if fixed is not None:
            return [[fixed]]
        dtypes: list[str | None] = [None]
        if any(np.dtype(g.dtype) == np.float32 for g in self.groups):
            dtypes.append("bfloat16")
        remats = ("none", "dots", "full") if self.ctx.trace.layers else ("none",)
        rounds = []
        for offload in (False, True):
            rounds.append(
                [
                    Recipe(remat=r, compute_dtype=d, microbatches=m, offload_opt=offload)
                    for r in remats
                    for d in dtypes
                    for m in _MICROBATCHES
                    if self.ctx.trace.batch_size % m == 0
                ]
            )
        return rounds

    def candidates(self, recipe: Recipe, extra: RulesLike | None) -> list[Candidate]:
        """Every preset and searched candidate under one recipe."""
        out: list[Candidate] = []
        for name in PRESETS:
            try:
                c = self.preset(name, extra, recipe)
            except UnknownLogicalAxisError:
                continue
            if self.fits_batch(recipe, c.activation.get("batch", ())):
                out.append(c)
        return out + self.searched(recipe)

    def analytic_candidates(self, extra: RulesLike | None, fixed: Recipe | None) -> list[Candidate]:
        """Candidates over the recipes (:meth:`recipes`): per remat policy and
        compute dtype, micro-batch counts grow only until some plan fits within
        :data:`_FLAT_HEADROOM` of the budget."""
        out: list[Candidate] = []
        for recipes in self.recipes(fixed):
            fits = False
            done: set[tuple] = set()
            for r in recipes:
                key = (r.remat, r.compute_dtype)
                if key in done:
                    continue
                cands = self.candidates(r, extra)
                out += cands
                if any(c.cost.peak_bytes <= self.budget for c in cands):
                    fits = True
                # more micro-batches until one fits with headroom: propagation
                # prices the step's memory above the analytic model (Llama-3 8B on
                # 8 GPUs: +12%), and auto re-costs the favourites (:meth:`recosted`)
                if any(c.cost.peak_bytes <= _FLAT_HEADROOM * self.budget for c in cands):
                    done.add(key)
            if fits:
                break
        return out

    def stages(self) -> tuple[str, ...] | None:
        """Per group, where it lives in a pipeline (:func:`~spmdkit.planner.pipecost.param_stages`);
        None when the model has no stacked layers to pipeline."""
        trace = self.ctx.trace
        if trace.layers < 2:
            return None
        found = self.info.memo(
            ("planner.stages", trace.layers),
            lambda: param_stages(
                self.info.loss_fn, self.info.abstract_params, self.info.batch, trace.layers
            ),
        )
        where = tuple(found.get(g.paths[0], "first") for g in self.groups)
        for g, w in zip(self.groups, where, strict=True):
            dim = g.logical.index("layers") if g.logical and "layers" in g.logical else 0
            if w == "layers" and (not g.shape or g.shape[dim] != trace.layers):
                return None
        return where if "layers" in where else None

    def pipelined(
        self, request: Pipeline | str, fixed: Recipe | None, extra: RulesLike | None = None
    ) -> list[Candidate]:
        """Pipelined candidates (:mod:`spmdkit.planner.pipesearch`): per pipe degree,
        recipe and batch axes, the layouts searched under the reference
        configuration, then every configuration costed with them; the best kept."""
        fixed_pipe = request if isinstance(request, Pipeline) else None
        where = self.stages()
        if where is None:
            if fixed_pipe is None:
                return []
            raise PipelineError(
                op="plan",
                must="a pipelined model has its layers stacked in one scan (nnx.scan, "
                "flax.linen.scan or jax.lax.scan over a params stack)",
                given=f"{self.info.name}: no layer scan whose stacked "
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
        recipes = {(r.remat, r.compute_dtype, r.save_names): r for r in self.recipes(fixed)[0]}
        base = [replace(r, microbatches=1) for r in recipes.values()]
        layers = self.ctx.trace.layers
        stages = fixed_pipe.stages if fixed_pipe is not None else None
        if fixed_pipe is not None:
            fixed_pipe.check_layers(layers, op="plan")
        out: list[Candidate] = []
        for mesh in pipe_meshes(self.mesh, layers, stages):
            for r in base:
                out += self.pipelined_on(mesh, where, r, fixed_pipe, extra)
        return out

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
        trace = self.ctx.trace
        inner = {a: s for a, s in sizes.items() if a != PIPE_AXIS}
        ctx = replace(self.ctx, mesh=mesh, sizes=sizes, recipe=recipe, memo=self.pipe_memo(mesh))
        groups = stage_groups(self.groups, where, p)
        out = []
        # a layer combining a micro-batch's rows (MoE's router statistics) runs
        # pipelined only without batch axes, unless the request computes it per
        # device's rows (the executor refuses it otherwise)
        local_stats = request is not None and request.local_statistics
        rows_apart = local_stats or not model_rows_combined(self.info)
        for batch_ax in _batch_axis_choices(inner, trace.batch_size):
            if math.prod(inner[a] for a in batch_ax) > 1 and not rows_apart:
                continue
            local = trace.batch_size // math.prod(inner[a] for a in batch_ax)
            configs = pipeline_configs(p, trace.layers, local, request)
            if not configs:
                continue
            found = self.pipe_search(ctx, groups, where, batch_ax, configs, inner)
            for choice, cost, pipe in found:
                full = [
                    _on_pipe(g, lay) if w == "layers" else lay
                    for g, lay, w in zip(self.groups, choice, where, strict=True)
                ]
                act = {n: () for n in BATCH_NAMES}
                act["batch"] = batch_ax
                name = f"searched[batch={','.join(batch_ax) or '-'}]"
                out.append(Candidate(name, full, act, None, cost, recipe, pipe, mesh))
        # the tensor-parallel presets' layouts on the other axes too: Megatron-LM's
        # pipelines keep tensor parallelism inside the node, which the per-group
        # search (each group's layout on its own) can miss; it covers the
        # data-parallel and FSDP layouts itself
        sub = _mesh_without(sizes, (PIPE_AXIS,))
        for name in _TP_PRESETS:
            try:
                tables = _preset_tables(name, extra, sub)
                c = self.pipelined_table(name, tables, mesh, recipe, request)
            except UnknownLogicalAxisError:
                continue
            if c is not None:
                out.append(c)
        return out

    def pipe_search(
        self,
        ctx: CostContext,
        groups: list[ParamGroup],
        where: tuple[str, ...],
        batch_ax: tuple[str, ...],
        configs: list[Pipeline],
        inner: dict[str, int],
    ) -> list[tuple[list[GroupLayout], Cost, Pipeline]]:
        """Stage layouts searched under the reference configuration
        (:func:`~spmdkit.planner.pipesearch.reference`, honouring the budget), then
        the best configuration with them, ``(choice, cost, pipeline)``, and the best
        within :data:`_PIPE_HEADROOM` of the budget when that is another one (the
        analytic model's memory is calibrated upwards later, :meth:`calibrated`)."""
        layers = ctx.trace.layers
        ref = reference(configs)
        rctx = replace(ctx, recipe=replace(ctx.recipe, microbatches=ref.microbatches))

        def cost_of(pipe: Pipeline, choice: Sequence[GroupLayout]) -> Cost:
            split = StageSplit(pipe, where, layers)
            return pipeline_cost(rctx, groups, choice, batch_ax, (), split)

        choice, _ = _search(
            rctx,
            groups,
            batch_ax,
            (),
            self.budget,
            total=lambda _c, _g, ch, _b, _s: cost_of(ref, ch),
            sizes=inner,
        )
        costed = [(cost_of(pipe, choice), i, pipe) for i, pipe in enumerate(configs)]
        cost, i, pipe = min(costed, key=lambda x: (*self.rank_cost(x[0]), x[1]))
        tight = self.budget * _PIPE_HEADROOM
        cost2, i2, pipe2 = min(costed, key=lambda x: (*self.rank_cost(x[0], tight), x[1]))
        out = [(choice, cost, pipe)]
        return out if i2 == i else [*out, (choice, cost2, pipe2)]

    def pipe_memo(self, mesh: MeshLike) -> dict:
        """The group-cost memo of one pipe mesh (shared by its recipes)."""
        return self.pipe_memos.setdefault(tuple(axis_sizes(mesh).items()), {})

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
            return self.ranked(self.recosted_pipelines(self.pipelined(pipeline, fixed, extra)))
        candidates = self.analytic_candidates(extra, fixed)
        if self.estimator == "propagate":
            # The three best candidates and the presets (plain recipe, or the fixed
            # one), re-costed on the traced step; a preset the analytic model puts
            # far over the budget is left out (no re-costing makes it fit).
            base = fixed or PLAIN
            ranked = sorted(range(len(candidates)), key=lambda i: (*self.rank(candidates[i]), i))
            keep = set(ranked[:3])
            keep |= {
                i
                for i, c in enumerate(candidates)
                if c.recipe == base
                and not c.name.startswith("searched")
                and c.cost.peak_bytes <= _RECOST_OVER_BUDGET * self.budget
            }
            candidates = self.recosted(candidates, keep)
        if pipeline is not None:
            candidates += self.recosted_pipelines(self.pipelined(pipeline, fixed, extra))
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
        memory seen so far applied to it), that one too (at most ``limit`` more);
        only the re-costed ones are kept. Where every analytic favourite turns out
        over the budget once propagated, this goes on to the candidates that fit
        (e.g. full recompute) instead of returning the smallest plan that cannot
        run."""
        recost = recost or self.propagated
        done = {i: recost(candidates[i]) for i in sorted(first)}
        scale = (1.0, 1.0)

        def grow(scale: tuple[float, float], i: int) -> tuple[float, float]:
            before, after = candidates[i].cost, done[i].cost
            return (
                max(scale[0], after.step_time_s / max(before.step_time_s, 1e-30)),
                max(scale[1], after.peak_bytes / max(before.peak_bytes, 1)),
            )

        for i in done:
            scale = grow(scale, i)

        def key(i: int) -> tuple:
            if i in done:
                return (*self.rank(done[i]), i)
            return (*self.rank_cost(candidates[i].cost, scale=scale), i)

        for _ in range(limit):
            top = min(range(len(candidates)), key=key)
            if top in done:
                break
            done[top] = recost(candidates[top])
            scale = grow(scale, top)
        return [done[i] for i in sorted(done)]

    def recosted_pipelines(self, candidates: list[Candidate]) -> list[Candidate]:
        """With the propagate estimator, pipelined candidates calibrated by
        propagation (:meth:`calibrated`), best first, until the best of them is a
        calibrated one (at most :data:`_RECOST_PIPELINES`, :meth:`recosted`); only
        the calibrated ones are kept, so they compete with propagated candidates on
        the same footing."""
        if self.estimator != "propagate" or not candidates:
            return candidates
        return self.recosted(list(candidates), set(), self.calibrated, _RECOST_PIPELINES)

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
            self.ctx, mesh=mesh, sizes=axis_sizes(mesh), recipe=recipe, memo=self.pipe_memo(mesh)
        )
        stage = [_without(lay, batch) for lay in choice]
        analytic = total_cost(ctx, self.groups, stage, (), seq)
        act = {n: () if n == "batch" else v for n, v in c.activation.items()}
        twin = Candidate(c.name, stage, act, None, analytic, recipe, mesh=mesh)
        prop = propagate_cost(
            self.info, self.optimizer, self.make_plan(c.name, twin, None), ctx, analytic
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
        """:func:`~spmdkit.planner.pipecost.pipeline_cost` of a pipelined candidate
        (its cost not read) whose layouts off the pipe axis are ``choice``."""
        assert c.pipeline is not None and c.mesh is not None
        where = self.stages()
        assert where is not None
        sizes = axis_sizes(c.mesh)
        pctx = replace(
            self.ctx, mesh=c.mesh, sizes=sizes, recipe=c.recipe, memo=self.pipe_memo(c.mesh)
        )
        split = StageSplit(c.pipeline, where, self.ctx.trace.layers)
        groups = stage_groups(self.groups, where, c.pipeline.stages)
        batch, seq = c.activation.get("batch", ()), c.activation.get("seq", ())
        return pipeline_cost(pctx, groups, choice, batch, seq, split, calibration=calibration)

    def pipelined_plan_cost(
        self,
        strategy: str | RulesLike,
        extra: RulesLike | None,
        recipe: Recipe | None,
        pipe: Pipeline,
    ) -> Cost:
        """The cost of a preset or rule table pipelined with ``pipe`` over this
        planner's mesh (:meth:`pipelined_table`), calibrated by propagation
        (:meth:`calibrated`) under the propagate estimator."""
        if isinstance(strategy, str):
            sub = _mesh_without(self.ctx.sizes, (pipe.axis,))
            tables = _preset_tables(strategy, extra, sub)
        else:
            table = LogicalRules.coerce(strategy)
            table = table if extra is None else table.prepend(extra)
            tables = (table, table)
        name = strategy if isinstance(strategy, str) else "rules"
        c = self.pipelined_table(name, tables, self.mesh, recipe or PLAIN, pipe)
        assert c is not None  # pipelined_plan checked the batch and the rows
        return self.calibrated(c).cost if self.estimator == "propagate" else c.cost

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
        preset = name if name in PRESETS else None
        choice = [
            _without(lay, (PLACEHOLDER_AXIS,))
            for lay in _rules_choice(rules, opt_rules, self.groups, sub, preset)
        ]
        act = {
            n: tuple(a for a in v if a in inner)
            for n, v in _activation(rules, sub, self.ctx.trace).items()
        }
        shards = math.prod(inner[a] for a in act.get("batch", ()))
        local_stats = request is not None and request.local_statistics
        if shards > 1 and not local_stats and model_rows_combined(self.info):
            return None
        configs = pipeline_configs(
            sizes[axis], self.ctx.trace.layers, self.ctx.trace.batch_size // shards, request
        )
        full = [
            _on_pipe(g, lay, axis) if w == "layers" else lay
            for g, lay, w in zip(self.groups, choice, where, strict=True)
        ]
        best: Candidate | None = None
        for pipe in configs:
            c = Candidate(name, full, act, rules, _NO_COST, recipe, pipe, mesh)
            c = c._replace(cost=self.pipelined_cost(c, choice))
            if best is None or self.rank(c) < self.rank(best):
                best = c
        return best

    def ranked(self, candidates: list[Candidate]) -> tuple[Candidate, list[Candidate]]:
        """The best candidate and the runner-ups (one per label), by :meth:`rank`."""
        ranked = sorted(range(len(candidates)), key=lambda i: (*self.rank(candidates[i]), i))
        best = candidates[ranked[0]]
        seen = {best.label}
        others = []
        for i in ranked[1:]:
            if candidates[i].label not in seen:
                seen.add(candidates[i].label)
                others.append(candidates[i])
        return best, others

    def auto_plan(
        self, extra: RulesLike | None, fixed: Recipe | None, pipeline: Pipeline | str | None = None
    ) -> Plan:
        """``strategy="auto"``'s plan: the best candidate, the others as
        alternatives; warns when none fits the budget."""
        best, others = self.auto(extra, fixed, pipeline)
        if best.cost.peak_bytes > self.budget:
            warnings.warn(
                f"plan(strategy='auto'): no candidate fits the memory budget of "
                f"{fmt_bytes(self.budget)} per device; chose {best.label!r}, the smallest "
                f"({fmt_bytes(best.cost.peak_bytes)}). Add devices, shard more axes, or lower "
                "the activation memory (a smaller batch per device, longer sequences "
                "split over devices).",
                stacklevel=3,  # the caller of plan()
            )
        out = self.make_plan("auto", best, best.cost)
        alternatives = tuple((c.label, c.cost) for c in others[:12])
        return replace(out, alternatives=alternatives, chosen=best.name)


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
    topology: Topology = DEFAULT_TOPOLOGY,
    peak_flops: float | None = None,
    init_args: tuple = (),
    estimator: str = "propagate",
    recipe: Recipe | None = None,
    names: Mapping[str, tuple | None] | None = None,
    strict: bool = False,
    axis_names: tuple[str, ...] = (),
    pipeline: Pipeline | str | None = None,
) -> Plan:
    """Plan a model's train step on a mesh.

    Traces forward + backward + optimizer state abstractly (once per model; no
    FLOPs, no device memory), then costs the strategy (module docstring).

    Args:
      model: a model spec (``spmdkit.models.get_model(name)``), an NNX module, a
        function returning one, a linen module, or a ``ModelInfo``.
      mesh: a ``Mesh`` (to run) or ``AbstractMesh`` (to plan).
      strategy: ``"auto"``, a preset name (:data:`PRESETS`), or a logical-rule
        table (``LogicalRules``, pairs, or a mapping).
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
      peak_flops: per-device FLOP/s for the compute term, overriding the
        topology's per-dtype achievable rates (ideal-peak accounting).
      init_args: linen only, ``module.init`` arguments after the rng.
      estimator: ``"propagate"`` (default): the plan's cost (and auto's final
        ranking of the presets and its best searched candidates) comes from
        propagating the specs through the traced train step
        (``spmdkit.propagation``); ``"analytic"``: the per-parameter model only
        (:mod:`spmdkit.planner.analytic`), fastest.
      recipe: the step's levers (:class:`~spmdkit.recipe.Recipe`: remat,
        compute dtype, micro-batches, optimizer offload). For a preset or rule
        table, default: the plain step. For ``"auto"``, default: searched with
        the layouts (remat none/dots/full, the params' dtype or bf16 compute,
        micro-batches until a plan fits, optimizer offload when nothing else
        fits); given, it is fixed.
      names: path glob → logical names, overriding the model's (fewer names than
        dims: the trailing dims unnamed, as flax pads); parameters without names
        get names inferred from their role in the traced step
        (:mod:`spmdkit.planner.naming`).
      strict: a tensor-parallel preset that leaves a weight off the model axes
        raises instead of warning.
      axis_names: collective axis names the model uses as if under ``pmap``
        (``nn.BatchNorm(axis_name="batch")``), bound around the loss
        (:func:`spmdkit.flax.model.bind_axis_names`).
      pipeline: with a preset or rule table, a :class:`~spmdkit.pipeline.Pipeline`
        pipelines the stacked layers over ``pipeline.axis``: the strategy is
        planned on the other axes and the ``layers`` dim goes on the pipe axis
        (:mod:`spmdkit.planner.pipelined`). With ``"auto"``: ``"auto"`` also
        costs pipelined plans (pipe degree, virtual stages, micro-batches and
        schedule searched with the layouts and recipes; a mesh without a ``pipe``
        axis has its data axis split into ``pipe × data``,
        :mod:`spmdkit.planner.pipesearch`), a ``Pipeline`` searches layouts and
        recipes for that pipeline. ``None`` (default): no pipelines.

    Returns:
      The :class:`Plan`.

    Raises:
      PlanError: unknown strategy, a ``names`` glob matching nothing, or (``strict``)
        a weight a tensor-parallel preset replicates; UnknownLogicalAxisError: a
        logical name has no rule; PipelineError: a pipeline the mesh or model
        cannot run.

    Example::

        >>> from spmdkit.models import get_model
        >>> mesh = sk.abstract_mesh(data=64, model=8)
        >>> p = sk.plan(get_model("llama"), mesh, config="8b", batch_size=512)
        >>> print(p)  # doctest: +SKIP
    """
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
    if pipeline is not None and strategy != "auto":
        sub = pipeline_submesh(mesh, pipeline, info, recipe)
        kw = {"optimizer": optimizer, "rules": layer_rules(rules), "memory_budget": memory_budget}
        # the layouts only: the cost is the pipeline's (below)
        kw |= {"topology": topology, "peak_flops": peak_flops, "estimator": "analytic"}
        base = plan(info, sub, strategy, recipe=recipe, names=names, strict=strict, **kw)
        out = pipelined_plan(info, mesh, pipeline, base)
        named, _ = apply_names(info, names, lambda: infer_names(info))
        planner = _planner(named, mesh, optimizer, topology, peak_flops, memory_budget, estimator)
        return replace(out, cost=planner.pipelined_plan_cost(strategy, rules, recipe, pipeline))
    if recipe is not None and not isinstance(recipe, Recipe):
        raise PlanError(
            op="plan",
            must="recipe is a spmdkit.Recipe or None",
            given=type(recipe).__name__,
            fix="pass recipe=sk.Recipe(remat='full', compute_dtype='bfloat16', ...)",
        )
    info, names_from = apply_names(info, names, lambda: infer_names(info))
    planner = _planner(info, mesh, optimizer, topology, peak_flops, memory_budget, estimator)
    fixed = recipe or PLAIN
    if isinstance(strategy, str) and strategy != "auto":
        out = replace(
            planner.final(strategy, planner.preset(strategy, rules, fixed)), names_from=names_from
        )
        check_placement(out, lambda: infer_names(info), strict=strict)
        return out
    if not isinstance(strategy, str):
        table = LogicalRules.coerce(strategy)
        if rules is not None:
            table = table.prepend(rules)
        return replace(planner.final("rules", planner.table(table, fixed)), names_from=names_from)
    if pipeline is not None and not (pipeline == "auto" or isinstance(pipeline, Pipeline)):
        raise PlanError(
            op="plan",
            must="pipeline is None, 'auto' or a spmdkit.pipeline.Pipeline",
            given=repr(pipeline),
            fix="pass pipeline='auto' or Pipeline(stages=..., microbatches=...)",
        )
    return replace(planner.auto_plan(rules, recipe, pipeline), names_from=names_from)


def _planner(
    info: ModelInfo,
    mesh: MeshLike,
    optimizer: GradientTransformation | None,
    topology: Topology,
    peak_flops: float | None,
    memory_budget: float | None,
    estimator: str,
) -> _Planner:
    if estimator not in ("propagate", "analytic"):
        raise PlanError(
            op="plan",
            must="estimator is 'propagate' or 'analytic'",
            given=repr(estimator),
            fix="pass estimator='propagate' (default) or 'analytic'",
        )
    trace = trace_step(info, optimizer)
    groups = param_groups(info, trace)
    raw = sum(param_flops(g, trace.tokens) * g.count for g in groups)
    matmul = trace.flops - trace.attn_flops
    ctx = CostContext(
        mesh=mesh,
        sizes=axis_sizes(mesh),
        topology=topology,
        trace=trace,
        peak_flops=None if peak_flops is None else float(peak_flops),
        flops_scale=(matmul / raw) if raw and matmul > 0 else 1.0,
    )
    budget = float(memory_budget) if memory_budget is not None else float(H100_MEMORY)
    return _Planner(mesh, info, optimizer, groups, ctx, budget, estimator)

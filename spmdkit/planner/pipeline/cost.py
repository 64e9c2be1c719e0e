"""The analytic cost of a pipelined plan: stages, bubble, held micro-batches, sends.

A pipelined candidate splits the model's stacked (scanned) layers over a
``pipe`` mesh axis of ``p`` devices (:class:`~spmdkit.pipeline.Pipeline`),
``v`` chunks per device, ``m`` micro-batches. Every other mesh axis lays out the
layers inside a stage as the usual per-group layouts do. This module prices
such a candidate with the per-group model of :mod:`spmdkit.planner.analytic`:

- **Where parameters work** (:func:`param_stages`): the forward pass is split
  at its layer scan. Parameters the scan slices (its stacked operands) are
  split over the stages along their layer dim; parameters used before it (the
  embedding) compute on the first stage, those used after it (final norm, head,
  loss) on the last, a parameter used on both sides (tied embeddings) on both.
  The plan's specs leave the pipe axis off the parameters outside the stack, so
  every device *holds* them, and their gradients (non-zero only where they were
  used) are all-reduced over the pipe axis (overlappable, like other gradient
  reductions).
- **Per stage** (:func:`stage_groups`): each device's layer groups hold
  ``L / p`` layers; a stage is costed as a model of ``L / p`` layers that sees
  every token of the step (all micro-batches pass through it): params, grads,
  optimizer state and the collectives of the other axes are
  :func:`~spmdkit.planner.analytic.total_cost`'s for that stage's groups, with
  ``m`` micro-batches and FSDP as the executor runs it
  (:attr:`~spmdkit.planner.analytic.CostContext.gather_once`): the stage's
  weights gathered over their FSDP axes once per step and held, their gradients
  accumulated at full size and reduce-scattered once (neither overlapped). The
  parameters outside the stack are priced the same way (the head runs inside the
  pipeline; the embedding, which runs before it, is over-counted).
- **Stage imbalance**: the first stage adds the embedding's work, the last the
  head's and the loss's (for Llama-3 70B the head's matmul is ~1.2 layers); the step runs
  at the pace of the slowest stage.
- **Bubble**: the slowest stage's compute is stretched by the schedule's idle
  share, ``compute / (1 − bubble)``, the bubble being the tick table's
  (:attr:`~spmdkit.pipeline.Schedule.bubble_fraction` = ``(p − 1) / (v·m + p − 1)``).
- **Activations per schedule** (:func:`activation_bytes`): the executor's
  buffers, counted by :func:`spmdkit.pipeline.memory.stage_buffers` (what
  ``plan.verify`` predicts a compiled pipelined step with): one program runs on
  every device of the pipe axis, so each holds the busiest device's stash slots
  (the schedule's peak of in-flight (micro-batch, chunk) pairs,
  :func:`held_activations`), a tick's working sets and the inboxes;
  GPipe every forward tick's residuals, head and chunk weights. A residual set
  is ``L / (p·v)`` layers × the per-layer bytes the recipe's remat keeps, for
  one micro-batch of ``batch / (data shards × m)`` sequences; with remat one
  layer's residuals live again while it is recomputed, and the loss's peak (the
  logits' gradient) is added.
- **Point-to-point**: each send moves one micro-batch's stage activation (the
  layer scan's carry) to the neighbouring device, over the pipe axis's link
  (:meth:`~spmdkit.topology.Topology.link`: a pipe axis spanning nodes uses the
  inter-node bandwidth); the busiest device's sends are on the critical path
  (Megatron-LM's default, no overlap), counted as ``collective_permute``.

- **Uneven layouts** (:attr:`~spmdkit.pipeline.Pipeline.layout`; the executor
  pads each chunk to the largest and skips the padded layers): device ``d``
  computes its chunks' layers (plus the first or last stage's extra work), every
  device holds the busiest device's stacked
  layers (one program runs on all), the buffers are sized for the largest chunk,
  and the bubble is ``p − 1`` ticks of the slowest chunk (:func:`_uneven_part`).
  The end stages' extra work, in layers (:func:`end_layers`), is what auto
  balances its uneven layouts against.

Memory per device is the largest over the pipe axis (:attr:`Cost.stage_memory`
lists each device's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import jax
from jax.extend.core import Jaxpr, Var

from spmdkit import jaxprs
from spmdkit.pipeline import Action, Pipeline, Schedule, build_schedule, device_orders
from spmdkit.pipeline.layer_scan import LayerScan, find_layer_scan
from spmdkit.pipeline.memory import StageSizes, stage_buffers
from spmdkit.planner.analytic import (
    CostContext,
    GroupLayout,
    ParamGroup,
    StepTrace,
    group_cost,
    param_flops,
    total_cost,
)
from spmdkit.planner.float8 import cast_ratio, layer_residuals
from spmdkit.planner.plans import Cost, PyTree
from spmdkit.planner.stored import stored_group
from spmdkit.state import cached
from spmdkit.step.recipe import Recipe
from spmdkit.util import path_str

__all__ = [
    "StageSplit",
    "Where",
    "activation_bytes",
    "end_layers",
    "held_activations",
    "most_sends",
    "param_stages",
    "pipeline_cost",
    "schedule_of",
    "stage_groups",
]

#: Where a parameter lives in a pipeline: split over the stages with the layer
#: stack, on the first stage, on the last, or on both ends (tied embeddings).
Where = Literal["layers", "first", "last", "both"]


@cached(maxsize=512, why="a pipeline configuration's tick table.")
def schedule_of(pipe: Pipeline) -> Schedule:
    """:func:`~spmdkit.pipeline.build_schedule`, memoized per configuration."""
    return build_schedule(pipe)


# -- which parameters live on which stage -----------------------------------------------


def _subs(eqn: Any) -> list[Jaxpr]:
    return [jaxprs.open_jaxpr(sub)[0] for sub in jaxprs.sub_jaxprs(eqn)]


def _stages_in(jaxpr: Jaxpr, label: dict[Var, set[int]], layer: LayerScan) -> dict[int, str]:
    """Per param index, ``"layers"``/``"first"``/``"last"``/``"both"``, for a jaxpr whose
    input vars carry the param indices they depend on (``label``)."""
    deps: dict[Any, set[int]] = dict(label)

    def of(v: Any) -> set[int]:
        return deps.get(v, set()) if isinstance(v, Var) else set()

    out: dict[int, set[str]] = {}
    seen_scan = False
    for eqn in jaxpr.eqns:
        ins = [of(v) for v in eqn.invars]
        union: set[int] = set().union(*ins) if ins else set()
        if eqn is layer.eqn:
            seen_scan = True
            for i, s in enumerate(ins):
                side = "first" if i in layer.carried else "layers"
                for k in s:
                    out.setdefault(k, set()).add(side)
            union = set()  # the stack's outputs are activations, not parameters
        elif not seen_scan and any(c is eqn for c in layer.calls):
            seen_scan = True
            sub = _subs(eqn)[0]
            inner = _stages_in(sub, dict(zip(sub.invars, ins, strict=False)), layer)
            for k, side in inner.items():
                out.setdefault(k, set()).add(side)
            union = set()
        else:
            side = "last" if seen_scan else "first"
            for s in ins:
                for k in s:
                    out.setdefault(k, set()).add(side)
        for v in eqn.outvars:
            deps[v] = union
    return {k: _merge_sides(s) for k, s in out.items()}


def _merge_sides(sides: set[str]) -> str:
    if "layers" in sides:
        return "layers"
    if sides == {"first"}:
        return "first"
    if sides == {"last"}:
        return "last"
    return "both"


def param_stages(loss_fn: Any, abstract_params: PyTree, batch: PyTree, layers: int) -> dict:
    """Param path → :data:`Where` it lives in a pipeline, from the forward jaxpr.

    The forward is split at its layer scan (:func:`~spmdkit.pipeline.layer_scan.
    find_layer_scan` of ``layers`` iterations, the one the executor splits):
    parameters the scan slices are
    split over the stages; those feeding its carry (through the embedding) or
    used before it live on the first stage, those used after it on the last.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        abstract_params: the params as ``ShapeDtypeStruct`` leaves.
        batch: an (abstract) batch.
        layers: the layer scan's length (:attr:`StepTrace.layers`).

    Returns:
        Path → ``"layers"``, ``"first"``, ``"last"`` or ``"both"``; an unused
        parameter is ``"first"``.
    """
    closed = jax.make_jaxpr(loss_fn)(abstract_params, batch)
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    paths = [path_str(kp) for kp, _ in flat]
    label = {v: {i} for i, v in enumerate(closed.jaxpr.invars[: len(paths)])}
    layer = find_layer_scan(closed.jaxpr, layers=layers)
    if layer is None:
        return {p: "first" for p in paths}
    found = _stages_in(closed.jaxpr, label, layer)
    return {p: found.get(i, "first") for i, p in enumerate(paths)}


# -- the stage view ----------------------------------------------------------------------


def _layer_dim(g: ParamGroup) -> int:
    logical = g.logical or ()
    return logical.index("layers") if "layers" in logical else 0


@dataclass(frozen=True)
class StageSplit:
    """A pipeline and where each parameter group lives in it.

    Attributes:
        pipe: the configuration (stages, virtual, micro-batches, schedule, axis).
        where: per parameter group (the planner's order), its :data:`Where`.
        layers: the stacked layer count ``L`` (``p · v`` divides it, or the
            pipe's layout sums to it).
    """

    pipe: Pipeline
    where: tuple[str, ...]
    layers: int

    def on_device(self, d: int) -> list[int]:
        """Indices of the groups pipe-axis device ``d`` holds."""
        last = self.pipe.stages - 1
        keep = {"layers", "both"}
        if d == 0:
            keep.add("first")
        if d == last:
            keep.add("last")
        return [i for i, w in enumerate(self.where) if w in keep]


def stage_groups(
    groups: Sequence[ParamGroup], where: Sequence[str], stages: int, held: int | None = None
) -> list:
    """The groups as one pipe-axis device holds them: layer groups with ``L / p``
    layers on their layer dim (``held`` of them when given: an uneven layout's
    busiest device's), and their optimizer state likewise; others whole."""
    out = []
    for g, w in zip(groups, where, strict=True):
        if w != "layers":
            out.append(g)
            continue
        i = _layer_dim(g)
        n = g.shape[i] // stages if held is None else held
        opt = g.opt_bytes // stages if held is None else g.opt_bytes * held // g.shape[i]
        out.append(replace(g, shape=(*g.shape[:i], n, *g.shape[i + 1 :]), opt_bytes=opt))
    return out


def _relayered(g: ParamGroup, n: int) -> ParamGroup:
    """A stage group with ``n`` layers on its layer dim (optimizer state likewise)."""
    i = _layer_dim(g)
    opt = g.opt_bytes * n // g.shape[i] if g.shape[i] else 0
    return replace(g, shape=(*g.shape[:i], n, *g.shape[i + 1 :]), opt_bytes=opt)


def _layers_trace(trace: StepTrace, held: int) -> StepTrace:
    """The trace of ``held`` of the stack's layers (an uneven layout's device)."""
    k = held / trace.layers
    return replace(
        trace,
        layers=held,
        resid_bytes=int(max(trace.resid_bytes - (trace.layers - held) * trace.layer_resid, 0)),
        attn_flops=trace.attn_flops * k,
        layer_fwd_flops=trace.layer_fwd_flops * k,
        attn_fwd_flops=trace.attn_fwd_flops * k,
        attn_fused_fwd_flops=trace.attn_fused_fwd_flops * k,
        attn_causal_fwd_flops=trace.attn_causal_fwd_flops * k,
        attn_kv_bytes=trace.attn_kv_bytes * k,
    )


def _stage_trace(trace: StepTrace, stages: int) -> StepTrace:
    """The trace of one stage's layers (FLOPs and per-layer facts of ``L / p`` layers)."""
    held = trace.layers // stages
    return replace(
        trace,
        layers=held,
        resid_bytes=int(max(trace.resid_bytes - (trace.layers - held) * trace.layer_resid, 0)),
        attn_flops=trace.attn_flops / stages,
        layer_fwd_flops=trace.layer_fwd_flops / stages,
        attn_fwd_flops=trace.attn_fwd_flops / stages,
        attn_fused_fwd_flops=trace.attn_fused_fwd_flops / stages,
        attn_causal_fwd_flops=trace.attn_causal_fwd_flops / stages,
        attn_plain_fwd_flops=trace.attn_plain_fwd_flops / stages,
        attn_plain_scores=trace.attn_plain_scores / stages,
        attn_plain_live=trace.attn_plain_live / stages,
        attn_kv_bytes=trace.attn_kv_bytes / stages,
    )


def _per_microbatch(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> tuple[float, float]:
    """``(activation, carry)`` scale from global-batch bytes to one micro-batch on one
    device: the compute itemsize, the batch/sequence shards, ``m``, and (activations
    only) the share tensor parallelism splits (as :mod:`~spmdkit.planner.analytic`)."""
    sizes, trace, recipe = ctx.sizes, ctx.trace, ctx.recipe
    shards = math.prod(sizes[a] for a in (*batch_axes, *seq_axes))
    scale = recipe.compute_itemsize(trace.act_itemsize) / trace.act_itemsize
    base = scale / shards / recipe.microbatches
    tp_weight = flops = 0.0
    for g, layout in zip(groups, choice, strict=True):
        tp_weight += group_cost(ctx, g, layout, batch_axes, seq_axes).tp_weight
        flops += param_flops(g, trace) * ctx.flops_scale * g.count
    tp_frac = tp_weight / flops if flops else 0.0
    tp_split = 1.0 if seq_axes else 1 - 0.5 * tp_frac
    return base * tp_split, base


def _kept_per_layer(trace: StepTrace, recipe: Recipe) -> float:
    """Device bytes per layer the recipe's remat policy keeps (offloaded values
    are on the host)."""
    full = layer_residuals(trace, recipe)
    if recipe.remat == "none":
        return full
    return min(trace.layer_carry + trace.saved_bytes(recipe)[0], full)


@cached(maxsize=512, why="each device's order of actions under a pipeline configuration.")
def _orders(pipe: Pipeline) -> tuple[tuple[Action, ...], ...]:
    return device_orders(pipe)


@cached(
    maxsize=512, why="the activations each device holds at its peak per pipeline configuration."
)
def held_activations(pipe: Pipeline) -> tuple[tuple[int, ...], int]:
    """Per device, the (micro-batch, chunk) activations it holds at its peak
    (``"gpipe"``: every forward tick, bubbles included), and how many of the
    last chunk's the last device holds at once (its head residuals).

    Counted on each device's order of actions (:func:`~spmdkit.pipeline.device_orders`:
    the tick table without its idle ticks, which hold nothing new), so equal to
    :attr:`~spmdkit.pipeline.Schedule.peak_in_flight` without building the table.
    """
    p, m, last = pipe.stages, pipe.microbatches, pipe.chunks - 1
    if pipe.schedule == "gpipe":
        # Autodiff through the forward tick scan keeps every tick's residuals
        # (v·m + p − 1 ticks when m >= p; circular chunks wait longer below that).
        ticks = schedule_of(pipe).ticks
        fwd = 1 + max(t for t, row in enumerate(ticks) for a in row if a and a.kind == "F")
        return (fwd,) * p, m
    held = []
    peak_last = 0
    for order in _orders(pipe):
        n = peak = n_last = 0
        for a in order:
            n += 1 if a.kind == "F" else -1
            peak = max(peak, n)
            if a.chunk == last:
                n_last += 1 if a.kind == "F" else -1
                peak_last = max(peak_last, n_last)
        held.append(peak)
    return tuple(held), peak_last


def most_sends(pipe: Pipeline) -> int:
    """The most point-to-point sends one device makes per step (as
    :attr:`~spmdkit.pipeline.Schedule.sends`): every micro-batch passes every
    chunk once each way, and each pass sends but the last chunk's forward and the
    first chunk's backward (device ``p − 1``'s and device 0's), so device ``d``
    makes ``m · (2v − [d = 0] − [d = p − 1])`` of them, whatever the schedule."""
    p, v, m = pipe.stages, pipe.virtual, pipe.microbatches
    return max(m * (2 * v - (d == 0) - (d == p - 1)) for d in {0, min(1, p - 1), p - 1})


def activation_bytes(
    trace: StepTrace,
    pipe: Pipeline,
    remat: str,
    save_names: tuple[str, ...],
    act_scale: float,
    carry_scale: float,
    *,
    chunk_weights: float = 0.0,
    compute_dtype: str | None = None,
    expert_kept: float = 0.0,
) -> tuple[float, ...]:
    """Activation bytes per pipe-axis device under ``pipe``'s schedule (module docstring).

    The executor's buffers (:func:`~spmdkit.pipeline.memory.stage_buffers`, the
    same count ``plan.verify`` predicts a compiled step with) of a residual set
    ``R`` = ``L / (p·v)`` layers × what the remat policy keeps, a head ``H`` (the
    residuals after the stack), a carry ``C``; plus one layer's residuals
    recomputed when rematting and the loss's peak (the logits' gradient). One
    program runs on every device of the pipe axis, so each allocates the same.

    Args:
        trace: the full model's trace (global batch, all ``L`` layers).
        pipe: the configuration.
        remat: the recipe's remat policy; ``save_names`` its saved names.
        act_scale: global-batch activation bytes → one micro-batch on one device.
        carry_scale: the same for the carry (not split by tensor parallelism).
        chunk_weights: one chunk's stacked weights on one device, in the compute
            dtype (GPipe keeps them per forward tick; the other schedules hold one
            chunk's gradients from a backward).
        compute_dtype: the recipe's (``"float8"``: a layer's residual set is the
            float8 step's, :func:`~spmdkit.planner.float8.layer_residuals`).
        expert_kept: bytes one layer's routed experts keep per micro-batch on
            one device beside the traced residuals, which hold only stand-ins
            for them (:func:`~spmdkit.planner.experts.stage_kept_bytes`): part
            of each residual set.

    Example: 8 layers whose input is 1 MiB and residuals 4 MiB per micro-batch
    and device, full remat, 1F1B over 4 stages: 4 stash slots of 2 layers × 1 MiB
    (8 MiB), a tick's two sets (4 MiB), 4 inbox slots of 1 MiB, one layer's 4 MiB
    recomputed and a 1 MiB logits' gradient: 21 MiB on every device.
    """
    p, v = pipe.stages, pipe.virtual
    recipe = Recipe(remat=remat, save_names=save_names, compute_dtype=compute_dtype)
    # an uneven layout's buffers are sized for its largest chunk
    chunk = max(pipe.layout) if pipe.uneven else trace.layers / (p * v)
    per_chunk = chunk * (_kept_per_layer(trace, recipe) * act_scale + expert_kept)
    recompute = layer_residuals(trace, recipe) * act_scale if remat != "none" else 0.0
    head = max(trace.resid_bytes - trace.layers * trace.layer_resid, 0.0) * act_scale
    sizes = StageSizes(
        residual=per_chunk,
        head=head,
        carry=trace.layer_carry * carry_scale,
        weights=chunk_weights,
    )
    held = sum(stage_buffers(pipe, sizes).values())
    return (held + recompute + trace.resid_peak * act_scale,) * p


def _p2p(ctx: CostContext, pipe: Pipeline, carry_bytes: float) -> tuple[float, float]:
    """``(seconds, bytes)`` of the busiest device's point-to-point sends."""
    sends = most_sends(pipe)
    if not sends or carry_bytes <= 0:
        return 0.0, 0.0
    bandwidth, latency = ctx.topology.link((pipe.axis,), ctx.mesh)
    return sends * (latency + carry_bytes / bandwidth), sends * carry_bytes


def pipeline_cost(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    split: StageSplit,
    calibration: tuple[float, float] | None = None,
) -> Cost:
    """The analytic :class:`~spmdkit.planner.plans.Cost` of a pipelined candidate.

    Args:
        ctx: the cost context on the mesh with the pipe axis; its recipe's
            micro-batches are ignored (the pipeline's count is used).
        groups: the stage groups (:func:`stage_groups`), in the planner's order.
        choice: their layouts over the mesh axes other than the pipe axis.
        batch_axes: mesh axes the batch is split over (not the pipe axis).
        seq_axes: mesh axes the sequence is split over.
        split: the pipeline and where each group lives.
        calibration: ``(communication, memory)`` factors that scale the stages'
            collectives (not the sends) and the memory, from propagating the same
            layouts without the pipe axis (``estimator`` then says
            ``"analytic+propagate"``).

    Returns:
        The cost; ``memory`` is the fullest pipe-axis device's, ``stage_memory``
        every device's, ``bubble_s`` the idle time the schedule adds.
    """
    pipe = split.pipe
    recipe = replace(ctx.recipe, microbatches=pipe.microbatches)
    p = pipe.stages
    stage = _stage_part(ctx, groups, choice, batch_axes, seq_axes, split)
    held, slow, sync_bytes = stage.held, stage.slow, stage.sync_bytes
    act_scale, carry_scale = stage.act_scale, stage.carry_scale
    chunk_weights = (
        stage.chunk_weights / pipe.virtual if stage.chunk_s is None else stage.chunk_weights
    )
    acts = activation_bytes(
        ctx.trace,
        pipe,
        recipe.remat,
        recipe.save_names,
        act_scale,
        carry_scale,
        chunk_weights=chunk_weights,
        compute_dtype=recipe.compute_dtype,
        expert_kept=stage.expert_kept,
    )
    stage_memory = tuple(int(_static(held) + a) for a in acts)
    peak_dev = max(range(p), key=lambda d: (stage_memory[d], -d))
    if stage.chunk_s is None:
        bubble_s = slow.compute_time_s * (p - 1) / (pipe.virtual * pipe.microbatches)
    else:  # an uneven layout: p − 1 ticks of its slowest chunk
        bubble_s = stage.chunk_s * (p - 1) / pipe.microbatches
    compute = slow.compute_time_s + bubble_s
    p2p_s, p2p_bytes = _p2p(ctx, pipe, ctx.trace.layer_carry * carry_scale)
    sync_s = ctx.topology.collective_time(
        "all_reduce", int(2 * sync_bytes * (p - 1) / p), p, (pipe.axis,), ctx.mesh
    )
    comm_k, mem_k = calibration or (1.0, 1.0)
    hidden = slow.hidden_comm_s * comm_k + sync_s
    colls = slow.comm_time_s * comm_k + sync_s
    step = compute + ctx.topology.exposed_comm(hidden, colls - hidden, slow.compute_time_s) + p2p_s
    comm_bytes = dict(slow.comm_bytes)
    if sync_bytes:
        comm_bytes["all_reduce"] = comm_bytes.get("all_reduce", 0) + int(sync_bytes)
    if p2p_bytes:
        # the stage sends, beside context parallelism's K/V ring
        comm_bytes["collective_permute"] = comm_bytes.get("collective_permute", 0) + int(p2p_bytes)
    memory = dict(held.memory)
    memory["activations"] = int(acts[peak_dev])
    return Cost(
        step_time_s=step,
        compute_time_s=compute,
        comm_time_s=colls + p2p_s,
        comm_bytes={k: int(v) for k, v in sorted(comm_bytes.items())},
        memory={k: int(v * mem_k) for k, v in memory.items()},
        estimator="analytic" if calibration is None else "analytic+propagate",
        hidden_comm_s=colls + p2p_s - (step - compute),
        stage_memory=tuple(int(v * mem_k) for v in stage_memory),
        bubble_s=bubble_s,
        ops=slow.ops,
    )


class _StagePart(NamedTuple):
    """What a pipelined candidate's cost shares with every schedule and virtual
    stage count of its micro-batch count (:func:`_stage_part`)."""

    held: Cost
    slow: Cost
    sync_bytes: float
    act_scale: float
    carry_scale: float
    chunk_weights: float
    #: an uneven layout's slowest chunk, all micro-batches (None: even chunks)
    chunk_s: float | None = None
    #: bytes one layer's routed experts keep per micro-batch on one device
    #: (:func:`~spmdkit.planner.experts.stage_kept_bytes`)
    expert_kept: float = 0.0


def _stage_part(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    split: StageSplit,
) -> _StagePart:
    """The stages' costs at ``split``'s micro-batch count (the schedule and the
    virtual stages only change the bubble, the held buffers and the sends),
    memoized in ``ctx.memo``: the planner costs many schedules per count."""
    pipe = split.pipe
    recipe = replace(ctx.recipe, microbatches=pipe.microbatches)
    key = _stage_key(ctx, groups, choice, batch_axes, seq_axes, split)
    key += (pipe.layout,) if pipe.uneven else ()
    hit = ctx.memo.get(key)
    if hit is not None:
        return hit
    if pipe.uneven:
        ctx.memo[key] = _uneven_part(ctx, groups, choice, batch_axes, seq_axes, split)
        return ctx.memo[key]
    sctx = replace(ctx, recipe=recipe, trace=_stage_trace(ctx.trace, pipe.stages), gather_once=True)
    groups = [stored_group(recipe, g) for g in groups]  # bf16 params, master in opt state
    p = pipe.stages

    def view(d: int) -> int:  # devices other than the two ends hold the same
        return d if d in (0, p - 1) else 1

    views = {view(d): split.on_device(view(d)) for d in range(p)}
    costs = {
        d: total_cost(sctx, [groups[i] for i in ix], [choice[i] for i in ix], batch_axes, seq_axes)
        for d, ix in views.items()
    }
    slow = max(costs.values(), key=lambda c: c.compute_time_s)
    out = _held_part(sctx, groups, choice, batch_axes, seq_axes, split, slow)
    ctx.memo[key] = out
    return out


def _stage_key(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    split: StageSplit,
) -> tuple:
    """``ctx.memo``'s key of what the stages cost at ``split``'s micro-batch count
    whatever the schedule, the virtual stages and an uneven layout (the memo is
    shared only by contexts of one mesh shape, topology and trace)."""
    recipe = replace(ctx.recipe, microbatches=split.pipe.microbatches)
    key = ("pipeline_stage", tuple(choice), batch_axes, seq_axes, split.where, split.pipe.stages)
    key += (recipe, tuple(g.key for g in groups), tuple(g.shape for g in groups))
    return (*key, tuple(ctx.sizes.items()))


def _layers_key(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    split: StageSplit,
) -> tuple:
    """``ctx.memo``'s key of the per-layer-count costs :func:`_layer_costs` shares."""
    return ("pipeline_layers", *_stage_key(ctx, groups, choice, batch_axes, seq_axes, split))


def _held_part(
    sctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    split: StageSplit,
    slow: Cost,
) -> _StagePart:
    """The :class:`_StagePart` of the stage context ``sctx`` (``groups`` as a
    device holds them) whose slowest device costs ``slow``: what it holds, the
    end stages' gradient sync, the per-micro-batch scales and a chunk's weights."""
    # Parameters outside the stack are replicated over the pipe axis (the plan's
    # specs leave it off them): every device holds them, and their gradients
    # (non-zero only on the stage that used them) are all-reduced over it.
    ends = [i for i, w in enumerate(split.where) if w != "layers"]
    ends_cost = total_cost(sctx, [groups[i] for i in ends], [choice[i] for i in ends], (), ())
    # reduced as accumulated: in float32 under bf16 compute
    wire = sctx.accumulator_ratio(groups[ends[0]].dtype) if ends else 1.0
    act_scale, carry_scale = _per_microbatch(sctx, groups, choice, batch_axes, seq_axes)
    stack = [i for i, w in enumerate(split.where) if w == "layers"]
    return _StagePart(
        held=total_cost(sctx, groups, choice, batch_axes, seq_axes),
        slow=slow,
        sync_bytes=ends_cost.memory["grads"] * wire,
        act_scale=act_scale,
        carry_scale=carry_scale,
        chunk_weights=_chunk_weights(sctx, groups, choice, stack, batch_axes, seq_axes),
        expert_kept=_expert_kept(sctx, groups, choice, stack, batch_axes, seq_axes),
    )


def _layer_costs(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    split: StageSplit,
) -> tuple[Callable[[int], tuple[CostContext, list[ParamGroup]]], Callable[[int, int], Cost]]:
    """``(at, cost)``: ``at(n)`` the stage context and groups of a device holding
    ``n`` stacked layers; ``cost(n, d)`` pipe-axis device ``d``'s cost holding ``n``
    (``d = -1``: the stack's groups alone), the devices between the ends alike.
    ``cost`` is memoized in ``ctx.memo`` per :func:`_stage_key`: the layouts of
    one micro-batch count (every virtual stage count, the end stages'
    rebalancing) share their devices' costs."""
    p, recipe = split.pipe.stages, replace(ctx.recipe, microbatches=split.pipe.microbatches)
    memo = ctx.memo.setdefault(_layers_key(ctx, groups, choice, batch_axes, seq_axes, split), {})
    # the stored groups depend on the recipe alone: shared by every choice
    keys = ("pipeline_stored", recipe, *((g.key, g.shape, g.dtype, g.opt_bytes) for g in groups))
    if keys not in ctx.memo:
        ctx.memo[keys] = [stored_group(recipe, g) for g in groups]
    stored = ctx.memo[keys]
    stack = [i for i, w in enumerate(split.where) if w == "layers"]

    def at(n: int) -> tuple[CostContext, list[ParamGroup]]:
        c = replace(ctx, recipe=recipe, trace=_layers_trace(ctx.trace, n), gather_once=True)
        where = zip(stored, split.where, strict=True)
        return c, [_relayered(g, n) if w == "layers" else g for g, w in where]

    def cost(n: int, d: int) -> Cost:
        view = d if d in (-1, 0, p - 1) else 1
        if (n, view) not in memo:
            c, gs = at(n)
            ix = stack if view < 0 else split.on_device(view)
            memo[n, view] = total_cost(
                c, [gs[i] for i in ix], [choice[i] for i in ix], batch_axes, seq_axes
            )
        return memo[n, view]

    return at, cost


def end_layers(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    split: StageSplit,
) -> tuple[float, float]:
    """The first and the last pipe-axis device's work besides their stacked layers
    (what runs before the stack, and after it: the embedding, a dense prefix, the
    head and the loss), in one stacked layer's compute time: what
    :func:`~spmdkit.planner.pipeline.search.with_ends` balances an uneven layout
    against. Arguments as :func:`pipeline_cost`'s (``groups`` whole or as a
    device holds them: each is re-layered)."""
    _, cost = _layer_costs(ctx, groups, choice, batch_axes, seq_axes, split)
    layer_s = cost(1, -1).compute_time_s
    if layer_s <= 0:
        return 0.0, 0.0
    first, last = (cost(1, d).compute_time_s - layer_s for d in (0, split.pipe.stages - 1))
    return max(first, 0.0) / layer_s, max(last, 0.0) / layer_s


def _uneven_part(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    split: StageSplit,
) -> _StagePart:
    """:func:`_stage_part` of an uneven layout (``split.pipe.layout``): each device
    computes its chunks' layers (the first also what runs before the stack, the
    last what runs after), holds the busiest device's (one program runs on every
    device); the slowest chunk, a layer's time by its count plus the end stages'
    extra work on the first and last chunks, sets the bubble."""
    pipe = split.pipe
    p = pipe.stages
    counts = pipe.device_layers(split.layers)
    at, cost = _layer_costs(ctx, groups, choice, batch_axes, seq_axes, split)
    layer_s = cost(1, -1).compute_time_s
    devices = {d: cost(counts[d], d) for d in range(p)}
    extra = {d: max(devices[d].compute_time_s - counts[d] * layer_s, 0.0) for d in (0, p - 1)}
    last = pipe.chunks - 1
    chunk_s = max(
        n * layer_s + (extra[0] if c == 0 else 0.0) + (extra[p - 1] if c == last else 0.0)
        for c, n in enumerate(pipe.layout or ())
    )
    slow = max(devices.values(), key=lambda c: c.compute_time_s)
    held = max(counts)
    memo = ctx.memo.setdefault(_layers_key(ctx, groups, choice, batch_axes, seq_axes, split), {})
    if ("held", held) not in memo:  # the busiest device's (slow only passes through)
        memo["held", held] = _held_part(*at(held), choice, batch_axes, seq_axes, split, slow)
    part = memo["held", held]
    weights = part.chunk_weights * max(pipe.layout or (1,)) / held
    return part._replace(slow=slow, chunk_weights=weights, chunk_s=chunk_s)


def _chunk_weights(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    stack: Sequence[int],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> float:
    """A stage's stacked weights (groups ``stack``) as it computes with them: whole
    over the FSDP axes (the executor's accumulators), in the compute dtype."""
    return sum(
        group_cost(ctx, groups[i], choice[i], batch_axes, seq_axes).accumulators
        / ctx.accumulator_ratio(groups[i].dtype)
        * cast_ratio(ctx, groups[i])
        for i in stack
    )


def _expert_kept(
    ctx: CostContext,
    groups: Sequence[ParamGroup],
    choice: Sequence[GroupLayout],
    stack: Sequence[int],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> float:
    """What one stacked layer's routed experts keep per micro-batch on one device:
    per group of the stage's stack (``stack``: each sliced per layer by the layer
    scan), its call's (:func:`~spmdkit.planner.experts.stage_kept_bytes`)."""
    return sum(
        group_cost(ctx, groups[i], choice[i], batch_axes, seq_axes).stage_kept for i in stack
    )


def _static(c: Cost) -> float:
    return sum(v for k, v in c.memory.items() if k != "activations")

"""What the planner and ``plan.verify`` read about a pipelined loss.

- From the traced program: each pipelined gradient leaves a :data:`FACTS` marker
  (an equation without values) in the program it is traced into, and
  :func:`traced_pipelines` reads a :class:`PipelineFacts` per marker (a stage
  output's bytes, a chunk's residual set's, the head's; the batch axes; the
  unpipelined loss and its arguments' shapes).
- From the schedule: :func:`permute_count`, the collective permutes the executor
  runs, and :func:`branch_runs`, how often the branch under each action scope
  runs (``FORWARD_SCOPE``…: the ``jax.named_scope``s the ticks run under).
- From the loss: :func:`chunk_residuals` / :func:`residual_probe`, what one
  forward of one chunk stashes for one micro-batch (:func:`backward_probe`,
  :func:`pullback_probe`: its backward; :func:`expert_local_program`: any of
  them traced on one device's rows and experts, as an expert-parallel stage
  runs them); :func:`rows_combined`, a
  layer that combines a micro-batch's rows, which a pipeline with batch axes
  refuses (:func:`rows_error`) and the planner asks about before it plans one,
  and :func:`rows_loss_refused`, a loss that is not a mean over the rows;
  :func:`tokens_refused`, what a pipelined context-parallel step refuses
  (:mod:`spmdkit.pipeline.context_parallel`), asked by the planner the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir

from spmdkit import jaxprs
from spmdkit.context_parallel import ContextShard, context_shard
from spmdkit.expert_shard import ExpertShard, expert_shard
from spmdkit.pipeline.chunk import BoundLoss, VjpStash
from spmdkit.pipeline.context_parallel import rows_loss_combined, tokens_combined
from spmdkit.pipeline.layouts import (
    BatchSplit,
    ManualAxes,
    local_experts,
    local_rows,
    local_tokens,
    per_mb_rows_split,
    per_mb_seq_split,
    split_microbatches,
)
from spmdkit.pipeline.rows import mixed_rows
from spmdkit.pipeline.schedule import Pipeline, PipelineError, build_schedule
from spmdkit.pipeline.split import SplitLoss, split_loss
from spmdkit.pipeline.tables import build_tables, forward_ticks
from spmdkit.util import path_str

__all__ = [
    "BACKWARD_SCOPE",
    "FACTS",
    "FORWARD_SCOPE",
    "HEAD_SCOPE",
    "PipelineFacts",
    "backward_probe",
    "branch_runs",
    "chunk_residuals",
    "expert_local_program",
    "permute_count",
    "pullback_probe",
    "record_traced",
    "residual_probe",
    "rows_combined",
    "rows_error",
    "rows_loss_refused",
    "rows_split",
    "split_on_tokens",
    "split_rows_combined",
    "tokens_refused",
    "traced_pipelines",
    "TracedPipeline",
]

# -- collected while a pipelined gradient is traced ----------------------------------


@dataclass(frozen=True)
class PipelineFacts:
    """What a traced pipelined gradient sends and holds (global shapes: divide by
    the batch's shards for a device's share).

    Attributes:
      pipe: the pipeline.
      carry_bytes: one micro-batch's stage output (what one permute sends).
      residual_bytes: one chunk's residual set for one micro-batch (``R``).
      head_bytes: the head and loss's residuals for one micro-batch (``H``).
      batch_axes: the mesh axes the pipeline's ``shard_map`` makes manual besides
        the pipe axis (the batch rows' axes:
        :func:`~spmdkit.pipeline.execute.pipelined_value_and_grad`).
      loss_fn, args: the loss the pipeline runs and its arguments' shapes
        (params, batch, rest): the unpipelined step, whose layer scans
        ``plan.verify`` prices the stages' collectives from.
      layers: the stacked layer count.
      context_bytes: with context parallelism, one layer's forward collectives
        over the context axes for one micro-batch on one device, ``((kind,
        payload bytes), ...)``, as its stage traced them (attention's K/V
        gathers: :func:`spmdkit.context_parallel.context_shard`).
      expert_bytes: with expert parallelism over batch axes, one layer's forward
        collectives over them for one micro-batch on one device, ``((kind,
        payload bytes, whether the backward runs its transpose), ...)``, as its
        stage traced them (the routed experts' all-to-alls:
        :func:`spmdkit.expert_shard.expert_shard`).
      local_residual_bytes: with expert parallelism over batch axes, one chunk's
        residual set for one micro-batch on one device, from the per-device
        program the stages run (the routed experts' exchanged buffers and
        grouped GEMMs' outputs, which the global trace's regions hold only
        empty stand-ins for: :mod:`spmdkit.engine.region`); None otherwise
        (``residual_bytes`` over the batch's shards is a device's share).
      experts: with expert parallelism over batch axes, per parameter leaf its
        routed experts' split over them
        (:func:`~spmdkit.pipeline.layouts.expert_splits`: those weights enter
        the pipeline split and stay so) and the
        :class:`~spmdkit.expert_shard.ExpertShard` the stages are traced on
        (:func:`expert_local_program` traces a probe as they do); None without.
    """

    pipe: Pipeline
    carry_bytes: int
    residual_bytes: int
    head_bytes: int
    batch_axes: tuple[str, ...] = ()
    loss_fn: Callable | None = field(default=None, compare=False)
    args: tuple = field(default=(), compare=False)
    layers: int = 0
    context_bytes: tuple[tuple[str, float], ...] = ()
    expert_bytes: tuple[tuple[str, float, bool], ...] = ()
    local_residual_bytes: int | None = None
    experts: tuple[tuple[BatchSplit, ...], ExpertShard] | None = None


#: The marker a traced pipelined gradient leaves in its program: an equation with
#: no operands and no results, lowered to nothing, whose ``facts`` parameter is a
#: :class:`TracedPipeline`. :func:`traced_pipelines` reads them back from the traced
#: program: what the executor computes reaches ``plan.verify`` through the program
#: it returns, not through a side channel.
FACTS = jax.extend.core.Primitive("spmdkit_pipeline_facts")
FACTS.multiple_results = True
FACTS.def_impl(lambda **_: [])
FACTS.def_abstract_eval(lambda **_: [])
mlir.register_lowering(FACTS, lambda ctx, **_: [])
ad.primitive_jvps[FACTS] = lambda primals, tangents, **params: (FACTS.bind(**params), [])
batching.primitive_batchers[FACTS] = lambda args, dims, **params: (FACTS.bind(**params), [])
assert FACTS.name in jaxprs.MARKER_PRIMITIVES


class TracedPipeline:
    """What one traced pipelined gradient's marker carries: its facts, sized (two
    abstract traces of the loss) only when a reader asks (:meth:`facts`).

    Compared and hashed by identity, as jaxpr parameters are.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        pipe: Pipeline,
        carry_bytes: int,
        layers: int,
        batch_axes: tuple[str, ...],
        args: tuple,
        context_bytes: tuple[tuple[str, float], ...] = (),
        expert_bytes: tuple[tuple[str, float, bool], ...] = (),
        experts: tuple[tuple[BatchSplit, ...], ExpertShard | None] = ((), None),
    ) -> None:
        self._known = (loss_fn, pipe, carry_bytes, layers, batch_axes, args)
        self._exchanges = (context_bytes, expert_bytes)
        self._experts = experts
        self._facts: PipelineFacts | None = None

    def __repr__(self) -> str:
        return f"TracedPipeline({self._known[1].short()})"

    def facts(self) -> PipelineFacts:
        """The :class:`PipelineFacts`, residuals sized on the first call."""
        if self._facts is None:
            loss_fn, pipe, carry, layers, batch_axes, args = self._known
            r = _residuals_of(loss_fn, pipe, args)
            h = _residuals_of(loss_fn, pipe, args, head=True)
            splits, owner = self._experts
            experts = (tuple(splits), owner) if owner is not None else None
            local = None
            if experts is not None:

                def probe(env: list[tuple[str, int]], rest: tuple) -> Callable[[Any, Any], Any]:
                    return residual_probe(loss_fn, pipe, *rest, axis_env=env)

                local = _tree_bytes(expert_local_program(probe, args, experts).out_avals)
            self._facts = PipelineFacts(
                pipe,
                carry,
                _tree_bytes(r),
                _tree_bytes(h),
                batch_axes=batch_axes,
                loss_fn=loss_fn,
                args=args,
                layers=layers,
                context_bytes=self._exchanges[0],
                expert_bytes=self._exchanges[1],
                local_residual_bytes=local,
                experts=experts,
            )
        return self._facts


def traced_pipelines(traced: Any) -> list[PipelineFacts]:
    """The :class:`PipelineFacts` of every pipelined gradient in a traced program
    (a jaxpr or closed jaxpr, nested programs included), in program order: what
    ``plan.verify`` predicts a pipelined step from.

    Example::

        >>> seen = traced_pipelines(jax.make_jaxpr(step)(params, batch))
        >>> seen[0].pipe.short()
        'pp2 1f1b m4'
    """
    return [
        eqn.params["facts"].facts() for eqn, _ in jaxprs.walk_eqns(traced) if eqn.primitive is FACTS
    ]


def record_traced(
    loss_fn: Callable[..., Any],
    pipe: Pipeline,
    sp: SplitLoss,
    batch_axes: tuple[str, ...],
    args: tuple,
    context_bytes: tuple[tuple[str, float], ...] = (),
    expert_bytes: tuple[tuple[str, float, bool], ...] = (),
    experts: tuple[tuple[BatchSplit, ...], ExpertShard | None] = ((), None),
) -> None:
    """Leave a pipelined gradient's facts in the program being traced (``sp``: its
    loss split; ``args``: its params, batch and the rest; ``experts``: per
    parameter leaf its expert-parallel split and the
    :class:`~spmdkit.expert_shard.ExpertShard` the stages are traced on, None
    without expert parallelism): a :data:`FACTS` marker, read back by
    :func:`traced_pipelines`."""
    carry = [v.aval for v in sp.carry]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), args)
    recorded = TracedPipeline(
        loss_fn,
        pipe,
        _tree_bytes(carry),
        sp.layers,
        batch_axes,
        tuple(shapes),
        context_bytes,
        expert_bytes,
        experts,
    )
    FACTS.bind(facts=recorded)


def _residuals_of(
    loss_fn: Callable[..., Any], pipe: Pipeline, args: tuple, head: bool = False
) -> Any:
    """:func:`chunk_residuals` at argument shapes (``args``: params, batch, the rest)."""

    def probe(params: Any, batch: Any, *rest: Any) -> Any:
        return residual_probe(loss_fn, pipe, *rest, head=head)(params, batch)

    return jax.eval_shape(probe, *args)


def expert_local_program(
    make: Callable[[list[tuple[str, int]], tuple], Callable[[Any, Any], Any]],
    args: tuple,
    experts: tuple[tuple[BatchSplit, ...], ExpertShard],
    extra: Any = None,
) -> Any:
    """A probe of the loss (``make(axis_env, rest)``: ``f(params, batch[, extra])``, such as
    :func:`residual_probe` or :func:`backward_probe` given the axis
    environment and the step's other arguments) traced as one device's stage runs
    it under expert parallelism:
    on a device's rows and experts under :func:`~spmdkit.expert_shard.expert_shard`
    (the executor's per-device program,
    :func:`spmdkit.pipeline.execute.pipelined_value_and_grad`), so the routed
    experts' values are their per-device program's. ``args``: the step's
    params, batch and the rest (shapes); ``experts``:
    :attr:`PipelineFacts.experts`; ``extra``: shapes the probe takes as a third
    argument (None: none). Returns the closed jaxpr (per-device shapes)."""
    splits, owner = experts
    params, batch, *rest = args
    leaves, tree = jax.tree.flatten(params)
    mine = jax.tree.unflatten(tree, local_experts(leaves, list(splits), dict(owner.sizes)))
    rows = local_rows(batch, owner.token_shards)
    env = list(owner.sizes)

    def run(p: Any, b: Any, e: Any, *r: Any) -> Any:
        f = make(env, r)
        return f(p, b) if extra is None else f(p, b, e)

    with expert_shard(owner):
        return jax.make_jaxpr(run, axis_env=env)(mine, rows, extra, *rest)


def _tree_bytes(shapes: Any) -> int:
    """The bytes of a tree of arrays or shapes."""
    return int(sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes)))


# -- counted from the schedule -------------------------------------------------------

#: ``jax.named_scope`` names of a tick's actions (in the compiled program's op
#: names): a chunk's forward, its backward, and the head and loss (inside a
#: forward of the last chunk). A ``lax.switch`` branch runs on some ticks only,
#: which the compiled HLO does not say: ``plan.verify`` counts the collectives
#: under these scopes by the schedule (:func:`branch_runs`).
FORWARD_SCOPE = "spmdkit_pipeline_forward"
BACKWARD_SCOPE = "spmdkit_pipeline_backward"
HEAD_SCOPE = "spmdkit_pipeline_head"


def branch_runs(pipe: Pipeline) -> dict[str, tuple[int, int]]:
    """Per action scope: ``(runs on the busiest device, ticks the branch's loops
    run)`` per step. The compiled program's loops run a tick's ``lax.switch`` on
    every tick, and each branch's collectives are counted that often; a device
    runs ``m·v`` forwards and backwards among those ticks, and the head ``m``
    times (on the last stage). GPipe's backward is the transpose of its forward
    ticks (under the forward's scope).

    Example::

        >>> branch_runs(Pipeline(stages=2, microbatches=4))
        {'spmdkit_pipeline_forward': (4, 10), 'spmdkit_pipeline_backward': (4, 10),
         'spmdkit_pipeline_head': (4, 10)}
    """
    sched = build_schedule(pipe)
    ticks = forward_ticks(sched) if pipe.schedule == "gpipe" else build_tables(sched).n_ticks
    work = pipe.microbatches * pipe.virtual
    return {
        FORWARD_SCOPE: (work, ticks),
        BACKWARD_SCOPE: (work, ticks),
        HEAD_SCOPE: (pipe.microbatches, ticks),
    }


def permute_count(pipe: Pipeline) -> int:
    """Collective permutes the executor runs for ``pipe``: per run of ticks, its
    length times the permutes of its body (a forward send, a backward send);
    for GPipe, the forward ticks' sends, doubled by their transposes."""
    sched = build_schedule(pipe)
    if pipe.schedule == "gpipe":
        tables = build_tables(sched, ticks=forward_ticks(sched))
        return 2 * sum(tables.send_f)
    tables = build_tables(sched)
    return sum(int(f) + int(b) for f, b in zip(tables.send_f, tables.send_b, strict=True))


# -- sized from the loss -------------------------------------------------------------


def chunk_residuals(
    loss_fn: Callable[..., Any],
    pipe: Pipeline,
    params: Any,
    batch: Any,
    *rest: Any,
    head: bool = False,
) -> list[jax.ShapeDtypeStruct]:
    """What one forward of one chunk stashes for one micro-batch in the explicit
    schedules (``fthenb``, ``1f1b``, ``interleaved``): the chunk's ``jax.vjp``
    residuals less its weights and shared constants (global shapes; divide by
    the batch's shards for a device's share). The same set is what GPipe's
    differentiated scan keeps per forward tick. ``head=True``: instead, what the
    head and loss keep for one micro-batch (GPipe's scan keeps that per forward
    tick too, on every device: its ``cond`` saves the residuals of both branches).

    Example::

        >>> sum(r.size * r.dtype.itemsize for r in chunk_residuals(loss, pipe, params, batch))
        5242880
    """
    return jax.eval_shape(residual_probe(loss_fn, pipe, *rest, head=head), params, batch)


def residual_probe(
    loss_fn: Callable[..., Any],
    pipe: Pipeline,
    *rest: Any,
    head: bool = False,
    axis_env: list[tuple[str, int]] | None = None,
) -> Callable[[Any, Any], list]:
    """``f(params, batch) -> residuals``: :func:`chunk_residuals`'s leaves as a
    function of the step's arguments, for micro-batch 0 and chunk 0 (what
    ``plan.verify`` propagates with the plan's layouts to size them per device;
    ``axis_env``: the manual axes a per-device trace of the loss may name in
    collectives, as :func:`~spmdkit.pipeline.split.split_loss` takes them)."""

    def probe_fn(params: Any, batch: Any) -> list:
        ctx, w, cd, carry = _chunk_zero(loss_fn, pipe, rest, params, batch, axis_env or [])
        if head:
            post = [ctx.sv[v] if v in ctx.sv else ctx.microbatch(0)[v] for v in ctx.dpost]

            def f(c: list, dv: list) -> Any:
                vals = {**ctx.sv, **ctx.microbatch(0), **dict(zip(ctx.dpost, dv, strict=True))}
                return ctx.sp.post(vals, c)

            _, vjp = jax.vjp(f, carry, post)
            shared = [v in ctx.sv for v in ctx.dpost]
            return VjpStash().record(jax.tree.leaves(vjp), [], post, shared)
        _, vjp = jax.vjp(
            lambda w_, c_, x_: ctx.stage(w_, c_, x_, 0, _chunk_zero_count(pipe)), w, cd, carry
        )
        return VjpStash().record(jax.tree.leaves(vjp), w, cd, [v in ctx.sv for v in ctx.dconsts])

    return probe_fn


def backward_probe(
    loss_fn: Callable[..., Any],
    pipe: Pipeline,
    *rest: Any,
    axis_env: list[tuple[str, int]] | None = None,
) -> Callable[..., Any]:
    """``f(params, batch) -> gradients``: chunk 0's forward and backward for
    micro-batch 0 (its ``jax.vjp`` and the pullback of a cotangent of ones), as a
    function of the step's arguments. Propagated with the plan's layouts, its
    temporaries' peak is the residual set the backward reads plus its working
    set (the cotangents it makes, the chunk's weights as it slices them): what
    ``plan.verify`` sizes a backward tick's working set from
    (:attr:`~spmdkit.pipeline.memory.StageSizes.working`; ``axis_env``:
    :func:`residual_probe`'s)."""

    def probe_fn(params: Any, batch: Any) -> Any:
        ctx, w, cd, carry = _chunk_zero(loss_fn, pipe, rest, params, batch, axis_env)
        out, vjp = jax.vjp(
            lambda w_, c_, x_: ctx.stage(w_, c_, x_, 0, _chunk_zero_count(pipe)), w, cd, carry
        )
        return vjp(jax.tree.map(jnp.ones_like, out))

    return probe_fn


def pullback_probe(
    loss_fn: Callable[..., Any],
    pipe: Pipeline,
    *rest: Any,
    axis_env: list[tuple[str, int]] | None = None,
) -> Callable[..., Any]:
    """``f(params, batch, stash) -> gradients``: chunk 0's backward for micro-batch 0
    as a backward tick runs it (:mod:`spmdkit.pipeline.ticks`): the chunk's
    ``jax.vjp`` rebuilt from its stashed residuals (``stash``: the leaves
    :func:`residual_probe` returns) and the weights it reads again, applied to a
    cotangent of ones; the forward is traced apart, as a forward tick's branch
    is. The program's temporaries are what a backward makes beyond the set it
    reads, a recomputed forward's included (a probe running the forward too,
    :func:`backward_probe`, shares them with its forward). ``axis_env``:
    :func:`residual_probe`'s."""

    held = VjpStash()

    def forward(params: Any, batch: Any) -> list:
        ctx, w, cd, carry = _chunk_zero(loss_fn, pipe, rest, params, batch, axis_env)
        out, vjp = jax.vjp(
            lambda w_, c_, x_: ctx.stage(w_, c_, x_, 0, _chunk_zero_count(pipe)), w, cd, carry
        )
        leaves, held.tree = jax.tree.flatten(vjp)
        held.record(leaves, w, cd, [v in ctx.sv for v in ctx.dconsts])
        return out

    def probe_fn(params: Any, batch: Any, stash: list) -> Any:
        # the forward in a trace of its own (as a forward tick's branch is): only
        # the stash's structure is read from it
        out = jax.eval_shape(forward, params, batch)
        _, w, cd, _ = _chunk_zero(loss_fn, pipe, rest, params, batch, axis_env)
        ct = [jnp.ones(o.shape, o.dtype) for o in out]
        return held.rebuild(list(stash), w, cd)(ct)

    return probe_fn


def _chunk_zero(
    loss_fn: Callable[..., Any],
    pipe: Pipeline,
    rest: tuple,
    params: Any,
    batch: Any,
    axis_env: list[tuple[str, int]] | None = None,
) -> tuple[BoundLoss, list, list, list]:
    """Chunk 0 and micro-batch 0 of the loss split for ``pipe``: the bound loss,
    the chunk's stacked weights, its differentiated constants and its input
    (``axis_env``: :func:`residual_probe`'s)."""
    micro = split_microbatches(batch, pipe.microbatches)
    one = jax.tree.map(lambda x: x[0], micro)
    sp = split_loss(loss_fn, params, one, rest, axis_env=axis_env or [])
    size = pipe.check_layers(sp.layers, op="pipeline")
    xs, shared, per = sp.pre(jax.tree.leaves((params, one, rest)))
    ctx = BoundLoss(sp, pipe, shared, [x[None] for x in per])
    # an uneven layout's largest chunk, its layers run under the executor's skip
    w = [x[:size] for x in xs]
    cd = [({**ctx.sv, **ctx.microbatch(0)})[v] for v in ctx.dconsts]
    carry = [ctx.per[v][0] for v in ctx.carry]
    return ctx, w, cd, carry


def _chunk_zero_count(pipe: Pipeline) -> Any:
    """The layer count :func:`_chunk_zero`'s chunk runs with: an uneven layout's
    largest chunk's (the executor's ``lax.cond`` per layer, sized alike), None
    for equal chunks."""
    return jnp.int32(max(pipe.layout)) if pipe.uneven and pipe.layout else None


# -- the row-combining layer check ---------------------------------------------------


def rows_split(
    loss_fn: Callable[..., Any], params: Any, batch: Any, *rest: Any
) -> tuple[SplitLoss, SplitLoss, ManualAxes] | None:
    """The loss split on ``batch`` and on one of two devices' rows of it, and those
    two devices as manual batch axes: what :func:`rows_combined` and
    :func:`rows_loss_refused` read (the planner traces it once per model). None
    when ``batch`` (concrete or abstract) has no even number of rows.

    Raises:
      PipelineError: the loss has no layer scan, or its structure changes with
        its rows (:func:`~spmdkit.pipeline.execute.pipelined_value_and_grad`).
    """
    first = jax.tree.leaves(batch)
    rows = first[0].shape[0] if first and np.ndim(first[0]) else 0
    if rows < 2 or rows % 2:
        return None
    sp = split_loss(loss_fn, params, batch, rest)
    local = split_loss(loss_fn, params, local_rows(batch, 2), rest)
    return sp, local, ManualAxes("", ("rows",), 2, per_mb_rows_split(sp, local, 2))


def rows_combined(loss_fn: Callable[..., Any], params: Any, batch: Any, *rest: Any) -> str:
    """The first equation of the loss's layer stack that combines a batch's rows
    (:func:`~spmdkit.pipeline.rows.mixed_rows`), else ``""``: what a pipeline
    with the batch over other mesh axes refuses unless ``local_statistics``
    (the planner asks before it plans one). ``batch``: concrete or abstract,
    with an even number of rows (else ``""``: its rows cannot be split).

    Raises:
      PipelineError: as :func:`rows_split`.

    Example::

        >>> rows_combined(moe.loss_fn, moe.abstract_params, moe.batch)
        'reduce_sum over the rows'
    """
    split = rows_split(loss_fn, params, batch, *rest)
    return "" if split is None else split_rows_combined(split[0], split[2])


def rows_loss_refused(loss_fn: Callable[..., Any], params: Any, batch: Any, *rest: Any) -> str:
    """What makes the loss not a mean over a batch's rows
    (:func:`~spmdkit.pipeline.context_parallel.rows_loss_combined`, on two devices' rows),
    else ``""``: what a pipeline with the batch over other mesh axes refuses (the
    planner asks before it plans one). ``batch``: as for :func:`rows_combined`.

    Raises:
      PipelineError: as :func:`rows_split`.

    Example::

        >>> rows_loss_refused(masked_mean_loss, params, batch)
        'the loss: `div by a sum over the rows (a masked mean is one)`'
    """
    split = rows_split(loss_fn, params, batch, *rest)
    return "" if split is None else rows_loss_combined(*split)


def rows_error(equation: str, axes: tuple[str, ...], op: str) -> PipelineError:
    """The typed error for a layer that combines a micro-batch's rows (``equation``)
    in a pipeline with the batch over ``axes`` besides the pipe axis."""
    return PipelineError(
        op=op,
        must="with the batch split over other mesh axes too, each device runs "
        "its stages on its own rows of a micro-batch, so no layer may combine rows",
        given=f"a layer equation `{equation}` (the batch over {axes}), e.g. a "
        "mixture-of-experts router's load-balancing statistics",
        fix="pass Pipeline(..., local_statistics=True) (spmdkit train: "
        "--local-statistics) to compute it over each device's rows (as Megatron-LM "
        "computes MoE load balancing per "
        "data-parallel rank), or keep the batch off the other axes",
    )


def split_rows_combined(sp: SplitLoss, lay: ManualAxes) -> str:
    """With batch axes: the first equation of the layer scan's body that combines
    a micro-batch's rows (:func:`~spmdkit.pipeline.rows.mixed_rows`), else empty.
    The scan's inputs split over the rows have their rows on dim 0."""
    if not lay.batch:
        return ""
    row = dict(zip(sp.per_mb, lay.rows, strict=True))
    eqn = sp.scan
    sc = jaxprs.scan(eqn)
    inputs = [*sp.consts, *sp.carry]
    dims = [0 if not hasattr(v, "val") and row.get(v) else None for v in inputs]
    dims += [None] * (len(eqn.invars) - sc.first_xs)
    return mixed_rows(sc.body, dims) or ""


# -- the token check, before a pipelined context-parallel step is traced -------------


def split_on_tokens(
    loss_fn: Callable, args: tuple, shards: int, shard: ContextShard, seq_dims: Any
) -> tuple[SplitLoss, tuple]:
    """The loss split on a device's rows and tokens of one micro-batch (``args``:
    params, its shapes, rest), traced under :func:`spmdkit.context_parallel.context_shard`
    with the context axes bound, and the collectives its attention noted."""
    params, one, rest = args
    dims = jax.tree_util.tree_map_with_path(
        lambda path, x: (seq_dims or {}).get(path_str(path)), one
    )
    cut = local_tokens(local_rows(one, shards), dims, shard.shards)
    env = list(zip(shard.axes, shard.sizes, strict=True))
    with context_shard(shard) as exchanges:
        local = split_loss(loss_fn, params, cut, rest, axis_env=env)
    return local, tuple(exchanges)


def tokens_refused(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    pipe: Pipeline,
    batch_axes: tuple[tuple[str, ...], int],
    shard: ContextShard,
    seq_dims: Mapping[str, int],
) -> str:
    """What makes a pipelined context-parallel step differ from the global one
    (:func:`~spmdkit.pipeline.context_parallel.tokens_combined`, on the loss traced as the
    executor traces it), else ``""``: the planner asks before it plans one, as
    the executor refuses it when the step is traced.

    Args:
      loss_fn: ``loss_fn(params, batch)``, its layers a scan.
      params, batch: concrete or abstract (the whole step's batch).
      pipe: the pipeline (its micro-batch count splits the batch's rows).
      batch_axes: the batch axes beside the pipe axis and their device count.
      shard: the context axes, their sizes, order and attention.
      seq_dims: per batch leaf (its path) the dim holding the sequence.

    Raises:
      PipelineError: the loss has no layer scan, or the batch does not divide
        into the micro-batches and devices.

    Example::

        >>> tokens_refused(loss, params, batch, pipe, (("data",), 2), shard, {"tokens": 1})
        'the loss: `div by a sum over the tokens (a masked mean is one)`'
    """
    axes, shards = batch_axes
    one = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
        _abstract_microbatches(batch, pipe.microbatches),
    )
    sp = split_loss(loss_fn, params, one, ())
    local, _ = split_on_tokens(loss_fn, (params, one, ()), shards, shard, seq_dims)
    rows, seq = per_mb_seq_split(sp, local, shards, shard.shards)
    lay = ManualAxes(
        pipe.axis, axes, shards, rows, context=shard.axes, context_size=shard.shards, seq=seq
    )
    return tokens_combined(sp, local, lay)


def _abstract_microbatches(batch: Any, m: int) -> Any:
    """``split_microbatches``'s shapes: ``[m, rows / m, ...]`` per leaf."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
    return jax.eval_shape(lambda b: split_microbatches(b, m), shapes)

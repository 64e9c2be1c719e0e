"""Running a schedule: the loss's layer stack pipelined over the pipe axis.

:func:`pipelined_value_and_grad` is ``jax.value_and_grad`` of a loss whose
stacked layers run as a pipeline (what ``sk.value_and_grad(loss, plan)`` runs
when ``plan.pipeline`` is set):

1. The loss is cut at its layer scan (:func:`spmdkit.pipeline.split.split_loss`).
   The batch's leaves are split on their leading dim into ``m`` micro-batches
   (micro-batch ``i`` takes rows ``i, i + m, ...``, so a batch sharded on that
   dim stays put); the *pre* part (embedding) runs for every micro-batch
   outside the pipeline (unrolled), differentiated with ``jax.vjp``.
2. The layer stack runs under ``jax.shard_map`` manual over the pipe axis and
   the batch's axes (``batch_axes``: a device computes its own rows of each
   micro-batch, with its stages' weights gathered over those axes once, at the
   shard_map's input; other axes, e.g. a tensor-parallel one, stay automatic,
   laid out as the plan says). Every gradient is accumulated locally over the
   micro-batches and summed over the batch axes once, at the end of the step
   (the embedding's, from the rows' cotangents, in a second shard_map over the
   batch axes: :func:`_rows_grad`): reduce-scattered to the plan's gradient
   layout where it splits the weight over batch axes (FSDP, ZeRO-2:
   :func:`weight_splits`), all-reduced where it replicates it. Each device
   holds its chunks' stacked weights (``L / (p·v)`` layers per chunk, chunk
   ``c`` on device ``c mod p``; with ``v > 1`` the layer dim is regrouped into
   that order inside the step). A ``lax.scan`` over the schedule's ticks runs,
   per tick and device, the action of the tick table
   (:mod:`spmdkit.pipeline.tables`) under ``lax.switch``; activations move to
   the next device and cotangents to the previous one with ``ppermute``.
   Ticks are scanned in runs with the same sends, so each run's body has only
   the permutes it needs (a forward-only run has no backward permute): the
   compiled program runs ``sum(run length × permutes per tick)`` collective
   permutes, :func:`permute_count`.
3. The *post* part (head and loss) runs on the last chunk's device right
   after that chunk's forward of each micro-batch, so 1F1B starts backwards
   early; the loss is the mean of the micro-batch losses (the full batch's, for
   a mean loss).

Schedules:

- ``"gpipe"``: the forward ticks run as one differentiated scan, and
  ``jax.vjp`` of it gives the gradients: every tick's residuals (bubble ticks
  included) and every sent activation stay alive until the backward pass.
- ``"fthenb"``, ``"1f1b"``, ``"interleaved"``: the full tick table runs
  explicitly. A forward takes ``jax.vjp`` of its chunk and stashes the
  residuals (minus the chunk's weights, which the backward reads again) in a
  slot; the backward pulls them back, applies the cotangent and frees the slot.
  A device holds as many residual sets as the schedule's ``peak_in_flight``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit import jaxprs
from spmdkit.batch import stack_rows
from spmdkit.pipeline.rows import mixed_rows
from spmdkit.pipeline.schedule import Pipeline, PipelineError, build_schedule
from spmdkit.pipeline.split import SplitLoss, split_loss
from spmdkit.pipeline.tables import FIELDS, Tables, build_tables, forward_ticks

__all__ = [
    "BACKWARD_SCOPE",
    "FORWARD_SCOPE",
    "HEAD_SCOPE",
    "PipelineFacts",
    "accumulator_dtype",
    "batch_split",
    "branch_runs",
    "chunk_residuals",
    "param_sources",
    "permute_count",
    "pipelined_value_and_grad",
    "pipelines_traced",
    "residual_probe",
    "rows_combined",
    "rows_error",
    "split_microbatches",
    "weight_splits",
]


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
        the pipe axis (the batch rows' axes: :func:`pipelined_value_and_grad`).
      loss_fn, args: the loss the pipeline runs and its arguments' shapes
        (params, batch, rest): the unpipelined step, whose layer scans
        ``plan.verify`` prices the stages' collectives from.
      layers: the stacked layer count.
    """

    pipe: Pipeline
    carry_bytes: int
    residual_bytes: int
    head_bytes: int
    batch_axes: tuple[str, ...] = ()
    loss_fn: Callable | None = field(default=None, compare=False)
    args: tuple = field(default=(), compare=False)
    layers: int = 0


_TRACED: contextvars.ContextVar[list[PipelineFacts] | None] = contextvars.ContextVar(
    "spmdkit_pipelines_traced", default=None
)


@contextlib.contextmanager
def pipelines_traced() -> Iterator[list[PipelineFacts]]:
    """Collect the :class:`PipelineFacts` of the pipelined gradients traced inside
    (what ``plan.verify`` predicts a pipelined step from).

    Example::

        >>> with pipelines_traced() as seen:
        ...     jax.eval_shape(step, params, batch)
        >>> seen[0].pipe.short()
        'pp2 1f1b m4'
    """
    seen: list[PipelineFacts] = []
    token = _TRACED.set(seen)
    try:
        yield seen
    finally:
        _TRACED.reset(token)


def _nbytes(shapes: Any) -> int:
    return int(sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes)))


def split_microbatches(batch: Any, m: int) -> Any:
    """Each array leaf ``[B, ...]`` → ``[m, B/m, ...]`` (micro-batch ``i``: rows
    ``i, i+m, ...``; :func:`spmdkit.batch.split_rows`, the one split every
    accumulation uses).

    Raises:
      PipelineError: a leaf's leading dim does not divide into ``m``.
    """
    return stack_rows(batch, m, op="pipeline", error=PipelineError)


def _float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _zero_ct(x: Any) -> Any:
    if _float(x):
        return jnp.zeros(np.shape(x), jnp.result_type(x))
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _perms(pipe: Pipeline) -> tuple[list, list]:
    """Forward and backward ``ppermute`` pairs: a line for ``v = 1``, a ring otherwise."""
    p = pipe.stages
    fwd = [(d, (d + 1) % p) for d in range(p if pipe.virtual > 1 else p - 1)]
    return fwd, [(b, a) for a, b in fwd]


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


class _Ctx:
    """One trace of the pipelined loss: the split, the values and the helpers."""

    def __init__(
        self, sp: SplitLoss, pipe: Pipeline, shared: list, per: list, shards: int = 1
    ) -> None:
        self.sp, self.pipe = sp, pipe
        # the loss of a device's rows of a micro-batch, as a share of the step's
        self.scale = 1.0 / (pipe.microbatches * shards)
        self.sv = dict(zip(sp.shared, shared, strict=True))
        self.per = dict(zip(sp.per_mb, per, strict=True))
        self.carry = [v for v in sp.carry]
        for v in self.carry:
            if v not in self.per or not _float(v.aval.dtype):
                raise PipelineError(
                    op="pipeline",
                    must="the layer scan's carry is floating (the hidden state; an "
                    "accumulator such as an auxiliary loss)",
                    given=f"a carry of {v.aval}",
                    fix="carry the hidden state; pass other values as scan constants",
                )
        self.consts = [v for v in sp.consts if not hasattr(v, "val")]
        self.dconsts = [v for v in self.consts if _float(v.aval.dtype)]
        self.post_vars = [v for v in (*sp.shared, *sp.per_mb) if v not in self.carry]
        self.dpost = [v for v in self.post_vars if _float(v.aval.dtype) and v not in sp.consts]
        self.dshared = [v for v in sp.shared if _float(v.aval.dtype)]
        self.dper = [v for v in sp.per_mb if _float(v.aval.dtype)]

    def mb(self, i: Any) -> dict:
        return {v: x[i] for v, x in self.per.items()}

    def stage(self, w: list, cd: list, carry: list, i: Any) -> list:
        vals = {**self.sv, **self.mb(i), **dict(zip(self.dconsts, cd, strict=True))}
        return self.sp.stage(w, vals, carry)

    def post(self, i: Any, out: list) -> tuple:
        """``(loss_i · scale, ct of carry, {var: ct})`` of micro-batch ``i``'s head and
        loss (``scale``: ``1 / (m · batch shards)``, the device's rows' share)."""
        base = {**self.sv, **self.mb(i)}
        diff = [base[v] for v in self.dpost]

        def f(c: list, dv: list) -> Any:
            return self.sp.post({**base, **dict(zip(self.dpost, dv, strict=True))}, c)

        loss, vjp = jax.vjp(f, out, diff)
        ct_c, ct_v = vjp(jnp.asarray(self.scale, loss.dtype))
        return loss * self.scale, ct_c, ct_v


#: ``jax.named_scope`` names of a tick's actions (in the compiled program's op
#: names): a chunk's forward, its backward, and the head and loss (inside a
#: forward of the last chunk). A ``lax.switch`` branch runs on some ticks only,
#: which the compiled HLO does not say: ``plan.verify`` counts the collectives
#: under these scopes by the schedule (:func:`branch_runs`).
FORWARD_SCOPE = "spmdkit_pipeline_forward"
BACKWARD_SCOPE = "spmdkit_pipeline_backward"
HEAD_SCOPE = "spmdkit_pipeline_head"


def _scoped(name: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        def run(*args: Any) -> Any:
            with jax.named_scope(name):
                return fn(*args)

        return run

    return wrap


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


def _chunk(xs_l: list, j: Any, v: int) -> list:
    return [x[0] if v == 1 else x[j] for x in xs_l]


#: How a weight is split over the batch axes: per dim of the parameter it is
#: (a cast of), the batch axes that split it, ``((dim, axes), ...)``.
Split = tuple[tuple[int, tuple[str, ...]], ...]


@dataclass(frozen=True)
class _Manual:
    """The pipeline ``shard_map``'s manual axes: the pipe axis and the batch axes
    (``batch``, ``shards`` devices in all), which per-micro-batch values are
    split over the latter on their row dim (``rows``), how the stacked weights
    enter split over them (``xs_in``: gathered inside, once per step; GPipe's,
    whose gradients autodiff transposes from that gather), and how
    their gradients and the shared weights' leave (``xs_out``, ``sh_out``:
    reduce-scattered to those splits), as the plan lays them out
    (:func:`weight_splits`); empty: replicated over the batch axes. The shared
    weights enter replicated: XLA gathers them at the input, the same gather as
    the embedding's or the head's outside the pipeline (one all-gather, where
    one inside would be a second that propagation would price apart)."""

    axis: str
    batch: tuple[str, ...] = ()
    shards: int = 1
    rows: tuple[bool, ...] = ()
    xs_in: tuple[Split, ...] = ()
    xs_out: tuple[Split, ...] = ()
    sh_out: tuple[Split, ...] = ()

    @property
    def every(self) -> tuple[str, ...]:
        return (self.axis, *self.batch)

    def per_spec(self, row: bool) -> P:
        return P(None, self.batch) if row and self.batch else P()

    def xs_spec(self, split: Split) -> P:
        """A stacked weight's spec, regrouped ``[p, v, L/(p·v), ...]``."""
        return _split_spec((self.axis, None, None), split, skip=1)

    def reduce(self, g: Any, split: Split, offset: int, extra: tuple[str, ...] = ()) -> Any:
        """A gradient summed over the batch axes (and ``extra``): reduce-scattered
        over the axes of ``split`` (its dims shifted by ``offset``), all-reduced
        over the others."""
        for d, axes in split:
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=d + offset, tiled=True)
        done = {a for _, axes in split for a in axes}
        rest = (*extra, *(a for a in self.batch if a not in done))
        return jax.lax.psum(g, rest) if rest else g


def _split_spec(lead: tuple, split: Split, skip: int = 0) -> P:
    """``lead``, then per dim of the value from ``skip`` on, the axes splitting it."""
    if not split:
        return P(*lead)
    entries: list = [None] * (max(d for d, _ in split) + 1)
    for d, axes in split:
        entries[d] = axes
    return P(*lead, *entries[skip:])


def _gather(x: Any, split: Split, offset: int) -> Any:
    """A device's split of a weight gathered whole (dims shifted by ``offset``)."""
    for d, axes in split:
        x = jax.lax.all_gather(x, axes, axis=d + offset, tiled=True)
    return x


#: Primitives a weight may pass through between its parameter and the layer
#: scan keeping the parameter's layout (the compute-dtype cast).
_SAME_LAYOUT = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})


def batch_split(spec: Any, shape: tuple, batch: tuple[str, ...], sizes: dict, skip: int) -> Split:
    """The dims (from ``skip`` on) of a value laid out as ``spec`` that the batch
    axes split major-most, where they divide it (the part of the layout a
    ``shard_map`` manual over those axes can take as given).

    Example::

        >>> batch_split(P("pipe", ("data", "model")), (8, 16), ("data",), sizes, 1)
        ((1, ('data',)),)
    """
    out = []
    for d, entry in enumerate(tuple(spec or ())):
        if d < skip or entry is None or d >= len(shape):
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        k = 0
        while k < len(axes) and axes[k] in batch:
            k += 1
        n = int(np.prod([sizes[a] for a in axes[:k]]))
        if k and shape[d] % n == 0:
            out.append((d, axes[:k]))
    return tuple(out)


def param_sources(sp: SplitLoss) -> tuple[list[int | None], list[int | None]]:
    """Per stacked weight and per shared value of ``sp``: the parameter leaf it is
    (or is a cast of: ``convert_element_type``, ``copy``), else None."""
    jaxpr = sp.closed.jaxpr
    made = {o: e for e in jaxpr.eqns[: sp.index] for o in e.outvars}
    leaf = {v: i for i, v in enumerate(jaxpr.invars[: sp.n_params])}

    def source(v: Any) -> int | None:
        while v not in leaf and v in made and made[v].primitive.name in _SAME_LAYOUT:
            v = made[v].invars[0]
        return None if isinstance(v, jex.Literal) else leaf.get(v)

    return [source(v) for v in sp.xs], [source(v) for v in sp.shared]


def weight_splits(
    sp: SplitLoss, specs: list | None, batch: tuple[str, ...], sizes: dict
) -> tuple[tuple[Split, ...], tuple[Split, ...]]:
    """Per stacked weight and per shared value of ``sp``: how the parameter it
    is (or is a cast of) is split over the batch axes by ``specs`` (the
    parameters' ``PartitionSpec`` leaves). A value computed otherwise, or
    with no specs or batch axes, is taken replicated (``()``)."""
    if not specs or not batch:
        return (), ()
    xs_src, sh_src = param_sources(sp)

    def split(v: Any, i: int | None, skip: int) -> Split:
        if i is None:
            return ()
        return batch_split(specs[i], tuple(v.aval.shape), batch, sizes, skip)

    return (
        tuple(split(v, i, 1) for v, i in zip(sp.xs, xs_src, strict=True)),
        tuple(split(v, i, 0) for v, i in zip(sp.shared, sh_src, strict=True)),
    )


def accumulator_dtype(dtype: Any) -> np.dtype:
    """The dtype a gradient of ``dtype`` accumulates in over the micro-batches
    and is reduced in: float32 for narrower floats (bf16 compute: as Megatron-LM
    accumulates and reduces fp32 main gradients), else ``dtype``."""
    d = np.dtype(dtype)
    narrow = jnp.issubdtype(d, jnp.floating) and d.itemsize < 4
    return np.dtype(np.float32) if narrow else d


def _direct(cts: list, vals: list, sources: list) -> tuple[list, dict[int, Any]]:
    """Gradients accumulated wider than their values (:func:`accumulator_dtype`):
    those of a (cast) parameter go to it directly, at that precision, and the
    pre part's vjp gets zeros for them; the others are cast back for it."""
    out, direct = [], {}
    for ct, x, src in zip(cts, vals, sources, strict=True):
        dtype = jnp.result_type(x)
        if not _float(x) or jnp.result_type(ct) == dtype:
            out.append(ct)
        elif src is None:
            out.append(ct.astype(dtype))
        else:
            out.append(jnp.zeros(np.shape(x), dtype))
            direct[src] = direct[src] + ct if src in direct else ct
    return out, direct


def _outputs(ctx: _Ctx, pipe: Pipeline) -> list:
    """The buffers of the last stage's outputs (``pipe.return_output``): per carry
    value, one slot per micro-batch of a device's rows; empty otherwise."""
    if not pipe.return_output:
        return []
    return [jnp.zeros_like(ctx.per[v]) for v in ctx.carry]


def _keep_output(outs: list, row: dict, out: list) -> list:
    """A forward of the last chunk on the last stage writes its outputs to its
    micro-batch's slot; any other tick writes out of bounds (dropped)."""
    if not outs:
        return outs
    m = outs[0].shape[0]
    slot = jnp.where((row["kind"] == 1) & (row["last"] > 0), row["mb"], m)
    return _put(outs, slot, out)


def _gpipe_body(
    sp: SplitLoss,
    pipe: Pipeline,
    tables: Tables,
    lay: _Manual,
    dtypes: tuple[Sequence[Any], Sequence[Any]],
) -> Callable:
    """GPipe's forward ticks; the stacked weights and shared values may enter
    wider than ``dtypes`` (the fp32 parameters of bf16 casts) and are cast per
    tick, so autodiff accumulates their gradients over the ticks, and reduces
    them, at the wider dtype."""
    fperm, _ = _perms(pipe)
    axis = lay.axis

    def cast(vals: list, types: Sequence[Any]) -> list:
        return [v.astype(t) if _float(v) else v for v, t in zip(vals, types, strict=True)]

    def body(xs_local: list, shared_in: list, per: list) -> Any:
        # the carry's shapes and the outputs' buffers; a tick builds its own with
        # the shared values cast
        ctx = _Ctx(sp, pipe, shared_in, per, lay.shards)
        d = jax.lax.axis_index(axis)
        # the stacked weights gathered over the batch axes (their gradients,
        # autodiff's transpose of it: reduce-scattered)
        xs_l = [
            _gather(x[0], s, 1) for x, s in zip(xs_local, lay.xs_in or _none(xs_local), strict=True)
        ]
        shapes = [ctx.per[v][0] for v in ctx.carry]
        inbox = [jnp.zeros((tables.n_inbox_f + 1, *s.shape), s.dtype) for s in shapes]
        loss_dtype = ctx.sp.closed.out_avals[0].dtype

        @_scoped(FORWARD_SCOPE)
        def fwd(row: dict, inbox: list) -> tuple:
            # the shared values cast where a tick reads them (see the docstring)
            ctx = _Ctx(sp, pipe, cast(shared_in, dtypes[1]), per, lay.shards)
            i = row["mb"]
            x_in = [
                jnp.where(row["first"] > 0, ctx.per[v][i], b[row["f_in"]])
                for v, b in zip(ctx.carry, inbox, strict=True)
            ]
            cd = [({**ctx.sv, **ctx.mb(i)})[v] for v in ctx.dconsts]
            out = ctx.stage(cast(_chunk(xs_l, row["local"], pipe.virtual), dtypes[0]), cd, x_in, i)
            loss = jax.lax.switch(
                row["last"],
                [
                    lambda: jnp.zeros((), loss_dtype),
                    _scoped(HEAD_SCOPE)(
                        lambda: (
                            ctx.sp.post({**ctx.sv, **ctx.mb(i)}, out).astype(loss_dtype) * ctx.scale
                        )
                    ),
                ],
            )
            return out, loss

        def idle(row: dict, inbox: list) -> tuple:
            return [jnp.zeros_like(s) for s in shapes], jnp.zeros((), loss_dtype)

        def make_tick(send: bool) -> Callable:
            def tick(state: tuple, tab: Any) -> tuple:
                inbox, loss, outs = state
                row = {name: tab[k, d] for k, name in enumerate(FIELDS)}
                out, li = jax.lax.switch(row["kind"], [idle, fwd], row, inbox)
                outs = _keep_output(outs, row, out)
                if send:
                    recv = [jax.lax.ppermute(o, axis, fperm) for o in out]
                    inbox = [b.at[row["recv_f"]].set(r) for b, r in zip(inbox, recv, strict=True)]
                return (inbox, loss + li, outs), None

            return tick

        state = (inbox, jnp.zeros((), loss_dtype), _outputs(ctx, pipe))
        tab = jnp.asarray(tables.stacked())
        for start, stop, send, _ in tables.segments():
            state, _ = jax.lax.scan(make_tick(send), state, tab[start:stop])
        loss = jax.lax.psum(state[1], lay.every)
        if not pipe.return_output:
            return loss
        return loss, [jax.lax.psum(o, axis) for o in state[2]]

    return body


class _Probe:
    """What a chunk's ``jax.vjp`` keeps (found once per trace): the residuals'
    tree, and per leaf whether it is one of the chunk's weights or shared
    constants (read again in the backward, never stashed) or stashed."""

    def __init__(self) -> None:
        self.tree: Any = None
        self.source: list[tuple[str, Any]] = []

    def record(self, leaves: list, w: list, cd: list, shared: list) -> list:
        """The leaves to stash; the first call records where each leaf comes from."""
        source: list[tuple[str, Any]] = []
        keep = []
        for leaf in leaves:
            hit = next((("w", k) for k, x in enumerate(w) if leaf is x), None)
            hit = hit or next((("c", k) for k, x in enumerate(cd) if leaf is x and shared[k]), None)
            if hit is None:
                hit = ("s", len(keep))
                keep.append(leaf)
            source.append(hit)
        if self.source and [s[0] for s in source] != [s[0] for s in self.source]:
            raise PipelineError(  # pragma: no cover (jax's vjp is deterministic)
                op="pipeline",
                must="a chunk's residuals have one structure",
                given="two traces of the chunk that keep different residuals",
                fix="report this with the model",
            )
        self.source = source
        return keep

    def rebuild(self, stash: list, w: list, cd: list) -> Callable:
        """The chunk's vjp from the stashed leaves and the re-read weights/constants."""
        leaves = []
        for kind, key in self.source:
            leaves.append(w[key] if kind == "w" else cd[key] if kind == "c" else stash[key])
        return jax.tree.unflatten(self.tree, leaves)


def _effects(
    ctx: _Ctx, probe: _Probe, xs_l: list, state: dict, *, read_slot: bool = False
) -> tuple[Callable, Callable]:
    """The forward and backward actions of one tick, as functions of its row
    returning every effect (zeros for the other action's)."""
    pipe = ctx.pipe

    def inputs(row: dict) -> tuple:
        i = row["mb"]
        w = _chunk(xs_l, row["local"], pipe.virtual)
        cd = [({**ctx.sv, **ctx.mb(i)})[v] for v in ctx.dconsts]
        return i, w, cd

    @_scoped(FORWARD_SCOPE)
    def fwd(row: dict) -> dict:
        i, w, cd = inputs(row)
        x_in = [
            jnp.where(row["first"] > 0, ctx.per[v][i], b[row["f_in"]])
            for v, b in zip(ctx.carry, state["inbox_f"], strict=True)
        ]
        out, vjp = jax.vjp(lambda w_, c_, x_: ctx.stage(w_, c_, x_, i), w, cd, x_in)
        leaves, probe.tree = jax.tree.flatten(vjp)
        keep = probe.record(leaves, w, cd, [v in ctx.sv for v in ctx.dconsts])
        loss, ct_c, ct_l = jax.lax.switch(
            row["last"],
            [
                lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(ctx.post, i, out)),
                _scoped(HEAD_SCOPE)(lambda: ctx.post(i, out)),
            ],
        )
        ct_v = dict(zip(ctx.dpost, ct_l, strict=True))
        return {
            "send_f": out,
            "stash": keep,
            "loss": loss,
            "post_ct": ct_c,
            "dsh": [ct_v.get(v, jnp.zeros(v.aval.shape, v.aval.dtype)) for v in ctx.dshared],
            "dmb": [ct_v.get(v, jnp.zeros(v.aval.shape, v.aval.dtype)) for v in ctx.dper],
        }

    @_scoped(BACKWARD_SCOPE)
    def bwd(row: dict) -> dict:
        _, w, cd = inputs(row)
        ct = [b[row["b_in"]] for b in state["inbox_b"]]
        held = [s[row["stash"]] for s in state["stash"]]
        vjp = probe.rebuild(held, w, cd)
        dw, dc_l, dx = vjp(ct)
        dc = dict(zip(ctx.dconsts, dc_l, strict=True))
        first = row["first"] > 0
        dmb = []
        for v in ctx.dper:
            g = dc.get(v, jnp.zeros(v.aval.shape, v.aval.dtype))
            if v in ctx.carry:
                g = g + jnp.where(first, dx[ctx.carry.index(v)], 0)
            dmb.append(g)
        return {
            **({"stash": held} if read_slot else {}),
            "send_b": dx,
            "dw": _after(
                [dw[k] for k, x in enumerate(w) if _float(x)], state["g_xs"], row["local"]
            ),
            "dsh": [dc.get(v, jnp.zeros(v.aval.shape, v.aval.dtype)) for v in ctx.dshared],
            "dmb": dmb,
        }

    return fwd, bwd


def _after(dw: list, acc: list, slot: Any) -> list:
    """A backward's chunk gradients ``dw``, made to read the accumulators ``acc``
    (``+ 0 · acc[slot, 0]``, one layer's slice, which XLA does not fold away):
    the tick's ``lax.switch`` then waits for the previous tick's addition, so XLA
    cannot run several (unrolled) ticks' backwards before their additions and
    hold all their gradients. The slice is along the chunk and layer dims, which
    no automatic axis splits: no collective. (``x · 0`` is NaN for a non-finite
    ``x``: non-finite accumulators make every gradient non-finite, not just
    theirs.)"""
    return [d.at[0].add(0 * g[slot, 0].astype(d.dtype)) for d, g in zip(dw, acc, strict=True)]


def _add_at(bufs: list, slot: Any, vals: list) -> list:
    """``bufs[slot] += vals``, in the buffers' (accumulator) dtype. Outside the
    tick's ``lax.switch``: a branch that returned the updated accumulators would
    have its result copied (a conditional's result buffer is not its operand's)."""
    return [b.at[slot].add(x.astype(b.dtype)) for b, x in zip(bufs, vals, strict=True)]


def _full(shapes: dict, part: dict) -> dict:
    """``part`` with every missing effect as zeros."""
    out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    out.update(part)
    return out


def _put(bufs: list, slot: Any, vals: list) -> list:
    return [b.at[slot].set(x) for b, x in zip(bufs, vals, strict=True)]


def _add(bufs: list, slot: Any, vals: list) -> list:
    return [b.at[slot].add(x) for b, x in zip(bufs, vals, strict=True)]


def _apply(state: dict, eff: dict, row: dict) -> dict:
    """A tick's effects written into the device's buffers and accumulators (the
    weight gradients are accumulated inside the backward's branch). Only
    a forward writes the stash: any other tick's slot index is the stash's
    length, out of bounds, and a scatter drops it (so the stash has no trash
    slot)."""
    n_stash = state["stash"][0].shape[0] if state["stash"] else 0
    slot = jnp.where(row["kind"] == 1, row["stash"], n_stash)
    return {
        **state,
        "stash": _put(state["stash"], slot, eff["stash"]),
        "inbox_b": _put(state["inbox_b"], row["self_b"], eff["post_ct"]),
        "g_xs": _add_at(state["g_xs"], row["local"], eff["dw"]),
        "g_sh": [g + x.astype(g.dtype) for g, x in zip(state["g_sh"], eff["dsh"], strict=True)],
        "g_mb": _add(state["g_mb"], row["mb"], eff["dmb"]),
        "loss": state["loss"] + eff["loss"],
    }


def _explicit_body(
    sp: SplitLoss, pipe: Pipeline, tables: Tables, lay: _Manual, *, read_slot: bool = False
) -> Callable:
    """The 1F1B-family tick loop. ``read_slot``: a backward's stash effect is the
    slot it read (the branch's result buffer holds that set anyway) rather than
    zeros; only where every mesh axis is manual, since XLA reshards such a branch
    result over an automatic axis inside the branch, with a collective permute
    that deadlocks XLA:CPU."""
    fperm, bperm = _perms(pipe)
    axis = lay.axis

    def body(xs_local: list, shared: list, per: list) -> tuple:
        ctx = _Ctx(sp, pipe, shared, per, lay.shards)
        d = jax.lax.axis_index(axis)
        xs_l = [
            _gather(x[0], s, 1) for x, s in zip(xs_local, lay.xs_in or _none(xs_local), strict=True)
        ]
        probe = _Probe()
        carry = [ctx.per[v][0] for v in ctx.carry]
        state = {
            "inbox_f": [jnp.zeros((tables.n_inbox_f + 1, *c.shape), c.dtype) for c in carry],
            "inbox_b": [jnp.zeros((tables.n_inbox_b + 1, *c.shape), c.dtype) for c in carry],
            # the weights' gradients accumulate in float32 under bf16 compute
            "g_xs": [jnp.zeros(x.shape, accumulator_dtype(x.dtype)) for x in xs_l if _float(x)],
            "g_sh": [
                jnp.zeros(ctx.sv[v].shape, accumulator_dtype(ctx.sv[v].dtype)) for v in ctx.dshared
            ],
            "g_mb": [jnp.zeros_like(ctx.per[v]) for v in ctx.dper],
            "loss": jnp.zeros((), sp.closed.out_avals[0].dtype),
            "outs": _outputs(ctx, pipe),
        }
        row0 = {name: jnp.int32(0) for name in FIELDS}
        state["stash"] = []
        f_shape = jax.eval_shape(_effects(ctx, probe, xs_l, state)[0], row0)
        stash_shapes = f_shape["stash"]
        state["stash"] = [jnp.zeros((tables.n_stash, *s.shape), s.dtype) for s in stash_shapes]
        dw_shapes = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs_l if _float(x)]
        shapes = {**f_shape, "send_b": f_shape["send_f"], "dw": dw_shapes}

        def make_tick(send_f: bool, send_b: bool) -> Callable:
            def tick(st: dict, tab: Any) -> tuple:
                row = {name: tab[k, d] for k, name in enumerate(FIELDS)}
                f, b = _effects(ctx, probe, xs_l, st, read_slot=read_slot)
                eff = jax.lax.switch(
                    row["kind"],
                    [lambda r: _full(shapes, {}), lambda r: _full(shapes, f(r)),
                     lambda r: _full(shapes, b(r))],
                    row,
                )  # fmt: skip
                st = _apply(st, eff, row)
                st["outs"] = _keep_output(st["outs"], row, eff["send_f"])
                if send_f:
                    recv = [jax.lax.ppermute(x, axis, fperm) for x in eff["send_f"]]
                    st["inbox_f"] = [
                        buf.at[row["recv_f"]].set(r)
                        for buf, r in zip(st["inbox_f"], recv, strict=True)
                    ]
                if send_b:
                    recv = [jax.lax.ppermute(x, axis, bperm) for x in eff["send_b"]]
                    st["inbox_b"] = [
                        buf.at[row["recv_b"]].set(r)
                        for buf, r in zip(st["inbox_b"], recv, strict=True)
                    ]
                return st, None

            return tick

        tab = jnp.asarray(tables.stacked())
        for start, stop, sf, sb in tables.segments():
            state, _ = jax.lax.scan(make_tick(sf, sb), state, tab[start:stop])
        return _reduced(ctx, lay, state, xs_l)

    return body


def _reduced(ctx: _Ctx, lay: _Manual, state: dict, xs_l: list) -> tuple:
    """The explicit schedules' results, every gradient reduced here, once per
    step: the weights' over the batch axes (accumulated locally over the
    micro-batches until now), reduce-scattered to the plan's split of them."""
    sp, axis = ctx.sp, lay.axis
    psum = lambda x, axes=lay.every: jax.lax.psum(x, axes)  # noqa: E731
    xs_out = [s for s, x in zip(lay.xs_out or _none(xs_l), xs_l, strict=True) if _float(x)]
    g_xs = [lay.reduce(g, s, 1)[None] for g, s in zip(state["g_xs"], xs_out, strict=True)]
    sh_out = [
        s for s, v in zip(lay.sh_out or _none(sp.shared), sp.shared, strict=True)
        if v in ctx.dshared
    ]  # fmt: skip
    rows = [r for r, v in zip(lay.rows, sp.per_mb, strict=True) if v in ctx.dper]
    return (
        psum(state["loss"]),
        g_xs,
        [lay.reduce(g, s, 0, (axis,)) for g, s in zip(state["g_sh"], sh_out, strict=True)],
        [psum(g, (axis,) if r else lay.every) for g, r in zip(state["g_mb"], rows, strict=True)],
        [psum(o, (axis,)) for o in state["outs"]],
    )


def _regroup(x: Any, pipe: Pipeline) -> Any:
    """``[L, ...]`` → ``[p, v, L/(p·v), ...]``: device ``d``'s chunks ``d, d+p, ...``."""
    p, v = pipe.stages, pipe.virtual
    y = jnp.reshape(x, (v, p, x.shape[0] // (p * v), *x.shape[1:]))
    return jnp.swapaxes(y, 0, 1)


def _ungroup(g: Any) -> Any:
    y = jnp.swapaxes(g, 0, 1)
    return jnp.reshape(y, (y.shape[0] * y.shape[1] * y.shape[2], *y.shape[3:]))


def _none(values: Any) -> tuple:
    return ((),) * len(values)


def _shard_map(body: Callable, lay: _Manual, mesh: Any, out_specs: Any, n: tuple) -> Callable:
    in_specs = (
        [lay.xs_spec(s) for s in lay.xs_in or ((),) * n[0]],
        [P()] * n[1],
        [lay.per_spec(r) for r in lay.rows],
    )
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(lay.every),
        check_vma=False,
    )


def _run(
    sp: SplitLoss,
    pipe: Pipeline,
    mesh: Any,
    lay: _Manual,
    vals: tuple[list, list, list],
    wide: tuple[Sequence[Any], Sequence[Any]] = ((), ()),
) -> tuple:
    """``(loss, (ct xs, ct shared, ct per), outputs)`` of the pipelined layer stack
    and head (``sp``: the loss split on a device's rows of a micro-batch;
    ``outputs``: the last stage's, ``[m, rows, ...]`` per carry value, with
    ``pipe.return_output``, else None). ``wide``: per stacked weight and per
    shared value, the wider value it is a cast of (its fp32 parameter) or None;
    GPipe runs with those and returns their gradients at that dtype."""
    carry_specs = [
        lay.per_spec(next(r for u, r in zip(sp.per_mb, lay.rows, strict=True) if u is v))
        for v in (sp.carry if pipe.return_output else ())
    ]
    xs, shared, per = vals
    sched = build_schedule(pipe)
    xs_g = [_regroup(x, pipe) for x in xs]
    n = (len(xs), len(shared), len(per))
    if pipe.schedule == "gpipe":
        tables = build_tables(sched, ticks=forward_ticks(sched))
        specs = (P(), carry_specs) if pipe.return_output else P()
        dtypes = ([jnp.result_type(x) for x in xs], [jnp.result_type(x) for x in shared])
        w_xs, w_sh = (list(w) or [None] * len(v) for w, v in zip(wide, (xs, shared), strict=True))
        xs_g = [x if w is None else _regroup(w, pipe) for x, w in zip(xs_g, w_xs, strict=True)]
        sh_g = [x if w is None else w for x, w in zip(shared, w_sh, strict=True)]
        fn = _shard_map(_gpipe_body(sp, pipe, tables, lay, dtypes), lay, mesh, specs, n)
        res, vjp = jax.vjp(fn, xs_g, sh_g, per)
        loss, outputs = res if pipe.return_output else (res, None)
        ones = jnp.ones_like(loss)
        ct = ones if outputs is None else (ones, jax.tree.map(jnp.zeros_like, outputs))
        ct_xs, ct_sh, ct_per = vjp(ct)
        return (
            loss,
            (
                [_ungroup(g) if _float(g) else _zero_ct(x) for g, x in zip(ct_xs, xs, strict=True)],
                ct_sh,
                ct_per,
            ),
            outputs,
        )
    tables = build_tables(sched)
    ctx_probe = [_float(x) for x in xs]
    mb_specs = [lay.per_spec(r) for r, x in zip(lay.rows, per, strict=True) if _float(x)]
    xs_out = [lay.xs_spec(s) for s, f in zip(lay.xs_out or _none(xs), ctx_probe, strict=True) if f]
    sh_out = [_split_spec((), s) for s, x in zip(lay.sh_out or _none(shared), shared, strict=True)
              if _float(x)]  # fmt: skip
    out_specs = (P(), xs_out, sh_out, mb_specs, carry_specs)
    read_slot = all(size == 1 for name, size in mesh.shape.items() if name not in lay.every)
    body = _explicit_body(sp, pipe, tables, lay, read_slot=read_slot)
    loss, g_xs, g_sh, g_mb, outputs = _shard_map(body, lay, mesh, out_specs, n)(xs_g, shared, per)
    it_xs, it_sh, it_mb = iter(g_xs), iter(g_sh), iter(g_mb)
    ct_xs = [
        _ungroup(next(it_xs)) if f else _zero_ct(x) for x, f in zip(xs, ctx_probe, strict=True)
    ]
    ct_sh = [next(it_sh) if _float(x) else _zero_ct(x) for x in shared]
    ct_per = [next(it_mb) if _float(x) else _zero_ct(x) for x in per]
    return loss, (ct_xs, ct_sh, ct_per), (outputs if pipe.return_output else None)


def _mesh(plan_mesh: Any, axis: str) -> Any:
    ctx = jax.sharding.get_abstract_mesh()
    if not ctx.empty and axis in ctx.axis_names:
        return ctx
    return plan_mesh


def _batch_axes(mesh: Any, pipe: Pipeline, batch_axes: tuple[str, ...]) -> tuple[tuple, int]:
    """The batch axes of ``mesh`` (size > 1, not the pipe axis) and their device count."""
    sizes = dict(mesh.shape)
    axes = tuple(a for a in batch_axes if a != pipe.axis and sizes.get(a, 1) > 1)
    return axes, int(np.prod([sizes[a] for a in axes]))


def _local_rows(one: Any, shards: int) -> Any:
    """One micro-batch's leaves with a device's share of its rows."""

    def cut(x: Any) -> jax.ShapeDtypeStruct:
        if x.shape[0] % shards:
            raise PipelineError(
                op="pipeline",
                must="a micro-batch's rows split evenly over the batch axes' devices",
                given=f"a micro-batch leaf of shape {tuple(x.shape)} over {shards} devices",
                fix=f"use a batch size that is a multiple of microbatches × {shards}",
            )
        return jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]), x.dtype)

    return jax.tree.map(cut, one)


def _row_split(sp: SplitLoss, local: SplitLoss, shards: int) -> tuple[bool, ...]:
    """Per value of ``sp.per_mb``: is it split over the batch rows (its leading dim
    scales with them)? ``local`` is the loss split on a device's rows."""
    same = all(
        [v.aval for v in getattr(sp, k)] == [v.aval for v in getattr(local, k)]
        for k in ("xs", "shared")
    )
    rows = []
    for g, lo in zip(sp.per_mb, local.per_mb, strict=False):
        gs, ls = tuple(g.aval.shape), tuple(lo.aval.shape)
        split = bool(ls) and gs == (ls[0] * shards, *ls[1:])
        same = same and (gs == ls or split) and g.aval.dtype == lo.aval.dtype
        rows.append(split)
    if not same or len(sp.per_mb) != len(local.per_mb):
        raise PipelineError(
            op="pipeline",
            must="the loss traced on a device's rows of a micro-batch has the same "
            "structure, its per-micro-batch values split on their leading dim",
            given="a loss whose values change otherwise with the rows (a batch statistic, "
            "a reshape that mixes rows with other dims before the layer stack)",
            fix="keep the layer stack's inputs row-wise, or plan without a batch axis",
        )
    return tuple(rows)


def pipelined_value_and_grad(
    loss_fn: Callable[..., Any],
    pipe: Pipeline,
    mesh: Any,
    batch_axes: tuple[str, ...] = (),
    layouts: Callable[[Any], tuple[Any, Any]] | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss_fn)`` with the layer stack pipelined (module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)`` → the scalar mean loss over the
        batch's examples; its layers a scan over stacked parameters.
      pipe: the pipeline.
      mesh: the mesh with ``pipe.axis`` (the context mesh, under ``jax.set_mesh``,
        wins when it has that axis).
      batch_axes: the mesh axes the batch's rows are split over (a plan's
        ``activation["batch"]``). They are manual inside the pipeline too: a
        device runs its stages on its own rows of each micro-batch with the
        stage's weights gathered over them once per step (at the ``shard_map``'s
        input), accumulates its weight gradients locally over the micro-batches
        and sums them over these axes once, at the end of the step. The loss must
        be a mean over rows (as for micro-batches), and a layer that combines
        rows needs ``pipe.local_statistics``. Other axes stay automatic (a
        tensor-parallel ``model`` axis, an expert axis: XLA partitions the
        stage over it).
      layouts: ``layouts(params) -> (param specs, grad specs)``, trees like the
        params of ``PartitionSpec`` (a plan's ``param_specs`` and ``grad_specs``).
        A weight the specs split over batch axes (FSDP, ZeRO-2) is gathered
        over them once per step, and its gradient leaves reduce-scattered to
        its grad spec (rather than all-reduced and sliced: half the bytes).
        ``None``: their gradients are all-reduced over the batch axes.

    The loss is the mean of the micro-batches' losses, each micro-batch running
    the whole loss, as ``sk.value_and_grad``'s micro-batches do: a value the
    layer scan carries from a constant (an auxiliary loss summed over the
    layers) starts from it for every micro-batch and crosses the stages with it.

    Returns:
      ``f(params, batch, *rest) -> (loss, grads)``; ``rest`` is passed to every
      micro-batch and not differentiated. With ``pipe.return_output``:
      ``((loss, outputs), grads)``, ``outputs`` a list with the layer stack's
      final value of each carried value (the scan's carry: the hidden state, and
      any other value the layers carry) for every example, ``[batch, ...]`` in
      the batch's row order, as the last stage computed it.

    Raises:
      PipelineError: the loss has no layer scan of ``stages · virtual``-divisible
        length, the batch does not divide into the micro-batches, a value the
        scan carries is not floating, or (with batch axes) a layer combines a
        micro-batch's rows and ``pipe.local_statistics`` is off.

    Example::

        >>> f = pipelined_value_and_grad(loss, Pipeline(stages=2, microbatches=4), mesh)
        >>> loss_value, grads = jax.jit(f)(params, batch)
    """

    def grad_fn(params: Any, batch: Any, *rest: Any) -> tuple[Any, Any]:
        micro = split_microbatches(batch, pipe.microbatches)
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro)
        sp = split_loss(loss_fn, params, one, rest)
        pipe.check_layers(sp.layers, op="pipeline")
        run_mesh = _mesh(mesh, pipe.axis)
        axes, shards = _batch_axes(run_mesh, pipe, batch_axes)
        local = sp if shards == 1 else split_loss(loss_fn, params, _local_rows(one, shards), rest)
        p_specs, g_specs = layouts(params) if layouts and axes else (None, None)
        on = dict(run_mesh.shape)
        leaves = jax.tree.leaves
        # GPipe's gradients are autodiff's transpose of its shard_map: its stacked
        # weights enter split and are gathered inside, so theirs are reduce-
        # scattered. The explicit schedules reduce-scatter their accumulators
        # themselves and take the weights gathered at the input (gathered
        # inside, XLA keeps a second copy for the tick loops: +W on the peak)
        split_in = p_specs if pipe.schedule == "gpipe" else None
        xs_in, _ = weight_splits(sp, split_in and leaves(split_in, _is_spec), axes, on)
        xs_out, sh_out = weight_splits(sp, g_specs and leaves(g_specs, _is_spec), axes, on)
        lay = _Manual(pipe.axis, axes, shards, _row_split(sp, local, shards), xs_in, xs_out, sh_out)
        mixed = _rows_mixed(sp, lay)
        if mixed and not pipe.local_statistics:
            raise rows_error(mixed, axes, "pipeline")
        p_leaves, p_tree = jax.tree.flatten(params)
        r_leaves = jax.tree.leaves(rest)
        pre_all = _pre_all(sp, micro, r_leaves)

        seen = _TRACED.get()
        if seen is not None:
            carry = [v.aval for v in sp.carry]
            args = (loss_fn, pipe, params, batch, *rest)
            r, h = chunk_residuals(*args), chunk_residuals(*args, head=True)
            sizes = (_nbytes(carry), _nbytes(r), _nbytes(h))
            shapes = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), args[2:]
            )
            seen.append(
                PipelineFacts(
                    pipe, *sizes, batch_axes=lay.batch, loss_fn=loss_fn,
                    args=tuple(shapes), layers=sp.layers,
                )
            )  # fmt: skip
        sources = param_sources(sp)
        if not _rows_apart(sp, lay):
            ((xs, shared), per), pre_vjp = jax.vjp(pre_all, p_leaves)
            wide = _wide(pipe, (xs, shared), sources, p_leaves)
            loss, (ct_xs, ct_sh, ct_per), outs = _run(
                local, pipe, run_mesh, lay, (xs, shared, per), wide
            )
            (ct_xs, ct_sh), direct = _routed((ct_xs, ct_sh), (xs, shared), sources)
            (g,) = pre_vjp(((ct_xs, ct_sh), ct_per))
            return _value(loss, outs), jax.tree.unflatten(p_tree, _plus(g, direct))
        # the embedding's gradient from the rows' cotangents: on each device's rows,
        # summed over the micro-batches, then over the batch axes once
        (_, per) = pre_all(p_leaves)
        (xs, shared), pre_vjp = jax.vjp(lambda pl: pre_all(pl)[0], p_leaves)
        wide = _wide(pipe, (xs, shared), sources, p_leaves)
        loss, (ct_xs, ct_sh, ct_per), outs = _run(
            local, pipe, run_mesh, lay, (xs, shared, per), wide
        )
        (ct_xs, ct_sh), direct = _routed((ct_xs, ct_sh), (xs, shared), sources)
        g = _plus(pre_vjp((ct_xs, ct_sh))[0], direct)
        g_out = (
            [batch_split(s, np.shape(x), axes, on, 0)
             for s, x in zip(leaves(g_specs, _is_spec), p_leaves, strict=True)]
            if g_specs else _none(p_leaves)
        )  # fmt: skip
        g_rows = _rows_grad(local, lay, run_mesh, (p_leaves, micro, r_leaves), ct_per, g_out)
        g = [a + b if _float(a) else a for a, b in zip(g, g_rows, strict=True)]
        return _value(loss, outs), jax.tree.unflatten(p_tree, g)

    return grad_fn


def _wide(pipe: Pipeline, vals: tuple, sources: tuple, p_leaves: list) -> tuple:
    """GPipe's stacked weights and shared values (``vals``, their parameter
    ``sources``) as it runs them: per value that is a narrower cast of a parameter
    (bf16 compute on fp32 master weights), that parameter, else None (the explicit
    schedules accumulate in float32 themselves: :func:`accumulator_dtype`)."""
    if pipe.schedule != "gpipe":
        return ((), ())

    def one(x: Any, src: int | None) -> Any:
        dtype = jnp.result_type(x)
        wider = accumulator_dtype(dtype)
        keep = src is not None and _float(x) and wider != dtype
        return p_leaves[src] if keep and jnp.result_type(p_leaves[src]) == wider else None

    return tuple(
        [one(x, i) for x, i in zip(v, srcs, strict=True)]
        for v, srcs in zip(vals, sources, strict=True)
    )


def _routed(cts: tuple, vals: tuple, sources: tuple) -> tuple[tuple, dict[int, Any]]:
    """:func:`_direct` over the stacked weights' and the shared values' gradients."""
    (xs, d_xs), (sh, d_sh) = (_direct(*a) for a in zip(cts, vals, sources, strict=True))
    for i, g in d_sh.items():
        d_xs[i] = d_xs[i] + g if i in d_xs else g
    return (xs, sh), d_xs


def _plus(g: list, direct: dict[int, Any]) -> list:
    """The pre part's parameter gradients plus those routed past it."""
    g = list(g)
    for i, x in direct.items():
        g[i] = (g[i] + x).astype(g[i].dtype)
    return g


def _value(loss: Any, outs: list | None) -> Any:
    """The loss, or ``(loss, outputs)`` with the last stage's outputs in the
    batch's row order (the inverse of :func:`split_microbatches`)."""
    if outs is None:
        return loss

    def rows(o: Any) -> Any:
        y = jnp.swapaxes(o, 0, 1)
        return jnp.reshape(y, (y.shape[0] * y.shape[1], *y.shape[2:]))

    return loss, [rows(o) for o in outs]


def _pre_all(sp: SplitLoss, micro: Any, r_leaves: list) -> Callable:
    """``params → ((xs, shared), per)``: the pre part for every micro-batch."""
    m = jax.tree.leaves(micro)[0].shape[0]

    def pre_one(pl: list, mb: Any) -> tuple:
        xs, shared, per = sp.pre([*pl, *jax.tree.leaves(mb), *r_leaves])
        return (xs, shared), per

    def pre_all(pl: list) -> tuple:
        # once per micro-batch, unrolled rather than vmapped: an spmdkit op (the
        # embedding) stays the planned region instead of a batched plain gather
        # (which XLA partitions with a permute of a vocab-sharded table), and a
        # weight's reshard is shared by the copies, as XLA shares it
        outs = [pre_one(pl, jax.tree.map(lambda x, i=i: x[i], micro)) for i in range(m)]
        per = [jnp.stack(vals) for vals in zip(*(o[1] for o in outs), strict=True)]
        return outs[0][0], per

    return pre_all


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


def rows_combined(loss_fn: Callable[..., Any], params: Any, batch: Any, *rest: Any) -> str:
    """The first equation of the loss's layer stack that combines a batch's rows
    (:func:`~spmdkit.pipeline.rows.mixed_rows`), else ``""``: what a pipeline
    with the batch over other mesh axes refuses unless ``local_statistics``
    (the planner asks before it plans one). ``batch``: concrete or abstract,
    with an even number of rows (else ``""``: its rows cannot be split).

    Raises:
      PipelineError: the loss has no layer scan, or its structure changes with
        its rows (:func:`pipelined_value_and_grad`).

    Example::

        >>> rows_combined(moe.loss_fn, moe.abstract_params, moe.batch)
        'reduce_sum over the rows'
    """
    first = jax.tree.leaves(batch)
    rows = first[0].shape[0] if first and np.ndim(first[0]) else 0
    if rows < 2 or rows % 2:
        return ""
    sp = split_loss(loss_fn, params, batch, rest)
    local = split_loss(loss_fn, params, _local_rows(batch, 2), rest)
    lay = _Manual("", ("rows",), 2, _row_split(sp, local, 2))
    return _rows_mixed(sp, lay)


def _rows_mixed(sp: SplitLoss, lay: _Manual) -> str:
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


def _rows_apart(sp: SplitLoss, lay: _Manual) -> bool:
    """Does the pre part's gradient run on each device's rows (:func:`_rows_grad`)?
    With batch axes, when every floating per-micro-batch value is split over them."""
    return bool(lay.batch) and all(
        r for v, r in zip(sp.per_mb, lay.rows, strict=True) if _float(v.aval.dtype)
    )


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


def _rows_grad(
    local: SplitLoss, lay: _Manual, mesh: Any, args: tuple, ct_per: list, g_out: Sequence
) -> list:
    """The parameters' gradient through the per-micro-batch values (the
    embedding's), under a ``shard_map`` manual over the batch axes: each device
    differentiates the pre part on its rows of every micro-batch (``local``: the
    loss split on those rows), summed over the micro-batches, then over the
    batch axes once (``g_out``: per parameter, the split over the batch axes
    its gradient is reduce-scattered to). Non-floating parameters get zeros."""
    p_leaves, micro, r_leaves = args
    dper = [i for i, x in enumerate(ct_per) if _float(x)]
    b_leaves = jax.tree.leaves(micro)
    read = _read_by(local, dper, (p_leaves, [x[0] for x in b_leaves], r_leaves))
    dp = [i for i in read if _float(p_leaves[i])]

    def body(pl: list, bl: list, rl: list, cts: list) -> list:
        # the parameters the rows' values are not computed from are not passed
        # (a shard_map input is gathered over the manual axes even when unread)
        given = dict(zip(read, pl, strict=True))

        def pre_rows(dpl: list) -> list:
            full = [given.get(i, jnp.zeros(x.shape, x.dtype)) for i, x in enumerate(p_leaves)]
            for i, x in zip(dp, dpl, strict=True):
                full[i] = x

            def one(mb: list) -> list:
                per = local.pre([*full, *mb, *rl])[2]
                return [per[i] for i in dper]

            return jax.vmap(one)(bl)

        _, vjp = jax.vjp(pre_rows, [given[i] for i in dp])
        (g,) = vjp(cts)
        return [lay.reduce(x, g_out[i], 0) for i, x in zip(dp, g, strict=True)]

    rows = P(None, lay.batch)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([P()] * len(read), [rows] * len(b_leaves),
                  [P()] * len(r_leaves), [rows] * len(dper)),
        out_specs=[_split_spec((), g_out[i]) for i in dp],
        axis_names=frozenset(lay.batch),
        check_vma=False,
    )  # fmt: skip
    g = fn([p_leaves[i] for i in read], b_leaves, r_leaves, [ct_per[i] for i in dper])
    out = [_zero_ct(x) for x in p_leaves]
    for i, x in zip(dp, g, strict=True):
        out[i] = x
    return out


def _read_by(sp: SplitLoss, outs: list, args: tuple) -> list[int]:
    """The parameter leaves that ``sp``'s per-micro-batch values ``outs``
    (indices) are computed from (the others' gradient through them is zero, and
    a ``psum`` of it would be priced though XLA drops it)."""
    p_leaves, mb, rl = args
    closed = jax.make_jaxpr(lambda *a: [sp.pre(list(a))[2][i] for i in outs])(*p_leaves, *mb, *rl)
    need = {v for v in closed.jaxpr.outvars if not isinstance(v, jex.Literal)}
    for eqn in reversed(closed.jaxpr.eqns):
        if any(o in need for o in eqn.outvars):
            need.update(v for v in eqn.invars if not isinstance(v, jex.Literal))
    invars = closed.jaxpr.invars[: len(p_leaves)]
    return [i for i, v in enumerate(invars) if v in need]


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
    loss_fn: Callable[..., Any], pipe: Pipeline, *rest: Any, head: bool = False
) -> Callable[[Any, Any], list]:
    """``f(params, batch) -> residuals``: :func:`chunk_residuals`'s leaves as a
    function of the step's arguments, for micro-batch 0 and chunk 0 (what
    ``plan.verify`` propagates with the plan's layouts to size them per device)."""
    m, chunks = pipe.microbatches, pipe.chunks

    def probe_fn(params: Any, batch: Any) -> list:
        micro = split_microbatches(batch, m)
        one = jax.tree.map(lambda x: x[0], micro)
        sp = split_loss(loss_fn, params, one, rest)
        pipe.check_layers(sp.layers, op="pipeline")
        xs, shared, per = sp.pre(jax.tree.leaves((params, one, rest)))
        ctx = _Ctx(sp, pipe, shared, [x[None] for x in per])
        w = [x[: sp.layers // chunks] for x in xs]
        cd = [({**ctx.sv, **ctx.mb(0)})[v] for v in ctx.dconsts]
        carry = [ctx.per[v][0] for v in ctx.carry]
        if head:
            post = [ctx.sv[v] if v in ctx.sv else ctx.mb(0)[v] for v in ctx.dpost]

            def f(c: list, dv: list) -> Any:
                vals = {**ctx.sv, **ctx.mb(0), **dict(zip(ctx.dpost, dv, strict=True))}
                return sp.post(vals, c)

            _, vjp = jax.vjp(f, carry, post)
            shared = [v in ctx.sv for v in ctx.dpost]
            return _Probe().record(jax.tree.leaves(vjp), [], post, shared)
        _, vjp = jax.vjp(lambda w_, c_, x_: ctx.stage(w_, c_, x_, 0), w, cd, carry)
        return _Probe().record(jax.tree.leaves(vjp), w, cd, [v in ctx.sv for v in ctx.dconsts])

    return probe_fn

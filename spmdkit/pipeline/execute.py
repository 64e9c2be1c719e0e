"""Running a schedule: the loss's layer stack pipelined over the pipe axis.

:func:`pipelined_value_and_grad` is ``jax.value_and_grad`` of a loss whose
stacked layers run as a pipeline (what ``sk.value_and_grad(loss, plan)`` runs
when ``plan.pipeline`` is set):

1. The loss is cut at its layer scan (:func:`spmdkit.pipeline.split.split_loss`).
   The batch's leaves are split on their leading dim into ``m`` micro-batches
   (micro-batch ``i`` takes rows ``i, i + m, ...``, so a batch sharded on that
   dim stays put); the *pre* part (embedding) runs for every micro-batch
   outside the pipeline (``vmap``), differentiated with ``jax.vjp``.
2. The layer stack runs under ``jax.shard_map`` over the pipe axis only (the
   other mesh axes stay automatic, laid out as the plan says): each device
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit.pipeline.schedule import Pipeline, PipelineError, build_schedule
from spmdkit.pipeline.split import SplitLoss, split_loss
from spmdkit.pipeline.tables import FIELDS, Tables, build_tables, forward_ticks

__all__ = [
    "PipelineFacts",
    "chunk_residuals",
    "permute_count",
    "pipelined_value_and_grad",
    "pipelines_traced",
    "split_microbatches",
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
    """

    pipe: Pipeline
    carry_bytes: int
    residual_bytes: int
    head_bytes: int


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
    """Each array leaf ``[B, ...]`` → ``[m, B/m, ...]`` (micro-batch ``i``: rows ``i, i+m, ...``).

    Raises:
      PipelineError: a leaf's leading dim does not divide into ``m``.
    """

    def one(x: Any) -> Any:
        if x.shape[0] % m:
            raise PipelineError(
                op="pipeline",
                must="every batch leaf's leading dim divides into the micro-batches",
                given=f"a leaf of shape {tuple(x.shape)}, microbatches={m}",
                fix=f"use a batch size that is a multiple of {m}",
            )
        return jnp.swapaxes(jnp.reshape(x, (x.shape[0] // m, m, *x.shape[1:])), 0, 1)

    return jax.tree.map(one, batch)


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

    def __init__(self, sp: SplitLoss, pipe: Pipeline, shared: list, per: list) -> None:
        self.sp, self.pipe = sp, pipe
        self.sv = dict(zip(sp.shared, shared, strict=True))
        self.per = dict(zip(sp.per_mb, per, strict=True))
        self.carry = [v for v in sp.carry]
        for v in self.carry:
            if v not in self.per or not _float(v.aval.dtype):
                raise PipelineError(
                    op="pipeline",
                    must="the layer scan's carry is floating and computed from the batch",
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
        """``(loss_i / m, ct of carry, {var: ct})`` of micro-batch ``i``'s head and loss."""
        m = self.pipe.microbatches
        base = {**self.sv, **self.mb(i)}
        diff = [base[v] for v in self.dpost]

        def f(c: list, dv: list) -> Any:
            return self.sp.post({**base, **dict(zip(self.dpost, dv, strict=True))}, c)

        loss, vjp = jax.vjp(f, out, diff)
        ct_c, ct_v = vjp(jnp.asarray(1.0 / m, loss.dtype))
        return loss / m, ct_c, ct_v


def _chunk(xs_l: list, j: Any, v: int) -> list:
    return [x[0] if v == 1 else x[j] for x in xs_l]


def _gpipe_body(sp: SplitLoss, pipe: Pipeline, tables: Tables, axis: str) -> Callable:
    fperm, _ = _perms(pipe)

    def body(xs_local: list, shared: list, per: list) -> Any:
        ctx = _Ctx(sp, pipe, shared, per)
        d = jax.lax.axis_index(axis)
        xs_l = [x[0] for x in xs_local]
        shapes = [ctx.per[v][0] for v in ctx.carry]
        inbox = [jnp.zeros((tables.n_inbox_f + 1, *s.shape), s.dtype) for s in shapes]
        loss_dtype = ctx.sp.closed.out_avals[0].dtype

        def fwd(row: dict, inbox: list) -> tuple:
            i = row["mb"]
            x_in = [
                jnp.where(row["first"] > 0, ctx.per[v][i], b[row["f_in"]])
                for v, b in zip(ctx.carry, inbox, strict=True)
            ]
            cd = [({**ctx.sv, **ctx.mb(i)})[v] for v in ctx.dconsts]
            out = ctx.stage(_chunk(xs_l, row["local"], pipe.virtual), cd, x_in, i)
            loss = jax.lax.switch(
                row["last"],
                [
                    lambda: jnp.zeros((), loss_dtype),
                    lambda: (
                        ctx.sp.post({**ctx.sv, **ctx.mb(i)}, out).astype(loss_dtype)
                        / pipe.microbatches
                    ),
                ],
            )
            return out, loss

        def idle(row: dict, inbox: list) -> tuple:
            return [jnp.zeros_like(s) for s in shapes], jnp.zeros((), loss_dtype)

        def make_tick(send: bool) -> Callable:
            def tick(state: tuple, tab: Any) -> tuple:
                inbox, loss = state
                row = {name: tab[k, d] for k, name in enumerate(FIELDS)}
                out, li = jax.lax.switch(row["kind"], [idle, fwd], row, inbox)
                if send:
                    recv = [jax.lax.ppermute(o, axis, fperm) for o in out]
                    inbox = [b.at[row["recv_f"]].set(r) for b, r in zip(inbox, recv, strict=True)]
                return (inbox, loss + li), None

            return tick

        state = (inbox, jnp.zeros((), loss_dtype))
        tab = jnp.asarray(tables.stacked())
        for start, stop, send, _ in tables.segments():
            state, _ = jax.lax.scan(make_tick(send), state, tab[start:stop])
        return jax.lax.psum(state[1], axis)

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


def _effects(ctx: _Ctx, probe: _Probe, xs_l: list, state: dict) -> tuple[Callable, Callable]:
    """The forward and backward actions of one tick, as functions of its row
    returning every effect (zeros for the other action's)."""
    pipe = ctx.pipe

    def inputs(row: dict) -> tuple:
        i = row["mb"]
        w = _chunk(xs_l, row["local"], pipe.virtual)
        cd = [({**ctx.sv, **ctx.mb(i)})[v] for v in ctx.dconsts]
        return i, w, cd

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
                lambda: ctx.post(i, out),
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
            "stash": held,
            "send_b": dx,
            "dxs": [dw[k] for k, x in enumerate(w) if _float(x)],
            "dsh": [dc.get(v, jnp.zeros(v.aval.shape, v.aval.dtype)) for v in ctx.dshared],
            "dmb": dmb,
        }

    return fwd, bwd


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
    weight and shared gradients are accumulated by :func:`_tick_effects`). Only
    a forward writes the stash: any other tick's slot index is the stash's
    length, out of bounds, and a scatter drops it (so the stash has no trash
    slot)."""
    n_stash = state["stash"][0].shape[0] if state["stash"] else 0
    slot = jnp.where(row["kind"] == 1, row["stash"], n_stash)
    return {
        **state,
        "stash": _put(state["stash"], slot, eff["stash"]),
        "inbox_b": _put(state["inbox_b"], row["self_b"], eff["post_ct"]),
        "g_mb": _add(state["g_mb"], row["mb"], eff["dmb"]),
        "loss": state["loss"] + eff["loss"],
    }


def _branch(action: Callable | None, shapes: dict) -> Callable:
    """One ``lax.switch`` branch of a tick: ``action``'s effects (zeros for the
    missing ones; ``None``: idle), with its weight and shared gradients added to
    the accumulators inside the branch (:func:`_tick_effects`). A backward's
    stash effect is the slot it read (the result buffer holds the set it reads
    anyway, not zeros)."""

    def run(acc: tuple, row: dict) -> tuple:
        part = {} if action is None else action(row)
        g_xs, g_sh = acc
        if "dxs" in part:
            g_xs = _add(g_xs, row["local"], part.pop("dxs"))
        if "dsh" in part:
            g_sh = [g + x for g, x in zip(g_sh, part.pop("dsh"), strict=True)]
        return _full(shapes, part), (g_xs, g_sh)

    return run


def _tick_effects(st: dict, row: dict, actions: tuple, shapes: dict, inside: bool) -> tuple:
    """``(effects, state with the gradients accumulated)`` of one tick's switch.

    ``inside`` (a mesh with only the pipe axis): the weight and shared gradients
    are added inside the branch. Added after the switch, the ticks of runs XLA
    unrolls (1F1B at ``p = 2`` is all one-tick runs) had their adds fused into
    one, holding every such tick's weight gradients at once. With other mesh
    axes the accumulators stay outside the switch, and a backward's stash
    effect is zeros, not the slot it read: XLA reshards such a branch operand
    or result inside the branch, with a collective permute, which deadlocks
    XLA:CPU there.
    """
    if inside:
        keep = {k: x for k, x in shapes.items() if k not in ("dxs", "dsh")}
        branches = [_branch(a, keep) for a in (None, *actions)]
        acc = (st["g_xs"], st["g_sh"])
        eff, (g_xs, g_sh) = jax.lax.switch(row["kind"], branches, acc, row)
        return eff, {**st, "g_xs": g_xs, "g_sh": g_sh}

    def outside(action: Callable | None, kind: int) -> Callable:
        def run(r: dict) -> dict:
            part = {} if action is None else dict(action(r))
            if kind == 2:  # zeros: XLA would reshard the slot read inside the branch too
                part.pop("stash")
            return _full(shapes, part)

        return run

    branches = [outside(a, k) for k, a in enumerate((None, *actions))]
    eff = jax.lax.switch(row["kind"], branches, row)
    g_xs = _add(st["g_xs"], row["local"], eff["dxs"])
    g_sh = [g + x for g, x in zip(st["g_sh"], eff["dsh"], strict=True)]
    return eff, {**st, "g_xs": g_xs, "g_sh": g_sh}


def _explicit_body(
    sp: SplitLoss, pipe: Pipeline, tables: Tables, axis: str, *, inside: bool = False
) -> Callable:
    fperm, bperm = _perms(pipe)

    def body(xs_local: list, shared: list, per: list) -> tuple:
        ctx = _Ctx(sp, pipe, shared, per)
        d = jax.lax.axis_index(axis)
        xs_l = [x[0] for x in xs_local]
        probe = _Probe()
        carry = [ctx.per[v][0] for v in ctx.carry]
        state = {
            "inbox_f": [jnp.zeros((tables.n_inbox_f + 1, *c.shape), c.dtype) for c in carry],
            "inbox_b": [jnp.zeros((tables.n_inbox_b + 1, *c.shape), c.dtype) for c in carry],
            "g_xs": [jnp.zeros_like(x) for x in xs_l if _float(x)],
            "g_sh": [jnp.zeros_like(ctx.sv[v]) for v in ctx.dshared],
            "g_mb": [jnp.zeros_like(ctx.per[v]) for v in ctx.dper],
            "loss": jnp.zeros((), sp.closed.out_avals[0].dtype),
        }
        row0 = {name: jnp.int32(0) for name in FIELDS}
        state["stash"] = []
        f_shape = jax.eval_shape(_effects(ctx, probe, xs_l, state)[0], row0)
        stash_shapes = f_shape["stash"]
        state["stash"] = [jnp.zeros((tables.n_stash, *s.shape), s.dtype) for s in stash_shapes]
        dxs = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in state["g_xs"]]
        shapes = {**f_shape, "send_b": f_shape["send_f"], "dxs": dxs}

        def make_tick(send_f: bool, send_b: bool) -> Callable:
            def tick(st: dict, tab: Any) -> tuple:
                row = {name: tab[k, d] for k, name in enumerate(FIELDS)}
                actions = _effects(ctx, probe, xs_l, st)
                eff, st = _tick_effects(st, row, actions, shapes, inside)
                st = _apply(st, eff, row)
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
        psum = lambda x: jax.lax.psum(x, axis)  # noqa: E731
        g_xs = [g[None] for g in state["g_xs"]]
        return (
            psum(state["loss"]),
            g_xs,
            [psum(g) for g in state["g_sh"]],
            [psum(g) for g in state["g_mb"]],
        )

    return body


def _regroup(x: Any, pipe: Pipeline) -> Any:
    """``[L, ...]`` → ``[p, v, L/(p·v), ...]``: device ``d``'s chunks ``d, d+p, ...``."""
    p, v = pipe.stages, pipe.virtual
    y = jnp.reshape(x, (v, p, x.shape[0] // (p * v), *x.shape[1:]))
    return jnp.swapaxes(y, 0, 1)


def _ungroup(g: Any) -> Any:
    y = jnp.swapaxes(g, 0, 1)
    return jnp.reshape(y, (y.shape[0] * y.shape[1] * y.shape[2], *y.shape[3:]))


def _shard_map(body: Callable, pipe: Pipeline, mesh: Any, out_specs: Any, n: tuple) -> Callable:
    in_specs = ([P(pipe.axis)] * n[0], [P()] * n[1], [P()] * n[2])
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset({pipe.axis}),
        check_vma=False,
    )


def _run(sp: SplitLoss, pipe: Pipeline, mesh: Any, xs: list, shared: list, per: list) -> tuple:
    """``(loss, (ct xs, ct shared, ct per))`` of the pipelined layer stack and head."""
    sched = build_schedule(pipe)
    xs_g = [_regroup(x, pipe) for x in xs]
    n = (len(xs), len(shared), len(per))
    if pipe.schedule == "gpipe":
        tables = build_tables(sched, ticks=forward_ticks(sched))
        fn = _shard_map(_gpipe_body(sp, pipe, tables, pipe.axis), pipe, mesh, P(), n)
        loss, vjp = jax.vjp(fn, xs_g, shared, per)
        ct_xs, ct_sh, ct_per = vjp(jnp.ones_like(loss))
        return loss, (
            [_ungroup(g) if _float(g) else _zero_ct(x) for g, x in zip(ct_xs, xs, strict=True)],
            ct_sh,
            ct_per,
        )
    tables = build_tables(sched)
    ctx_probe = [_float(x) for x in xs]
    out_specs = (P(), [P(pipe.axis)] * sum(ctx_probe), P(), P())
    # gradients accumulated inside a tick's branch only where XLA has no other
    # axis to reshard them over (:func:`_tick_effects`)
    inside = all(size == 1 for name, size in mesh.shape.items() if name != pipe.axis)
    body = _explicit_body(sp, pipe, tables, pipe.axis, inside=inside)
    loss, g_xs, g_sh, g_mb = _shard_map(body, pipe, mesh, out_specs, n)(xs_g, shared, per)
    it_xs, it_sh, it_mb = iter(g_xs), iter(g_sh), iter(g_mb)
    ct_xs = [
        _ungroup(next(it_xs)) if f else _zero_ct(x) for x, f in zip(xs, ctx_probe, strict=True)
    ]
    ct_sh = [next(it_sh) if _float(x) else _zero_ct(x) for x in shared]
    ct_per = [next(it_mb) if _float(x) else _zero_ct(x) for x in per]
    return loss, (ct_xs, ct_sh, ct_per)


def _mesh(plan_mesh: Any, axis: str) -> Any:
    ctx = jax.sharding.get_abstract_mesh()
    if not ctx.empty and axis in ctx.axis_names:
        return ctx
    return plan_mesh


def pipelined_value_and_grad(
    loss_fn: Callable[..., Any], pipe: Pipeline, mesh: Any
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss_fn)`` with the layer stack pipelined (module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)`` → the scalar mean loss over the
        batch's examples; its layers a scan over stacked parameters.
      pipe: the pipeline.
      mesh: the mesh with ``pipe.axis`` (the context mesh, under ``jax.set_mesh``,
        wins when it has that axis).

    Returns:
      ``f(params, batch, *rest) -> (loss, grads)``; ``rest`` is passed to every
      micro-batch and not differentiated.

    Raises:
      PipelineError: the loss has no layer scan of ``stages · virtual``-divisible
        length, the batch does not divide into the micro-batches, or the
        scan's carry is not the batch's hidden state.

    Example::

        >>> f = pipelined_value_and_grad(loss, Pipeline(stages=2, microbatches=4), mesh)
        >>> loss_value, grads = jax.jit(f)(params, batch)
    """

    def grad_fn(params: Any, batch: Any, *rest: Any) -> tuple[Any, Any]:
        micro = split_microbatches(batch, pipe.microbatches)
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro)
        sp = split_loss(loss_fn, params, one, rest)
        pipe.check_layers(sp.layers, op="pipeline")
        p_leaves, p_tree = jax.tree.flatten(params)
        r_leaves = jax.tree.leaves(rest)

        def pre_one(pl: list, mb: Any) -> tuple:
            xs, shared, per = sp.pre([*pl, *jax.tree.leaves(mb), *r_leaves])
            return (xs, shared), per

        def pre_all(pl: list) -> tuple:
            return jax.vmap(pre_one, in_axes=(None, 0), out_axes=((None, None), 0))(pl, micro)

        seen = _TRACED.get()
        if seen is not None:
            carry = [v.aval for v in sp.carry]
            args = (loss_fn, pipe, params, batch, *rest)
            r, h = chunk_residuals(*args), chunk_residuals(*args, head=True)
            seen.append(PipelineFacts(pipe, _nbytes(carry), _nbytes(r), _nbytes(h)))
        ((xs, shared), per), pre_vjp = jax.vjp(pre_all, p_leaves)
        loss, (ct_xs, ct_sh, ct_per) = _run(sp, pipe, _mesh(mesh, pipe.axis), xs, shared, per)
        (g,) = pre_vjp(((ct_xs, ct_sh), ct_per))
        return loss, jax.tree.unflatten(p_tree, g)

    return grad_fn


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

    return jax.eval_shape(probe_fn, params, batch)

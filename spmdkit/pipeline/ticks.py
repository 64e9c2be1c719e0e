"""The tick loops: what every device runs inside the pipeline's ``shard_map``.

A loop scans the schedule's tick table (:mod:`spmdkit.pipeline.tables`) in runs of
ticks with the same sends: each tick a ``lax.switch`` on the device's action
(idle, forward, backward; never two computed), each run's body with only the
``ppermute``s it needs (activations to the next device, cotangents to the
previous one). Runs that repeat (a 2-stage 1F1B's steady state alternates two) are
scanned once over their repeats (:meth:`~spmdkit.pipeline.tables.Tables.blocks`), so
the program does not grow with the micro-batches:

- :func:`gpipe_forward_loop`: GPipe's forward ticks; the executor takes
  ``jax.vjp`` of the loop, so autodiff runs the backward ticks and keeps every
  tick's residuals until then.
- :func:`explicit_tick_loop`: the whole table of ``fthenb``, ``1f1b`` and
  ``interleaved``. A forward stashes its chunk's residuals in a slot
  (:class:`~spmdkit.pipeline.chunk.VjpStash`), a backward applies the cotangent
  to them, frees the slot and accumulates the chunk's weight gradients locally;
  every gradient is reduced over the batch axes once, at the end
  (:func:`_reduced_results`).

A tick's forward, backward and head run under the ``jax.named_scope``s that
``plan.verify`` counts (:data:`~spmdkit.pipeline.facts.FORWARD_SCOPE`…).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from spmdkit.pipeline.chunk import BoundLoss, VjpStash
from spmdkit.pipeline.facts import BACKWARD_SCOPE, FORWARD_SCOPE, HEAD_SCOPE
from spmdkit.pipeline.layouts import (
    ManualAxes,
    accumulator_dtype,
    differentiable,
    gather_split,
    replicated_splits,
    unowned,
)
from spmdkit.pipeline.schedule import Pipeline
from spmdkit.pipeline.split import SplitLoss
from spmdkit.pipeline.tables import FIELDS, Tables

__all__ = ["explicit_tick_loop", "gpipe_forward_loop"]


def gpipe_forward_loop(
    sp: SplitLoss,
    pipe: Pipeline,
    tables: Tables,
    lay: ManualAxes,
    dtypes: tuple[Sequence[Any], Sequence[Any]],
) -> Callable:
    """GPipe's forward ticks; the stacked weights and shared values may enter
    wider than ``dtypes`` (the fp32 parameters of bf16 casts) and are cast per
    tick, so autodiff accumulates their gradients over the ticks, and reduces
    them, at the wider dtype."""
    fperm, _ = _permute_pairs(pipe)
    axis = lay.axis

    def cast(vals: list, types: Sequence[Any]) -> list:
        return [v.astype(t) if differentiable(v) else v for v, t in zip(vals, types, strict=True)]

    def body(xs_local: list, shared_in: list, per: list) -> Any:
        # the carry's shapes and the outputs' buffers; a tick builds its own with
        # the shared values cast
        ctx = BoundLoss(sp, pipe, shared_in, per, lay.parts)
        d = jax.lax.axis_index(axis)
        # the stacked weights gathered over the batch axes (their gradients,
        # autodiff's transpose of it: reduce-scattered)
        xs_l = _gathered_weights(xs_local, lay)
        shapes = [ctx.per[v][0] for v in ctx.carry]
        inbox = [jnp.zeros((tables.n_inbox_f + 1, *s.shape), s.dtype) for s in shapes]
        loss_dtype = ctx.sp.closed.out_avals[0].dtype

        @_in_named_scope(FORWARD_SCOPE)
        def fwd(row: dict, inbox: list) -> tuple:
            # the shared values cast where a tick reads them (see the docstring)
            ctx = BoundLoss(sp, pipe, cast(shared_in, dtypes[1]), per, lay.parts)
            i = row["mb"]
            x_in = [
                jnp.where(row["first"] > 0, ctx.per[v][i], b[row["f_in"]])
                for v, b in zip(ctx.carry, inbox, strict=True)
            ]
            cd = [({**ctx.sv, **ctx.microbatch(i)})[v] for v in ctx.dconsts]
            w = cast(_chunk_weights(xs_l, row["local"], pipe.virtual), dtypes[0])
            out = ctx.stage(w, cd, x_in, i, ctx.chunk_count(d, row["local"]))
            loss = jax.lax.switch(
                row["last"],
                [
                    lambda: jnp.zeros((), loss_dtype),
                    _in_named_scope(HEAD_SCOPE)(
                        lambda: (
                            ctx.sp.post({**ctx.sv, **ctx.microbatch(i)}, out).astype(loss_dtype)
                            * ctx.scale
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

        state = (inbox, jnp.zeros((), loss_dtype), _output_buffers(ctx, pipe))
        tab = jnp.asarray(tables.stacked())
        for start, stop, send, _ in tables.segments():
            state, _ = jax.lax.scan(make_tick(send), state, tab[start:stop])
        loss = jax.lax.psum(state[1], lay.all_axes)
        if not pipe.return_output:
            return loss
        return loss, [jax.lax.psum(o, axis) for o in state[2]]

    return body


def explicit_tick_loop(
    sp: SplitLoss, pipe: Pipeline, tables: Tables, lay: ManualAxes, *, read_slot: bool = False
) -> Callable:
    """The 1F1B-family tick loop. ``read_slot``: a backward's stash effect is the
    slot it read (the branch's result buffer holds that set anyway) rather than
    zeros; only where every mesh axis is manual, since XLA reshards such a branch
    result over an automatic axis inside the branch, with a collective permute
    that deadlocks XLA:CPU."""
    fperm, bperm = _permute_pairs(pipe)
    axis = lay.axis

    def body(xs_local: list, shared: list, per: list) -> tuple:
        ctx = BoundLoss(sp, pipe, shared, per, lay.parts)
        d = jax.lax.axis_index(axis)
        xs_l = _gathered_weights(xs_local, lay)
        vjp_stash = VjpStash()
        carry = [ctx.per[v][0] for v in ctx.carry]
        state = {
            "inbox_f": [jnp.zeros((tables.n_inbox_f + 1, *c.shape), c.dtype) for c in carry],
            "inbox_b": [jnp.zeros((tables.n_inbox_b + 1, *c.shape), c.dtype) for c in carry],
            # the weights' gradients accumulate in float32 under bf16 compute
            "g_xs": [
                jnp.zeros(x.shape, accumulator_dtype(x.dtype)) for x in xs_l if differentiable(x)
            ],
            "g_sh": [
                jnp.zeros(ctx.sv[v].shape, accumulator_dtype(ctx.sv[v].dtype)) for v in ctx.dshared
            ],
            "g_mb": [jnp.zeros_like(ctx.per[v]) for v in ctx.dper],
            "loss": jnp.zeros((), sp.closed.out_avals[0].dtype),
            "outs": _output_buffers(ctx, pipe),
        }
        row0 = {name: jnp.int32(0) for name in FIELDS}
        state["stash"] = []
        f_shape = jax.eval_shape(_tick_actions(ctx, vjp_stash, xs_l, state)[0], row0)
        stash_shapes = f_shape["stash"]
        state["stash"] = [jnp.zeros((tables.n_stash, *s.shape), s.dtype) for s in stash_shapes]
        dw_shapes = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs_l if differentiable(x)]
        shapes = {**f_shape, "send_b": f_shape["send_f"], "dw": dw_shapes}

        def make_tick(send_f: bool, send_b: bool) -> Callable:
            def tick(st: dict, tab: Any) -> tuple:
                row = {name: tab[k, d] for k, name in enumerate(FIELDS)}
                f, b = _tick_actions(ctx, vjp_stash, xs_l, st, read_slot=read_slot)
                eff = jax.lax.switch(
                    row["kind"],
                    [
                        lambda r: _with_zero_effects(shapes, {}),
                        lambda r: _with_zero_effects(shapes, f(r)),
                        lambda r: _with_zero_effects(shapes, b(r)),
                    ],
                    row,
                )
                st = _write_effects(st, eff, row)
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
        for start, reps, unit in tables.blocks():
            width = sum(n for n, _, _ in unit)
            if reps == 1:
                state = _run_unit(state, tab[start : start + width], unit, make_tick)
                continue
            rows = tab[start : start + reps * width].reshape(reps, width, *tab.shape[1:])

            def repeat(st: dict, rows_r: Any, unit: tuple = unit) -> tuple:
                return _run_unit(st, rows_r, unit, make_tick), None

            state, _ = jax.lax.scan(repeat, state, rows)
        return _reduced_results(ctx, lay, state, xs_l)

    return body


def _run_unit(state: dict, rows: Any, unit: tuple, make_tick: Callable) -> dict:
    """``state`` after the ticks of ``rows`` (a :meth:`~spmdkit.pipeline.tables.Tables.blocks`
    unit's), each run of ``unit`` one ``lax.scan`` with its own sends."""
    at = 0
    for n, send_f, send_b in unit:
        state, _ = jax.lax.scan(make_tick(send_f, send_b), state, rows[at : at + n])
        at += n
    return state


def _permute_pairs(pipe: Pipeline) -> tuple[list, list]:
    """Forward and backward ``ppermute`` pairs: a line for ``v = 1``, a ring otherwise."""
    p = pipe.stages
    fwd = [(d, (d + 1) % p) for d in range(p if pipe.virtual > 1 else p - 1)]
    return fwd, [(b, a) for a, b in fwd]


def _in_named_scope(name: str) -> Callable:
    """A decorator: the function runs under ``jax.named_scope(name)``."""

    def wrap(fn: Callable) -> Callable:
        def run(*args: Any) -> Any:
            with jax.named_scope(name):
                return fn(*args)

        return run

    return wrap


def _gathered_weights(xs_local: list, lay: ManualAxes) -> list:
    """A device's stacked weights (``[1, v, L/(p·v), ...]``: its row of the pipe
    axis) as its chunks run them, ``[v, L/(p·v), ...]``, gathered over the batch
    axes that split them (where they enter split: ``lay.xs_in``), but for the
    expert-parallel dims (``lay.xs_ep``: a device runs its own experts)."""
    splits = lay.xs_in or replicated_splits(xs_local)
    owned = lay.xs_ep or replicated_splits(xs_local)
    return [
        gather_split(x[0], unowned(s, o), 1)
        for x, s, o in zip(xs_local, splits, owned, strict=True)
    ]


def _chunk_weights(xs_l: list, j: Any, v: int) -> list:
    """Local chunk ``j``'s weights (the only one with ``v = 1``)."""
    return [x[0] if v == 1 else x[j] for x in xs_l]


def _output_buffers(ctx: BoundLoss, pipe: Pipeline) -> list:
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
    return _set_slot(outs, slot, out)


def _tick_actions(
    ctx: BoundLoss, vjp_stash: VjpStash, xs_l: list, state: dict, *, read_slot: bool = False
) -> tuple[Callable, Callable]:
    """The forward and backward actions of one tick, as functions of its row
    returning every effect (zeros for the other action's)."""
    pipe = ctx.pipe

    def inputs(row: dict) -> tuple:
        i = row["mb"]
        w = _chunk_weights(xs_l, row["local"], pipe.virtual)
        cd = [({**ctx.sv, **ctx.microbatch(i)})[v] for v in ctx.dconsts]
        return i, w, cd

    @_in_named_scope(FORWARD_SCOPE)
    def fwd(row: dict) -> dict:
        i, w, cd = inputs(row)
        x_in = [
            jnp.where(row["first"] > 0, ctx.per[v][i], b[row["f_in"]])
            for v, b in zip(ctx.carry, state["inbox_f"], strict=True)
        ]
        count = ctx.chunk_count(jax.lax.axis_index(pipe.axis), row["local"])
        out, vjp = jax.vjp(lambda w_, c_, x_: ctx.stage(w_, c_, x_, i, count), w, cd, x_in)
        leaves, vjp_stash.tree = jax.tree.flatten(vjp)
        keep = vjp_stash.record(leaves, w, cd, [v in ctx.sv for v in ctx.dconsts])
        loss, ct_c, ct_l = jax.lax.switch(
            row["last"],
            [
                lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(ctx.post, i, out)),
                _in_named_scope(HEAD_SCOPE)(lambda: ctx.post(i, out)),
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

    @_in_named_scope(BACKWARD_SCOPE)
    def bwd(row: dict) -> dict:
        _, w, cd = inputs(row)
        ct = [b[row["b_in"]] for b in state["inbox_b"]]
        held = [s[row["stash"]] for s in state["stash"]]
        vjp = vjp_stash.rebuild(held, w, cd)
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
            "dw": _wait_for_accumulators(
                [dw[k] for k, x in enumerate(w) if differentiable(x)], state["g_xs"], row["local"]
            ),
            "dsh": [dc.get(v, jnp.zeros(v.aval.shape, v.aval.dtype)) for v in ctx.dshared],
            "dmb": dmb,
        }

    return fwd, bwd


def _wait_for_accumulators(dw: list, acc: list, slot: Any) -> list:
    """A backward's chunk gradients ``dw``, made to read the accumulators ``acc``
    (``+ 0 · acc[slot, 0]``, one layer's slice, which XLA does not fold away):
    the tick's ``lax.switch`` then waits for the previous tick's addition, so XLA
    cannot run several (unrolled) ticks' backwards before their additions and
    hold all their gradients. The slice is along the chunk and layer dims, which
    no automatic axis splits: no collective. (``x · 0`` is NaN for a non-finite
    ``x``: non-finite accumulators make every gradient non-finite, not just
    theirs.)"""
    return [d.at[0].add(0 * g[slot, 0].astype(d.dtype)) for d, g in zip(dw, acc, strict=True)]


def _accumulate_at(bufs: list, slot: Any, vals: list) -> list:
    """``bufs[slot] += vals``, in the buffers' (accumulator) dtype. Outside the
    tick's ``lax.switch``: a branch that returned the updated accumulators would
    have its result copied (a conditional's result buffer is not its operand's)."""
    return [b.at[slot].add(x.astype(b.dtype)) for b, x in zip(bufs, vals, strict=True)]


def _with_zero_effects(shapes: dict, part: dict) -> dict:
    """``part`` with every missing effect as zeros."""
    out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    out.update(part)
    return out


def _set_slot(bufs: list, slot: Any, vals: list) -> list:
    """``bufs[slot] = vals`` (a slot out of bounds: dropped)."""
    return [b.at[slot].set(x) for b, x in zip(bufs, vals, strict=True)]


def _add_at_slot(bufs: list, slot: Any, vals: list) -> list:
    """``bufs[slot] += vals``."""
    return [b.at[slot].add(x) for b, x in zip(bufs, vals, strict=True)]


def _write_effects(state: dict, eff: dict, row: dict) -> dict:
    """A tick's effects written into the device's buffers and accumulators (the
    weight gradients are accumulated inside the backward's branch). Only
    a forward writes the stash: any other tick's slot index is the stash's
    length, out of bounds, and a scatter drops it (so the stash has no trash
    slot)."""
    n_stash = state["stash"][0].shape[0] if state["stash"] else 0
    slot = jnp.where(row["kind"] == 1, row["stash"], n_stash)
    return {
        **state,
        "stash": _set_slot(state["stash"], slot, eff["stash"]),
        "inbox_b": _set_slot(state["inbox_b"], row["self_b"], eff["post_ct"]),
        "g_xs": _accumulate_at(state["g_xs"], row["local"], eff["dw"]),
        "g_sh": [g + x.astype(g.dtype) for g, x in zip(state["g_sh"], eff["dsh"], strict=True)],
        "g_mb": _add_at_slot(state["g_mb"], row["mb"], eff["dmb"]),
        "loss": state["loss"] + eff["loss"],
    }


def _reduced_results(ctx: BoundLoss, lay: ManualAxes, state: dict, xs_l: list) -> tuple:
    """The explicit schedules' results, every gradient reduced here, once per
    step: the weights' over the batch axes (accumulated locally over the
    micro-batches until now), reduce-scattered to the plan's split of them."""
    sp, axis = ctx.sp, lay.axis
    psum = lambda x, axes=lay.all_axes: jax.lax.psum(x, axes)  # noqa: E731
    owned = lay.xs_ep or replicated_splits(xs_l)
    xs_out = [
        (s, o)
        for s, o, x in zip(lay.xs_out or replicated_splits(xs_l), owned, xs_l, strict=True)
        if differentiable(x)
    ]
    g_xs = [
        lay.reduce(g, s, 1, owned=o)[None] for g, (s, o) in zip(state["g_xs"], xs_out, strict=True)
    ]
    sh_out = [
        s
        for s, v in zip(lay.sh_out or replicated_splits(sp.shared), sp.shared, strict=True)
        if v in ctx.dshared
    ]
    dper = [k for k, v in enumerate(sp.per_mb) if v in ctx.dper]
    return (
        psum(state["loss"]),
        g_xs,
        [lay.reduce(g, s, 0, (axis,)) for g, s in zip(state["g_sh"], sh_out, strict=True)],
        [psum(g, lay.value_sum_axes(k)) for g, k in zip(state["g_mb"], dper, strict=True)],
        [psum(o, (axis,)) for o in state["outs"]],
    )

"""Context parallelism in a pipeline: does a stage on a device's tokens compute the global step?

With context axes (:func:`~spmdkit.pipeline.execute.pipelined_value_and_grad`'s
``context``) each device runs its stages on its own tokens of a micro-batch's
sequences and the step's loss is the mean of the devices' losses. That is the
global step only when

- no layer mixes tokens other than through the attention op, which exchanges
  K/V over the context axes: a causal convolution over time, a ``cumsum``, a
  mean over the sequence or a token shift would see a device's tokens alone;
- the loss is a mean over the tokens: an affine function of sums over them,
  each weighed by one over the tokens it sums (``nll.mean()``). A masked mean
  ``sum(mask · nll) / sum(mask)`` divides by a sum over the tokens, so the
  devices' masked means averaged are not the global one.

:func:`tokens_combined` checks both on the loss traced on a device's tokens
(where the context axes are bound): the layer scan's body with the walk of
:mod:`spmdkit.pipeline.rows` on the tokens' sequence dim (a value computed from
the device's index over the context axes, as the tokens' positions, or gathered
whole over them, as attention's K/V, holds the global entries), and the part
after it, where every sum over the tokens is followed to the loss with its
weight: a device's weights times the tokens each sum covers must equal those of
the loss traced on the whole micro-batch. The executor refuses the step
otherwise (:func:`tokens_error`), when the step is traced, before anything runs.

With batch axes the same holds of a device's rows: its loss on its rows of a
micro-batch, averaged over the devices, is the micro-batch's loss only for a
mean over the rows. :func:`rows_loss_combined` weighs the loss's sums over the
rows as above (:func:`rows_loss_error`); the planner asks both before it plans
a pipeline (:mod:`spmdkit.planner.pipeline.plan`).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.extend.core as jex
import numpy as np

from spmdkit import jaxprs
from spmdkit.pipeline import rows as rw
from spmdkit.pipeline.layouts import ManualAxes
from spmdkit.pipeline.schedule import PipelineError
from spmdkit.pipeline.split import SplitLoss
from spmdkit.state import register_context

__all__ = ["rows_loss_combined", "rows_loss_error", "tokens_combined", "tokens_error"]

#: what the walk's messages call the split entries: a device's tokens, or its rows
_UNIT: contextvars.ContextVar[str] = register_context(
    contextvars.ContextVar("spmdkit_tokens_unit", default="tokens"),
    module=__name__,
    name="_UNIT",
    set_by="`rows_loss_combined()`",
    read_by="the same walk's messages",
    why="what a row-combining check's messages call a device's share: its tokens or its rows.",
)


@dataclass(frozen=True)
class _Sum:
    """A value affine in sums over the tokens: per sum, its weight times the
    number of entries the sums leading to it reduced (1 for a mean)."""

    terms: tuple[float, ...]

    def scaled(self, k: float | None) -> _Sum:
        return self if k is None else _Sum(tuple(t * k for t in self.terms))


#: operations that pass a sum over the tokens on unchanged
_SAME = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "reduce_precision",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "name",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "optimization_barrier",
        "stop_gradient",
    }
)
_FOLD = {
    "neg": lambda a: -a,
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": max,
    "min": min,
    **dict.fromkeys(
        (
            "convert_element_type",
            "broadcast_in_dim",
            "reshape",
            "squeeze",
            "expand_dims",
            "copy",
            "reduce_max",
            "reduce_min",
        ),
        lambda a: a,
    ),
}
_LOOPS = frozenset({"scan", "while", "cond"})


def tokens_combined(sp: SplitLoss, local: SplitLoss, lay: ManualAxes) -> str:
    """With context axes: what makes the stages' step differ from the global one
    (module docstring), else ``""``.

    Args:
      sp: the loss split on one whole micro-batch.
      local: the loss split on a device's rows and tokens of it, traced where the
        context axes are bound (:func:`spmdkit.context_parallel.context_shard`).
      lay: the pipeline's manual axes (``lay.seq``: per per-micro-batch value,
        the dim the context axes split).

    Example::

        >>> tokens_combined(sp, local, lay)   # a masked-mean loss
        'the loss: `div by a sum over the tokens (a masked mean is one)`'
    """
    if not lay.context:
        return ""
    seq = [rw.state_of(d) for d in lay.seq]
    with rw.aware_of(lay.context):
        env = dict(zip(local.per_mb, seq, strict=False))
        ins = [_read(env, v) for v in local.scan.invars]
        if all(rw.row_dim(s) is None for s in ins):
            return ""
        try:
            outs = [rw.state_of(d) for d in rw.row_rule(local.scan, ins)]
        except rw.Mixed as e:
            return f"a layer's `{e}`"
        return _not_a_mean(sp, local, seq, outs, "tokens", "the whole sequence")


def _not_a_mean(
    sp: SplitLoss, local: SplitLoss, states: list, outs: list, unit: str, whole: str
) -> str:
    """How the loss weighs its sums over ``unit`` (tokens or rows) on a device's
    share (``local``) against on ``whole`` (``sp``), when the two differ: then the
    devices' losses, averaged, are not the loss. ``""`` when they agree."""
    try:
        mine = _loss_terms(local, states, outs)
        theirs = _loss_terms(sp, states, outs)
    except rw.Mixed as e:
        return f"the loss: `{e}`"
    if len(mine) != len(theirs) or not np.allclose(mine, theirs, rtol=1e-6, atol=0.0):
        return (
            f"the loss weighs its sums over the {unit} by {list(mine)} on a device's "
            f"{unit} and {list(theirs)} on {whole} (each weight times the entries it "
            f"sums): not a mean over the {unit}"
        )
    return ""


def tokens_error(problem: str, axes: tuple[str, ...], op: str) -> PipelineError:
    """The typed error for a pipelined context-parallel step whose stages would not
    compute the global step (``problem``: :func:`tokens_combined`'s)."""
    return PipelineError(
        op=op,
        must="with the sequence split over context axes inside the pipeline, each "
        "device runs its stages on its own tokens: no layer may mix tokens but "
        "through the attention op, and the loss must be a mean over the tokens",
        given=f"{problem} (the sequence over {axes})",
        fix="plan this model without pipelining (a flat plan runs context parallelism "
        "as global SPMD, correct for any layer and loss), or with a context degree "
        "of 1; for a masked mean, weigh the tokens by a mask normalized over the "
        "whole batch before the step (mean(mask · nll) / mean(mask) computed outside)",
    )


def rows_loss_combined(sp: SplitLoss, local: SplitLoss, lay: ManualAxes) -> str:
    """With batch axes: what makes the devices' losses on their rows of a
    micro-batch, averaged, differ from the micro-batch's loss (a loss that is not
    a mean over the rows: a masked mean, a sum), else ``""``. The same weighing
    of sums as :func:`tokens_combined`'s, on the rows' dim; a layer that combines
    rows is :func:`~spmdkit.pipeline.facts.split_rows_combined`'s to refuse (or
    ``local_statistics``'s to allow), so the loss is not checked past it.

    Args:
      sp: the loss split on one whole micro-batch.
      local: the loss split on a device's rows of it (``lay.shards`` devices).
      lay: the pipeline's manual axes (``lay.rows``: per per-micro-batch value,
        whether its rows are split).

    Example::

        >>> rows_loss_combined(sp, local, lay)   # nll.sum() over data=2
        'the loss weighs its sums over the rows by [8.0] ... not a mean over the rows'
    """
    if not lay.batch or lay.shards == 1:
        return ""
    rows = [rw.state_of(0 if r else None) for r in lay.rows]
    token = _UNIT.set("rows")
    try:
        env = dict(zip(local.per_mb, rows, strict=False))
        ins = [_read(env, v) for v in local.scan.invars]
        try:
            outs = [rw.state_of(d) for d in rw.row_rule(local.scan, ins)]
        except rw.Mixed:
            return ""
        return _not_a_mean(sp, local, rows, outs, "rows", "the whole micro-batch")
    finally:
        _UNIT.reset(token)


def rows_loss_error(problem: str, axes: tuple[str, ...], op: str) -> PipelineError:
    """The typed error for a pipeline with batch axes whose loss is not a mean over
    a micro-batch's rows (``problem``: :func:`rows_loss_combined`'s)."""
    return PipelineError(
        op=op,
        must="with the batch split over other mesh axes inside the pipeline, each "
        "device runs the loss on its own rows of a micro-batch and the step's loss "
        "is the mean of the devices': the loss must be a mean over the rows",
        given=f"{problem} (the batch over {axes})",
        fix="keep the batch off the axes beside the pipe axis (a plan whose batch "
        "rule names none of them), or plan without pipelining (a flat plan with "
        "micro-batches computes each micro-batch's loss whole); for a masked mean, "
        "weigh the tokens by a mask normalized over the whole batch before the step",
    )


def _read(env: dict, v: Any) -> rw.State:
    return rw.FREE if isinstance(v, jex.Literal) else env.get(v, rw.FREE)


def _loss_terms(split: SplitLoss, seq: Sequence[rw.State], carry: Sequence[Any]) -> tuple:
    """The weights of the sums over the tokens in ``split``'s loss (the part after
    the layer scan), given the per-micro-batch values' sequence dims and the
    scan's results' (:class:`_Sum`); raises ``rows.Mixed`` where it is not affine
    in such sums."""
    jaxpr = split.closed.jaxpr
    env: dict = dict(zip(split.per_mb, seq, strict=False))
    env.update(zip(split.scan.outvars, carry, strict=True))
    known = {
        v: float(c)
        for v, c in zip(jaxpr.constvars, split.closed.consts, strict=True)
        if np.ndim(c) == 0 and np.issubdtype(np.asarray(c).dtype, np.number)
    }
    (out,) = _walk(jaxpr.eqns[split.index + 1 :], env, known, jaxpr.outvars[:1])
    if isinstance(out, _Sum):
        return out.terms
    if rw.row_dim(out) is not None:  # pragma: no cover - a scalar loss has no dims
        raise rw.Mixed(f"a loss that keeps the {_UNIT.get()}' dim")
    return ()


def _walk(eqns: Sequence[Any], env: dict, known: dict, outvars: Sequence[Any]) -> list:
    """The states of ``outvars`` (``known``: variables whose entries are each one
    known value, updated as they are computed)."""

    def value(v: Any) -> float | None:
        if isinstance(v, jex.Literal):
            return float(v.val) if np.ndim(v.val) == 0 else None
        return known.get(v)

    for eqn in eqns:
        ins = [_read(env, v) for v in eqn.invars]
        vals = [value(v) for v in eqn.invars]
        outs = _step(eqn, ins, vals, known)
        env.update(zip(eqn.outvars, outs, strict=True))
        k = _fold(eqn, vals)
        if k is not None:
            known[eqn.outvars[0]] = k
    return [_read(env, v) for v in outvars]


def _fold(eqn: Any, vals: list) -> float | None:
    """The value of every entry of the equation's result, where its operands'
    entries are each one known value (a literal, a broadcast constant: the
    count of a mask of ones is the tokens' count)."""
    name = eqn.primitive.name
    if len(eqn.outvars) != 1 or not vals or any(x is None for x in vals):
        return None
    if name == "reduce_sum":
        shape = rw.shape_of(eqn.invars[0])
        return vals[0] * math.prod(shape[a] for a in eqn.params["axes"])
    fold = _FOLD.get(name)
    return None if fold is None else float(fold(*vals))


def _step(eqn: Any, ins: list, vals: list, known: dict) -> list:
    """The states of one equation's results (module docstring)."""
    name = eqn.primitive.name
    if any(isinstance(s, _Sum) for s in ins):
        return _on_sum(eqn, ins, vals, known)
    if all(rw.row_dim(s) is None for s in ins):
        return rw.free_rule(eqn, ins)
    body = jaxprs.computed_body(eqn) if name not in _LOOPS else None
    if body is not None:
        return _nested(body, ins, vals)
    d = next(rw.row_dim(s) for s in ins if rw.row_dim(s) is not None)
    if name in rw.REDUCE and d in eqn.params["axes"]:
        if name != "reduce_sum" or len(ins) != 1:
            raise rw.mixed(eqn, f"over the {_UNIT.get()}", eqn.invars[0], dim=d)
        shape = rw.shape_of(eqn.invars[0])
        return [_Sum((float(math.prod(shape[a] for a in eqn.params["axes"])),))]
    return [rw.state_of(x) for x in rw.row_rule(eqn, ins)]


def _nested(body: Any, ins: list, vals: list) -> list:
    inner, consts = jaxprs.open_jaxpr(body)
    known = {
        v: float(c)
        for v, c in zip(inner.constvars, consts, strict=False)
        if np.ndim(c) == 0 and np.issubdtype(np.asarray(c).dtype, np.number)
    }
    known.update({v: x for v, x in zip(inner.invars, vals, strict=True) if x is not None})
    env = dict(zip(inner.invars, ins, strict=True))
    return _walk(inner.eqns, env, known, inner.outvars)


def _on_sum(eqn: Any, ins: list, vals: list, known: dict) -> list:
    """A sum over the tokens may be added to, scaled by values that do not depend
    on the tokens, summed further or reshaped; nothing else keeps the loss a
    mean over them."""
    name = eqn.primitive.name
    sums = [s for s in ins if isinstance(s, _Sum)]
    if any(rw.row_dim(s) is not None for s in ins):
        unit = _UNIT.get()
        raise rw.mixed(eqn, f"of a sum over the {unit} and the {unit} themselves")
    if name in _SAME and len(sums) == 1:
        return [sums[0]] * len(eqn.outvars)
    if name == "neg":
        return [sums[0].scaled(-1.0)]
    if name in {"add", "sub"}:
        sign = [1.0, -1.0 if name == "sub" else 1.0]
        terms = [
            t * k for s, k in zip(ins, sign, strict=True) if isinstance(s, _Sum) for t in s.terms
        ]
        return [_Sum(tuple(terms))]
    if name == "reduce_sum":
        shape = rw.shape_of(eqn.invars[0])
        return [sums[0].scaled(float(math.prod(shape[a] for a in eqn.params["axes"])))]
    if name == "mul" and len(sums) == 1:
        other = vals[1] if isinstance(ins[0], _Sum) else vals[0]
        return [sums[0].scaled(other)]
    if name == "div" and isinstance(ins[0], _Sum) and not isinstance(ins[1], _Sum):
        return [sums[0].scaled(None if vals[1] is None else 1.0 / vals[1])]
    if name == "div":
        raise rw.mixed(eqn, f"by a sum over the {_UNIT.get()} (a masked mean is one)")
    body = jaxprs.computed_body(eqn) if name not in _LOOPS else None
    if body is not None:
        return _nested(body, ins, vals)
    raise rw.mixed(
        eqn, f"of a sum over the {_UNIT.get()} (not affine in it: a masked mean's count is one)"
    )

"""Softmax cross-entropy: ``softmax_cross_entropy(logits, labels)``.

Attributes: ``axis`` (the class dim of ``logits``, default -1), ``soft_label``
(``None``: decided by the labels' rank — same rank as the logits → soft labels,
one less → hard integer labels; ``True``/``False`` states it and is checked),
``ignore_index`` (hard labels equal to it give loss 0 and are left out of the
mean; default -100), ``reduction`` (``"none"`` → one loss per row,
``"sum"``, ``"mean"`` → over the rows that are not ignored; default
``"mean"``, 0 when every row is ignored) and ``label_smoothing`` ε (the target
becomes ``(1-ε)·target + ε/C``).

Out-of-range hard labels (outside ``[0, C)`` and not ``ignore_index``) cannot
raise under ``jit``; they give a NaN loss for their row (so a mean is NaN too)
and a zero gradient for it, on every layout. Hard labels must be integers and
soft labels floats: nothing is cast.

Algebra. A row's loss is ``lse(z) - Σ_c t_c z_c`` scaled by ``Σ t`` for soft
targets: it depends on the whole class dim only through per-row scalars — the
max, the sum of exponentials, the target logit (hard) or ``Σ q·z`` and ``Σ q``
(soft), and ``Σ z`` under label smoothing. So the class dim may stay sharded
(*vocab-parallel*): each device reduces its class block and the per-row
scalars are all-reduced over the class axes (one max, one sum of the stacked
scalars) — O(rows) bytes, never the logits. Each device finds its class block
from its offset, gathers the target logit per row (zero when the target lies
in another block), and masks the padding of an uneven block. The backward, ``(softmax - t)·g`` (and
``(1-ε)(lse - z)·g`` for soft labels), is local to each class block given the
row's ``lse``, so it moves nothing: the local computation carries a custom VJP
that saves the row statistics instead of differentiating the all-reduces.

Strategies:

* ``"default"`` (the reference, PaddlePaddle's rule): the class dim keeps its
  sharding only for hard labels on the last dim; otherwise it is replicated.
* ``"vocab_parallel"`` (beyond the reference): the class dim may stay sharded
  for soft labels and for any ``axis`` too.

The other dims (rows) pass through: the labels follow the logits there (the
logits' sharding wins; a dim the logits leave unsharded takes the labels'),
and the per-row loss carries the same layout. ``"sum"`` and ``"mean"`` over
sharded rows leave a scalar that is sum-partial over the row axes: each device
holds its rows' sum (divided, for ``"mean"``, by the global count of kept rows,
which costs one scalar all-reduce over the row axes for hard labels). Padding
rows of uneven blocks are masked out of these sums.

Partials: the loss is not linear in the logits, and label smoothing makes it
affine rather than linear in soft labels, so partial inputs are resolved.
The grads are linear in the cotangent: a sum/avg-partial cotangent over an axis
the case does not use passes to the grads; the logits grad (and a soft labels
grad) has the logits' (labels') layout — it follows the labels on the row dims.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.engine.factor_rule import assign_factors
from spmdkit.engine.rule import (
    Example,
    Inferred,
    InferredGrad,
    LocalContext,
    Rule,
    RuleContext,
    op_collective,
    without_strategy,
)
from spmdkit.errors import ShardingConflictError
from spmdkit.spec import TensorSpec

__all__ = ["RULES", "REDUCTIONS", "CrossEntropyConfig", "cross_entropy_config"]

OP = "softmax_cross_entropy"

#: Accepted ``reduction`` values.
REDUCTIONS = ("none", "mean", "sum")

_CLASS = "c"


@dataclass(frozen=True)
class CrossEntropyConfig:
    """The checked attributes of one softmax cross-entropy call.

    Attributes:
      rank: rank of the logits.
      axis: the class dim of the logits (non-negative).
      num_classes: C.
      soft: soft (float, logits-shaped) labels, else hard integer labels.
      ignore_index: hard label value that is ignored.
      reduction: ``"none"``, ``"mean"`` or ``"sum"``.
      smoothing: label smoothing ε.
    """

    rank: int
    axis: int
    num_classes: int
    soft: bool
    ignore_index: int | None
    reduction: str
    smoothing: float

    @property
    def row_dims(self) -> tuple[int, ...]:
        """The logits dims that are not the class dim."""
        return tuple(d for d in range(self.rank) if d != self.axis)


def _fail(must: str, given: str, fix: str) -> ShardingConflictError:
    return ShardingConflictError(op=OP, must=must, given=given, fix=fix)


def cross_entropy_config(
    logits_shape: Sequence[int],
    labels_shape: Sequence[int],
    *,
    logits_dtype: Any = None,
    labels_dtype: Any = None,
    axis: int = -1,
    soft_label: bool | None = None,
    ignore_index: int | None = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> CrossEntropyConfig:
    """Check the shapes, dtypes and attributes of a call; return its config.

    Raises:
      ShardingConflictError: the labels do not fit the logits (shape, rank,
        dtype), or an attribute is out of range.

    Example::

        >>> cross_entropy_config((8, 16), (8,), labels_dtype="int32").soft
        False
    """
    logits_shape, labels_shape = tuple(logits_shape), tuple(labels_shape)
    rank = len(logits_shape)
    if rank == 0:
        raise _fail("logits have a class dim (rank ≥ 1)", "a scalar", "pass logits [..., C]")
    if not isinstance(axis, (int, np.integer)) or not -rank <= axis < rank:
        raise _fail(f"axis is a dim of the rank-{rank} logits", f"axis={axis!r}", "pass axis=-1")
    ax = int(axis) % rank
    if reduction not in REDUCTIONS:
        raise _fail(f"reduction is one of {REDUCTIONS}", repr(reduction), "pass reduction='mean'")
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise _fail("0 ≤ label_smoothing ≤ 1", repr(label_smoothing), "pass e.g. 0.1")
    if logits_dtype is not None and not jnp.issubdtype(np.dtype(logits_dtype), jnp.floating):
        raise _fail("logits are floating point", str(np.dtype(logits_dtype)), "cast the logits")
    rows = tuple(n for d, n in enumerate(logits_shape) if d != ax)
    if soft_label is None:
        if len(labels_shape) == rank:
            soft_label = True
        elif len(labels_shape) == rank - 1:
            soft_label = False
        else:
            raise _fail(
                "labels have the logits' rank (soft) or one less (hard, class dim dropped)",
                f"logits {logits_shape}, labels {labels_shape}",
                "pass integer labels of shape logits.shape without the class dim",
            )
    want = logits_shape if soft_label else rows
    if labels_shape != want:
        kind = (
            "soft labels have the logits' shape"
            if soft_label
            else ("hard labels have the logits' shape without the class dim")
        )
        raise _fail(
            kind,
            f"logits {logits_shape} (axis={axis}), labels {labels_shape}",
            f"pass labels of shape {want}",
        )
    if labels_dtype is not None:
        dt = np.dtype(labels_dtype)
        if soft_label and not jnp.issubdtype(dt, jnp.floating):
            raise _fail(
                "soft labels are floating point",
                str(dt),
                "pass soft_label=False for integer class labels (rank of logits minus one)",
            )
        if not soft_label and not jnp.issubdtype(dt, jnp.integer):
            raise _fail("hard labels are integers", str(dt), "cast them with .astype(jnp.int32)")
    return CrossEntropyConfig(
        rank=rank,
        axis=ax,
        num_classes=int(logits_shape[ax]),
        soft=bool(soft_label),
        ignore_index=None if ignore_index is None else int(ignore_index),
        reduction=reduction,
        smoothing=eps,
    )


_ATTRS = ("axis", "soft_label", "ignore_index", "reduction", "label_smoothing")


def _config(logits: TensorSpec, labels: TensorSpec, attrs: Any) -> CrossEntropyConfig:
    unknown = sorted(set(without_strategy(attrs)) - set(_ATTRS))
    if unknown:
        raise _fail(f"attributes are among {_ATTRS}", f"{unknown}", "drop or rename them")
    return cross_entropy_config(
        logits.shape,
        labels.shape,
        logits_dtype=logits.dtype,
        labels_dtype=labels.dtype,
        **without_strategy(attrs),
    )


# ---------------------------------------------------------------------------
# The unsharded reference
# ---------------------------------------------------------------------------


def _reduce(loss: jax.Array, keep: jax.Array, reduction: str) -> jax.Array:
    if reduction == "none":
        return loss
    total = jnp.sum(loss)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(keep), 1).astype(loss.dtype)


def softmax_cross_entropy_reference(
    logits: jax.Array,
    labels: jax.Array,
    *,
    axis: int = -1,
    soft_label: bool | None = None,
    ignore_index: int | None = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> jax.Array:
    """The unsharded op (the rule's ``impl``): plain ``log_softmax`` arithmetic."""
    cfg = cross_entropy_config(
        logits.shape,
        labels.shape,
        logits_dtype=logits.dtype,
        labels_dtype=labels.dtype,
        axis=axis,
        soft_label=soft_label,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    eps, n = cfg.smoothing, cfg.num_classes
    logp = jax.nn.log_softmax(jnp.moveaxis(logits, cfg.axis, -1), axis=-1)
    if cfg.soft:
        q = jnp.moveaxis(labels, cfg.axis, -1)
        loss = -jnp.sum(((1 - eps) * q + eps / n) * logp, axis=-1)
        keep = jnp.ones(loss.shape, bool)
    else:
        inrange = (labels >= 0) & (labels < n)
        safe = jnp.where(inrange, labels, 0)
        # the target's log-probability selected by a class mask and a sum, not
        # gathered: the same value exactly, and XLA's SPMD partitioner aborts on a
        # gather along a sharded class dim inside a partially manual shard_map
        # (a pipeline stage with data and model axes; spmdkit.pipeline.execute)
        target = jnp.arange(n) == safe[..., None]
        nll = -jnp.sum(jnp.where(target, logp, 0.0), axis=-1)
        loss = (1 - eps) * nll - eps * jnp.mean(logp, axis=-1)
        keep = (
            jnp.ones(labels.shape, bool)
            if cfg.ignore_index is None
            else (labels != cfg.ignore_index)
        )
        loss = jnp.where(keep, jnp.where(inrange, loss, jnp.nan), 0.0).astype(logp.dtype)
    return _reduce(loss, keep, cfg.reduction)


# ---------------------------------------------------------------------------
# The per-device computation (vocab-parallel forward, communication-free backward)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _LocalCE:
    """The local loss of one case, with a custom VJP whose backward moves nothing.

    Arguments of :meth:`fn`'s function: ``z`` (local logits, class dim last),
    ``y`` (local labels: class dim last for soft labels), ``offset`` (global
    index of the first local class), ``row_ok`` (False on padding rows).
    ``padded_classes``: the class blocks are uneven, so columns past C are masked.
    Each pass re-reads ``z`` inside its own reduction, and the hard target is a
    per-row gather, so no logits-sized temporary outlives a collective.
    """

    cfg: CrossEntropyConfig
    class_axes: tuple[str, ...]
    count_axes: tuple[str, ...]
    total_rows: int
    padded_classes: bool

    def fn(self) -> Callable[..., Any]:
        """``ce(z, y, offset, row_ok)`` with the communication-free backward."""

        @jax.custom_vjp
        def ce(z, y, offset, row_ok):
            return self.fwd(z, y, offset, row_ok)[0]

        ce.defvjp(self.fwd, self.bwd)
        return ce

    def valid(self, z, offset):
        """Per local column: whether it is a real class (None: every one is)."""
        if not self.padded_classes:
            return None
        return (jnp.arange(z.shape[-1]) + offset) < self.cfg.num_classes

    @staticmethod
    def masked(x, ok, fill):
        return x if ok is None else jnp.where(ok, x, fill)

    @staticmethod
    def target(z, y, offset):
        """Per row: the local target logit (0 where the target is in another block)."""
        local = y - offset
        inside = (local >= 0) & (local < z.shape[-1])
        idx = jnp.clip(local, 0, z.shape[-1] - 1)[..., None]
        return jnp.where(inside, jnp.take_along_axis(z, idx, axis=-1)[..., 0], 0.0), inside

    def stats(self, z, y, offset):
        """Per row: log-sum-exp, and the class sums every device reduces together."""
        ok, masked, class_axes = self.valid(z, offset), self.masked, self.class_axes
        m = jnp.max(masked(z, ok, -jnp.inf), axis=-1)
        if class_axes:
            m = jax.lax.pmax(m, class_axes)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        cols = [jnp.sum(masked(jnp.exp(z - m[..., None]), ok, 0.0), axis=-1)]
        if self.cfg.soft:
            cols += [
                jnp.sum(masked(y * z, ok, 0.0), axis=-1),
                jnp.sum(masked(y, ok, 0.0), axis=-1),
            ]
        else:
            cols.append(self.target(z, y, offset)[0])
        if self.cfg.smoothing:
            cols.append(jnp.sum(masked(z, ok, 0.0), axis=-1))
        s = jnp.stack(cols, axis=-1)
        if class_axes:
            s = jax.lax.psum(s, class_axes)
        lse = m + jnp.log(s[..., 0])
        return lse, s

    def fwd(self, z, y, offset, row_ok):
        cfg = self.cfg
        eps, n = cfg.smoothing, cfg.num_classes
        lse, s = self.stats(z, y, offset)
        smooth = eps / n * s[..., -1] if eps else 0.0
        if cfg.soft:
            loss = lse * ((1 - eps) * s[..., 2] + eps) - (1 - eps) * s[..., 1] - smooth
            keep = jnp.ones(loss.shape, bool)
            good = keep
        else:
            loss = lse - (1 - eps) * s[..., 1] - smooth
            inrange = (y >= 0) & (y < n)
            keep = jnp.ones(y.shape, bool) if cfg.ignore_index is None else (y != cfg.ignore_index)
            loss = jnp.where(keep, jnp.where(inrange, loss, jnp.nan), 0.0)
            good = keep & inrange
        loss = loss.astype(z.dtype)
        count = jnp.ones((), z.dtype)
        if cfg.reduction == "none":
            out = loss
        else:
            out = jnp.sum(jnp.where(row_ok, loss, 0.0))
            if cfg.reduction == "mean":
                count = self.count(z, keep, row_ok)
                out = out / count
        return out, (z, y, offset, lse, s, good, count)

    def count(self, z, keep, row_ok):
        """The mean's denominator: every row (soft labels) or the kept rows, over all devices."""
        if self.cfg.soft:
            return jnp.asarray(max(self.total_rows, 1), z.dtype)
        kept = jnp.sum(keep & row_ok).astype(jnp.int32)
        if self.count_axes:
            kept = jax.lax.psum(kept, self.count_axes)
        return jnp.maximum(kept, 1).astype(z.dtype)

    def bwd(self, res, g):
        z, y, offset, lse, s, good, count = res
        eps, n = self.cfg.smoothing, self.cfg.num_classes
        ok, masked = self.valid(z, offset), self.masked
        p = masked(jnp.exp(z - lse[..., None]), ok, 0.0)
        gr = g if self.cfg.reduction == "none" else jnp.broadcast_to(g / count, lse.shape)
        uniform = eps / n if ok is None else eps / n * ok
        if self.cfg.soft:
            sq = (1 - eps) * s[..., 2] + eps
            dz = (p * sq[..., None] - (1 - eps) * masked(y, ok, 0.0) - uniform) * gr[..., None]
            dy = (1 - eps) * masked(lse[..., None] - z, ok, 0.0) * gr[..., None]
            return dz.astype(z.dtype), dy.astype(y.dtype), None, None
        cls = jnp.arange(z.shape[-1]) + offset
        onehot = cls == y[..., None]
        w = jnp.where(good, gr, 0.0)
        dz = (p - (1 - eps) * onehot - uniform) * w[..., None]
        return dz.astype(z.dtype), None, None, None


def _row_mask(lctx: LocalContext, spec: TensorSpec, cfg: CrossEntropyConfig, shape) -> Any:
    """False on the padding rows of uneven row blocks (``shape``: local rows)."""
    ok = jnp.ones(shape, bool)
    for j, d in enumerate(cfg.row_dims):
        if not spec.dims[d] or spec.shape[d] % lctx.shards(spec, d) == 0:
            continue
        idx = jnp.arange(shape[j]) + lctx.offset(spec, d)
        ok = ok & (idx < spec.shape[d]).reshape([-1 if k == j else 1 for k in range(len(shape))])
    return ok


# ---------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------


class CrossEntropyRule(Rule):
    """``softmax_cross_entropy``: vocab-parallel forward, communication-free backward."""

    name = OP
    impl = staticmethod(softmax_cross_entropy_reference)
    strategies = ("default", "vocab_parallel")
    doc = "softmax cross-entropy; the class dim may stay sharded (vocab-parallel)"

    def __init__(self, examples: Sequence[Example] = ()) -> None:
        self.examples = tuple(examples)

    def named_strategy(self, ctx: RuleContext, inputs: Sequence[TensorSpec]) -> str:
        """``"vocab_parallel"`` wherever the logits' class dim stays sharded (the
        reference strategy keeps it so for hard labels on the last dim, computing
        exactly what ``vocab_parallel`` does), else the strategy asked for."""
        name = self.strategy(ctx)
        logits, labels = inputs[0], inputs[1]
        cfg = _config(logits, labels, ctx.attrs)
        return "vocab_parallel" if logits.dims[cfg.axis] else name

    # -- layout ------------------------------------------------------------
    @staticmethod
    def _factors(cfg: CrossEntropyConfig, spec_rank: int, is_labels: bool) -> list[Any]:
        """Factor of each dim: a row index, or ``"c"`` for the class dim."""
        if spec_rank == cfg.rank and not (is_labels and not cfg.soft):
            rows = iter(range(cfg.rank - 1))
            return [_CLASS if d == cfg.axis else next(rows) for d in range(cfg.rank)]
        return list(range(spec_rank))

    def _sources(
        self, cfg: CrossEntropyConfig, logits: TensorSpec, labels: TensorSpec
    ) -> list[tuple[list[Any], TensorSpec]]:
        """The logits, then the labels, as factor sources."""
        return [
            (self._factors(cfg, logits.ndim, False), logits),
            (self._factors(cfg, labels.ndim, True), labels),
        ]

    def _assign(
        self,
        ctx: RuleContext,
        cfg: CrossEntropyConfig,
        sources: Sequence[tuple[list[Any], TensorSpec]],
        start: dict[Any, tuple[str, ...]] | None = None,
    ) -> dict[Any, tuple[str, ...]]:
        """:func:`~spmdkit.engine.factor_rule.assign_factors` in the logits' dim order; the class
        dim stays unsharded unless the strategy (or hard labels on the last dim)
        allows it."""
        class_ok = self.strategy(ctx) == "vocab_parallel" or (
            not cfg.soft and cfg.axis == cfg.rank - 1
        )
        order = self._factors(cfg, cfg.rank, False)
        return assign_factors(
            sources, order=order, start=start, allowed=lambda f, _: class_ok or f != _CLASS
        )

    def _specs(
        self,
        ctx: RuleContext,
        cfg: CrossEntropyConfig,
        logits: TensorSpec,
        labels: TensorSpec,
        assign: dict[Any, tuple[str, ...]],
    ) -> Inferred:
        def layout(spec: TensorSpec, is_labels: bool) -> list[tuple[str, ...]]:
            return [assign[f] for f in self._factors(cfg, spec.ndim, is_labels)]

        req = (
            TensorSpec(logits.shape, layout(logits, False), dtype=logits.dtype),
            TensorSpec(labels.shape, layout(labels, True), dtype=labels.dtype),
        )
        row_axes = tuple(a for j in range(cfg.rank - 1) for a in assign[j])
        if cfg.reduction == "none":
            rows = tuple(logits.shape[d] for d in cfg.row_dims)
            out = TensorSpec(rows, [assign[j] for j in range(len(rows))], dtype=logits.dtype)
        else:
            out = TensorSpec((), partial={a: "sum" for a in row_axes}, dtype=logits.dtype)
        return Inferred(req, (out,), self._collectives(ctx, cfg, req[0], assign, row_axes))

    @staticmethod
    def _collectives(
        ctx: RuleContext,
        cfg: CrossEntropyConfig,
        logits: TensorSpec,
        assign: dict[Any, tuple[str, ...]],
        row_axes: tuple[str, ...],
    ) -> tuple[Any, ...]:
        out = []
        class_axes = assign[_CLASS]
        if class_axes:
            shards = {a: n for a, n in ctx.axis_sizes.items()}
            rows = math.prod(
                -(-logits.shape[d] // math.prod(shards[a] for a in logits.dims[d]))
                for d in cfg.row_dims
            )
            item = logits.itemsize
            k = (3 if cfg.soft else 2) + (1 if cfg.smoothing else 0)
            out.append(op_collective(ctx, "all_reduce", class_axes, rows * item, reduce_op="max"))
            out.append(
                op_collective(ctx, "all_reduce", class_axes, rows * k * item, reduce_op="sum")
            )
        if cfg.reduction == "mean" and not cfg.soft and row_axes:
            out.append(op_collective(ctx, "all_reduce", row_axes, 4, reduce_op="sum"))
        return tuple(out)

    # -- the three inferences ----------------------------------------------
    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Rows follow the logits (then the labels); the class dim keeps its sharding
        where the strategy allows; partial inputs are resolved."""
        logits, labels = self._two(inputs)
        cfg = _config(logits, labels, ctx.attrs)
        assign = self._assign(ctx, cfg, self._sources(cfg, logits, labels))
        return self._specs(ctx, cfg, logits, labels, assign)

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """Rows take the per-row loss's layout; a sum-partial scalar loss (sum/mean)
        is traced back to the first row dim, sharded over those axes."""
        logits, labels = self._two(inputs)
        cfg = _config(logits, labels, ctx.attrs)
        (out,) = self._outputs(cfg, logits, outputs, "outputs")
        if cfg.reduction == "none":
            assign = self._assign(ctx, cfg, [(list(range(out.ndim)), out)])
        else:
            axes = tuple(a for a, op in out.partial if op == "sum")
            rows = (logits.shape[d] for d in cfg.row_dims)
            first = next((j for j, n in enumerate(rows) if n > 1), None)
            start = {first: axes} if axes and first is not None else {}
            assign = self._assign(ctx, cfg, [], start)
        plain = (logits.without_partial(), labels.without_partial())
        return self._specs(ctx, cfg, *plain, assign)

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """The forward layout; rows it left unsharded take the cotangent's layout.
        The grads have their inputs' layouts (the backward moves nothing) plus the
        cotangent's sum/avg partials over axes the case does not use."""
        logits, labels = self._two(inputs)
        cfg = _config(logits, labels, ctx.attrs)
        (g,) = self._outputs(cfg, logits, out_grads, "out_grads")
        plain = (logits.without_partial(), labels.without_partial())
        assign = self._assign(ctx, cfg, self._sources(cfg, *plain))
        if cfg.reduction == "none":
            start = {f: a for f, a in assign.items() if a or f == _CLASS}
            assign = self._assign(ctx, cfg, [(list(range(g.ndim)), g)], start)
        fwd = self._specs(ctx, cfg, *plain, assign)
        used = {a for axes in assign.values() for a in axes}
        g_partial = {a: op for a, op in g.partial if a not in used and op in ("sum", "avg")}
        req_g = TensorSpec(
            g.shape,
            fwd.outputs[0].dims,
            partial=g_partial,
            dtype=g.dtype,
        )
        grads = (
            fwd.inputs[0].replace(partial=g_partial),
            fwd.inputs[1].replace(partial=g_partial) if cfg.soft else fwd.inputs[1],
        )
        return InferredGrad(fwd.inputs, (req_g,), grads, fwd.outputs)

    # -- the local computation ---------------------------------------------
    def local_fn(self, lctx: LocalContext) -> Any:
        """Per-device loss: all-reduces of per-row scalars over the class axes,
        a custom VJP that moves nothing."""
        logits_spec, labels_spec = lctx.inputs
        cfg = _config(logits_spec, labels_spec, lctx.attrs)
        class_axes = logits_spec.dims[cfg.axis]
        row_axes = tuple(a for d in cfg.row_dims for a in logits_spec.dims[d])
        total_rows = math.prod(logits_spec.shape[d] for d in cfg.row_dims)
        padded = cfg.num_classes % lctx.shards(logits_spec, cfg.axis) != 0
        ce = _LocalCE(cfg, class_axes, row_axes, total_rows, padded).fn()

        def fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
            z = jnp.moveaxis(logits, cfg.axis, -1)
            y = jnp.moveaxis(labels, cfg.axis, -1) if cfg.soft else labels
            offset = jnp.asarray(lctx.offset(logits_spec, cfg.axis), jnp.int32)
            row_ok = _row_mask(lctx, logits_spec, cfg, z.shape[:-1])
            return ce(z, y, offset, row_ok)

        return fn

    # -- checks --------------------------------------------------------------
    @staticmethod
    def _two(inputs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, TensorSpec]:
        if len(inputs) != 2:
            raise _fail(
                "two inputs: logits and labels",
                f"{len(inputs)} inputs",
                "pass (logits, labels)",
            )
        return inputs[0], inputs[1]

    @staticmethod
    def _outputs(
        cfg: CrossEntropyConfig,
        logits: TensorSpec,
        given: Sequence[TensorSpec],
        what: str,
    ) -> tuple[TensorSpec]:
        want = () if cfg.reduction != "none" else tuple(logits.shape[d] for d in cfg.row_dims)
        if len(given) != 1 or given[0].shape != want:
            raise _fail(
                f"{what} are one tensor of shape {want}",
                str([g.shape for g in given]),
                f"pass {what} with the loss's shape",
            )
        return (given[0],)


# ---------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------


def _hard_values(rows: tuple[int, ...], classes: int, ignore: int):
    def values(rng: np.random.Generator) -> list[np.ndarray]:
        logits = rng.standard_normal((*rows, classes)).astype(np.float32) * 2
        labels = rng.integers(0, classes, size=rows).astype(np.int32)
        labels.reshape(-1)[1] = ignore
        return [logits, labels]

    return values


def _hard_values_axis(rows: tuple[int, ...], classes: int, axis: int, ignore: int):
    """Hard-label values with the class dim at ``axis`` of the logits."""
    last = _hard_values(rows, classes, ignore)

    def values(rng: np.random.Generator) -> list[np.ndarray]:
        logits, labels = last(rng)
        return [np.ascontiguousarray(np.moveaxis(logits, -1, axis)), labels]

    return values


def _soft_values(shape: tuple[int, ...]):
    def values(rng: np.random.Generator) -> list[np.ndarray]:
        logits = rng.standard_normal(shape).astype(np.float32) * 2
        q = rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]).astype(np.float32)
        return [logits, q]

    return values


_EXAMPLES = (
    Example(
        ((6, 8), (6,)),
        attrs={"reduction": "mean", "ignore_index": 3, "label_smoothing": 0.1},
        dtypes=("float32", "int32"),
        differentiable=(True, False),
        values=_hard_values((6,), 8, 3),
    ),
    Example(
        ((4, 6), (4, 6)),
        attrs={"reduction": "none", "label_smoothing": 0.2, "strategy": "vocab_parallel"},
        values=_soft_values((4, 6)),
    ),
    # Uneven: 6 rows and 7 classes divide neither 4 nor 8 (7 not even 2), so the
    # class blocks are padded (one device may hold padding only) and so are the rows.
    Example(
        ((6, 7), (6,)),
        attrs={"reduction": "mean", "ignore_index": 3, "label_smoothing": 0.1},
        dtypes=("float32", "int32"),
        differentiable=(True, False),
        values=_hard_values((6,), 7, 3),
        uneven=True,
    ),
    Example(
        ((5, 7), (5, 7)),
        attrs={"reduction": "mean", "label_smoothing": 0.2, "strategy": "vocab_parallel"},
        values=_soft_values((5, 7)),
        uneven=True,
    ),
    # a class dim that is not last, two row dims, one loss per row
    Example(
        ((3, 7, 5), (3, 5)),
        attrs={"axis": 1, "reduction": "none", "strategy": "vocab_parallel"},
        dtypes=("float32", "int32"),
        differentiable=(True, False),
        values=_hard_values_axis((3, 5), 7, 1, -100),
        uneven=True,
    ),
)

RULES = (CrossEntropyRule(_EXAMPLES),)

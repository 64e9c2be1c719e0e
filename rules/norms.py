"""Normalizations: layer_norm, rms_norm, group_norm, instance_norm, batch_norm, sync_batch_norm.

Algebra. A norm computes per-row *statistics* (mean, variance or mean square)
over some *statistic dims* of ``x``, then an elementwise affine map per
*channel* (``scale``, ``bias``). Every dim of ``x`` passes to ``y`` unchanged,
so each rule is one factor notation plus a choice of which factors must stay
unsharded:

================ =========================== =========================== ===========
op               statistic dims              may stay sharded (default)  params
================ =========================== =========================== ===========
layer_norm       ``x.shape[begin_norm_axis:]`` leading dims                dims ≥ begin
rms_norm         same                        leading dims                dims ≥ begin
group_norm       C (in groups) and spatial   N                           C
instance_norm    spatial                     N, C                        C
batch_norm       N and spatial (training)    C                           C
sync_batch_norm  N and spatial               every dim                   C
================ =========================== =========================== ===========

Default strategy = the reference semantics (Paddle's SPMD rules): statistic dims
replicated, so the statistics need no communication, and the parameters follow
the channel dims they scale (replicated where those dims must be). A norm is not
linear in ``x`` (it divides by a statistic), so a pending reduction on any
input is resolved first.

Beyond the reference:

* ``strategy="sharded_stats"`` (layer_norm, rms_norm): the normalized dims may
  stay sharded. Each device sums its slice of every row (``Σx`` and ``Σx²``, or
  ``Σx²`` alone for rms_norm) and one all-reduce of ``2 × rows`` (``rows``)
  scalars over the axes that shard the normalized dims completes them; the
  backward pass all-reduces the same number of scalars. The activations never
  move, where the default strategy all-gathers them. Parameters follow the
  normalized dims (each device holds its slice).
* ``sync_batch_norm`` keeps N and the spatial dims sharded and all-reduces the
  per-channel ``Σx`` and ``Σx²`` (``2 × C`` scalars) over the axes sharding them.
* ``batch_norm`` with ``training=False`` normalizes with the running
  statistics, an elementwise map per channel, so every dim passes (the
  reference drops batch sharding in both modes).

Grads. ``x``'s cotangent follows ``x``. A parameter's cotangent sums over every
dim it lacks, so it is partial(sum) over the axes sharding those dims (the
leading dims for layer_norm; N for instance_norm; N and spatial for
sync_batch_norm). Running statistics enter the new running statistics
linearly (``momentum · running``), with no sum over rows, so their cotangents
are not partial.

Operands. ``x`` first, then ``scale`` if ``has_scale``, then ``bias`` if
``has_bias`` (both default True; rms_norm has no bias); batch_norm and
sync_batch_norm then take ``running_mean`` and ``running_var``. Outputs: ``y``;
batch_norm in training mode (and sync_batch_norm) also returns the new running
mean and variance (``momentum · old + (1 - momentum) · batch``, biased
variance, as flax does). Running statistics are buffers: no gradient flows
from the new running statistics into ``x`` (the batch statistics enter them
through ``stop_gradient``), only ``momentum ×`` the cotangent to the old ones.

Uneven shards. Local pieces of an unevenly sharded dim carry padding; each
device zeroes the padded positions of every input and output, so padding never
reaches a statistic, and no cotangent arriving on padding reaches an input.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.engine.factor import Notation
from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.rule import (
    Example,
    Inferred,
    InferredGrad,
    LocalContext,
    RuleContext,
    op_collective,
    without_strategy,
)
from spmdkit.errors import ShardingConflictError
from spmdkit.spec import TensorSpec

__all__ = [
    "RULES",
    "FusedAddNormRule",
    "NormRule",
    "batch_norm_notation",
    "fused_add_rms_norm_notation",
    "group_norm_notation",
    "instance_norm_notation",
    "layer_norm_notation",
]

_CHANNEL_FIRST = "NCHW"
_CHANNEL_LAST = "NHWC"

# ---------------------------------------------------------------------------
# Attribute checks
# ---------------------------------------------------------------------------


def _fail(op: str, must: str, given: str, fix: str) -> ShardingConflictError:
    return ShardingConflictError(op=op, must=must, given=given, fix=fix)


def _check_strategy(op: str, strategy: str, allowed: Sequence[str]) -> None:
    if strategy not in allowed:
        raise _fail(op, f"strategy is one of {tuple(allowed)}", repr(strategy), "pick a listed one")


def _check_epsilon(op: str, epsilon: Any) -> None:
    if not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise _fail(op, "epsilon is a positive number", repr(epsilon), "pass e.g. epsilon=1e-5")


def _n_params(op: str, shapes: Sequence[tuple[int, ...]], n_params: int, names: str) -> None:
    if len(shapes) != 1 + n_params:
        raise _fail(
            op,
            f"the op takes x plus {n_params} operand(s) ({names})",
            f"{len(shapes)} inputs of shapes {tuple(shapes)}",
            "match has_scale/has_bias to the operands passed",
        )


def _param_shapes(
    op: str, shapes: Sequence[tuple[int, ...]], expected: tuple[int, ...], names: Sequence[str]
) -> None:
    for name, shape in zip(names, shapes[1:], strict=True):
        if tuple(shape) != expected:
            raise _fail(
                op,
                f"{name} has shape {expected}",
                f"{name} of shape {tuple(shape)} for x of shape {tuple(shapes[0])}",
                "pass parameters shaped like the dims they scale",
            )


def _param_names(has_scale: bool, has_bias: bool) -> list[str]:
    return [n for n, on in (("scale", has_scale), ("bias", has_bias)) if on]


def _channel_dim(op: str, rank: int, data_format: str) -> int:
    if data_format not in (_CHANNEL_FIRST, _CHANNEL_LAST):
        raise _fail(
            op,
            f"data_format is {_CHANNEL_FIRST!r} (channels at dim 1) or "
            f"{_CHANNEL_LAST!r} (channels last), for any rank",
            repr(data_format),
            "pass data_format='NCHW' or 'NHWC'",
        )
    return 1 if data_format == _CHANNEL_FIRST else rank - 1


def _norm_axis(op: str, rank: int, begin_norm_axis: Any) -> int:
    if not isinstance(begin_norm_axis, int) or not -rank <= begin_norm_axis < rank:
        raise _fail(
            op,
            f"begin_norm_axis is a dim of the rank-{rank} input",
            f"begin_norm_axis={begin_norm_axis!r}",
            f"pass an int in [-{rank}, {rank})",
        )
    return begin_norm_axis % rank


# ---------------------------------------------------------------------------
# Notations (factor names: b* leading, d* normalized, n c s* for N C spatial)
# ---------------------------------------------------------------------------


def layer_norm_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-5,
    has_scale: bool = True,
    has_bias: bool = True,
    strategy: str = "default",
    _op: str = "layer_norm",
) -> Notation:
    """Notation of layer_norm (and rms_norm): ``b.. d.., d.., d.. -> b.. d..``.

    The normalized dims ``d..`` are replicated under ``strategy="default"``
    and may stay sharded under ``"sharded_stats"``.

    Example::

        >>> str(layer_norm_notation(((4, 8, 16), (16,), (16,))))
        'b0 b1 d0, d0, d0 -> b0 b1 d0  [replicated: d0]'
    """
    _check_strategy(_op, strategy, ("default", "sharded_stats"))
    _check_epsilon(_op, epsilon)
    x = shapes[0]
    begin = _norm_axis(_op, len(x), begin_norm_axis)
    names = _param_names(has_scale, has_bias)
    _n_params(_op, shapes, len(names), ", ".join(names) or "none")
    _param_shapes(_op, shapes, tuple(x[begin:]), names)
    lead = tuple(f"b{i}" for i in range(begin))
    norm = tuple(f"d{i}" for i in range(len(x) - begin))
    need = frozenset(norm) if strategy == "default" else frozenset()
    return Notation(((*lead, *norm), *(norm for _ in names)), ((*lead, *norm),), need, None)


def _rms_norm_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-6,
    has_scale: bool = True,
    strategy: str = "default",
) -> Notation:
    return layer_norm_notation(
        shapes,
        begin_norm_axis=begin_norm_axis,
        epsilon=epsilon,
        has_scale=has_scale,
        has_bias=False,
        strategy=strategy,
        _op="rms_norm",
    )


def fused_add_rms_norm_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-6,
    has_scale: bool = True,
    strategy: str = "default",
) -> Notation:
    """Notation of fused_add_rms_norm: ``x, residual, [scale] -> y, x + residual, inv_rms``.

    ``inv_rms`` has the leading dims only (one value per normalized row).

    Example::

        >>> str(fused_add_rms_norm_notation(((4, 8), (4, 8), (8,))))
        'b0 d0, b0 d0, d0 -> b0 d0, b0 d0, b0  [replicated: d0]'
    """
    op = "fused_add_rms_norm"
    _check_strategy(op, strategy, ("default", "sharded_stats"))
    _check_epsilon(op, epsilon)
    x = tuple(shapes[0])
    begin = _norm_axis(op, len(x), begin_norm_axis)
    names = _param_names(has_scale, False)
    _n_params(op, shapes, 1 + len(names), ", ".join(["residual", *names]))
    _param_shapes(op, shapes[:2], x, ["residual"])
    _param_shapes(op, (x, *shapes[2:]), tuple(x[begin:]), names)
    lead = tuple(f"b{i}" for i in range(begin))
    norm = tuple(f"d{i}" for i in range(len(x) - begin))
    need = frozenset(norm) if strategy == "default" else frozenset()
    full = (*lead, *norm)
    return Notation((full, full, *(norm for _ in names)), (full, full, lead), need, None)


def _nc_factors(rank: int, c_dim: int) -> tuple[str, ...]:
    spatial = iter(f"s{i}" for i in range(rank - 2))
    return tuple("n" if d == 0 else "c" if d == c_dim else next(spatial) for d in range(rank))


def _nc_check(
    op: str,
    shapes: Sequence[tuple[int, ...]],
    data_format: str,
    n_params: int,
    names: str,
    min_rank: int,
) -> tuple[tuple[int, ...], int]:
    x = shapes[0]
    if len(x) < min_rank:
        raise _fail(
            op,
            f"x has rank ≥ {min_rank} (N, C, spatial...)",
            f"shape {tuple(x)}",
            "add the missing dims",
        )
    c_dim = _channel_dim(op, len(x), data_format)
    _n_params(op, shapes, n_params, names)
    return x, c_dim


def group_norm_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    num_groups: int,
    epsilon: float = 1e-5,
    data_format: str = _CHANNEL_FIRST,
    has_scale: bool = True,
    has_bias: bool = True,
    strategy: str = "default",
) -> Notation:
    """Notation of group_norm: only N may stay sharded.

    Example::

        >>> str(group_norm_notation(((2, 8, 4), (8,), (8,)), num_groups=4))
        'n c s0, c, c -> n c s0  [replicated: c,s0]'
    """
    op = "group_norm"
    _check_strategy(op, strategy, ("default",))
    _check_epsilon(op, epsilon)
    names = _param_names(has_scale, has_bias)
    x, c_dim = _nc_check(op, shapes, data_format, len(names), ", ".join(names) or "none", 2)
    channels = x[c_dim]
    if not isinstance(num_groups, int) or num_groups < 1 or channels % num_groups:
        raise _fail(
            op,
            f"num_groups is a positive divisor of the {channels} channels",
            f"num_groups={num_groups!r}",
            "pick a divisor of C",
        )
    _param_shapes(op, shapes, (channels,), names)
    dims = _nc_factors(len(x), c_dim)
    need = frozenset(f for f in dims if f != "n")
    return Notation((dims, *(("c",) for _ in names)), (dims,), need, None)


def instance_norm_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    epsilon: float = 1e-5,
    data_format: str = _CHANNEL_FIRST,
    has_scale: bool = True,
    has_bias: bool = True,
    strategy: str = "default",
) -> Notation:
    """Notation of instance_norm: N and C may stay sharded, spatial dims replicated.

    Example::

        >>> str(instance_norm_notation(((2, 8, 4, 4), (8,), (8,))))
        'n c s0 s1, c, c -> n c s0 s1  [replicated: s0,s1]'
    """
    op = "instance_norm"
    _check_strategy(op, strategy, ("default",))
    _check_epsilon(op, epsilon)
    names = _param_names(has_scale, has_bias)
    x, c_dim = _nc_check(op, shapes, data_format, len(names), ", ".join(names) or "none", 3)
    _param_shapes(op, shapes, (x[c_dim],), names)
    dims = _nc_factors(len(x), c_dim)
    need = frozenset(f for f in dims if f.startswith("s"))
    return Notation((dims, *(("c",) for _ in names)), (dims,), need, None)


def batch_norm_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    training: bool = True,
    momentum: float = 0.9,
    epsilon: float = 1e-5,
    data_format: str = _CHANNEL_FIRST,
    has_scale: bool = True,
    has_bias: bool = True,
    strategy: str = "default",
    _op: str = "batch_norm",
) -> Notation:
    """Notation of batch_norm: ``x, [scale], [bias], running_mean, running_var``.

    Training: ``y`` plus the new running statistics; only C may stay sharded
    (``sync_batch_norm``: every dim may). Inference: ``y`` only; every dim passes.

    Example::

        >>> str(batch_norm_notation(((8, 4), (4,), (4,), (4,), (4,))))
        'n c, c, c, c, c -> n c, c, c  [replicated: n]'
    """
    _check_strategy(_op, strategy, ("default",))
    _check_epsilon(_op, epsilon)
    if not isinstance(training, bool):
        raise _fail(_op, "training is a bool", repr(training), "pass training=True or False")
    if not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
        raise _fail(_op, "momentum is in [0, 1]", repr(momentum), "pass e.g. momentum=0.9")
    names = [*_param_names(has_scale, has_bias), "running_mean", "running_var"]
    x, c_dim = _nc_check(_op, shapes, data_format, len(names), ", ".join(names), 2)
    _param_shapes(_op, shapes, (x[c_dim],), names)
    dims = _nc_factors(len(x), c_dim)
    sync = _op == "sync_batch_norm"
    need = frozenset() if sync or not training else frozenset(f for f in dims if f != "c")
    outs = (dims, ("c",), ("c",)) if training else (dims,)
    return Notation((dims, *(("c",) for _ in names)), outs, need, None)


def _sync_batch_norm_notation(shapes: tuple[tuple[int, ...], ...], **attrs: Any) -> Notation:
    return batch_norm_notation(shapes, **attrs, _op="sync_batch_norm")


# ---------------------------------------------------------------------------
# The computations (one body serves the unsharded reference and every device)
# ---------------------------------------------------------------------------


def _psum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.psum(x, axes) if axes else x


def _moments(
    x: jax.Array, dims: tuple[int, ...], count: int, axes: tuple[str, ...]
) -> tuple[jax.Array, jax.Array]:
    """Mean and (biased) variance over ``dims``, divided by the global element ``count``.

    With ``axes`` (the mesh axes sharding ``dims``): one all-reduce of the stacked
    Σx and Σx², and ``var = E[x²] - mean²`` — the one-pass form flax uses by
    default (``use_fast_variance``), which loses precision when the variance is
    tiny against the mean. Without: two passes over local data, exact.
    """
    if not axes:
        mean = jnp.sum(x, dims, keepdims=True) / count
        centered = x - mean
        return mean, jnp.sum(centered * centered, dims, keepdims=True) / count
    sums = jnp.stack([jnp.sum(x, dims, keepdims=True), jnp.sum(x * x, dims, keepdims=True)])
    s1, s2 = _psum(sums, axes)
    mean = s1 / count
    return mean, jnp.maximum(s2 / count - mean * mean, 0.0)


def _apply_params(
    y: jax.Array, params: Sequence[jax.Array], has_scale: bool, has_bias: bool, shape: Any
) -> jax.Array:
    it = iter(params)
    if has_scale:
        y = y * next(it).reshape(shape)
    if has_bias:
        y = y + next(it).reshape(shape)
    return y


def _layer_norm(
    x: jax.Array,
    *params: jax.Array,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-5,
    has_scale: bool = True,
    has_bias: bool = True,
    _axes: tuple[str, ...] = (),
    _count: int | None = None,
) -> jax.Array:
    begin = begin_norm_axis % x.ndim
    dims = tuple(range(begin, x.ndim))
    count = _count or math.prod(x.shape[begin:])
    mean, var = _moments(x, dims, count, _axes)
    y = (x - mean) * jax.lax.rsqrt(var + epsilon)
    return _apply_params(y, params, has_scale, has_bias, x.shape[begin:])


def _rms_norm(
    x: jax.Array,
    *params: jax.Array,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-6,
    has_scale: bool = True,
    _axes: tuple[str, ...] = (),
    _count: int | None = None,
) -> jax.Array:
    begin = begin_norm_axis % x.ndim
    dims = tuple(range(begin, x.ndim))
    count = _count or math.prod(x.shape[begin:])
    ms = _psum(jnp.sum(x * x, dims, keepdims=True), _axes) / count
    y = x * jax.lax.rsqrt(ms + epsilon)
    return _apply_params(y, params, has_scale, False, x.shape[begin:])


def _fused_add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    *params: jax.Array,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-6,
    has_scale: bool = True,
    _axes: tuple[str, ...] = (),
    _count: int | None = None,
    _partial_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    h = _psum(x + residual, _partial_axes)
    begin = begin_norm_axis % h.ndim
    dims = tuple(range(begin, h.ndim))
    count = _count or math.prod(h.shape[begin:])
    inv = jax.lax.rsqrt(_psum(jnp.sum(h * h, dims, keepdims=True), _axes) / count + epsilon)
    y = _apply_params(h * inv, params, has_scale, False, h.shape[begin:])
    return y, h, inv.reshape(h.shape[:begin])


def _channel_shape(x: jax.Array, c_dim: int) -> tuple[int, ...]:
    return tuple(x.shape[d] if d == c_dim else 1 for d in range(x.ndim))


def _group_norm(
    x: jax.Array,
    *params: jax.Array,
    num_groups: int,
    epsilon: float = 1e-5,
    data_format: str = _CHANNEL_FIRST,
    has_scale: bool = True,
    has_bias: bool = True,
) -> jax.Array:
    c_dim = 1 if data_format == _CHANNEL_FIRST else x.ndim - 1
    channels = x.shape[c_dim]
    grouped = x.reshape(
        (*x.shape[:c_dim], num_groups, channels // num_groups, *x.shape[c_dim + 1 :])
    )
    dims = tuple(d for d in range(1, grouped.ndim) if d != c_dim)
    mean, var = _moments(grouped, dims, math.prod(grouped.shape[d] for d in dims), ())
    y = ((grouped - mean) * jax.lax.rsqrt(var + epsilon)).reshape(x.shape)
    return _apply_params(y, params, has_scale, has_bias, _channel_shape(x, c_dim))


def _instance_norm(
    x: jax.Array,
    *params: jax.Array,
    epsilon: float = 1e-5,
    data_format: str = _CHANNEL_FIRST,
    has_scale: bool = True,
    has_bias: bool = True,
) -> jax.Array:
    c_dim = 1 if data_format == _CHANNEL_FIRST else x.ndim - 1
    dims = tuple(d for d in range(1, x.ndim) if d != c_dim)
    mean, var = _moments(x, dims, math.prod(x.shape[d] for d in dims), ())
    y = (x - mean) * jax.lax.rsqrt(var + epsilon)
    return _apply_params(y, params, has_scale, has_bias, _channel_shape(x, c_dim))


def _batch_norm(
    x: jax.Array,
    *operands: jax.Array,
    training: bool = True,
    momentum: float = 0.9,
    epsilon: float = 1e-5,
    data_format: str = _CHANNEL_FIRST,
    has_scale: bool = True,
    has_bias: bool = True,
    _axes: tuple[str, ...] = (),
    _count: int | None = None,
) -> Any:
    c_dim = 1 if data_format == _CHANNEL_FIRST else x.ndim - 1
    *params, running_mean, running_var = operands
    shape = _channel_shape(x, c_dim)
    if not training:
        mean, var = running_mean.reshape(shape), running_var.reshape(shape)
    else:
        dims = tuple(d for d in range(x.ndim) if d != c_dim)
        count = _count or math.prod(x.shape[d] for d in dims)
        mean, var = _moments(x, dims, count, _axes)
    y = _apply_params((x - mean) * jax.lax.rsqrt(var + epsilon), params, has_scale, has_bias, shape)
    if not training:
        return y
    # Running statistics are buffers (flax's batch_stats, PyTorch's no_grad update): no
    # gradient reaches x through them, only the linear momentum term to the old ones.
    mean, var = jax.lax.stop_gradient(mean), jax.lax.stop_gradient(var)
    new_mean = momentum * running_mean + (1 - momentum) * mean.reshape(running_mean.shape)
    new_var = momentum * running_var + (1 - momentum) * var.reshape(running_var.shape)
    return y, new_mean, new_var


# ---------------------------------------------------------------------------
# The rule class
# ---------------------------------------------------------------------------


class NormRule(FactorRule):
    """A norm: factor notation for the layouts, plus what factor notation cannot say.

    * ``grad``: cotangents of running statistics are not partial (they are not
      summed over rows, see the module docstring).
    * ``local_fn``: each device runs the norm's body with its statistics
      all-reduced over the axes that shard the statistic dims (none under the
      reference strategies) and the padding of uneven shards zeroed in every
      input and output.

    Args:
      name: op name.
      notation: ``fn(shapes, **attrs) -> Notation``.
      impl: the unsharded op; accepts ``_axes`` (mesh axes to all-reduce the
        statistics over) and ``_count`` (global element count per statistic)
        when ``stat_dims`` is given.
      stat_dims: ``fn(x_rank, **attrs) -> dims`` of ``x`` the statistics reduce
        over (``None``: the statistics never need an all-reduce).
      strategies: strategy names, the reference one first.
      running_stats: whether the last two operands are running statistics.
      n_stats: scalars per row the statistic all-reduce carries (Σx and Σx²: 2).
      examples: inputs for the validation toolkit.
      doc: one line on the semantics.
    """

    def __init__(
        self,
        name: str,
        notation: Callable[..., Notation],
        *,
        impl: Callable[..., Any],
        stat_dims: Callable[..., tuple[int, ...]] | None = None,
        strategies: tuple[str, ...] = ("default",),
        running_stats: bool = False,
        n_stats: int = 2,
        examples: Sequence[Example] = (),
        doc: str = "",
    ) -> None:
        super().__init__(
            name, notation, impl=impl, reduce=None, partial="NONE", examples=examples, doc=doc
        )
        self.strategies = strategies
        self._stat_dims = stat_dims
        self._running_stats = running_stats
        self._n_stats = n_stats

    def _local_kwargs(self, lctx: LocalContext) -> dict[str, Any]:
        """Extra keyword arguments of the per-device body (none for plain norms)."""
        return {}

    def _notation_attrs(self, ctx: RuleContext) -> Mapping[str, Any]:
        """The attributes with ``strategy`` kept: the notation depends on it."""
        self.strategy(ctx)  # validates the name
        return ctx.attrs

    def _stat_axes(self, x: TensorSpec, attrs: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
        """(statistic dims, mesh axes sharding them) of the required ``x``."""
        if self._stat_dims is None:
            return (), ()
        dims = self._stat_dims(x.ndim, **without_strategy(attrs))
        return dims, tuple(a for d in dims for a in x.dims[d])

    def _collectives(self, ctx: RuleContext, x: TensorSpec) -> tuple[Any, ...]:
        """The statistic all-reduce: ``n_stats`` scalars per local row (per local
        channel for batch norms) over the axes sharding the statistic dims."""
        dims, axes = self._stat_axes(x, ctx.attrs)
        if not axes:
            return ()
        rows = math.prod(
            -(-n // math.prod(ctx.axis_sizes[a] for a in x.dims[d]))
            for d, n in enumerate(x.shape)
            if d not in dims
        )
        payload = self._n_stats * rows * x.itemsize
        return (op_collective(ctx, "all_reduce", axes, payload, reduce_op="sum"),)

    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Factor-notation layouts, plus the statistic all-reduce where the
        statistic dims stay sharded."""
        ans = super().forward(ctx, inputs)
        return Inferred(ans.inputs, ans.outputs, self._collectives(ctx, ans.inputs[0]))

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """Factor-notation grad; running statistics' cotangents are not summed over
        rows; the backward pass all-reduces as many scalars as the forward did."""
        ans = super().grad(ctx, inputs, out_grads)
        grads = list(ans.input_grads)
        if self._running_stats and ctx.attrs.get("training", True):
            x_axes = set(ans.inputs[0].sharding_axes)
            for i in (len(grads) - 2, len(grads) - 1):
                g = grads[i]
                own = set(g.sharding_axes)
                grads[i] = g.replace(
                    partial={a: op for a, op in g.partial if a not in x_axes or a in own}
                )
        return InferredGrad(
            ans.inputs,
            ans.out_grads,
            tuple(grads),
            ans.forward_outputs,
            self._collectives(ctx, ans.inputs[0]),
        )

    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """The per-device body: statistics all-reduced over the axes sharding the
        statistic dims; padded positions of uneven shards zeroed in ``x`` and ``y``."""
        attrs = without_strategy(lctx.attrs)
        x_spec: TensorSpec = lctx.inputs[0]
        body = functools.partial(self.impl, **attrs)
        dims, axes = self._stat_axes(x_spec, lctx.attrs)
        if axes:
            count = math.prod(x_spec.shape[d] for d in dims)
            body = functools.partial(body, _axes=axes, _count=count)
        body = functools.partial(body, **self._local_kwargs(lctx))
        specs = (*lctx.inputs, *lctx.outputs)
        if not any(
            s.dims[d] and n % lctx.shards(s, d) for s in specs for d, n in enumerate(s.shape)
        ):
            return body

        def masked(*xs: jax.Array) -> Any:
            xs = tuple(_zero_padding(lctx, s, v) for s, v in zip(lctx.inputs, xs, strict=True))
            out = body(*xs)
            outs = out if isinstance(out, tuple) else (out,)
            outs = tuple(_zero_padding(lctx, s, v) for s, v in zip(lctx.outputs, outs, strict=True))
            return outs if isinstance(out, tuple) else outs[0]

        return masked


def _zero_padding(lctx: LocalContext, spec: TensorSpec, v: jax.Array) -> jax.Array:
    """``v`` with the padding of ``spec``'s uneven blocks set to zero, so it reaches no
    sum (and a cotangent arriving there reaches no input)."""
    valid = None
    for d, n in enumerate(spec.shape):
        if not spec.dims[d] or n % lctx.shards(spec, d) == 0:
            continue
        pos = lctx.offset(spec, d) + jax.lax.broadcasted_iota(jnp.int32, v.shape, d)
        valid = pos < n if valid is None else valid & (pos < n)
    return v if valid is None else jnp.where(valid, v, jnp.zeros_like(v))


class FusedAddNormRule(NormRule):
    """A norm of ``x + residual`` whose inputs may arrive sum-partial.

    The sum is linear: a sum-partial ``x`` or ``residual`` (the other one
    replicated or sum-partial over the same axis, joining as partial for free)
    passes into the op, which all-reduces ``h = x + residual`` once (one
    all-reduce of the local ``h``, stated as the op's own collective) instead of
    resolving each input. ``h`` and the outputs are whole afterwards.
    """

    def _summed_axes(self, inputs: Sequence[TensorSpec], required: Sequence[TensorSpec]) -> tuple:
        """Axes on which ``x`` / ``residual`` are sum-partial and nothing shards."""
        used = {a for s in required for a in s.sharding_axes}
        scale = {a for s in inputs[2:] for a, _ in s.partial}
        out = []
        for a in sorted({a for s in inputs[:2] for a, _ in s.partial}):
            ops = {s.partial_ops.get(a) for s in inputs[:2]} - {None}
            if ops == {"sum"} and a not in used and a not in scale:
                out.append(a)
        return tuple(out)

    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """The norm's layouts; sum-partial inputs stay partial and ``h`` is all-reduced."""
        ans = super().forward(ctx, inputs)
        axes = self._summed_axes(inputs, ans.inputs)
        if not axes:
            return ans
        partial = dict.fromkeys(axes, "sum")
        req = (
            ans.inputs[0].replace(partial=partial),
            ans.inputs[1].replace(partial=partial),
            *ans.inputs[2:],
        )
        h = ans.inputs[0]
        blocks = [math.prod(ctx.axis_sizes[a] for a in d) for d in h.dims]
        local = [-(-n // b) for n, b in zip(h.shape, blocks, strict=True)]
        payload = math.prod(local) * h.itemsize
        resolve = op_collective(ctx, "all_reduce", axes, payload, reduce_op="sum")
        return Inferred(req, ans.outputs, (resolve, *ans.collectives))

    def _local_kwargs(self, lctx: LocalContext) -> dict[str, Any]:
        """The axes ``h`` is all-reduced over: where the required ``x`` is sum-partial."""
        axes = tuple(a for a, op in lctx.inputs[0].partial if op == "sum")
        return {"_partial_axes": axes} if axes else {}


def _layer_stat_dims(rank: int, *, begin_norm_axis: int = -1, **_: Any) -> tuple[int, ...]:
    return tuple(range(begin_norm_axis % rank, rank))


def _batch_stat_dims(
    rank: int, *, data_format: str = _CHANNEL_FIRST, training: bool = True, **_: Any
) -> tuple[int, ...]:
    if not training:
        return ()
    c_dim = 1 if data_format == _CHANNEL_FIRST else rank - 1
    return tuple(d for d in range(rank) if d != c_dim)


def _bn_values(shapes: tuple[tuple[int, ...], ...]) -> Callable[[np.random.Generator], list]:
    """Batch-norm example values: normal x and parameters, positive running variance."""

    def values(rng: np.random.Generator) -> list[np.ndarray]:
        out = [rng.standard_normal(s).astype(np.float32) for s in shapes[:-1]]
        return [*out, rng.uniform(0.5, 2.0, size=shapes[-1]).astype(np.float32)]

    return values


# Examples stay small: the shared sweep runs each under many specs on two meshes.
# The second example of each rule has dims (6, 3) that the mesh axes do not divide.
_LN_EX = (
    Example(((4, 8), (8,), (8,)), attrs={"begin_norm_axis": -1}, rtol=1e-4),
    Example(
        ((6, 2, 3), (2, 3)),
        attrs={"begin_norm_axis": 1, "has_bias": False},
        rtol=1e-4,
        uneven=True,
    ),
)
_RMS_EX = (
    Example(((4, 8), (8,)), attrs={}, rtol=1e-4),
    Example(((6, 6),), attrs={"has_scale": False}, rtol=1e-4, uneven=True),
)
_FUSED_EX = (
    Example(((4, 8), (4, 8), (8,)), attrs={}, rtol=1e-4),
    Example(((6, 6), (6, 6)), attrs={"has_scale": False}, rtol=1e-4, uneven=True),
)
_GN_EX = (
    Example(((4, 4, 2), (4,), (4,)), attrs={"num_groups": 2}, rtol=1e-4),
    Example(
        ((6, 3, 4), (4,), (4,)),
        attrs={"num_groups": 2, "data_format": "NHWC"},
        rtol=1e-4,
        uneven=True,
    ),
)
_IN_EX = (
    Example(((4, 8, 2), (8,), (8,)), attrs={}, rtol=1e-4),
    Example(
        ((2, 3, 6), (6,)),
        attrs={"data_format": "NHWC", "has_bias": False},
        rtol=1e-4,
        uneven=True,
    ),
)
# Batch norms' examples leave out scale and bias: the sweep enumerates the product
# of every operand's specs, and five operands make it millions of combinations.
_BN_SHAPES = ((8, 4, 2), (4,), (4,))
_BN_UNEVEN = ((6, 3, 4), (4,), (4,))
_NO_PARAMS = {"has_scale": False, "has_bias": False}
_BN_EX = (
    Example(_BN_SHAPES, attrs=_NO_PARAMS, rtol=1e-4, values=_bn_values(_BN_SHAPES)),
    Example(
        _BN_UNEVEN,
        attrs={**_NO_PARAMS, "training": False, "data_format": "NHWC"},
        rtol=1e-4,
        values=_bn_values(_BN_UNEVEN),
        uneven=True,
    ),
)
_SBN_EX = (
    Example(_BN_SHAPES, attrs=_NO_PARAMS, rtol=1e-4, values=_bn_values(_BN_SHAPES)),
    Example(
        _BN_UNEVEN,
        attrs={**_NO_PARAMS, "data_format": "NHWC"},
        rtol=1e-4,
        values=_bn_values(_BN_UNEVEN),
        uneven=True,
    ),
)


RULES = (
    NormRule(
        "batch_norm",
        batch_norm_notation,
        impl=_batch_norm,
        stat_dims=_batch_stat_dims,
        running_stats=True,
        examples=_BN_EX,
        doc="batch norm (training: batch stats, C only sharded; inference: running stats)",
    ),
    FusedAddNormRule(
        "fused_add_rms_norm",
        fused_add_rms_norm_notation,
        impl=_fused_add_rms_norm,
        stat_dims=_layer_stat_dims,
        strategies=("default", "sharded_stats"),
        n_stats=1,
        examples=_FUSED_EX,
        doc="RMS norm of x + residual, returning (y, x + residual, inv_rms); sum-partial "
        "inputs are resolved once, as h (sharded_stats: all-reduce Σh²)",
    ),
    NormRule(
        "group_norm",
        group_norm_notation,
        impl=_group_norm,
        examples=_GN_EX,
        doc="group norm over C/num_groups channels and spatial dims; only N sharded",
    ),
    NormRule(
        "instance_norm",
        instance_norm_notation,
        impl=_instance_norm,
        examples=_IN_EX,
        doc="instance norm over spatial dims; N and C sharded",
    ),
    NormRule(
        "layer_norm",
        layer_norm_notation,
        impl=_layer_norm,
        stat_dims=_layer_stat_dims,
        strategies=("default", "sharded_stats"),
        examples=_LN_EX,
        doc="layer norm over dims ≥ begin_norm_axis (sharded_stats: all-reduce Σx, Σx²)",
    ),
    NormRule(
        "rms_norm",
        _rms_norm_notation,
        impl=_rms_norm,
        stat_dims=_layer_stat_dims,
        strategies=("default", "sharded_stats"),
        n_stats=1,
        examples=_RMS_EX,
        doc="RMS norm over dims ≥ begin_norm_axis (sharded_stats: all-reduce Σx²)",
    ),
    NormRule(
        "sync_batch_norm",
        _sync_batch_norm_notation,
        impl=_batch_norm,
        stat_dims=_batch_stat_dims,
        running_stats=True,
        examples=_SBN_EX,
        doc="batch norm whose per-channel Σx, Σx² are all-reduced; every dim may stay sharded",
    ),
)

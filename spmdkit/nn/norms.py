"""Norm drop-ins: ``flax.nnx`` norms computed by :mod:`spmdkit.ops.norms`.

The statistics are computed in float32 (as flax does for low-precision inputs)
and the result is cast to the module's ``dtype`` (default: the promoted input and
parameter dtype). What flax offers and the ops do not — a ``mask``, an
``axis_name`` (the ops' statistics are global already), normalized axes that are
not the trailing ones — raises :class:`~spmdkit.ShardingConflictError` naming
the flax module to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.errors import ShardingConflictError
from spmdkit.nn.calls import call_op
from spmdkit.ops import norms as ops

__all__ = ["BatchNorm", "GroupNorm", "LayerNorm", "RMSNorm"]

_NORM = {"out_sharding": ("norm",)}


def _metadata(given: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return _NORM if given is None else given


def flax_name(op: str) -> str:
    """The flax module a drop-in stands for: ``"LayerNorm"`` → ``flax.nnx.LayerNorm``,
    ``"linen.LayerNorm"`` → ``flax.linen.LayerNorm``."""
    return f"flax.{op}" if op.startswith("linen.") else f"flax.nnx.{op}"


def unsupported(op: str, what: str, given: str, fix: str) -> ShardingConflictError:
    """The error a drop-in raises for a flax option its op does not have.

    Args:
      op: the module's name under ``spmdkit.nn`` (``"LayerNorm"``, ``"linen.RMSNorm"``).
      what: what must hold; given: what was given; fix: what to do instead.
    """
    return ShardingConflictError(op=f"spmdkit.nn.{op}", must=what, given=given, fix=fix)


def _axes(axes: Any) -> tuple[int, ...]:
    return tuple(axes) if isinstance(axes, Sequence) else (axes,)


def begin_norm_axis(op: str, rank: int, reduction_axes: Any, feature_axes: Any) -> int:
    """``begin_norm_axis`` (negative: counted from the end, as the ops' default ``-1``)
    of trailing ``reduction_axes`` equal to ``feature_axes``.

    Raises:
      ShardingConflictError: the axes are not the trailing dims, or differ.

    Example::

        >>> begin_norm_axis("LayerNorm", 3, -1, -1)
        -1
    """
    red = sorted(a % rank for a in _axes(reduction_axes))
    feat = sorted(a % rank for a in _axes(feature_axes))
    if red != list(range(red[0], rank)) or red != feat:
        raise unsupported(
            op,
            "reduction_axes are the trailing dims and equal feature_axes",
            f"reduction_axes={reduction_axes!r}, feature_axes={feature_axes!r} for rank {rank}",
            f"use {flax_name(op)} for other axes",
        )
    return red[0] - rank


def check_norm_call(op: str, mask: Any, axis_name: Any) -> None:
    """Raise :class:`~spmdkit.ShardingConflictError` for a ``mask`` or an ``axis_name``
    (the ops compute statistics over the global array, unmasked)."""
    if mask is not None:
        raise unsupported(op, "no mask", "a mask", f"use {flax_name(op)} for masked statistics")
    if axis_name is not None:
        raise unsupported(
            op,
            "no axis_name (statistics are over the global array already)",
            f"axis_name={axis_name!r}",
            "drop axis_name: sharded statistics are all-reduced by the op's rule",
        )


def in_f32(*xs: Any) -> list[Any]:
    """Each array as float32 (``None`` stays ``None``): the statistics' precision."""
    return [None if x is None else x.astype(jnp.float32) for x in xs]


def out_dtype(module: Any, x: jax.Array, *params: Any) -> Any:
    """The result dtype, as flax: ``module.dtype``, else ``x``'s and the parameters'
    promoted dtype."""
    if module.dtype is not None:
        return module.dtype
    return jnp.result_type(x, *(p for p in params if p is not None))


def _value(v: Any) -> Any:
    return None if v is None else v[...]


def layer_norm(op: str, module: Any, x: jax.Array, scale: Any, bias: Any, mask: Any) -> jax.Array:
    """A LayerNorm drop-in's computation (flax NNX or linen: the same attributes):
    :func:`spmdkit.ops.layer_norm` of ``x`` in float32, cast to :func:`out_dtype`.

    Args:
      op: the module's name for errors (``"LayerNorm"``, ``"linen.LayerNorm"``).
      module: reads ``reduction_axes``, ``feature_axes``, ``axis_name``, ``epsilon``,
        ``dtype``, ``strategy``.
      x: the input; scale, bias: the parameters' values (or ``None``); mask: flax's.
    """
    check_norm_call(op, mask, module.axis_name)
    begin = begin_norm_axis(op, x.ndim, module.reduction_axes, module.feature_axes)
    dtype = out_dtype(module, x, scale, bias)
    xf, sf, bf = in_f32(x, scale, bias)
    y = call_op(
        ops.layer_norm,
        xf,
        sf,
        bf,
        begin_norm_axis=begin,
        epsilon=module.epsilon,
        strategy=module.strategy,
    )
    return y.astype(dtype)


def rms_norm(op: str, module: Any, x: jax.Array, scale: Any, mask: Any) -> jax.Array:
    """An RMSNorm drop-in's computation: :func:`spmdkit.ops.rms_norm` (as :func:`layer_norm`)."""
    check_norm_call(op, mask, module.axis_name)
    begin = begin_norm_axis(op, x.ndim, module.reduction_axes, module.feature_axes)
    dtype = out_dtype(module, x, scale)
    xf, sf = in_f32(x, scale)
    y = call_op(
        ops.rms_norm,
        xf,
        sf,
        begin_norm_axis=begin,
        epsilon=module.epsilon,
        strategy=module.strategy,
    )
    return y.astype(dtype)


def group_norm(
    op: str, module: Any, x: jax.Array, scale: Any, bias: Any, num_groups: int, mask: Any
) -> jax.Array:
    """A GroupNorm drop-in's computation (channels last): :func:`spmdkit.ops.group_norm`.

    Raises:
      ShardingConflictError: a mask, an ``axis_name``, or ``reduction_axes`` other
        than every dim but the first.
    """
    check_norm_call(op, mask, module.axis_name)
    red = module.reduction_axes
    if red is not None and sorted(a % x.ndim for a in _axes(red)) != list(range(1, x.ndim)):
        raise unsupported(
            op,
            "reduction_axes are every dim but the first (N)",
            f"reduction_axes={red!r}",
            f"use {flax_name(op)} for other axes",
        )
    dtype = out_dtype(module, x, scale, bias)
    xf, sf, bf = in_f32(x, scale, bias)
    y = call_op(
        ops.group_norm,
        xf,
        sf,
        bf,
        num_groups=num_groups,
        epsilon=module.epsilon,
        data_format="NHWC",
    )
    return y.astype(dtype)


def batch_norm(
    op: str,
    module: Any,
    x: jax.Array,
    stats: tuple[jax.Array, jax.Array],
    params: tuple[Any, Any],
    use_running_average: bool | None,
    mask: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A BatchNorm drop-in's computation: ``(y, new_mean, new_var)`` by
    :func:`spmdkit.ops.sync_batch_norm` (``module.sync``) or ``batch_norm``.

    Args:
      op: the module's name for errors.
      module: reads ``axis``, ``axis_name``, ``momentum``, ``epsilon``, ``dtype``, ``sync``.
      x: the input; stats: the running ``(mean, var)``; params: ``(scale, bias)``.
      use_running_average: normalize with ``stats`` (the new ones are ``stats``).
      mask: flax's (not supported).

    Raises:
      ShardingConflictError: ``use_running_average`` is None, the channel dim is
        neither 1 nor the last, a mask or an ``axis_name``.
    """
    check_norm_call(op, mask, module.axis_name)
    if use_running_average is None:
        raise unsupported(
            op,
            "use_running_average is known",
            "None in the constructor and the call",
            "pass use_running_average=True/False",
        )
    channel = module.axis % x.ndim
    if channel not in (1, x.ndim - 1):
        raise unsupported(
            op,
            "axis is the channel dim 1 (NCHW) or the last (NHWC)",
            f"axis={module.axis!r} for rank {x.ndim}",
            f"use {flax_name(op)} for other layouts",
        )
    scale, bias = params
    dtype = out_dtype(module, x, scale, bias)
    xf, sf, bf = in_f32(x, scale, bias)
    y, mean, var = call_op(
        ops.sync_batch_norm if module.sync else ops.batch_norm,
        xf,
        *stats,
        sf,
        bf,
        training=not use_running_average,
        momentum=module.momentum,
        epsilon=module.epsilon,
        data_format="NHWC" if channel == x.ndim - 1 else "NCHW",
    )
    return y.astype(dtype), mean, var


class LayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` computed by :func:`spmdkit.ops.layer_norm`.

    Args:
      num_features: the size of the normalized (trailing) dims, as flax.
      strategy: the op's strategy (``None``: the planner's choice in a planned step).
      scale_metadata: default ``out_sharding=("norm",)``.
      bias_metadata: likewise.
      **kwargs: flax's other arguments (``epsilon``, ``dtype``, ``param_dtype``,
        ``use_bias``, ``use_scale``, initializers, ``reduction_axes``, ``rngs``...).

    Example::

        >>> ln = LayerNorm(64, rngs=nnx.Rngs(0))
        >>> y = ln(x)   # x [..., 64]
    """

    def __init__(
        self,
        num_features: int,
        *,
        strategy: str | None = None,
        scale_metadata: Mapping[str, Any] | None = None,
        bias_metadata: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            num_features,
            scale_metadata=_metadata(scale_metadata),
            bias_metadata=_metadata(bias_metadata),
            **kwargs,
        )
        self.strategy = strategy

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalize ``x`` over its trailing dims."""
        return layer_norm("LayerNorm", self, x, _value(self.scale), _value(self.bias), mask)


class RMSNorm(nnx.RMSNorm):
    """``flax.nnx.RMSNorm`` computed by :func:`spmdkit.ops.rms_norm`.

    Args:
      num_features: as flax.
      strategy: the op's strategy (``None``: the planner's choice in a planned step).
      scale_metadata: default ``out_sharding=("norm",)``.
      **kwargs: flax's other arguments.

    Example::

        >>> y = RMSNorm(64, rngs=nnx.Rngs(0))(x)
    """

    def __init__(
        self,
        num_features: int,
        *,
        strategy: str | None = None,
        scale_metadata: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_features, scale_metadata=_metadata(scale_metadata), **kwargs)
        self.strategy = strategy

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Normalize ``x`` by the root mean square of its trailing dims."""
        return rms_norm("RMSNorm", self, x, _value(self.scale), mask)


class GroupNorm(nnx.GroupNorm):
    """``flax.nnx.GroupNorm`` (channels last) computed by :func:`spmdkit.ops.group_norm`.

    Args:
      num_features: as flax.
      num_groups: as flax.
      group_size: as flax.
      scale_metadata: default ``out_sharding=("norm",)``.
      bias_metadata: likewise.
      **kwargs: flax's other arguments.

    Example::

        >>> y = GroupNorm(32, num_groups=8, rngs=nnx.Rngs(0))(images)   # NHWC
    """

    def __init__(
        self,
        num_features: int,
        num_groups: int | None = 32,
        group_size: int | None = None,
        *,
        scale_metadata: Mapping[str, Any] | None = None,
        bias_metadata: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            num_features,
            num_groups,
            group_size,
            scale_metadata=_metadata(scale_metadata),
            bias_metadata=_metadata(bias_metadata),
            **kwargs,
        )

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalize each sample's channel groups over the channels and spatial dims."""
        scale, bias = _value(self.scale), _value(self.bias)
        return group_norm("GroupNorm", self, x, scale, bias, self.num_groups, mask)


class BatchNorm(nnx.BatchNorm):
    """``flax.nnx.BatchNorm`` computed by :func:`spmdkit.ops.sync_batch_norm`.

    flax under ``jit`` normalizes with the statistics of the whole (global) batch;
    so does ``sync_batch_norm``, whose batch and spatial dims may stay sharded (the
    per-channel sums are all-reduced); in evaluation it normalizes a sharded batch
    with the running statistics in place. ``sync=False`` uses ``batch_norm``, the
    reference semantics, which gathers the batch first.

    Args:
      num_features: as flax; ``axis`` is the channel dim (``-1``: NHWC, ``1``: NCHW).
      sync: global statistics over sharded batches (default True).
      scale_metadata: default ``out_sharding=("norm",)``; the running statistics
        take the same names.
      bias_metadata: likewise.
      **kwargs: flax's other arguments (``use_running_average``, ``momentum``...).

    Example::

        >>> bn = BatchNorm(64, rngs=nnx.Rngs(0))
        >>> y = bn(images)                       # training: running stats updated
        >>> y = bn(images, use_running_average=True)
    """

    def __init__(
        self,
        num_features: int,
        *,
        sync: bool = True,
        scale_metadata: Mapping[str, Any] | None = None,
        bias_metadata: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            num_features,
            scale_metadata=_metadata(scale_metadata),
            bias_metadata=_metadata(bias_metadata),
            **kwargs,
        )
        self.sync = sync
        self.mean = nnx.BatchStat(self.mean[...], out_sharding=("norm",))
        self.var = nnx.BatchStat(self.var[...], out_sharding=("norm",))

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Normalize ``x`` per channel; in training, update the running statistics."""
        use_ra = self.use_running_average if use_running_average is None else use_running_average
        y, mean, var = batch_norm(
            "BatchNorm",
            self,
            x,
            (self.mean[...], self.var[...]),
            (_value(self.scale), _value(self.bias)),
            use_ra,
            mask,
        )
        if not use_ra:
            self.mean[...] = mean
            self.var[...] = var
        return y

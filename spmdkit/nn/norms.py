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


def _unsupported(op: str, what: str, given: str, fix: str) -> ShardingConflictError:
    return ShardingConflictError(op=f"spmdkit.nn.{op}", must=what, given=given, fix=fix)


def _axes(axes: Any) -> tuple[int, ...]:
    return tuple(axes) if isinstance(axes, Sequence) else (axes,)


def _begin(op: str, rank: int, reduction_axes: Any, feature_axes: Any) -> int:
    """``begin_norm_axis`` (negative: counted from the end, as the ops' default ``-1``)
    of trailing ``reduction_axes`` equal to ``feature_axes``."""
    red = sorted(a % rank for a in _axes(reduction_axes))
    feat = sorted(a % rank for a in _axes(feature_axes))
    if red != list(range(red[0], rank)) or red != feat:
        raise _unsupported(
            op,
            "reduction_axes are the trailing dims and equal feature_axes",
            f"reduction_axes={reduction_axes!r}, feature_axes={feature_axes!r} for rank {rank}",
            f"use flax.nnx.{op} for other axes",
        )
    return red[0] - rank


def _check_call(op: str, mask: Any, axis_name: Any) -> None:
    if mask is not None:
        raise _unsupported(op, "no mask", "a mask", f"use flax.nnx.{op} for masked statistics")
    if axis_name is not None:
        raise _unsupported(
            op,
            "no axis_name (statistics are over the global array already)",
            f"axis_name={axis_name!r}",
            "drop axis_name: sharded statistics are all-reduced by the op's rule",
        )


def _f32(*xs: Any) -> list[Any]:
    return [None if x is None else x.astype(jnp.float32) for x in xs]


def _out_dtype(module: Any, x: jax.Array, *params: Any) -> Any:
    if module.dtype is not None:
        return module.dtype
    return jnp.result_type(x, *(p for p in params if p is not None))


def _value(v: Any) -> Any:
    return None if v is None else v[...]


class LayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` computed by :func:`spmdkit.ops.layer_norm`.

    Args:
      num_features: the size of the normalized (trailing) dims, as flax.
      strategy: the op's strategy (``None``: the planner's choice in a planned step).
      scale_metadata, bias_metadata: default ``out_sharding=("norm",)``.
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
        _check_call("LayerNorm", mask, self.axis_name)
        begin = _begin("LayerNorm", x.ndim, self.reduction_axes, self.feature_axes)
        scale, bias = _value(self.scale), _value(self.bias)
        dtype = _out_dtype(self, x, scale, bias)
        xf, sf, bf = _f32(x, scale, bias)
        y = call_op(
            ops.layer_norm,
            xf,
            sf,
            bf,
            begin_norm_axis=begin,
            epsilon=self.epsilon,
            strategy=self.strategy,
        )
        return y.astype(dtype)


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
        _check_call("RMSNorm", mask, self.axis_name)
        begin = _begin("RMSNorm", x.ndim, self.reduction_axes, self.feature_axes)
        scale = _value(self.scale)
        dtype = _out_dtype(self, x, scale)
        xf, sf = _f32(x, scale)
        y = call_op(
            ops.rms_norm,
            xf,
            sf,
            begin_norm_axis=begin,
            epsilon=self.epsilon,
            strategy=self.strategy,
        )
        return y.astype(dtype)


class GroupNorm(nnx.GroupNorm):
    """``flax.nnx.GroupNorm`` (channels last) computed by :func:`spmdkit.ops.group_norm`.

    Args:
      num_features, num_groups, group_size: as flax.
      scale_metadata, bias_metadata: default ``out_sharding=("norm",)``.
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
        _check_call("GroupNorm", mask, self.axis_name)
        if self.reduction_axes is not None and sorted(
            a % x.ndim for a in self.reduction_axes
        ) != list(range(1, x.ndim)):
            raise _unsupported(
                "GroupNorm",
                "reduction_axes are every dim but the first (N)",
                f"reduction_axes={self.reduction_axes!r}",
                "use flax.nnx.GroupNorm for other axes",
            )
        scale, bias = _value(self.scale), _value(self.bias)
        dtype = _out_dtype(self, x, scale, bias)
        xf, sf, bf = _f32(x, scale, bias)
        y = call_op(
            ops.group_norm,
            xf,
            sf,
            bf,
            num_groups=self.num_groups,
            epsilon=self.epsilon,
            data_format="NHWC",
        )
        return y.astype(dtype)


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
      scale_metadata, bias_metadata: default ``out_sharding=("norm",)``; the running
        statistics take the same names.
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
        _check_call("BatchNorm", mask, self.axis_name)
        use_ra = self.use_running_average if use_running_average is None else use_running_average
        if use_ra is None:
            raise _unsupported(
                "BatchNorm",
                "use_running_average is known",
                "None in the constructor and the call",
                "pass use_running_average=True/False",
            )
        channel = self.axis % x.ndim
        if channel not in (1, x.ndim - 1):
            raise _unsupported(
                "BatchNorm",
                "axis is the channel dim 1 (NCHW) or the last (NHWC)",
                f"axis={self.axis!r} for rank {x.ndim}",
                "use flax.nnx.BatchNorm for other layouts",
            )
        fmt = "NHWC" if channel == x.ndim - 1 else "NCHW"
        scale, bias = _value(self.scale), _value(self.bias)
        dtype = _out_dtype(self, x, scale, bias)
        xf, sf, bf = _f32(x, scale, bias)
        op = ops.sync_batch_norm if self.sync else ops.batch_norm
        y, mean, var = call_op(
            op,
            xf,
            self.mean[...],
            self.var[...],
            sf,
            bf,
            training=not use_ra,
            momentum=self.momentum,
            epsilon=self.epsilon,
            data_format=fmt,
        )
        if not use_ra:
            self.mean[...] = mean
            self.var[...] = var
        return y.astype(dtype)

"""Norm ops whose partitioning is the registered rule (``spmdkit.rules.norms``).

Each op checks its arguments, then hands them to
:func:`spmdkit.ops.base.apply_rule`: inputs are resharded to the specs the
rule requires, every device runs the rule's local body under ``shard_map``
(with exactly the rule's collectives: none for the reference strategies; one
all-reduce of the per-row or per-channel sums for ``strategy="sharded_stats"``
and ``sync_batch_norm``), and the outputs carry the rule's specs. ``jax.grad``
differentiates through the same body: the backward pass of a statistic
all-reduce is one all-reduce of the same size, so no ``custom_vjp`` is needed.

Optional parameters are ``None``; the rule is told which are present through
its ``has_scale`` / ``has_bias`` attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from spmdkit.errors import ShardingConflictError
from spmdkit.ops.base import apply_rule
from spmdkit.spec import MeshLike, TensorSpec

__all__ = [
    "batch_norm",
    "fused_add_rms_norm",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "rms_norm",
    "sync_batch_norm",
]

Specs = Sequence[TensorSpec] | None


def _operands(x: Any, params: Sequence[tuple[str, Any]]) -> tuple[list[Any], dict[str, bool]]:
    args = [x]
    flags = {}
    for name, value in params:
        flags[f"has_{name}"] = value is not None
        if value is not None:
            args.append(value)
    return args, flags


def _strategy(strategy: str | None) -> dict[str, str]:
    """``strategy=`` when the caller fixed one; left out, the rule's first applies (and,
    where the op is traced as a region, the planner chooses)."""
    return {} if strategy is None else {"strategy": strategy}


def _check_specs(op: str, in_specs: Specs, n: int) -> None:
    if in_specs is not None and len(in_specs) != n:
        raise ShardingConflictError(
            op=op,
            must=f"in_specs has one spec per array passed ({n})",
            given=f"{len(in_specs)} specs",
            fix="drop the specs of parameters passed as None",
        )


def _norm(
    op: str,
    x: Any,
    params: Sequence[tuple[str, Any]],
    mesh: MeshLike | None,
    in_specs: Specs,
    **attrs: Any,
) -> Any:
    """``x`` and the optional params that are given, checked and run through the rule."""
    args, flags = _operands(x, params)
    _check_specs(op, in_specs, len(args))
    return apply_rule(op, *args, mesh=mesh, in_specs=in_specs, **attrs, **flags)


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-5,
    strategy: str | None = None,
    mesh: MeshLike | None = None,
    in_specs: Specs = None,
) -> jax.Array:
    """Layer norm over the dims from ``begin_norm_axis`` on, sharded by its rule.

    ``y = (x - mean) / sqrt(var + epsilon) * scale + bias`` with mean and biased
    variance over ``x.shape[begin_norm_axis:]``.

    Args:
      x: the input.
      scale: shape ``x.shape[begin_norm_axis:]``, or ``None`` (no scaling).
      bias: shape ``x.shape[begin_norm_axis:]``, or ``None`` (no shift).
      begin_norm_axis: first normalized dim.
      epsilon: added to the variance.
      strategy: ``"default"`` (normalized dims gathered) or ``"sharded_stats"``
        (normalized dims stay sharded; the per-row Σx and Σx² are all-reduced);
        ``None``: the default, or the planner's choice where the op is a region.
      mesh: the mesh (default: from the arrays or the mesh context).
      in_specs: the inputs' specs (one per array passed), needed under Auto
        mesh axes inside ``jit``.

    Returns:
      ``y``, laid out as the rule claims.

    Raises:
      ShardingConflictError: shapes or attributes do not fit the op.

    Example::

        >>> mesh = sk.make_mesh(data=2, model=4)
        >>> y = layer_norm(x, scale, bias, strategy="sharded_stats", mesh=mesh)
    """
    return _norm(
        "layer_norm",
        x,
        (("scale", scale), ("bias", bias)),
        mesh,
        in_specs,
        begin_norm_axis=begin_norm_axis,
        epsilon=epsilon,
        **_strategy(strategy),
    )


def rms_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    *,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-6,
    strategy: str | None = None,
    mesh: MeshLike | None = None,
    in_specs: Specs = None,
) -> jax.Array:
    """RMS norm over the dims from ``begin_norm_axis`` on, sharded by its rule.

    ``y = x / sqrt(mean(x²) + epsilon) * scale``.

    Args:
      x: the input.
      scale: shape ``x.shape[begin_norm_axis:]``, or ``None``.
      begin_norm_axis: first normalized dim.
      epsilon: added to the mean square.
      strategy: ``"default"`` or ``"sharded_stats"`` (per-row Σx² all-reduced);
        ``None``: the default, or the planner's choice where the op is a region.
      mesh: the mesh (default: from the arrays or the mesh context).
      in_specs: the inputs' specs (one per array passed), for Auto axes inside ``jit``.

    Returns:
      ``y``, laid out as the rule claims.

    Example::

        >>> y = rms_norm(x, scale, strategy="sharded_stats", mesh=mesh)
    """
    return _norm(
        "rms_norm",
        x,
        (("scale", scale),),
        mesh,
        in_specs,
        begin_norm_axis=begin_norm_axis,
        epsilon=epsilon,
        **_strategy(strategy),
    )


def fused_add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    scale: jax.Array | None = None,
    *,
    begin_norm_axis: int = -1,
    epsilon: float = 1e-6,
    strategy: str | None = None,
    mesh: MeshLike | None = None,
    in_specs: Specs = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Residual add fused with an RMS norm, sharded by its rule.

    ``h = x + residual``; ``inv_rms = 1 / sqrt(mean(h²) + epsilon)`` over the dims
    from ``begin_norm_axis`` on; ``y = h · inv_rms · scale``. A sum-partial ``x``
    or ``residual`` (a row-parallel matmul's output) is all-reduced once, as ``h``.

    Args:
      x: the input (e.g. a sublayer's output).
      residual: the residual stream, shaped like ``x``.
      scale: shape ``x.shape[begin_norm_axis:]``, or ``None``.
      begin_norm_axis: first normalized dim.
      epsilon: added to the mean square.
      strategy: ``"default"`` or ``"sharded_stats"`` (per-row Σh² all-reduced);
        ``None``: the default, or the planner's choice where the op is a region.
      mesh: the mesh (default: from the arrays or the mesh context).
      in_specs: the inputs' specs (one per array passed), for Auto axes inside ``jit``.

    Returns:
      ``(y, h, inv_rms)``; ``inv_rms`` has ``x``'s leading dims.

    Example::

        >>> y, h, inv_rms = fused_add_rms_norm(attn_out, stream, scale, mesh=mesh)
    """
    args, flags = _operands(x, (("scale", scale),))
    args.insert(1, residual)
    _check_specs("fused_add_rms_norm", in_specs, len(args))
    return apply_rule(
        "fused_add_rms_norm",
        *args,
        mesh=mesh,
        in_specs=in_specs,
        begin_norm_axis=begin_norm_axis,
        epsilon=epsilon,
        **_strategy(strategy),
        **flags,
    )


def group_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    num_groups: int,
    epsilon: float = 1e-5,
    data_format: str = "NCHW",
    mesh: MeshLike | None = None,
    in_specs: Specs = None,
) -> jax.Array:
    """Group norm: statistics per sample over each group of ``C / num_groups``
    channels and the spatial dims; only N may stay sharded.

    Args:
      x: ``(N, C, *spatial)`` (``"NCHW"``) or ``(N, *spatial, C)`` (``"NHWC"``), any rank ≥ 2.
      scale: shape ``(C,)`` or ``None``.
      bias: shape ``(C,)`` or ``None``.
      num_groups: a divisor of C.
      epsilon: added to the variance.
      data_format: ``"NCHW"`` (channels at dim 1) or ``"NHWC"`` (channels last).
      mesh: the mesh (default: from the arrays or the mesh context).
      in_specs: the inputs' specs (one per array passed), for Auto axes inside ``jit``.

    Returns:
      ``y``, laid out as the rule claims.

    Example::

        >>> y = group_norm(x, scale, bias, num_groups=4, mesh=mesh)
    """
    return _norm(
        "group_norm",
        x,
        (("scale", scale), ("bias", bias)),
        mesh,
        in_specs,
        num_groups=num_groups,
        epsilon=epsilon,
        data_format=data_format,
    )


def instance_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    epsilon: float = 1e-5,
    data_format: str = "NCHW",
    mesh: MeshLike | None = None,
    in_specs: Specs = None,
) -> jax.Array:
    """Instance norm: statistics per sample and channel over the spatial dims;
    N and C may stay sharded.

    Args:
      x: ``(N, C, *spatial)`` (``"NCHW"``) or ``(N, *spatial, C)`` (``"NHWC"``), rank ≥ 3.
      scale: shape ``(C,)`` or ``None``.
      bias: shape ``(C,)`` or ``None``.
      epsilon: added to the variance.
      data_format: ``"NCHW"`` or ``"NHWC"``.
      mesh: the mesh (default: from the arrays or the mesh context).
      in_specs: the inputs' specs (one per array passed), for Auto axes inside ``jit``.

    Returns:
      ``y``, laid out as the rule claims.

    Example::

        >>> y = instance_norm(x, scale, bias, mesh=mesh)
    """
    return _norm(
        "instance_norm",
        x,
        (("scale", scale), ("bias", bias)),
        mesh,
        in_specs,
        epsilon=epsilon,
        data_format=data_format,
    )


def _batch_norm(
    op: str,
    x: jax.Array,
    running_mean: jax.Array,
    running_var: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    training: bool,
    momentum: float,
    epsilon: float,
    data_format: str,
    mesh: MeshLike | None,
    in_specs: Specs,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    args, flags = _operands(x, (("scale", scale), ("bias", bias)))
    args += [running_mean, running_var]
    _check_specs(op, in_specs, len(args))
    if in_specs is not None:  # the rule takes x, [scale], [bias], running_mean, running_var
        in_specs = (in_specs[0], *in_specs[3:], in_specs[1], in_specs[2])
    out = apply_rule(
        op,
        *args,
        mesh=mesh,
        in_specs=in_specs,
        training=training,
        momentum=momentum,
        epsilon=epsilon,
        data_format=data_format,
        **flags,
    )
    if training:
        y, new_mean, new_var = out
        return y, new_mean, new_var
    y = out[0] if isinstance(out, tuple) else out
    return y, running_mean, running_var


def batch_norm(
    x: jax.Array,
    running_mean: jax.Array,
    running_var: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    training: bool = True,
    momentum: float = 0.9,
    epsilon: float = 1e-5,
    data_format: str = "NCHW",
    mesh: MeshLike | None = None,
    in_specs: Specs = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Batch norm, sharded by its rule: in training only C keeps its sharding
    (N and spatial sharding is gathered; ``sync_batch_norm`` keeps it).

    Training normalizes with the batch mean and biased variance over every dim
    but C, and updates the running statistics as flax does:
    ``new = momentum * running + (1 - momentum) * batch`` (note: PyTorch's
    ``momentum`` is the weight of the batch statistic, i.e. ``1 -`` this one).
    The running statistics are buffers: no gradient flows from them into ``x``.
    Inference normalizes with the running statistics, which come back unchanged;
    every dim may then stay sharded.

    Args:
      x: ``(N, C, *spatial)`` (``"NCHW"``) or ``(N, *spatial, C)`` (``"NHWC"``), rank ≥ 2.
      running_mean: shape ``(C,)``.
      running_var: shape ``(C,)``.
      scale: shape ``(C,)`` or ``None``.
      bias: shape ``(C,)`` or ``None``.
      training: batch statistics (True) or running statistics (False).
      momentum: weight of the old running statistics.
      epsilon: added to the variance.
      data_format: ``"NCHW"`` or ``"NHWC"``.
      mesh: the mesh (default: from the arrays or the mesh context).
      in_specs: specs of the arrays passed, in this function's argument order
        (x, running_mean, running_var, [scale], [bias]); for Auto axes inside ``jit``.

    Returns:
      ``(y, new_running_mean, new_running_var)``.

    Example::

        >>> y, mean, var = batch_norm(x, mean, var, scale, bias, mesh=mesh)
    """
    return _batch_norm(
        "batch_norm",
        x,
        running_mean,
        running_var,
        scale,
        bias,
        training,
        momentum,
        epsilon,
        data_format,
        mesh,
        in_specs,
    )


def sync_batch_norm(
    x: jax.Array,
    running_mean: jax.Array,
    running_var: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    training: bool = True,
    momentum: float = 0.9,
    epsilon: float = 1e-5,
    data_format: str = "NCHW",
    mesh: MeshLike | None = None,
    in_specs: Specs = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Synchronized batch norm: every dim of ``x`` keeps its sharding and the
    per-channel Σx and Σx² (``2 × C`` scalars) are all-reduced over the axes
    sharding N and the spatial dims — the activations never move.

    Arguments, statistics update and return value as :func:`batch_norm`.

    Example::

        >>> y, mean, var = sync_batch_norm(x, mean, var, scale, bias, mesh=mesh)
    """
    return _batch_norm(
        "sync_batch_norm",
        x,
        running_mean,
        running_var,
        scale,
        bias,
        training,
        momentum,
        epsilon,
        data_format,
        mesh,
        in_specs,
    )

"""``softmax_cross_entropy``: the registered rule applied to arrays.

The computation runs under ``shard_map`` (see :func:`spmdkit.ops.base.apply_rule`):
with vocab-sharded logits each device reduces its class block and only per-row
scalars are all-reduced (max, then the stacked sum-exp / target logit / smoothing
sums); the backward is a ``jax.custom_vjp`` that moves nothing. Under Explicit
mesh axes this works where ``optax.softmax_cross_entropy_with_integer_labels``
raises ``ShardingTypeError`` (its gather along a sharded class dim is ambiguous).
Semantics of every attribute: :mod:`spmdkit.rules.cross_entropy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from spmdkit.ops.base import apply_rule
from spmdkit.spec import MeshLike

__all__ = ["softmax_cross_entropy"]


def softmax_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    axis: int = -1,
    soft_label: bool | None = None,
    ignore_index: int | None = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    strategy: str | None = None,
    mesh: MeshLike | None = None,
    in_specs: Sequence[Any] | None = None,
) -> jax.Array:
    """Softmax cross-entropy whose partitioning is the ``softmax_cross_entropy`` rule.

    Args:
      logits: ``[..., C, ...]`` floating-point logits; ``axis`` is the class dim.
      labels: hard integer labels (``logits.shape`` without the class dim) or soft
        float labels (``logits.shape``).
      axis: the class dim.
      soft_label: ``None`` decides by the labels' rank; ``True``/``False`` states it.
      ignore_index: hard label value that gives loss 0 and is left out of the mean.
      reduction: ``"none"`` (per-row loss), ``"sum"`` or ``"mean"`` (over rows
        that are not ignored; 0 when all are).
      label_smoothing: ε; the target becomes ``(1-ε)·target + ε/C``.
      strategy: ``"default"`` (class dim stays sharded only for hard labels on the
        last dim) or ``"vocab_parallel"`` (also soft labels and any ``axis``).
      mesh: the mesh (default: the arrays' mesh or the ``jax.set_mesh`` context).
      in_specs: per argument a ``PartitionSpec``/``TensorSpec`` or ``None``;
        needed for traced arguments under Auto mesh axes.

    Returns:
      The loss: per row for ``"none"`` (laid out like the logits' rows), else a
      scalar. Hard labels outside ``[0, C)`` that are not ``ignore_index`` give NaN.

    Raises:
      ShardingConflictError: the labels do not fit the logits or an attribute is
        out of range (see :func:`spmdkit.rules.cross_entropy.cross_entropy_config`).
      SpecError: no mesh can be found, or a traced argument's layout is unknown.

    Example::

        >>> mesh = sk.make_mesh(x=4)
        >>> logits = jax.device_put(z, NamedSharding(mesh, P(None, "x")))  # vocab-sharded
        >>> loss = softmax_cross_entropy(logits, labels)                   # scalar mean
    """
    attrs: dict[str, Any] = {
        "axis": axis,
        "soft_label": soft_label,
        "ignore_index": ignore_index,
        "reduction": reduction,
        "label_smoothing": label_smoothing,
    }
    if strategy is not None:
        attrs["strategy"] = strategy
    return apply_rule(
        "softmax_cross_entropy", logits, labels, mesh=mesh, in_specs=in_specs, **attrs
    )

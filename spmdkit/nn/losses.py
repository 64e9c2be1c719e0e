"""Cross-entropy losses computed by :func:`spmdkit.ops.softmax_cross_entropy`.

``softmax_cross_entropy_with_integer_labels`` has optax's signature and result (a
loss per example); ``cross_entropy`` reduces inside the op (one scalar, the mean
over the examples), which a vocab-parallel layout computes from per-row scalars.
Logits are taken in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spmdkit.errors import ShardingConflictError
from spmdkit.nn.calls import call_op
from spmdkit.ops import softmax_cross_entropy

__all__ = ["cross_entropy", "softmax_cross_entropy_with_integer_labels"]


def softmax_cross_entropy_with_integer_labels(
    logits: jax.Array, labels: jax.Array, axis: int = -1, where: Any = None
) -> jax.Array:
    """optax's integer-label softmax cross-entropy: one loss per example.

    Args:
      logits: ``[..., C]`` unnormalized log-probabilities.
      labels: integer labels, ``logits.shape`` without the class dim.
      axis: the class dim.
      where: not supported (raises).

    Example::

        >>> losses = softmax_cross_entropy_with_integer_labels(logits, labels)   # [...]
    """
    if where is not None:
        raise ShardingConflictError(
            op="spmdkit.nn.softmax_cross_entropy_with_integer_labels",
            must="where is None",
            given="a where mask",
            fix="use ignore labels with cross_entropy(..., ignore_index=) or optax",
        )
    return call_op(
        softmax_cross_entropy,
        logits.astype(jnp.float32),
        labels,
        axis=axis,
        reduction="none",
        ignore_index=None,
    )


def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    axis: int = -1,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    strategy: str | None = None,
) -> jax.Array:
    """Softmax cross-entropy of integer labels, reduced inside the op.

    Args:
      logits: ``[..., C]`` logits (taken in float32).
      labels: integer labels, ``logits.shape`` without the class dim.
      axis: the class dim.
      reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
      ignore_index: a label value left out of the loss and the mean.
      label_smoothing: ε of the smoothed target.
      strategy: the op's strategy (``None``: the planner's choice in a planned step).

    Example::

        >>> loss = cross_entropy(model(tokens), targets)   # scalar
    """
    return call_op(
        softmax_cross_entropy,
        logits.astype(jnp.float32),
        labels,
        axis=axis,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        strategy=strategy,
    )

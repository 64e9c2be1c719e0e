"""Shared pieces of the reference models: the swappable computations and small layers.

The functions at the top (``layer_norm``, ``rms_norm``, ``group_norm``,
``batch_norm``, ``attention``, ``embedding_lookup``, ``softmax_cross_entropy``)
are the computations that ``spmdkit.ops`` provides sharding-aware versions of.
Every model calls them from here and nowhere else, so switching a model to the
ops means changing only this file.

The layers below them create their parameters with logical axis names in flax's
standard ``out_sharding`` metadata and never mention a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.errors import SpmdError
from spmdkit.planner import BATCH_NAMES, PARAM_NAMES

__all__ = [
    "ModelConfigError",
    "PARAM_AXES",
    "BATCH_AXES",
    "layer_norm",
    "rms_norm",
    "group_norm",
    "batch_norm",
    "attention",
    "embedding_lookup",
    "softmax_cross_entropy",
    "batch_stats",
    "rope",
    "param",
    "fan_in_init",
    "check_config",
    "count_params",
    "LayerNorm",
    "RMSNorm",
]

PARAM_AXES: frozenset[str] = frozenset(PARAM_NAMES)
"""Every logical axis name a parameter of the reference models may carry (the
names every preset of :mod:`spmdkit.planner` maps)."""

BATCH_AXES: frozenset[str] = frozenset(BATCH_NAMES)
"""Every logical axis name a batch field of the reference models may carry."""

Initializer = Callable[..., jax.Array]


class ModelConfigError(SpmdError, ValueError):
    """A model config is inconsistent.

    Broken example: ``ConvNetConfig(widths=(16, 32), blocks=(1,), norms=("group",))``.
    """


# ---------------------------------------------------------------------------
# Swappable computations (spmdkit.ops will provide sharded versions).
# ---------------------------------------------------------------------------


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *, eps: float) -> jax.Array:
    """Layer norm over the last dim, statistics in float32."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale + bias).astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float) -> jax.Array:
    """RMS norm over the last dim, statistics in float32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def group_norm(
    x: jax.Array, scale: jax.Array, bias: jax.Array, *, groups: int, eps: float
) -> jax.Array:
    """Group norm of an NHWC tensor: statistics per sample over (H, W, C/groups)."""
    n, h, w, c = x.shape
    xg = x.astype(jnp.float32).reshape(n, h, w, groups, c // groups)
    mean = jnp.mean(xg, axis=(1, 2, 4), keepdims=True)
    var = jnp.mean(jnp.square(xg - mean), axis=(1, 2, 4), keepdims=True)
    y = ((xg - mean) * jax.lax.rsqrt(var + eps)).reshape(n, h, w, c)
    return (y * scale + bias).astype(x.dtype)


def batch_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    *,
    eps: float,
) -> jax.Array:
    """Normalize the channels (last dim) with the given statistics."""
    y = (x.astype(jnp.float32) - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale + bias).astype(x.dtype)


def batch_stats(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-channel mean and (biased) variance over every dim but the last."""
    axes = tuple(range(x.ndim - 1))
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=axes)
    var = jnp.mean(jnp.square(xf - mean), axis=axes)
    return mean, var


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
    """Scaled dot-product attention with grouped-query support.

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k: ``[batch, seq, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``.
      v: like ``k``.
      causal: mask out keys after each query.

    Returns:
      ``[batch, seq, heads, head_dim]``.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k).astype(jnp.float32) / math.sqrt(d)
    if causal:
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, s, h, d)


def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of ``table`` ``[vocab, embed]`` at integer ``ids``."""
    return jnp.take(table, ids, axis=0)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits [..., classes]`` against integer ``labels [...]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def rope(x: jax.Array, *, theta: float) -> jax.Array:
    """Rotary position embedding of ``x [batch, seq, heads, head_dim]`` (half-split pairs)."""
    s, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------
# Parameters and small layers.
# ---------------------------------------------------------------------------


def check_config(name: str, *conditions: tuple[bool, str], given: Any) -> None:
    """Raise :class:`ModelConfigError` for the first ``(holds, what must hold)`` that fails."""
    for holds, must in conditions:
        if not holds:
            raise ModelConfigError(
                op=name, must=must, given=repr(given), fix=f"choose sizes where {must}"
            )


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    names: Sequence[str | None],
    dtype: Any = jnp.float32,
) -> nnx.Param:
    """A parameter whose ``out_sharding`` metadata holds its logical axis names.

    Args:
      rngs: the model's rng streams (the ``params`` stream is used).
      init: a ``jax.nn.initializers`` initializer ``(key, shape, dtype)``.
      shape: the parameter's shape.
      names: one logical axis name per dim, from :data:`PARAM_AXES`.
      dtype: the parameter dtype.

    Example::

        >>> w = param(nnx.Rngs(0), jax.nn.initializers.normal(0.02), (64, 256),
        ...           ("embed", "mlp"))
    """
    # Constant initializers take no key: drawing one costs ~10 ms per parameter when
    # traced (nnx.eval_shape), because flax probes the rng counter tracer's sharding.
    key = None if init in _CONSTANT_INITS else rngs.params()
    return nnx.Param(init(key, tuple(shape), dtype), out_sharding=tuple(names))


_CONSTANT_INITS = (jax.nn.initializers.zeros, jax.nn.initializers.ones)


def fan_in_init(fan_in: int) -> Initializer:
    """Normal init with standard deviation ``1/sqrt(fan_in)`` (for any kernel layout)."""
    return jax.nn.initializers.normal(1.0 / math.sqrt(fan_in))


class LayerNorm(nnx.Module):
    """Layer norm with ``scale`` and ``bias`` on the ``norm`` logical axis."""

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, jax.nn.initializers.ones, (dim,), ("norm",), dtype)
        self.bias = param(rngs, jax.nn.initializers.zeros, (dim,), ("norm",), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], eps=self.eps)


class RMSNorm(nnx.Module):
    """RMS norm with ``scale`` on the ``norm`` logical axis."""

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, jax.nn.initializers.ones, (dim,), ("norm",), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], eps=self.eps)


def count_params(model: nnx.Module) -> int:
    """Number of parameter elements of a (possibly abstract) model."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(math.prod(x.shape) for x in leaves)

"""Flax linen drop-ins whose computation is a :mod:`spmdkit.ops` op.

Each module subclasses its ``flax.linen`` namesake: the same attributes (plus
``strategy`` where the op has strategies, and ``logical_axes``), the same
parameter and collection names and shapes (``params/scale``, ``params/bias``,
``batch_stats/mean``, ``params/embedding``), so flax linen variables apply
unchanged. Parameters are created through ``nn.with_logical_partitioning`` with
``logical_axes`` (default ``("norm",)``; ``("vocab", "embed")`` for ``Embed``), as
linen models name them for ``nn.get_partition_spec`` and ``nnx.bridge`` (the names
become ``out_sharding`` metadata); ``logical_axes=None`` creates plain arrays.

================== ======================================= =============================
module             op                                      notes
================== ======================================= =============================
LayerNorm          ``layer_norm``                          trailing reduction axes
RMSNorm            ``rms_norm``                            trailing reduction axes
GroupNorm          ``group_norm`` (channels last)          flax's NHWC layout
BatchNorm          ``sync_batch_norm`` / ``batch_norm``    global statistics by default
Embed              ``embedding``                           ``attend``: one matmul
MultiHeadDot...    ``attention`` (no mask, no dropout)     else flax's attention
================== ======================================= =============================

(``MultiHeadDotProductAttention``: flax linen's module with :func:`attention_fn`
and logical names on its kernels and biases.)

The loss is :func:`spmdkit.nn.cross_entropy` (a function, for both APIs).

Example::

    >>> from spmdkit.nn import linen as sklinen
    >>> variables = flax.linen.LayerNorm().init(key, x)
    >>> y = sklinen.LayerNorm().apply(variables, x)    # flax's params, spmdkit's op
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from spmdkit.errors import ShardingConflictError
from spmdkit.nn import norms
from spmdkit.nn.calls import call_op
from spmdkit.nn.embedding import attend as attend_table
from spmdkit.ops import attention, embedding_lookup

__all__ = [
    "BatchNorm",
    "Embed",
    "GroupNorm",
    "LayerNorm",
    "MultiHeadDotProductAttention",
    "RMSNorm",
    "attention_fn",
]

Names = tuple[str | None, ...] | None


def _init(init: Callable[..., Any], names: Names, rank: int) -> Callable[..., Any]:
    """``init`` boxed with ``names`` for a ``rank``-dim variable: fewer names than dims
    name the trailing ones (the leading ones unnamed); ``None``: not boxed."""
    if names is None:
        return init
    if len(names) > rank:
        raise norms.unsupported(
            "linen",
            f"at most {rank} logical_axes for a {rank}-dim variable",
            f"logical_axes={names!r}",
            "give one logical name per dim of the parameter",
        )
    return nn.with_logical_partitioning(init, (None,) * (rank - len(names)) + tuple(names))


def _features(x: jax.Array, feature_axes: Any) -> tuple[int, ...]:
    """The parameters' shape: ``x``'s sizes on the (trailing) feature axes."""
    axes = feature_axes if isinstance(feature_axes, (tuple, list)) else (feature_axes,)
    return tuple(x.shape[a % x.ndim] for a in sorted(a % x.ndim for a in axes))


def _affine(module: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """``scale`` and ``bias`` as the module's flags ask (``None`` where off)."""
    scale = bias = None
    if module.use_scale:
        init = _init(module.scale_init, module.logical_axes, len(shape))
        scale = module.param("scale", init, shape, module.param_dtype)
    if getattr(module, "use_bias", False):
        init = _init(module.bias_init, module.logical_axes, len(shape))
        bias = module.param("bias", init, shape, module.param_dtype)
    return scale, bias


class LayerNorm(nn.LayerNorm):
    """``flax.linen.LayerNorm`` computed by :func:`spmdkit.ops.layer_norm`.

    Attributes:
      strategy: the op's strategy (``None``: the planner's choice in a planned step).
      logical_axes: logical names of ``scale`` and ``bias`` (default ``("norm",)``).
      (flax's others: ``epsilon``, ``dtype``, ``param_dtype``, ``use_bias``,
      ``use_scale``, initializers, ``reduction_axes``/``feature_axes`` = the trailing
      dims.)

    Example::

        >>> y = LayerNorm(epsilon=1e-5).apply(flax_layer_norm_variables, x)
    """

    strategy: str | None = None
    logical_axes: Names = ("norm",)

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalize ``x`` over its trailing dims."""
        scale, bias = _affine(self, _features(x, self.feature_axes))
        return norms.layer_norm("linen.LayerNorm", self, x, scale, bias, mask)


class RMSNorm(nn.RMSNorm):
    """``flax.linen.RMSNorm`` computed by :func:`spmdkit.ops.rms_norm`.

    Attributes:
      strategy: the op's strategy (``None``: the planner's choice in a planned step).
      logical_axes: logical names of ``scale`` (default ``("norm",)``).

    Example::

        >>> y = RMSNorm(epsilon=1e-5).apply(flax_rms_norm_variables, x)
    """

    strategy: str | None = None
    logical_axes: Names = ("norm",)

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalize ``x`` by the root mean square of its trailing dims."""
        scale, _ = _affine(self, _features(x, self.feature_axes))
        return norms.rms_norm("linen.RMSNorm", self, x, scale, mask)


class GroupNorm(nn.GroupNorm):
    """``flax.linen.GroupNorm`` (channels last) computed by :func:`spmdkit.ops.group_norm`.

    Attributes:
      logical_axes: logical names of ``scale`` and ``bias`` (default ``("norm",)``).
      (flax's others: ``num_groups`` or ``group_size``, ``epsilon``, ...)

    Example::

        >>> y = GroupNorm(num_groups=8).apply(flax_group_norm_variables, images)   # NHWC
    """

    logical_axes: Names = ("norm",)

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalize each sample's channel groups over the channels and spatial dims."""
        channels = x.shape[-1]
        groups = _groups(self.num_groups, self.group_size, channels)
        scale, bias = _affine(self, (channels,))
        return norms.group_norm("linen.GroupNorm", self, x, scale, bias, groups, mask)


def _groups(num_groups: int | None, group_size: int | None, channels: int) -> int:
    """The number of groups, from exactly one of ``num_groups`` / ``group_size``."""
    if (num_groups is None) == (group_size is None):
        raise norms.unsupported(
            "linen.GroupNorm",
            "exactly one of num_groups and group_size is set",
            f"num_groups={num_groups!r}, group_size={group_size!r}",
            "set one of them (group_size=None to use num_groups)",
        )
    groups = channels // group_size if group_size is not None else num_groups
    if groups is None or groups < 1 or channels % groups:
        raise norms.unsupported(
            "linen.GroupNorm",
            "the number of groups divides the channels",
            f"{groups} groups of {channels} channels",
            "choose num_groups (or group_size) dividing the channels",
        )
    return groups


class BatchNorm(nn.BatchNorm):
    """``flax.linen.BatchNorm`` computed by :func:`spmdkit.ops.sync_batch_norm`.

    The statistics of the whole (global) batch, as flax under ``jit``; the running
    statistics are ``batch_stats/mean`` and ``batch_stats/var`` (updated when not
    ``use_running_average`` and not initializing, with flax's momentum rule).

    Attributes:
      sync: global statistics over sharded batches (default True); ``False`` uses
        ``batch_norm``, which gathers the batch.
      logical_axes: logical names of the parameters and statistics (``("norm",)``).

    Example::

        >>> y, updates = BatchNorm(use_running_average=False).apply(
        ...     variables, images, mutable=["batch_stats"])
    """

    sync: bool = True
    logical_axes: Names = ("norm",)

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Normalize ``x`` per channel; in training, update the running statistics."""
        use_ra = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        shape = (x.shape[self.axis % x.ndim],)
        ra_mean = self.variable(
            "batch_stats",
            "mean",
            _init(lambda s: jnp.zeros(s, jnp.float32), self.logical_axes, 1),
            shape,
        )
        ra_var = self.variable(
            "batch_stats",
            "var",
            _init(lambda s: jnp.ones(s, jnp.float32), self.logical_axes, 1),
            shape,
        )
        params = _affine(self, shape)
        y, mean, var = norms.batch_norm(
            "linen.BatchNorm", self, x, (ra_mean.value, ra_var.value), params, use_ra, mask
        )
        if not use_ra and not self.is_initializing():
            ra_mean.value, ra_var.value = mean, var
        return y


class Embed(nn.Embed):
    """``flax.linen.Embed`` whose lookup is :func:`spmdkit.ops.embedding_lookup`.

    The table is ``params/embedding [num_embeddings, features]`` as in flax; a
    vocab-sharded table is looked up locally and masked, and the rows are summed
    once. ``attend`` (tied output logits) is one matmul against the table
    (:func:`spmdkit.nn.embedding.attend`): with ``dtype`` set both are cast to it as
    in flax; with ``dtype=None`` the table is cast to the query's dtype (flax would
    promote both to their common type, e.g. f32 logits for a bf16 query).

    Attributes:
      logical_axes: logical names of the table (default ``("vocab", "embed")``).

    Example::

        >>> emb = Embed(50257, 768)
        >>> x = emb.apply(variables, tokens)       # [batch, seq, 768]
    """

    logical_axes: Names = ("vocab", "embed")

    def setup(self) -> None:
        """Create the table (with its logical names)."""
        self.embedding = self.param(
            "embedding",
            _init(self.embedding_init, self.logical_axes, 2),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """The rows of the table at integer ``inputs`` (cast to ``dtype`` if set)."""
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ShardingConflictError(
                op="spmdkit.nn.linen.Embed",
                must="integer inputs",
                given=str(inputs.dtype),
                fix="pass token ids (int32)",
            )
        table = self.embedding if self.dtype is None else self.embedding.astype(self.dtype)
        return call_op(embedding_lookup, table, inputs)

    def attend(self, query: jax.Array) -> jax.Array:
        """Logits ``query [..., features] @ embedding.T`` (tied output projection),
        in ``dtype`` if set, else in the query's dtype.

        Example::

            >>> logits = emb.apply(variables, h, method="attend")
        """
        return attend_table(query, self.embedding, self.dtype)


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
) -> jax.Array:
    """An ``attention_fn`` for flax linen's attention modules: the ``attention`` op
    where it fits (no bias, mask, dropout or sowing; one batch dim), else
    ``flax.linen.dot_product_attention`` with the same arguments.

    Args:
      query: ``[batch, q_len, heads, head_dim]``; key, value: ``[batch, kv_len,
        heads, head_dim]``.
      bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype,
        precision, module: flax linen's.

    Example::

        >>> mha = flax.linen.MultiHeadDotProductAttention(8, attention_fn=attention_fn)
    """
    plain = (
        bias is None
        and mask is None
        and (dropout_rate == 0.0 or deterministic)
        and module is None
        and query.ndim == 4
    )
    if plain:
        q, k, v = (
            (query, key, value) if dtype is None else (t.astype(dtype) for t in (query, key, value))
        )
        return call_op(attention, q, k, v, causal=False)
    return nn.dot_product_attention(
        query,
        key,
        value,
        bias,
        mask,
        broadcast_dropout,
        dropout_rng,
        dropout_rate,
        deterministic,
        dtype,
        precision,
        module,
    )


def _named(init: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
    return nn.with_logical_partitioning(init, names)


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
    """``flax.linen.MultiHeadDotProductAttention`` with :func:`attention_fn` and
    logical names: kernels ``query``/``key``/``value`` ``(embed, heads, head_dim)``,
    ``out`` ``(heads, head_dim, embed)``; biases ``(heads, head_dim)`` / ``(embed,)``.
    Parameter paths and shapes are flax's (``query/kernel``, ..., ``out/bias``).

    flax linen's module takes causality as a ``mask`` (which falls back to flax's
    attention); unmasked attention is the ``attention`` op.

    Example::

        >>> y = MultiHeadDotProductAttention(num_heads=8).apply(variables, x)
    """

    kernel_init: Callable[..., Any] = _named(
        nn.linear.default_kernel_init, ("embed", "heads", "head_dim")
    )
    out_kernel_init: Callable[..., Any] | None = _named(
        nn.linear.default_kernel_init, ("heads", "head_dim", "embed")
    )
    bias_init: Callable[..., Any] = _named(nn.initializers.zeros_init(), ("heads", "head_dim"))
    out_bias_init: Callable[..., Any] | None = _named(nn.initializers.zeros_init(), ("embed",))
    attention_fn: Callable[..., jax.Array] = attention_fn

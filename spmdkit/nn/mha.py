"""``MultiHeadAttention``: ``flax.nnx.MultiHeadAttention`` whose attention is
:func:`spmdkit.ops.attention`.

Projections, parameter names and shapes are flax's (``query``, ``key``,
``value``, ``out``), named ``embed``/``heads``/``head_dim`` by default. The
attention itself goes through :func:`attention_fn`: the ``attention`` op
(causal or not, grouped-query) where flax's call has no mask, no dropout and
no weight sowing, else flax's ``dot_product_attention`` (jnp, which the
planner sees as primitives).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from spmdkit.errors import ShardingConflictError
from spmdkit.nn.calls import call_op
from spmdkit.ops import attention

__all__ = ["MultiHeadAttention", "attention_fn"]


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    module: Any = None,
    is_causal: bool = False,
    implementation: str | None = None,
    block_size: int | None = None,
    **kwargs: Any,
) -> jax.Array:
    """An ``attention_fn`` for flax's attention modules: the ``attention`` op where it
    fits (no bias, mask, dropout or sowing), else ``flax.nnx.dot_product_attention``.

    Args:
      query: ``[batch..., q_len, heads, head_dim]`` (one batch dim for the op).
      key: ``[batch..., kv_len, kv_heads, head_dim]``.
      value: ``[batch..., kv_len, kv_heads, head_dim]``.
      bias: flax's.
      mask: flax's.
      dropout_rate: flax's.
      deterministic: flax's.
      module: flax's.
      is_causal: flax's.
      implementation: the op's local kernel (see :func:`spmdkit.ops.attention`;
        ``None``: the op's own). Bind it with ``functools.partial`` to pass it
        through flax's module.
      block_size: the blockwise kernel's block size, likewise.
      **kwargs: flax's.

    Raises:
      ShardingConflictError: ``implementation``/``block_size`` given where the call
        cannot reach the op (a bias, mask, dropout or sowing): flax's fallback has
        no such kernels.

    Example::

        >>> mha = nnx.MultiHeadAttention(8, 512, attention_fn=attention_fn, rngs=rngs)
    """
    plain = (
        bias is None
        and mask is None
        and (dropout_rate == 0.0 or deterministic)
        and module is None
        and query.ndim == 4
    )
    kernel = {"implementation": implementation, "block_size": block_size}
    if plain:
        return call_op(attention, query, key, value, causal=bool(is_causal), **kernel)
    if implementation is not None or block_size is not None:
        raise ShardingConflictError(
            op="attention",
            must="implementation= and block_size= reach the attention op",
            given="a call with a bias, mask, dropout, sowing module or extra batch dims, "
            "which goes to flax's dot_product_attention",
            fix="drop implementation/block_size, or express the mask as is_causal=True",
        )
    return nnx.dot_product_attention(
        query,
        key,
        value,
        bias,
        mask,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        module=module,
        is_causal=is_causal,
        **kwargs,
    )


_QKV = {"out_sharding": ("embed", "heads", "head_dim")}
_OUT = {"out_sharding": ("heads", "head_dim", "embed")}
_QKV_BIAS = {"out_sharding": ("heads", "head_dim")}
_OUT_BIAS = {"out_sharding": ("embed",)}


class MultiHeadAttention(nnx.MultiHeadAttention):
    """``flax.nnx.MultiHeadAttention`` with :func:`attention_fn` and logical names.

    Args:
      num_heads: as flax.
      in_features: as flax.
      qkv_features: as flax.
      out_features: as flax.
      num_kv_heads: as flax.
      kernel_metadata: default ``embed``/``heads``/``head_dim`` logical names.
      out_kernel_metadata: likewise.
      bias_metadata: likewise.
      out_bias_metadata: likewise.
      **kwargs: flax's other arguments (``attention_fn`` defaults to :func:`attention_fn`).

    Example::

        >>> mha = MultiHeadAttention(8, 512, rngs=nnx.Rngs(0), decode=False)
        >>> y = mha(x, is_causal=True)
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        *,
        kernel_metadata: Mapping[str, Any] | None = None,
        out_kernel_metadata: Mapping[str, Any] | None = None,
        bias_metadata: Mapping[str, Any] | None = None,
        out_bias_metadata: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("attention_fn", attention_fn)
        super().__init__(
            num_heads,
            in_features,
            qkv_features,
            out_features,
            num_kv_heads,
            kernel_metadata=_QKV if kernel_metadata is None else kernel_metadata,
            out_kernel_metadata=_OUT if out_kernel_metadata is None else out_kernel_metadata,
            bias_metadata=_QKV_BIAS if bias_metadata is None else bias_metadata,
            out_bias_metadata=_OUT_BIAS if out_bias_metadata is None else out_bias_metadata,
            **kwargs,
        )

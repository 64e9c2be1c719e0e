"""``Embed``: ``flax.nnx.Embed`` whose lookup is :func:`spmdkit.ops.embedding_lookup`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit.errors import ShardingConflictError
from spmdkit.nn.calls import call_op
from spmdkit.ops import embedding_lookup

__all__ = ["Embed", "attend"]


class Embed(nnx.Embed):
    """``flax.nnx.Embed`` whose lookup is the ``embedding`` rule's op.

    The table is ``embedding [num_embeddings, features]`` as in flax (a module
    attribute ``embed`` holds it at ``embed/embedding``), named ``("vocab",
    "embed")`` by default; a vocab-sharded table is looked up locally and masked,
    and the rows are summed once. :meth:`attend` (tied output logits) is one
    matmul against the same table, traced as a plain ``dot_general`` the planner
    lays out like any other (the table keeps its logical names).

    One difference from flax: ``dtype=None`` (the default) computes in the dtype of
    the arrays a call gets — the lookup in the table's dtype, ``attend`` in the
    query's (the table cast to it) — where flax fixes ``dtype`` to ``param_dtype``
    at construction (so a bf16 query against an f32 table gives f32 logits there,
    bf16 here, and parameters cast to bf16 by a compute-dtype recipe stay bf16).
    With ``dtype`` given both behave as flax's: the table (and the query) are cast
    to it.

    Args:
      num_embeddings: rows of the table.
      features: the embedding size.
      dtype: the computation dtype (``None``: the inputs', see above).
      embedding_metadata: default ``out_sharding=("vocab", "embed")``.
      **kwargs: flax's other arguments (``param_dtype``, ``embedding_init``,
        ``rngs``).

    Example::

        >>> emb = Embed(50257, 768, rngs=nnx.Rngs(0))
        >>> x = emb(tokens)            # [batch, seq, 768]
        >>> logits = emb.attend(x)     # [batch, seq, 50257]
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: Any = None,
        embedding_metadata: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        meta = (
            {"out_sharding": ("vocab", "embed")}
            if embedding_metadata is None
            else embedding_metadata
        )
        super().__init__(num_embeddings, features, dtype=dtype, embedding_metadata=meta, **kwargs)
        self.dtype = dtype  # flax stores `dtype or param_dtype`; None: the inputs'

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """The rows of the table at integer ``inputs`` (cast to ``dtype`` if set)."""
        _no_out_sharding("spmdkit.nn.Embed", out_sharding)
        table = self.embedding[...]
        if self.dtype is not None:
            table = table.astype(self.dtype)
        return call_op(embedding_lookup, table, inputs)

    def attend(self, query: jax.Array, out_sharding: Any = None) -> jax.Array:
        """Logits ``query [..., features] @ embedding.T`` (tied output projection).

        Args:
          query: ``[..., features]`` activations.
          out_sharding: must be ``None`` (the planner lays the logits out).

        Returns:
          ``[..., num_embeddings]``, in ``dtype`` if set, else in the query's dtype.

        Example::

            >>> logits = emb.attend(h)          # h [batch, seq, features]
        """
        _no_out_sharding("spmdkit.nn.Embed.attend", out_sharding)
        return attend(query, self.embedding[...], self.dtype)


def attend(query: jax.Array, table: jax.Array, dtype: Any = None) -> jax.Array:
    """``query [..., D] · table [V, D]ᵀ`` as one contraction over ``D``.

    Shared by :class:`Embed` and :class:`spmdkit.nn.linen.Embed`: with ``dtype``
    both operands are cast to it (flax's promotion), else the table is cast to the
    query's dtype. No transpose of the table is traced, so its ``vocab``/``embed``
    dims map straight onto the logits' last dim and the contraction.

    Example::

        >>> attend(jnp.ones((2, 3, 16)), jnp.ones((64, 16))).shape
        (2, 3, 64)
    """
    if dtype is not None:
        query = query.astype(dtype)
    table = table.astype(query.dtype)
    return jnp.einsum("...d,vd->...v", query, table)


def _no_out_sharding(op: str, out_sharding: Any) -> None:
    if out_sharding is not None:
        raise ShardingConflictError(
            op=op,
            must="no out_sharding (the rule and the planner lay the result out)",
            given=f"out_sharding={out_sharding!r}",
            fix="drop out_sharding, or use flax.nnx.Embed",
        )

"""``Embed``: ``flax.nnx.Embed`` whose lookup is :func:`spmdkit.ops.embedding_lookup`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from spmdkit.errors import ShardingConflictError
from spmdkit.nn.calls import call_op
from spmdkit.ops import embedding_lookup

__all__ = ["Embed"]


class Embed(nnx.Embed):
    """``flax.nnx.Embed`` whose lookup is the ``embedding`` rule's op.

    The table is ``embedding [num_embeddings, features]`` as in flax, named
    ``("vocab", "embed")`` by default; a vocab-sharded table is looked up locally
    and masked, and the rows are summed once. ``attend`` (tied output logits) is
    flax's matmul.

    Args:
      num_embeddings: rows of the table.
      features: the embedding size.
      embedding_metadata: default ``out_sharding=("vocab", "embed")``.
      **kwargs: flax's other arguments (``dtype``, ``param_dtype``, ``embedding_init``,
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
        embedding_metadata: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        meta = (
            {"out_sharding": ("vocab", "embed")}
            if embedding_metadata is None
            else embedding_metadata
        )
        super().__init__(num_embeddings, features, embedding_metadata=meta, **kwargs)

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """The rows of the table at integer ``inputs`` (cast to ``dtype`` if set)."""
        if out_sharding is not None:
            raise ShardingConflictError(
                op="spmdkit.nn.Embed",
                must="no out_sharding (the rule and the planner lay the result out)",
                given=f"out_sharding={out_sharding!r}",
                fix="drop out_sharding, or use flax.nnx.Embed",
            )
        table = self.embedding[...]
        if self.dtype is not None:
            table = table.astype(self.dtype)
        return call_op(embedding_lookup, table, inputs)

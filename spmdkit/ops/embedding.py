"""``embedding_lookup``: the registered ``embedding`` rule applied to arrays.

The computation runs under ``shard_map`` (see :func:`spmdkit.ops.base.apply_rule`):
a row-sharded (vocab-parallel) table is looked up locally with the ids masked to
each device's row block, and the sum-partial result is all-reduced once inside
the same program; a column-sharded table gives a D-sharded output with no
communication. ``jax.grad`` scatter-adds locally: the table grad keeps the table's
layout, summed over the axes that shard the ids. Semantics:
:mod:`spmdkit.rules.embedding`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from spmdkit.ops.base import apply_rule
from spmdkit.spec import MeshLike

__all__ = ["embedding_lookup"]


def embedding_lookup(
    table: jax.Array,
    ids: jax.Array,
    *,
    mesh: MeshLike | None = None,
    in_specs: Sequence[Any] | None = None,
) -> jax.Array:
    """``table[ids]`` whose partitioning is the ``embedding`` rule.

    Args:
      table: ``[V, D]`` floating-point table (replicated, row- or column-sharded).
      ids: integer ids of any shape (sharded on any of its dims).
      mesh: the mesh (default: the arrays' mesh or the ``jax.set_mesh`` context).
      in_specs: per argument a ``PartitionSpec``/``TensorSpec`` or ``None``;
        needed for traced arguments under Auto mesh axes.

    Returns:
      ``ids.shape + (D,)``: the ids' dims laid out like the ids, the last like the
      table's D. Ids outside ``[0, V)`` give rows of NaN.

    Raises:
      ShardingConflictError: the table is not ``[V, D]`` floats or the ids are not
        integers.
      SpecError: no mesh can be found, or a traced argument's layout is unknown.

    Example::

        >>> mesh = sk.make_mesh(data=2, model=4)
        >>> table = jax.device_put(w, NamedSharding(mesh, P("model", None)))  # vocab-parallel
        >>> ids = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
        >>> embedding_lookup(table, ids).shape      # [batch@data, seq, D], one all-reduce
    """
    return apply_rule("embedding", table, ids, mesh=mesh, in_specs=in_specs)

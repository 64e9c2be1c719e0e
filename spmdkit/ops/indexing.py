"""``index_put``: the registered ``index_put`` rule applied to arrays.

The computation runs under ``shard_map`` (see :func:`spmdkit.ops.base.apply_rule`).
With ``strategy="default"`` (the reference semantics) the indexed dims of ``x`` are gathered
first and every device scatters all values (only ``x``'s trailing dims stay
sharded). With ``strategy="local_update"`` a row-sharded ``x`` stays sharded:
every device rebases the replicated indices to its own row block, drops the ones
it does not own and scatters the rest — no communication at all. ``jax.grad``
differentiates the local scatter: ``d x`` keeps ``x``'s layout, ``d value`` is
gathered locally and summed over the row axes once (the transpose of replicating
``value``). Semantics: :mod:`spmdkit.rules.index_put`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from spmdkit.ops.base import apply_rule
from spmdkit.spec import MeshLike

__all__ = ["index_put"]


def index_put(
    x: jax.Array,
    indices: jax.Array | Sequence[jax.Array],
    value: jax.Array,
    *,
    accumulate: bool = False,
    strategy: str | None = None,
    mesh: MeshLike | None = None,
    in_specs: Sequence[Any] | None = None,
) -> jax.Array:
    """``x.at[indices].set(value)`` (or ``.add`` with ``accumulate``) governed by the
    ``index_put`` rule.

    Args:
      x: the array written into, ``[n_0, ..., n_{k-1}, *t]``.
      indices: one integer array (addresses dim 0 of ``x``) or a sequence of ``k``
        integer arrays of one shape ``m`` (array ``i`` addresses dim ``i``).
        Negative indices count from the end; out-of-range ones are dropped.
      value: ``[*m, *t]`` with ``x``'s dtype (broadcast and cast it yourself:
        the op never does so silently).
      accumulate: add the values instead of overwriting. With ``False`` and
        duplicate indices, which write wins is unspecified (as in JAX).
      strategy: ``"default"`` (the reference semantics: indexed dims replicated) or
        ``"local_update"`` (indexed dims keep ``x``'s sharding; zero communication).
      mesh: the mesh (default: the arrays' mesh or the ``jax.set_mesh`` context).
      in_specs: layouts of ``(x, indices, value)`` — ``indices`` as one entry
        (shared by every index array) or a tuple with one per index array; each
        a ``PartitionSpec``/``TensorSpec`` or ``None``. Needed for traced
        arguments under Auto mesh axes.

    Returns:
      The updated array, laid out as the rule claims (``x``'s layout, with the
      indexed dims replicated under ``"default"``).

    Raises:
      ShardingConflictError: non-integer indices, index arrays of different
        shapes, a value of the wrong shape or dtype, or an unknown strategy.
      SpecError: no mesh can be found, or a traced argument's layout is unknown.

    Example::

        >>> mesh = sk.make_mesh(x=4)
        >>> table = jax.device_put(jnp.zeros((1024, 64)), NamedSharding(mesh, P("x")))
        >>> rows = jnp.array([3, 700, 12])
        >>> out = index_put(table, rows, jnp.ones((3, 64)), strategy="local_update")
        >>> out.sharding.spec                       # still row-sharded, nothing moved
        PartitionSpec('x', None)
    """
    several = isinstance(indices, (tuple, list))
    idx = tuple(indices) if several else (indices,)
    specs = None
    if in_specs is not None:
        x_spec, idx_spec, v_spec = in_specs
        per_index = several and isinstance(idx_spec, (tuple, list)) and not isinstance(idx_spec, P)
        idx_specs = tuple(idx_spec) if per_index else (idx_spec,) * len(idx)
        specs = (x_spec, *idx_specs, v_spec)
    attrs: dict[str, Any] = {"accumulate": bool(accumulate)}
    if strategy is not None:
        attrs["strategy"] = strategy
    return apply_rule("index_put", x, *idx, value, mesh=mesh, in_specs=specs, **attrs)

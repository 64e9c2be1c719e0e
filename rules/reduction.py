"""Reductions over some dims: sum, mean, max, min, prod (``axis``, ``keepdims``).

Algebra: kept dims pass through; reduced dims are reduction factors. A reduced
dim sharded over an axis leaves each device a partial result, so the output is
partial over that axis with the reduction's own op: ``sum`` → sum, ``max`` →
max, ``min`` → min, ``mean`` → avg (each device's mean of its slice; the
average of the devices' means is the global mean). An unevenly sharded reduced
dim stays sharded: its padding is filled with the reduction's identity (0, or
∓inf for max/min), and a device's mean of a padded block is rescaled by
``block · shards / size`` so the average still comes out right. ``prod`` has
no partial form here, so its reduced dims must be replicated. A pending
reduction on the input passes when it commutes with the op: sum/avg through sum
and mean, max through max, min through min. With ``keepdims`` the reduced dims
stay as size-1 dims, never sharded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spmdkit.engine.factor import BROADCAST
from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.rule import Example
from spmdkit.errors import ShardingConflictError

__all__ = ["RULES", "reduce_notation"]


def _axes(rank: int, axis: Any) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(rank))
    items = (axis,) if isinstance(axis, int) else tuple(axis)
    bad = [a for a in items if not -rank <= a < rank]
    if bad or len({a % rank for a in items}) != len(items):
        raise ShardingConflictError(
            op="reduce",
            must=f"axis names distinct dims of a rank-{rank} input",
            given=f"axis={axis!r}",
            fix=f"pass axes in [-{rank}, {rank})",
        )
    return tuple(sorted(a % rank for a in items))


def reduce_notation(
    shapes: tuple[tuple[int, ...], ...], *, axis: Any = None, keepdims: bool = False
) -> str:
    """Notation of a reduction over ``axis``.

    Example::

        >>> reduce_notation(((8, 4, 2),), axis=1)
        'r0 r1 r2 -> r0 r2'
        >>> reduce_notation(((8, 4),), axis=(0,), keepdims=True)
        'r0 r1 -> 1 r1'
    """
    (shape,) = shapes
    red = _axes(len(shape), axis)
    ins = [f"r{i}" for i in range(len(shape))]
    outs = (
        [BROADCAST if i in red else f for i, f in enumerate(ins)]
        if keepdims
        else [f for i, f in enumerate(ins) if i not in red]
    )
    return f"{' '.join(ins)} -> {' '.join(outs)}"


def _reducer(fn: Any):
    def impl(x: jax.Array, *, axis: Any = None, keepdims: bool = False):
        return fn(x, axis=axis, keepdims=keepdims)

    return impl


_EX = (
    Example(((8, 8),), attrs={"axis": 1}),
    Example(((8, 8),), attrs={"axis": 0, "keepdims": True}),
    Example(((4, 8, 2),), attrs={"axis": (0, 2)}),
    Example(((8, 8),), attrs={"axis": None}),
)
_NEAR_ONE_EX = tuple(Example(e.shapes, attrs=e.attrs, domain="near_one") for e in _EX)


def _rule(name: str, fn: Any, reduce: str | None, policy: str, examples: Any = _EX) -> FactorRule:
    return FactorRule(
        name,
        reduce_notation,
        impl=_reducer(fn),
        reduce=reduce,
        partial=policy,
        examples=examples,
        doc=f"{fn.__name__} over axis (None: all), keepdims",
    )


RULES = (
    _rule("reduce_max", jnp.max, "max", "REDUCE_MAX"),
    _rule("reduce_mean", jnp.mean, "avg", "REDUCE_SUM"),
    _rule("reduce_min", jnp.min, "min", "REDUCE_MIN"),
    _rule("reduce_prod", jnp.prod, None, "NONE", _NEAR_ONE_EX),
    _rule("reduce_sum", jnp.sum, "sum", "REDUCE_SUM"),
)

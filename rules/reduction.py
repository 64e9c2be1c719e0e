"""Reductions over some dims: sum, mean, max, min, prod (``axis``, ``keepdims``);
and the ops that run along one dim: cumulative sums, products, maxima, minima and
log-sum-exps, argmax/argmin, sort and top_k.

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

Along one dim (``cumsum`` and the other scans, ``sort``, ``argmax``, ``top_k``): every
output element depends on the whole dim, so it stays unsharded and the other dims
pass through. ``top_k`` runs per device under ``shard_map`` (its rule's own local
computation, and ``sk.jit``'s replay, :mod:`spmdkit.compile.enforce`): XLA's
partitioner gathers the whole operand of its TopK custom call, rows included, where a
router's top-k of each token's expert scores needs only that token's row (MaxText runs
its routing so, inside ``shard_map``; Megatron-LM on each rank's tokens). A pending
reduction passes a scan that computes with the same op: a sum/avg
through ``cumsum`` (a running sum of the devices' pieces sums to the running sum),
max through ``cummax``, min through ``cummin``; nothing through a product, a
log-sum-exp, a sort or an argmax (a running sum of max-partial pieces is not the
running sum of their max).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdkit.engine.factor import BROADCAST, Notation
from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.rule import Example, LocalContext, RuleContext
from spmdkit.errors import ShardingConflictError

__all__ = ["PRIMITIVE_RULES", "RULES", "along_notation", "reduce_notation"]


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


# -- ops along one dim: jax primitives the library has no op of its own for ---------


def along_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    along: tuple[int, ...] = (),
    drop: bool = False,
    outputs: int | None = None,
) -> Notation:
    """Notation of an op over the dims ``along`` of same-rank operands: those dims
    unsharded, the others shared by every operand and output; ``drop`` takes them
    out of the output (argmax), ``outputs`` is the number of results (default: one
    per operand).

    Example::

        >>> str(along_notation(((8, 4),), along=(0,)))
        's0 s1 -> s0 s1  [replicated: s0]'
    """
    ranks = {len(s) for s in shapes}
    if len(ranks) != 1:
        raise ValueError(f"operands of different ranks {sorted(ranks)}")
    (rank,) = ranks
    along = tuple(a % rank for a in along) if rank else ()
    fs = tuple(f"s{i}" for i in range(rank))
    out = tuple(f for i, f in enumerate(fs) if not (drop and i in along))
    n_out = len(shapes) if outputs is None else outputs
    need = frozenset(fs[i] for i in along)
    return Notation(tuple(fs for _ in shapes), tuple(out for _ in range(n_out)), need, None)


def _scan_notation(shapes: tuple[tuple[int, ...], ...], *, axis: int, **_: Any) -> Notation:
    return along_notation(shapes, along=(axis,))


def _scan(name: str, fn: Any, policy: str, domain: str = "real") -> FactorRule:
    def impl(x: jax.Array, *, axis: int, reverse: bool = False) -> jax.Array:
        return fn(x, axis=axis, reverse=reverse)

    return FactorRule(
        name,
        _scan_notation,
        impl=impl,
        partial=policy,
        examples=(
            Example(((8, 8),), attrs={"axis": 0}, domain=domain),
            Example(((4, 8, 2),), attrs={"axis": 1, "reverse": True}, domain=domain),
        ),
        doc=f"{fn.__name__} along axis (reverse: from the end); that dim unsharded",
    )


def _arg_notation(shapes: tuple[tuple[int, ...], ...], *, axes: Any, **_: Any) -> Notation:
    return along_notation(shapes, along=tuple(axes), drop=True)


def _index_dtype(dtypes: tuple[Any, ...], *, index_dtype: Any, **_: Any) -> np.dtype:
    return np.dtype(index_dtype)


def _arg(name: str, fn: Any) -> FactorRule:
    def impl(x: jax.Array, *, axes: Any, index_dtype: Any) -> jax.Array:
        (axis,) = axes
        return fn(x, axis, index_dtype)

    return FactorRule(
        name,
        _arg_notation,
        impl=impl,
        partial="NONE",
        dtype=_index_dtype,
        examples=(
            Example(((8, 8),), attrs={"axes": (1,), "index_dtype": "int32"}),
            Example(((4, 8, 2),), attrs={"axes": (0,), "index_dtype": "int32"}),
        ),
        doc=f"{fn.__name__} over axes (one dim, dropped); that dim unsharded",
    )


def _sort_notation(shapes: tuple[tuple[int, ...], ...], *, dimension: int, **_: Any) -> Notation:
    return along_notation(shapes, along=(dimension,))


def _sort(*xs: jax.Array, dimension: int, is_stable: bool = True, num_keys: int = 1) -> Any:
    out = lax.sort(xs if len(xs) > 1 else xs[0], dimension, is_stable, num_keys)
    return tuple(out) if len(xs) > 1 else out


def _top_k_notation(
    shapes: tuple[tuple[int, ...], ...], *, k: int, axis: int = -1, **_: Any
) -> Notation:
    (shape,) = shapes
    at = axis % len(shape)
    nt = along_notation(shapes, along=(at,), outputs=0)
    out = tuple("k" if i == at else f for i, f in enumerate(nt.inputs[0]))
    return Notation(nt.inputs, (out, out), nt.need_replication | {"k"}, None)


class _TopKRule(FactorRule):
    """top_k: its results hold ``k`` elements along the selected dim, a factor no
    operand has, sized by the attribute; the other dims (a router's tokens) pass
    through, each device taking the top ``k`` of its own rows.

    Its computation is its own ``shard_map`` program (:meth:`local_fn`, the op on a
    device's block): XLA's SPMD partitioner gathers the whole operand of the TopK
    custom call it lowers ``top_k`` to, sharded rows included (compiled on jax
    0.10.2 and 0.12), so ``sk.jit``'s replay runs it per device as the rule says
    (:mod:`spmdkit.compile.enforce`), and the jit check compiles that program."""

    def _sizes(
        self, ctx: RuleContext, nt: Notation, shapes: Sequence[tuple[int, ...]]
    ) -> dict[str, int]:
        sizes = super()._sizes(ctx, nt, shapes)
        sizes["k"] = int(ctx.attrs["k"])
        return sizes

    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """The op on a device's block of rows (the selected dim whole): its
        top ``k``, padding rows of an uneven block masked as for any rule."""
        attrs = {k: v for k, v in lctx.attrs.items() if k != "strategy"}
        return self.masked(functools.partial(_top_k, **attrs), lctx)


def _top_k(x: jax.Array, *, k: int, axis: int = -1, **kw: Any) -> tuple[jax.Array, jax.Array]:
    if axis in (-1, x.ndim - 1) and not kw:
        return tuple(lax.top_k(x, k))
    return tuple(lax.top_k(x, k, axis=axis, **kw))


PRIMITIVE_RULES = (
    _arg("argmax", lax.argmax),
    _arg("argmin", lax.argmin),
    _scan("cumlogsumexp", lax.cumlogsumexp, "NONE"),
    _scan("cummax", lax.cummax, "REDUCE_MAX"),
    _scan("cummin", lax.cummin, "REDUCE_MIN"),
    _scan("cumprod", lax.cumprod, "NONE", "near_one"),
    _scan("cumsum", lax.cumsum, "REDUCE_SUM"),
    FactorRule(
        "sort",
        _sort_notation,
        impl=_sort,
        partial="NONE",
        examples=(
            Example(((8, 8),), attrs={"dimension": 0}),
            Example(
                ((4, 8), (4, 8)),
                attrs={"dimension": 1, "num_keys": 1},
                dtypes=("float32", "int32"),
                differentiable=(True, False),
            ),
        ),
        doc="sorts along dimension by the first num_keys operands, the rest carried along; "
        "that dim unsharded",
    ),
    _TopKRule(
        "top_k",
        _top_k_notation,
        impl=_top_k,
        partial="NONE",
        examples=(Example(((8, 8),), attrs={"k": 2}), Example(((4, 8, 2),), attrs={"k": 1})),
        doc="the k largest along the last dim and their indices; that dim unsharded, the "
        "others pass through (run per device: XLA gathers its TopK custom call's operand)",
    ),
)

RULES = (
    *PRIMITIVE_RULES,
    _rule("reduce_max", jnp.max, "max", "REDUCE_MAX"),
    _rule("reduce_mean", jnp.mean, "avg", "REDUCE_SUM"),
    _rule("reduce_min", jnp.min, "min", "REDUCE_MIN"),
    _rule("reduce_prod", jnp.prod, None, "NONE", _NEAR_ONE_EX),
    _rule("reduce_sum", jnp.sum, "sum", "REDUCE_SUM"),
)

"""Contractions: matmul (with transpose flags, 1-D operands, broadcast batch dims),
dot_general and einsum.

Algebra: a contraction is linear in each operand. Its free dims and batch dims
pass through; its contracted dims are reduction factors: when both operands
shard a contracted dim over an axis, each device multiplies its slices and
the output is sum-partial over that axis (one all-reduce or reduce-scatter
later, instead of gathering both operands now). Because it is linear in each
operand separately, one sum-partial operand times a replicated one stays
sum-partial; two partial operands do not (Σa·Σb ≠ Σ a·b). The grad of an
operand sums over the factors it lacks (dW of ``x @ W`` sums over the batch),
so it is sum-partial over the axes sharding them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.rule import Example
from spmdkit.errors import ShardingConflictError

__all__ = ["RULES", "matmul_notation", "dot_general_notation", "einsum_notation"]


def matmul_notation(
    shapes: tuple[tuple[int, ...], ...], *, transpose_x: bool = False, transpose_y: bool = False
) -> str:
    """Notation of ``matmul(x, y)`` (numpy semantics plus transpose flags).

    Example::

        >>> matmul_notation(((4, 8, 16), (32, 16)), transpose_y=True)
        '... m k, n k -> ... m n'
    """
    rx, ry = (len(s) for s in shapes)
    if rx == 0 or ry == 0:
        raise ShardingConflictError(
            op="matmul",
            must="both operands have rank ≥ 1",
            given=f"shapes {shapes}",
            fix="use mul for scalars",
        )
    x = "k" if rx == 1 else ("... k m" if transpose_x else "... m k")
    y = "k" if ry == 1 else ("... n k" if transpose_y else "... k n")
    out = ["..."] if max(rx, ry) > 2 else []
    if rx > 1:
        out.append("m")
    if ry > 1:
        out.append("n")
    return f"{x}, {y} -> {' '.join(out)}"


def _matmul(x: jax.Array, y: jax.Array, *, transpose_x: bool = False, transpose_y: bool = False):
    if transpose_x and x.ndim > 1:
        x = jnp.swapaxes(x, -1, -2)
    if transpose_y and y.ndim > 1:
        y = jnp.swapaxes(y, -1, -2)
    return jnp.matmul(x, y)


def dot_general_notation(
    shapes: tuple[tuple[int, ...], ...], *, dimension_numbers: Any, **_: Any
) -> str:
    """Notation of ``lax.dot_general`` from its dimension numbers.

    Example::

        >>> dot_general_notation(((2, 8, 4), (2, 4, 6)),
        ...                      dimension_numbers=(((2,), (1,)), ((0,), (0,))))
        'b0 m0 k0, b0 k0 n0 -> b0 m0 n0'
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lx, ly = (["?"] * len(s) for s in shapes)
    for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
        lx[a] = ly[b] = f"b{i}"
    for i, (a, b) in enumerate(zip(lc, rc, strict=True)):
        lx[a] = ly[b] = f"k{i}"
    m = [f"m{i}" for i in range(lx.count("?"))]
    n = [f"n{i}" for i in range(ly.count("?"))]
    it_m, it_n = iter(m), iter(n)
    lx = [next(it_m) if f == "?" else f for f in lx]
    ly = [next(it_n) if f == "?" else f for f in ly]
    out = [f"b{i}" for i in range(len(lb))] + m + n
    return f"{' '.join(lx)}, {' '.join(ly)} -> {' '.join(out)}"


def _dot_general(x: jax.Array, y: jax.Array, *, dimension_numbers: Any) -> jax.Array:
    return lax.dot_general(x, y, dimension_numbers)


def einsum_notation(shapes: tuple[tuple[int, ...], ...], *, equation: str) -> str:
    """Notation of ``jnp.einsum(equation, ...)``: one factor per index letter.

    Example::

        >>> einsum_notation(((2, 8, 4), (2, 4, 6)), equation="bmk,bkn->bmn")
        'b m k, b k n -> b m n'
    """
    if "->" not in equation:
        raise ShardingConflictError(
            op="einsum",
            must="the equation names its output ('ij,jk->ik')",
            given=repr(equation),
            fix="write the output indices explicitly",
        )
    lhs, rhs = equation.replace(" ", "").split("->")

    def spaced(term: str) -> str:
        return " ".join("..." if t == "." else t for t in term.replace("...", "."))

    return ", ".join(spaced(t) for t in lhs.split(",")) + " -> " + spaced(rhs)


def _einsum(*xs: jax.Array, equation: str) -> jax.Array:
    return jnp.einsum(equation, *xs)


_DN_BATCHED = (((2,), (1,)), ((0,), (0,)))
_DN_TN = (((0,), (0,)), ((), ()))

RULES = (
    FactorRule(
        "dot_general",
        dot_general_notation,
        impl=_dot_general,
        partial="MULTIPLICATIVE",
        examples=(
            Example(((8, 8), (8, 8)), attrs={"dimension_numbers": (((1,), (0,)), ((), ()))}),
            Example(((2, 8, 8), (2, 8, 4)), attrs={"dimension_numbers": _DN_BATCHED}),
            Example(((8, 4), (8, 8)), attrs={"dimension_numbers": _DN_TN}),
        ),
        doc="lax.dot_general: batch dims pass, contracting dims reduce (sum)",
    ),
    FactorRule(
        "einsum",
        einsum_notation,
        impl=_einsum,
        partial="MULTIPLICATIVE",
        examples=(
            Example(((2, 8, 8), (2, 8, 4)), attrs={"equation": "bmk,bkn->bmn"}),
            Example(((8, 4), (4, 8), (8, 2)), attrs={"equation": "ij,jk,kl->il"}),
        ),
        doc="jnp.einsum: one factor per index letter; contracted letters reduce (sum)",
    ),
    FactorRule(
        "matmul",
        matmul_notation,
        impl=_matmul,
        partial="MULTIPLICATIVE",
        examples=(
            Example(((8, 8), (8, 8))),
            Example(((8, 8), (8, 8)), attrs={"transpose_x": True, "transpose_y": True}),
            Example(((2, 8, 8), (8, 4))),
            Example(((8,), (8, 8))),
            Example(((8, 8), (8,))),
        ),
        doc="numpy matmul with transpose_x / transpose_y; batch dims broadcast right-aligned",
    ),
)

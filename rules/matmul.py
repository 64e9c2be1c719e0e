"""Contractions: matmul (with transpose flags, 1-D operands, broadcast batch dims),
dot_general, einsum and convolution (``conv_general_dilated``).

Algebra: a contraction is linear in each operand. Its free dims and batch dims
pass through; its contracted dims are reduction factors: when both operands
shard a contracted dim over an axis, each device multiplies its slices and
the output is sum-partial over that axis (one all-reduce or reduce-scatter
later, instead of gathering both operands now). Because it is linear in each
operand separately, one sum-partial operand times a replicated one stays
sum-partial; two partial operands do not (Σa·Σb ≠ Σ a·b). The grad of an
operand sums over the factors it lacks (dW of ``x @ W`` sums over the batch),
so it is sum-partial over the axes sharding them.

A convolution contracts like a matmul: the input's batch dim and the kernel's
output-feature dim pass through, the input-feature dim is contracted
(sum-partial when both operands shard it alike). Its spatial dims stay unsharded
(a window reads its neighbours' elements: halos are not modelled), and a grouped
convolution (``feature_group_count`` or ``batch_group_count`` above 1) keeps its
feature and batch dims unsharded as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmdkit.engine.factor import Notation
from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.rule import Example, RuleContext
from spmdkit.errors import ShardingConflictError

__all__ = [
    "PRIMITIVE_RULES",
    "RULES",
    "conv_notation",
    "dot_general_notation",
    "einsum_notation",
    "matmul_notation",
]


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


def conv_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    dimension_numbers: Any,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    **_: Any,
) -> Notation:
    """Notation of ``lax.conv_general_dilated(lhs, rhs)`` for its dimension numbers
    (``lhs_spec``, ``rhs_spec``, ``out_spec``: batch/feature first, then spatial).

    Example::

        >>> dn = lax.ConvDimensionNumbers((0, 1, 2), (0, 1, 2), (0, 1, 2))
        >>> str(conv_notation(((8, 4, 6), (8, 4, 3)), dimension_numbers=dn))
        'b f s0, o f k0 -> b o t0  [reduce f,s0,k0: sum]  [replicated: k0,s0,t0]'
    """
    lhs, rhs = shapes
    lspec, rspec, ospec = dimension_numbers
    grouped = feature_group_count != 1 or batch_group_count != 1
    ldims, rdims, odims = [""] * len(lhs), [""] * len(rhs), [""] * len(lhs)
    ldims[lspec[0]], ldims[lspec[1]] = "b", "f"
    rdims[rspec[0]], rdims[rspec[1]] = "o", "g" if grouped else "f"
    odims[ospec[0]], odims[ospec[1]] = "bo" if batch_group_count != 1 else "b", "o"
    need = set()
    for i, (ld, rd, od) in enumerate(zip(lspec[2:], rspec[2:], ospec[2:], strict=True)):
        ldims[ld], rdims[rd], odims[od] = f"s{i}", f"k{i}", f"t{i}"
        need |= {f"s{i}", f"k{i}", f"t{i}"}
    if grouped:
        need |= {"b", "bo", "f", "g", "o"}
    dims = (tuple(ldims), tuple(rdims))
    return Notation(dims, (tuple(odims),), frozenset(need), "sum")


class _ConvRule(FactorRule):
    """conv_general_dilated: its output's spatial dims (and a batch-grouped output's
    batch dim) are factors no operand has, sized by the convolution's arithmetic."""

    def _sizes(
        self, ctx: RuleContext, nt: Notation, shapes: Sequence[tuple[int, ...]]
    ) -> dict[str, int]:
        sizes = super()._sizes(ctx, nt, shapes)
        a = ctx.attrs
        lhs, rhs = shapes
        try:
            lspec, rspec, _ = a["dimension_numbers"]
            n = len(lspec) - 2
            strides = a.get("window_strides") or (1,) * n
            ldil = a.get("lhs_dilation") or (1,) * n
            rdil = a.get("rhs_dilation") or (1,) * n
            for i in range(n):
                lo, hi = a["padding"][i]
                size = (lhs[lspec[2 + i]] - 1) * ldil[i] + 1 + lo + hi
                window = (rhs[rspec[2 + i]] - 1) * rdil[i] + 1
                sizes[f"t{i}"] = max(0, (size - window) // strides[i] + 1)
            sizes["bo"] = lhs[lspec[0]] // a.get("batch_group_count", 1)
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
            raise ShardingConflictError(
                op=ctx.op,
                must="explicit padding pairs, strides and dilations, one per spatial dim",
                given=f"attrs {dict(a)} ({type(e).__name__}: {e})",
                fix="pass the attributes of the lax.conv_general_dilated equation",
            ) from e
        return sizes


def _conv(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    window_strides: Any,
    padding: Any,
    dimension_numbers: Any,
    lhs_dilation: Any = None,
    rhs_dilation: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    **_: Any,
) -> jax.Array:
    return lax.conv_general_dilated(
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        lax.ConvDimensionNumbers(*dimension_numbers),  # a plain tuple after hashing
        feature_group_count,
        batch_group_count,
    )


def _conv_attrs(**kw: Any) -> dict:
    return {
        "window_strides": (1,),
        "padding": ((1, 1),),
        "lhs_dilation": (1,),
        "rhs_dilation": (1,),
        "dimension_numbers": lax.ConvDimensionNumbers((0, 1, 2), (0, 1, 2), (0, 1, 2)),
        "feature_group_count": 1,
        "batch_group_count": 1,
        **kw,
    }


#: The rules of primitives the library has no op of its own for.
PRIMITIVE_RULES = (
    _ConvRule(
        "conv_general_dilated",
        conv_notation,
        impl=_conv,
        partial="MULTIPLICATIVE",
        examples=(
            Example(((8, 4, 6), (8, 4, 3)), attrs=_conv_attrs()),
            Example(
                ((8, 6, 4), (3, 4, 8)),
                attrs=_conv_attrs(
                    dimension_numbers=lax.ConvDimensionNumbers((0, 2, 1), (2, 1, 0), (0, 2, 1)),
                    window_strides=(2,),
                ),
            ),
            Example(((8, 2, 6), (8, 1, 3)), attrs=_conv_attrs(feature_group_count=2)),
        ),
        doc="lax.conv_general_dilated: batch and output features pass, input features "
        "reduce (sum); spatial dims (and a grouped convolution's features) unsharded",
    ),
)

_DN_BATCHED = (((2,), (1,)), ((0,), (0,)))
_DN_TN = (((0,), (0,)), ((), ()))

RULES = (
    *PRIMITIVE_RULES,
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

"""Windowed reductions (pooling): reduce_window_sum / _max / _min and select_and_scatter_add.

Op names and attributes are the ``jax.lax`` primitives' (``window_dimensions``,
``window_strides``, ``padding``, ``base_dilation``, ``window_dilation``), so a
jaxpr equation maps to its rule unchanged. ``flax.linen.max_pool`` is
``reduce_window_max``, ``avg_pool`` is ``reduce_window_sum`` and a division; the
gradient of a max-pool is ``select_and_scatter_add``.

Algebra. A dim the window does not touch (window 1, stride 1, no padding, no
dilation: the batch and channel dims of a 2-D pool) maps each input element to
the output element at the same index, so it keeps its sharding, uneven blocks
included. A windowed dim reads neighbouring elements across block boundaries
(halos are not modelled) and is replicated. A pending reduction on the input
passes when it commutes with the window's reduction: sum and avg through a
window sum (linear), max through a window max, min through a window min; any
other partial is resolved first. ``select_and_scatter_add(source, operand)``
adds each source element at the position the select picks in its window of
the operand: linear in ``source`` (its sum/avg partial passes), the operand
only chooses positions and must be complete. Gradients: a window sum's VJP is
a (padded) window sum of the cotangent and a window max's is
``select_and_scatter_add``, both linear in the cotangent, so its sum/avg
partial passes to the input grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from spmdkit.engine.rule import Example, Inferred, RuleContext
from spmdkit.rules.shape import DimMap, MapRule
from spmdkit.spec import TensorSpec

__all__ = ["RULES", "WindowRule", "window_map"]


def _window(shape: tuple[int, ...], attrs: dict[str, Any]) -> list[bool]:
    """Per dim, whether the window touches it (it must then be replicated)."""
    r = len(shape)
    wd = tuple(attrs["window_dimensions"])
    ws = tuple(attrs.get("window_strides") or (1,) * r)
    pad = tuple(tuple(p) for p in (attrs.get("padding") or ((0, 0),) * r))
    bd = tuple(attrs.get("base_dilation") or (1,) * r)
    wdl = tuple(attrs.get("window_dilation") or (1,) * r)
    if not all(len(t) == r for t in (wd, ws, pad, bd, wdl)):
        raise ValueError(f"window attributes of rank {r} expected")
    return [
        not (wd[i] == 1 and ws[i] == 1 and pad[i] == (0, 0) and bd[i] == 1 and wdl[i] == 1)
        for i in range(r)
    ]


def _out_dim(n: int, w: int, s: int, pad: tuple[int, int], bd: int, wdl: int) -> int:
    size = (n - 1) * bd + 1 + pad[0] + pad[1]
    span = (w - 1) * wdl + 1
    return max(0, (size - span) // s + 1)


def window_map(shapes: Any, **attrs: Any) -> DimMap:
    """The :class:`~spmdkit.rules.shape.DimMap` of a reduce_window: untouched dims pass,
    windowed dims replicated.

    Example::

        >>> window_map(((8, 6, 6, 4),), window_dimensions=(1, 2, 2, 1),
        ...            window_strides=(1, 2, 2, 1), padding=((0, 0),) * 4).outputs
        (('d0', None, None, 'd3'),)
    """
    (shape,) = shapes
    r = len(shape)
    touched = _window(shape, attrs)
    f = tuple(
        None if t or n <= 1 else f"d{i}"
        for i, (t, n) in enumerate(zip(touched, shape, strict=True))
    )
    out = tuple(
        _out_dim(
            shape[i],
            attrs["window_dimensions"][i],
            (attrs.get("window_strides") or (1,) * r)[i],
            tuple((attrs.get("padding") or ((0, 0),) * r)[i]),
            (attrs.get("base_dilation") or (1,) * r)[i],
            (attrs.get("window_dilation") or (1,) * r)[i],
        )
        for i in range(r)
    )
    return DimMap((f,), (f,), (out,), (True,))


def _scatter_map(shapes: Any, **attrs: Any) -> DimMap:
    source, operand = shapes
    (f,) = window_map((operand,), **attrs).inputs
    if tuple(window_map((operand,), **attrs).out_shapes[0]) != tuple(source):
        raise ValueError(f"source {source} is not the pooled shape of operand {operand}")
    return DimMap((f, f), (f,), (tuple(operand),), (True, False))


class WindowRule(MapRule):
    """A :class:`~spmdkit.rules.shape.MapRule` whose input partials pass only when they
    commute with the window's reduction (``passes``: the reduce ops that do)."""

    def __init__(self, *args: Any, passes: frozenset[str], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.passes = passes

    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """As MapRule's forward, after resolving partials the window does not commute with."""
        kept = tuple(
            s.replace(partial={a: o for a, o in s.partial if o in self.passes}) for s in inputs
        )
        return super().forward(ctx, kept)


def _pool(kind: str):
    init = {"sum": 0.0, "max": -np.inf, "min": np.inf}[kind]
    fn = {"sum": lax.add, "max": lax.max, "min": lax.min}[kind]

    def impl(x: jax.Array, **attrs: Any) -> jax.Array:
        r = x.ndim
        return lax.reduce_window(
            x,
            np.asarray(init, dtype=x.dtype),
            fn,
            tuple(attrs["window_dimensions"]),
            tuple(attrs.get("window_strides") or (1,) * r),
            tuple(tuple(p) for p in (attrs.get("padding") or ((0, 0),) * r)),
            tuple(attrs.get("base_dilation") or (1,) * r),
            tuple(attrs.get("window_dilation") or (1,) * r),
        )

    return impl


def _select_and_scatter_add(source: jax.Array, operand: jax.Array, **attrs: Any) -> jax.Array:
    """The VJP of a max-pool (``select_prim`` ``ge``) or min-pool (``le``) at
    ``operand``, applied to ``source``."""
    kind = "min" if getattr(attrs.get("select_prim"), "name", "ge") == "le" else "max"
    pool = _pool(kind)
    attrs = {k: v for k, v in attrs.items() if k != "select_prim"}
    return jax.vjp(lambda x: pool(x, **attrs), operand)[1](source)[0]


def _attrs(window: Sequence[int], strides: Sequence[int], padding: Sequence) -> dict[str, Any]:
    return {
        "window_dimensions": tuple(window),
        "window_strides": tuple(strides),
        "padding": tuple(tuple(p) for p in padding),
        "base_dilation": (1,) * len(window),
        "window_dilation": (1,) * len(window),
    }


_POOL3 = _attrs((1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0)))
_POOL_1D = _attrs((3, 1), (1, 1), ((1, 1), (0, 0)))
_EX = (
    Example(((4, 6, 6, 8),), attrs=_POOL3),
    Example(((6, 8),), attrs=_POOL_1D),
)


def _distinct(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A permutation: no ties, so the select's pick does not depend on layout."""
    return (rng.permutation(int(np.prod(shape))).reshape(shape) / 10.0).astype(np.float32)


def _scatter_example(attrs: dict[str, Any], shape: tuple[int, ...]) -> Example:
    pooled = window_map((shape,), **attrs).out_shapes[0]

    def values(rng: np.random.Generator) -> list[np.ndarray]:
        return [rng.standard_normal(pooled).astype(np.float32), _distinct(rng, shape)]

    return Example(
        (pooled, shape),
        attrs={**attrs, "select_prim": lax.ge_p},
        differentiable=(True, False),
        values=values,
    )


def _pool_examples(kind: str) -> tuple[Example, ...]:
    if kind == "sum":
        return _EX
    return tuple(
        Example(e.shapes, attrs=e.attrs, values=lambda rng, s=e.shapes[0]: [_distinct(rng, s)])
        for e in _EX
    )


RULES = (
    WindowRule(
        "reduce_window_max",
        window_map,
        impl=_pool("max"),
        passes=frozenset({"max"}),
        examples=_pool_examples("max"),
        doc="max-pool: windowed dims replicated, the others keep their sharding; max passes",
    ),
    WindowRule(
        "reduce_window_min",
        window_map,
        impl=_pool("min"),
        passes=frozenset({"min"}),
        examples=_pool_examples("min"),
        doc="min-pool: windowed dims replicated, the others keep their sharding; min passes",
    ),
    WindowRule(
        "reduce_window_sum",
        window_map,
        impl=_pool("sum"),
        passes=frozenset({"sum", "avg"}),
        examples=_pool_examples("sum"),
        doc="sum-pool (avg_pool's sum): windowed dims replicated; sum/avg partials pass",
    ),
    WindowRule(
        "select_and_scatter_add",
        _scatter_map,
        impl=_select_and_scatter_add,
        passes=frozenset({"sum", "avg"}),
        examples=(_scatter_example(_POOL3, (4, 6, 6, 8)),),
        doc="max-pool's grad: source and operand share the untouched dims; source's sum passes",
    ),
)

"""softmax and log_softmax over one ``axis``.

Algebra: every element of the output depends on the whole softmax axis (its
max and its sum of exponentials), so the softmax axis is a need-replication
factor (the reference behaviour); every other dim passes through untouched.
Softmax is not linear and not monotone in a way that commutes with a pending
sum or max, so partial inputs are resolved first. The grad,
``y * (g - sum(g * y, axis))``, needs the same axis whole and is linear in the
cotangent, so a sum-partial cotangent passes through to the input grad.
"""

from __future__ import annotations

from typing import Any

import jax

from spmdkit.engine.factor import Notation, parse_notation
from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.rule import Example
from spmdkit.errors import ShardingConflictError

__all__ = ["RULES", "softmax_notation"]


def softmax_notation(shapes: tuple[tuple[int, ...], ...], *, axis: int = -1) -> Notation:
    """Notation of softmax over ``axis``: every dim passes, ``axis`` replicated.

    Example::

        >>> str(softmax_notation(((8, 16),), axis=-1))
        'd0 d1 -> d0 d1  [replicated: d1]'
    """
    (shape,) = shapes
    if not -len(shape) <= axis < len(shape):
        raise ShardingConflictError(
            op="softmax",
            must=f"axis is a dim of the rank-{len(shape)} input",
            given=f"axis={axis}",
            fix=f"pass an axis in [-{len(shape)}, {len(shape)})",
        )
    names = [f"d{i}" for i in range(len(shape))]
    text = f"{' '.join(names)} -> {' '.join(names)}"
    return parse_notation(
        text, (len(shape),), need_replication=(names[axis % len(shape)],), reduce=None, op="softmax"
    )


def _softmax(x: jax.Array, *, axis: int = -1) -> jax.Array:
    return jax.nn.softmax(x, axis=axis)


def _log_softmax(x: jax.Array, *, axis: int = -1) -> jax.Array:
    return jax.nn.log_softmax(x, axis=axis)


def _examples() -> tuple[Example, ...]:
    return (
        Example(((8, 8),), attrs={"axis": -1}),
        Example(((8, 8),), attrs={"axis": 0}),
        Example(((2, 8, 4),), attrs={"axis": 1}),
    )


def _rule(name: str, impl: Any) -> FactorRule:
    return FactorRule(
        name,
        softmax_notation,
        impl=impl,
        reduce=None,
        partial="NONE",
        examples=_examples(),
        doc=f"{name} over axis; the axis stays replicated",
    )


RULES = (_rule("log_softmax", _log_softmax), _rule("softmax", _softmax))

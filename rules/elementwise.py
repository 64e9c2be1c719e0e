"""Elementwise ops: unary, binary with numpy broadcasting, n-ary, select, casts, comparisons.

Algebra: every output element depends on the same element of each operand,
so every dim is a pass-through factor and any layout is kept as is; a dim of
size 1 that broadcasts is never sharded. What differs between ops is how a
*pending reduction* on an operand travels: ``add`` is linear, so sum-partial
operands add up to a sum-partial result; ``exp`` is not linear, but it is
increasing, so ``max`` over the shards commutes with it and a max-partial
passes while a sum-partial must be all-reduced first. ``mul`` is linear in each
operand separately: one sum-partial operand times replicated ones stays
sum-partial. ``fmax``/``fmin`` are ``max``/``min`` that skip NaN operands: as
associative as max and min, so they pass max (min) partials. ``gelu``,
``atan2`` and ``reciprocal`` are not monotone on the whole line (``1/x`` jumps
at 0), so they pass nothing. ``name`` (the primitive
``jax.ad_checkpoint.checkpoint_name`` emits) is the identity that tags a value
for a recompute policy: every layout and every partial passes, so a tagged
projection plans as the untagged one. Comparisons and logic ops pass nothing.
The policies are listed in :mod:`spmdkit.engine.rule`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from spmdkit.engine.factor import BROADCAST, Notation, parse_notation
from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.rule import Example, InferredGrad, RuleContext
from spmdkit.spec import TensorSpec

__all__ = ["PRIMITIVE_RULES", "RULES", "broadcast_notation", "identity_notation"]


def broadcast_notation(shapes: tuple[tuple[int, ...], ...], **_: Any) -> str:
    """Notation of an elementwise op over numpy-broadcast operands.

    Example::

        >>> broadcast_notation(((8, 4), (4,)))
        'd0 d1, d1 -> d0 d1'
        >>> broadcast_notation(((8, 1), (1, 4)))
        'd0 1, 1 d1 -> d0 d1'
    """
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for j in range(rank):
        sizes = [s[len(s) - rank + j] for s in shapes if len(s) - rank + j >= 0]
        out.append(max(sizes))
    names = [f"d{j}" for j in range(rank)]
    operands = []
    for s in shapes:
        off = rank - len(s)
        dims = [
            BROADCAST if n == 1 and out[off + i] != 1 else names[off + i] for i, n in enumerate(s)
        ]
        operands.append(" ".join(dims))
    return ", ".join(operands) + " -> " + " ".join(names)


def identity_notation(shapes: tuple[tuple[int, ...], ...], **_: Any) -> str:
    """Notation of an op that returns its one operand unchanged (``copy``,
    ``device_put``). A call on several operands does not fit: the factor notation
    would make every result depend on every operand (their grads sum-partial over
    each other's axes).

    Example::

        >>> identity_notation(((8, 4),))
        'd0 d1 -> d0 d1'
    """
    if len(shapes) != 1:
        raise ValueError(f"one operand, given {len(shapes)}")
    return broadcast_notation(shapes)


def _bool_dtype(dtypes: tuple[Any, ...], **_: Any) -> np.dtype:
    return np.dtype(bool)


def _cast_dtype(dtypes: tuple[Any, ...], *, new_dtype: Any, **_: Any) -> np.dtype:
    return np.dtype(new_dtype)


def _select_dtype(dtypes: tuple[Any, ...], **_: Any) -> Any:
    rest = [d for d in dtypes[1:] if d is not None]
    return np.result_type(*rest) if len(rest) == len(dtypes) - 1 else None


_UNARY_EX = (Example(((8, 8),)), Example(((4, 8, 2),)))
_POS_EX = tuple(Example(e.shapes, domain="positive") for e in _UNARY_EX)
_BINARY_EX = (
    Example(((8, 8), (8, 8))),
    Example(((8, 8), (8,))),
    Example(((8, 1), (1, 8))),
)
_POS_BINARY_EX = tuple(Example(e.shapes, domain="positive") for e in _BINARY_EX)
_CMP_EX = tuple(Example(e.shapes, differentiable=(False, False)) for e in _BINARY_EX[:2])
_BOOL_EX = (Example(((8, 8), (8, 8)), dtypes=("bool", "bool"), differentiable=(False, False)),)


def _unary(
    name: str, impl: Any, policy: str, examples: Any = _UNARY_EX, doc: str = ""
) -> FactorRule:
    return FactorRule(
        name, broadcast_notation, impl=impl, partial=policy, examples=examples, doc=doc
    )


def _binary(name: str, impl: Any, policy: str, examples: Any = _BINARY_EX, **kw: Any) -> FactorRule:
    return FactorRule(name, broadcast_notation, impl=impl, partial=policy, examples=examples, **kw)


def _add_n(*xs: jax.Array) -> jax.Array:
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


def _polynomial(x: jax.Array, *coeffs: jax.Array, unroll: int | None = None) -> jax.Array:
    """``a_0 + x (a_1 + x (a_2 + ...))`` by Horner's rule: jax 0.12's
    ``lax.polynomial_p`` (what its ``erf`` lowers through), written with
    ``mul``/``add`` so it runs on every supported jax (``unroll`` only tells XLA
    how to loop)."""
    del unroll
    shape = jnp.broadcast_shapes(jnp.shape(x), *(jnp.shape(c) for c in coeffs))
    out = jnp.broadcast_to(jnp.asarray(coeffs[-1], jnp.result_type(x)), shape)
    for c in reversed(coeffs[:-1]):
        out = c + x * out
    return out


def _where(cond: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.where(cond, x, y)


def _convert(x: jax.Array, *, new_dtype: Any) -> jax.Array:
    return lax.convert_element_type(x, new_dtype)


def _integer_pow(x: jax.Array, *, y: int) -> jax.Array:
    return lax.integer_pow(x, y)


def _gelu(x: jax.Array, *, approximate: bool = True) -> jax.Array:
    return jax.nn.gelu(x, approximate=approximate)


def _name(x: jax.Array, *, name: str) -> jax.Array:
    return checkpoint_name(x, name)


def _reciprocal(x: jax.Array) -> jax.Array:
    return jnp.reciprocal(x)


def _cast_policy(dtypes: tuple[Any, ...], *, new_dtype: Any, **_: Any) -> str:
    """Casts commute with max/min exactly. They commute with sum/avg only up to
    rounding, and a narrowing cast rounds each partial piece (which may be much
    larger than the sum) before the sum: then sum/avg partials are resolved first."""
    src, dst = dtypes[0], np.dtype(new_dtype)
    floats = (
        src is not None and jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
    )
    if floats and dst.itemsize >= src.itemsize:
        return "LINEAR"
    return "MONOTONE"


def _cast_policy_rule() -> FactorRule:
    return FactorRule(
        "convert_element_type",
        broadcast_notation,
        impl=_convert,
        partial=_cast_policy,
        dtype=_cast_dtype,
        examples=(
            Example(((8, 8),), attrs={"new_dtype": "bfloat16"}, rtol=2e-2),
            Example(((8, 8),), attrs={"new_dtype": "float32"}),
        ),
        doc="casts: max/min partials pass; sum/avg pass only through widening float casts",
    )


_SELECT_EX = (
    Example(
        ((8, 8), (8, 8), (8, 8)),
        dtypes=("bool", "float32", "float32"),
        differentiable=(False, True, True),
    ),
    Example(
        ((8, 1), (8, 8), (8,)),
        dtypes=("bool", "float32", "float32"),
        differentiable=(False, True, True),
    ),
)

# -- primitives the library has no op of its own for ---------------------------------
#
# jax primitives a traced step may hold (``jnp.floor``, ``jnp.round``, ``x % y``,
# ``jnp.isfinite``, ``jax.device_put``…): each its own rule, named after the primitive,
# so propagation uses a checked rule for it. Monotone policies only where the function
# is monotone on every real input (a max-partial piece may lie anywhere below the
# value): asin, atanh, acosh, erf_inv increase but only on part of the line, so they
# pass nothing.

_UNIT_EX = tuple(Example(e.shapes, domain="unit") for e in _UNARY_EX)
_ABOVE_ONE_EX = tuple(Example(e.shapes, domain="above_one") for e in _UNARY_EX)
_INT = ("int32", "int32")
# lax's binary primitives take operands of one shape (jnp broadcasts before them)
_INT_EX = (
    Example(((8, 8), (8, 8)), dtypes=_INT, differentiable=(False, False)),
    Example(((4, 8, 2), (4, 8, 2)), dtypes=_INT, differentiable=(False, False)),
)
_SAME_EX = (Example(((8, 8), (8, 8))), Example(((4, 8, 2), (4, 8, 2))))
_POS_SAME_EX = tuple(Example(e.shapes, domain="positive") for e in _SAME_EX)
_FLAG_EX = (Example(((8, 8),), differentiable=(False,)),)
_COMPLEX_EX = (Example(((8, 8),), dtypes=("complex64",), differentiable=(False,)),)


def _real_dtype(dtypes: tuple[Any, ...], **_: Any) -> Any:
    return None if dtypes[0] is None else np.dtype(np.finfo(dtypes[0]).dtype)


def _same_dtype(dtypes: tuple[Any, ...], **_: Any) -> Any:
    return dtypes[0]


def _new_dtype(dtypes: tuple[Any, ...], *, new_dtype: Any, **_: Any) -> np.dtype:
    return np.dtype(new_dtype)


def _accurate(fn: Any) -> Any:
    """``fn(x)`` taking the equation's ``accuracy`` parameter (jax >= 0.6)."""

    def impl(x: jax.Array, *, accuracy: Any = None) -> jax.Array:
        return fn(x, accuracy=accuracy)

    impl.__name__ = fn.__name__
    return impl


def _round(x: jax.Array, *, rounding_method: Any = 0) -> jax.Array:
    return lax.round(x, rounding_method)


def _reduce_precision(x: jax.Array, *, exponent_bits: int, mantissa_bits: int) -> jax.Array:
    return lax.reduce_precision(x, exponent_bits, mantissa_bits)


def _bitcast(x: jax.Array, *, new_dtype: Any) -> jax.Array:
    return lax.bitcast_convert_type(x, new_dtype)


def _conj(x: jax.Array, **_: Any) -> jax.Array:
    return lax.conj(x)


def _device_put(x: jax.Array, **_: Any) -> jax.Array:
    return jax.device_put(x)


def _identity(name: str, impl: Any, doc: str, examples: Any = _UNARY_EX) -> FactorRule:
    return FactorRule(
        name, identity_notation, impl=impl, partial="LINEAR", examples=examples, doc=doc
    )


def _whole_notation(shapes: tuple[tuple[int, ...], ...], **_: Any) -> Notation:
    nt = parse_notation(broadcast_notation(shapes), tuple(len(s) for s in shapes))
    return dataclasses.replace(nt, need_replication=frozenset(nt.factors))


class _RoundingRule(FactorRule):
    """reduce_precision: its VJP rounds the cotangent as well, so unlike a linear
    op's a sum-partial cotangent does not pass (each piece would be rounded)."""

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """The factor rule's grad, on the cotangents with their partials resolved."""
        return super().grad(ctx, inputs, tuple(g.without_partial() for g in out_grads))


#: The rules of primitives the library has no op of its own for (listed by
#: ``spmdkit rules``, swept like the others; see tests/conftest.py for their sample).
PRIMITIVE_RULES = (
    _unary("acos", lax.acos, "NONE", _UNIT_EX),
    _unary("acosh", lax.acosh, "NONE", _ABOVE_ONE_EX),
    _unary("asin", lax.asin, "NONE", _UNIT_EX),
    _unary("asinh", lax.asinh, "MONOTONE"),
    _unary("atan", lax.atan, "MONOTONE"),
    _unary("atanh", lax.atanh, "NONE", _UNIT_EX),
    FactorRule(
        "bitcast_convert_type",
        broadcast_notation,
        impl=_bitcast,
        partial="NONE",
        dtype=_new_dtype,
        examples=(Example(((8, 8),), attrs={"new_dtype": "int32"}, differentiable=(False,)),),
        doc="the bits reread as new_dtype (same width): nothing passes",
    ),
    _unary("cbrt", _accurate(lax.cbrt), "MONOTONE", _POS_EX),
    _unary("ceil", lax.ceil, "MONOTONE"),
    _binary(
        "clamp",
        lax.clamp,
        "NONE",
        examples=(
            Example(((), (8, 8), ()), differentiable=(False, True, False)),
            Example(((8, 8), (8, 8), (8, 8))),
        ),
        doc="clamp(lo, x, hi)",
    ),
    FactorRule(
        "conj",
        broadcast_notation,
        impl=_conj,
        partial="NONE",
        dtype=_same_dtype,
        examples=_COMPLEX_EX,
        doc="complex conjugate",
    ),
    _identity("copy", jnp.copy, "a copy of its operand"),
    _unary("cosh", lax.cosh, "NONE"),
    _identity(
        "device_put",
        _device_put,
        "a move inside a step (between memory kinds: optimizer offload) keeps the layout",
    ),
    _unary("digamma", lax.digamma, "NONE", _POS_EX),
    _unary("erf_inv", lax.erf_inv, "NONE", _UNIT_EX),
    _unary("erfc", lax.erfc, "ANTITONE", doc="1 - erf(x): decreasing, so max and min swap"),
    _unary("exp2", _accurate(lax.exp2), "MONOTONE"),
    _unary("floor", lax.floor, "MONOTONE"),
    FactorRule(
        "igamma",
        _whole_notation,
        impl=lax.igamma,
        partial="NONE",
        examples=_POS_SAME_EX,
        doc="regularized lower incomplete gamma P(a, x); every dim unsharded: XLA runs a "
        "series loop over the whole array, and sharded it all-reduces the loop's test",
    ),
    FactorRule(
        "imag",
        broadcast_notation,
        impl=lax.imag,
        partial="NONE",
        dtype=_real_dtype,
        examples=_COMPLEX_EX,
        doc="imaginary part",
    ),
    FactorRule(
        "is_finite",
        broadcast_notation,
        impl=lax.is_finite,
        partial="NONE",
        dtype=_bool_dtype,
        examples=_FLAG_EX,
    ),
    _unary("lgamma", lax.lgamma, "NONE", _POS_EX),
    _binary(
        "nextafter",
        lax.nextafter,
        "NONE",
        examples=tuple(dataclasses.replace(e, differentiable=(False, False)) for e in _SAME_EX),
        doc="the next float after x towards y (no derivative)",
    ),
    _identity(
        "optimization_barrier",
        lax.optimization_barrier,
        "its operands unchanged, kept from being moved across the barrier",
        (Example(((8, 8),)),),
    ),
    FactorRule(
        "population_count",
        broadcast_notation,
        impl=lax.population_count,
        partial="NONE",
        examples=(Example(((8, 8),), dtypes=("int32",), differentiable=(False,)),),
        doc="set bits of each integer",
    ),
    FactorRule(
        "real",
        broadcast_notation,
        impl=lax.real,
        partial="NONE",
        dtype=_real_dtype,
        examples=_COMPLEX_EX,
        doc="real part",
    ),
    _RoundingRule(
        "reduce_precision",
        broadcast_notation,
        impl=_reduce_precision,
        partial="MONOTONE",
        examples=(Example(((8, 8),), attrs={"exponent_bits": 5, "mantissa_bits": 10}),),
        doc="rounds to a narrower float: monotone, so max/min pass; a sum rounded piece "
        "by piece is not the sum rounded, so sum/avg are resolved first",
    ),
    FactorRule(
        "polynomial",
        broadcast_notation,
        impl=_polynomial,
        partial="NONE",
        examples=(Example(((8, 8), (), (), ())), Example(((4, 8, 2), (), ()), attrs={"unroll": 2})),
        doc="a_0 + x a_1 + x^2 a_2 + ... (jax 0.12's erf lowers through it): not "
        "monotone, so every partial is resolved",
    ),
    _binary("rem", lax.rem, "NONE", examples=_POS_SAME_EX, doc="x - y * trunc(x / y)"),
    _unary("round", _round, "MONOTONE"),
    _binary("shift_left", lax.shift_left, "NONE", examples=_INT_EX),
    _binary("shift_right_arithmetic", lax.shift_right_arithmetic, "NONE", examples=_INT_EX),
    _binary("shift_right_logical", lax.shift_right_logical, "NONE", examples=_INT_EX),
    _unary("sinh", lax.sinh, "MONOTONE"),
    _identity(
        "stop_gradient",
        lax.stop_gradient,
        "its operand unchanged, with a zero gradient",
        (Example(((8, 8),)),),
    ),
    _unary("tan", _accurate(lax.tan), "NONE", _UNIT_EX),
    _binary("xor", lax.bitwise_xor, "NONE", examples=(*_BOOL_EX, _INT_EX[0]), dtype=_same_dtype),
)

RULES = tuple(
    sorted(
        (
            *PRIMITIVE_RULES,
            _unary("abs", jnp.abs, "NONE"),
            _binary("add", jnp.add, "ADDITIVE"),
            FactorRule(
                "add_n",
                broadcast_notation,
                impl=_add_n,
                partial="ADDITIVE",
                examples=(Example(((8, 8), (8, 8), (8, 8))), Example(((8, 8), (8,), (1, 8)))),
                doc="sum of n operands",
            ),
            _binary("and", jnp.logical_and, "NONE", examples=_BOOL_EX, dtype=_bool_dtype),
            _binary(
                "atan2",
                jnp.arctan2,
                "NONE",
                doc="atan2(y, x): the angle of (x, y); nonlinear, every partial resolved",
            ),
            _cast_policy_rule(),
            _unary("cos", jnp.cos, "NONE"),
            _binary("div", jnp.divide, "DIVIDE", examples=_POS_BINARY_EX),
            _binary("eq", jnp.equal, "NONE", examples=_CMP_EX, dtype=_bool_dtype),
            _unary("erf", jax.scipy.special.erf, "MONOTONE"),
            _unary("exp", jnp.exp, "MONOTONE"),
            _unary("expm1", jnp.expm1, "MONOTONE"),
            _binary(
                "fmax",
                jnp.fmax,
                "MAX",
                doc="maximum that ignores NaN (a NaN operand yields the other); max partials pass",
            ),
            _binary(
                "fmin",
                jnp.fmin,
                "MIN",
                doc="minimum that ignores NaN (a NaN operand yields the other); min partials pass",
            ),
            FactorRule(
                "gelu",
                broadcast_notation,
                impl=_gelu,
                partial="NONE",
                examples=(
                    Example(((8, 8),), attrs={"approximate": True}),
                    Example(((4, 8, 2),), attrs={"approximate": False}),
                ),
                doc="GELU: approximate=True the tanh form, False the exact erf form "
                "(jax.nn.gelu); not monotone, so every partial is resolved",
            ),
            _binary("ge", jnp.greater_equal, "NONE", examples=_CMP_EX, dtype=_bool_dtype),
            _binary("gt", jnp.greater, "NONE", examples=_CMP_EX, dtype=_bool_dtype),
            FactorRule(
                "integer_pow",
                broadcast_notation,
                impl=_integer_pow,
                partial="NONE",
                examples=(Example(((8, 8),), attrs={"y": 3}), Example(((8, 8),), attrs={"y": 2})),
                doc="x ** y for a static int y",
            ),
            _binary("le", jnp.less_equal, "NONE", examples=_CMP_EX, dtype=_bool_dtype),
            _unary("log", jnp.log, "MONOTONE", _POS_EX),
            _unary("log1p", jnp.log1p, "MONOTONE", _POS_EX),
            _unary("logistic", jax.nn.sigmoid, "MONOTONE"),
            _binary("lt", jnp.less, "NONE", examples=_CMP_EX, dtype=_bool_dtype),
            _binary("max", jnp.maximum, "MAX"),
            _binary("min", jnp.minimum, "MIN"),
            _binary("mul", jnp.multiply, "MULTIPLICATIVE"),
            FactorRule(
                "name",
                broadcast_notation,
                impl=_name,
                partial="LINEAR",
                examples=(Example(((8, 8),), attrs={"name": "query_proj"}),),
                doc="jax.ad_checkpoint.checkpoint_name(x, name): the identity that tags a "
                "value for a recompute policy; every layout and partial passes unchanged",
            ),
            _binary("ne", jnp.not_equal, "NONE", examples=_CMP_EX, dtype=_bool_dtype),
            _unary("neg", jnp.negative, "NEGATE"),
            FactorRule(
                "not",
                broadcast_notation,
                impl=jnp.logical_not,
                partial="NONE",
                examples=(Example(((8, 8),), dtypes=("bool",), differentiable=(False,)),),
                dtype=_bool_dtype,
            ),
            _binary("or", jnp.logical_or, "NONE", examples=_BOOL_EX, dtype=_bool_dtype),
            _unary(
                "one_minus_square",
                lambda x: 1 - x * x,
                "NONE",
                doc="1 - x * x: tanh's derivative, one primitive since jax 0.12",
            ),
            _binary("pow", jnp.power, "NONE", examples=_POS_BINARY_EX),
            _unary(
                "reciprocal",
                _reciprocal,
                "NONE",
                _POS_EX,
                doc="1 / x; decreasing only on each side of 0, so every partial is resolved",
            ),
            _unary("relu", jax.nn.relu, "MONOTONE"),
            _unary("rsqrt", lax.rsqrt, "ANTITONE", _POS_EX),
            FactorRule(
                "select_n",
                broadcast_notation,
                impl=lax.select_n,
                partial="SELECT",
                dtype=_select_dtype,
                examples=_SELECT_EX[:1],
                doc="lax.select_n(which, *cases): case i where which == i",
            ),
            _unary("sign", jnp.sign, "MONOTONE"),
            _unary("sin", jnp.sin, "NONE"),
            _unary("sqrt", jnp.sqrt, "MONOTONE", _POS_EX),
            _unary("square", jnp.square, "NONE"),
            _binary("sub", jnp.subtract, "SUBTRACT"),
            _unary("tanh", jnp.tanh, "MONOTONE"),
            FactorRule(
                "where",
                broadcast_notation,
                impl=_where,
                partial="SELECT",
                dtype=_select_dtype,
                examples=_SELECT_EX,
                doc="jnp.where(cond, x, y)",
            ),
        ),
        key=lambda r: r.name,
    )
)

"""Does a layer keep the batch's rows apart?

With batch axes the pipeline runs each device's stages on its own rows of a
micro-batch (:mod:`spmdkit.pipeline.execute`). That is only the same
computation when no layer combines rows: a load-balancing statistic of a
mixture-of-experts router (the fraction of the micro-batch's tokens per
expert), batch normalization, or any reduction or contraction over the batch
dim would see a device's rows alone. :func:`mixed_rows` finds such an
equation in the layer scan's body, so the executor can keep the batch axes
automatic there (XLA then partitions those reductions with their collectives).

It follows each value's *row dim* (the dim whose index is the batch row, or
none when the value does not depend on the rows) through the body, equation by
equation, into nested calls, scans, loops and conditionals. It is
conservative: a primitive it has no rule for, given a value with rows, counts
as combining them (running with automatic batch axes is correct for any
layer, only slower).

The same walk checks a pipelined context-parallel stage's *tokens*
(:mod:`spmdkit.pipeline.context_parallel`): the "rows" are then a device's tokens on
their sequence dim, traced where the context axes are bound (``aware``). A
value computed from ``axis_index`` over those axes (the tokens' natural
positions) or gathered over them whole (attention's K/V) holds what the
global computation holds, so it may meet the tokens entry by entry.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax.extend.core as jex

from spmdkit import jaxprs
from spmdkit.context_parallel import CONTEXT_ATTENTION
from spmdkit.state import register_context

__all__ = ["AWARE", "aware_of", "mixed_rows"]

#: primitives applied entry by entry (operands of the result's shape, or scalars)
ELEMENTWISE = frozenset(
    {
        "abs",
        "acos",
        "acosh",
        "add",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "cbrt",
        "ceil",
        "clamp",
        "conj",
        "convert_element_type",
        "copy",
        "copy_p",
        "cos",
        "cosh",
        "digamma",
        "div",
        "eq",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "ge",
        "gt",
        "igamma",
        "imag",
        "integer_pow",
        "is_finite",
        "le",
        "lgamma",
        "log",
        "log1p",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "name",
        "ne",
        "neg",
        "nextafter",
        "not",
        "one_minus_square",
        "or",
        "polynomial",
        "population_count",
        "pow",
        "real",
        "reduce_precision",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "stop_gradient",
        "sub",
        "tan",
        "tanh",
        "xor",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
    }
)
REDUCE = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
    }
)
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


class Mixed(Exception):
    """An equation combines rows (its description is the message)."""


#: in a free value's state: it is computed from the device's index over the
#: ``aware`` axes (:func:`aware_of`), so it may vary along the rows
AWARE = -1

_AWARE_AXES: contextvars.ContextVar[frozenset] = register_context(
    contextvars.ContextVar("spmdkit_rows_aware", default=frozenset()),
    module=__name__,
    name="_AWARE_AXES",
    set_by="`aware_of()`",
    read_by="the row walk (`mixed_rows`)",
    why="the manual axes the rows are split over while a layer's body is walked.",
)


@contextlib.contextmanager
def aware_of(axes: Sequence[str]) -> Iterator[None]:
    """Inside, the walk knows the rows are split over the manual ``axes``: an
    ``axis_index`` over them, and an ``all_gather`` of the rows over them along
    their dim, are values that hold the global computation's entries
    (module docstring)."""
    token = _AWARE_AXES.set(frozenset(axes))
    try:
        yield
    finally:
        _AWARE_AXES.reset(token)


def _axis_names(eqn: Any) -> frozenset:
    names = eqn.params.get("axis_name", eqn.params.get("axes", ()))
    return frozenset(names if isinstance(names, (tuple, list)) else (names,))


def _over_aware(eqn: Any) -> bool:
    """A collective or ``axis_index`` over the aware axes only."""
    aware = _AWARE_AXES.get()
    names = _axis_names(eqn)
    return bool(aware) and bool(names) and names <= aware


def mixed_rows(body: Any, dims: Sequence[int | None]) -> str | None:
    """The first equation of ``body`` that combines different batch rows, or None.

    Args:
      body: a (closed) jaxpr, e.g. the layer scan's body.
      dims: per input of ``body``, its row dim (None: it does not depend on the rows).

    Returns:
      ``None`` when every output's row ``i`` is computed from the inputs' row ``i``
      alone (and values without rows), else a short description of the first
      equation that does not keep them apart (``"reduce_sum over the rows"``).

    Example::

        >>> closed = jax.make_jaxpr(lambda x: x - x.mean(0))(jnp.ones((4, 3)))
        >>> mixed_rows(closed, [0])
        'reduce_sum over the rows (dim 0 of f32[4,3])'
    """
    jaxpr = _open(body)
    try:
        _walk(jaxpr, [state_of(d) for d in dims])
    except Mixed as e:
        return str(e)
    return None


def _open(j: Any) -> Any:
    return jaxprs.open_jaxpr(j)[0]


#: a value's state: its row dim (an int), or, for a value that does not depend on
#: the rows, the dims along which it is known to be constant (a frozenset)
State = int | frozenset

FREE: frozenset = frozenset()


def state_of(d: int | None) -> State:
    """A value's state from its row dim: ``FREE`` for ``None``."""
    return FREE if d is None else int(d)  # a numpy integer from a primitive's params


def row_dim(s: State) -> int | None:
    """A state's row dim, or ``None`` for a value without rows."""
    return s if isinstance(s, int) else None


def _walk(jaxpr: Any, states: list[State]) -> list[State]:
    """The outputs' states of ``jaxpr`` given its inputs' (raises :class:`Mixed`)."""
    env: dict = dict(zip(jaxpr.invars, states, strict=True))

    def read(v: Any) -> State:
        return FREE if isinstance(v, jex.Literal) else env.get(v, FREE)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if all(row_dim(s) is None for s in ins):
            outs = free_rule(eqn, ins)
        elif eqn.primitive.name == "all_gather" and _over_aware(eqn):
            outs = [_gathered(eqn, ins)]
        else:
            outs = [state_of(d) for d in row_rule(eqn, ins)]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def free_rule(eqn: Any, ins: list[State]) -> list[State]:
    """The states of an equation's results when no operand has rows: the dims
    they are constant along, where a broadcast or an entrywise op makes that known."""
    name = eqn.primitive.name
    if not eqn.outvars:  # an effect (a debug callback)
        return []
    if (name == "axis_index" and _over_aware(eqn)) or any(
        AWARE in s for s in ins if isinstance(s, frozenset)
    ):
        return [frozenset({AWARE})] * len(eqn.outvars)
    out_shape = shape_of(eqn.outvars[0])
    if name == "broadcast_in_dim":
        bd = eqn.params["broadcast_dimensions"]
        src = shape_of(eqn.invars[0])
        same = {j for j in range(len(out_shape)) if j not in bd}
        same |= {bd[i] for i in ins[0]} | {bd[i] for i, n in enumerate(src) if n == 1}
        return [frozenset(same)]
    if name in ELEMENTWISE:
        same = set(range(len(out_shape)))
        for v, s in zip(eqn.invars, ins, strict=True):
            if len(shape_of(v)) == len(out_shape):
                same &= s | {j for j, n in enumerate(shape_of(v)) if n == 1}
        return [frozenset(same)] * len(eqn.outvars)
    return [FREE] * len(eqn.outvars)


def _gathered(eqn: Any, ins: list[State]) -> State:
    """An ``all_gather`` over the aware axes of a value with rows: tiled along its
    row dim, it is the whole of them on every device (attention's K/V)."""
    d = ins[0]
    if (
        len(ins) != 1
        or not isinstance(d, int)
        or not eqn.params.get("tiled", False)
        or eqn.params.get("all_gather_dimension") != d
    ):
        raise mixed(eqn, "a gather of the rows that does not join them whole", eqn.invars[0])
    return frozenset({AWARE})


def _context_attention(e: _Eqn) -> list[int | None]:
    """Attention on a device's tokens (``[B, S, H, D]`` q, k, v, their tokens on dim
    1), its K/V exchanged over the aware axes: its result's tokens are q's."""
    if len(e.ins) != 3 or any(d not in (None, 1) for d in e.ins) or e.ins[0] != 1:
        raise e.mixed("with q, k, v not split on their sequence dim (1)")
    return [1] * e.n_out


def shape_of(v: Any) -> tuple[int, ...]:
    """A jaxpr variable's shape (``()`` for a literal without one)."""
    return tuple(getattr(v.aval, "shape", ()))


def mixed(eqn: Any, what: str, v: Any = None, dim: int | None = None) -> Mixed:
    """``"<primitive> <what> (dim <dim> of <operand>)"``."""
    at = "" if dim is None else f"dim {dim} of "
    where = "" if v is None else f" ({at}{v.aval.str_short()})"
    return Mixed(f"{eqn.primitive.name} {what}{where}")


def _same(eqn: Any, ins: list[int | None]) -> int:
    """The one row dim of the operands that have rows (they must agree)."""
    have = {d for d in ins if d is not None}
    if len(have) != 1:
        raise mixed(eqn, f"operands with rows on different dims {sorted(have)}")
    return have.pop()


def _constant_along(eqn: Any, v: Any, s: State, dim: int) -> None:
    """A value without rows meeting rows entry by entry must be the same for
    every row (broadcast along ``dim``), else row ``i`` would meet entry ``i`` of
    something else (an ``iota`` over the batch, whose entries differ on a device's rows)."""
    if not isinstance(s, int) and shape_of(v) and shape_of(v)[dim] > 1 and not s & {dim, AWARE}:
        raise mixed(eqn, "rows meeting a value that varies along them", v, dim=dim)


@dataclass(frozen=True)
class _Eqn:
    """An equation with at least one operand with rows: its operands' row dims
    (``ins``), the first such operand (``src``, index ``first``) and its row dim ``d``."""

    eqn: Any
    states: list
    ins: list
    first: int

    @property
    def d(self) -> int:
        return self.ins[self.first]

    @property
    def src(self) -> Any:
        return self.eqn.invars[self.first]

    @property
    def p(self) -> dict:
        return self.eqn.params

    @property
    def n_out(self) -> int:
        return len(self.eqn.outvars)

    def mixed(self, what: str, v: Any = None, dim: int | None = None) -> Mixed:
        return mixed(self.eqn, what, v, dim)


def row_rule(eqn: Any, states: list[State]) -> list[int | None]:
    """The row dims of an equation's results given its operands' states, at least
    one with rows; raises :class:`Mixed` where the equation combines rows."""
    ins = [row_dim(s) for s in states]
    e = _Eqn(eqn, states, ins, next(i for i, d in enumerate(ins) if d is not None))
    name = eqn.primitive.name
    if name in ELEMENTWISE:
        return _elementwise(e)
    if name in _AXIS_OPS:
        return _along(e)
    rule = _RULES.get(name)
    if rule is not None:
        return rule(e)
    if _AWARE_AXES.get() and jaxprs.call_name(eqn) == CONTEXT_ATTENTION:
        return _context_attention(e)
    body = jaxprs.computed_body(eqn)
    if body is not None and len(_open(body).invars) == len(ins):
        return [row_dim(x) for x in _walk(_open(body), states)]
    raise e.mixed("no row rule for this primitive, given a value with rows", e.src)


def _elementwise(e: _Eqn) -> list[int | None]:
    d = _same(e.eqn, e.ins)
    out_shape = shape_of(e.eqn.outvars[0])
    for v, di, s in zip(e.eqn.invars, e.ins, e.states, strict=True):
        # operands of the result's rank broadcast their size-1 dims
        if di is not None and (
            len(shape_of(v)) != len(out_shape) or shape_of(v)[d] != out_shape[d]
        ):
            raise e.mixed("an operand with rows broadcast", v)
        if di is None and len(shape_of(v)) == len(out_shape):
            _constant_along(e.eqn, v, s, d)
    return [d] * e.n_out


def _along(e: _Eqn) -> list[int | None]:
    """Reductions (the rows' dim goes if reduced over) and ops along one axis."""
    name, p, d = e.eqn.primitive.name, e.p, e.d
    if name in REDUCE:
        axes = set(p["axes"])
        if d in axes:
            raise e.mixed("over the rows", e.src, dim=d)
        return [d - sum(1 for a in axes if a < d)] * e.n_out
    if name == "top_k":
        along = {p.get("axis", -1) % len(shape_of(e.src))}
    else:
        found = p.get("axis", p.get("dimension", p.get("dimensions")))
        along = set(found) if isinstance(found, (tuple, list)) else {found}
    if name in {"sort", "split"}:
        d = _same(e.eqn, e.ins)
    if d in along:
        raise e.mixed("along the rows", e.src, dim=d)
    return [d] * e.n_out


def _broadcast(e: _Eqn) -> list[int | None]:
    bd = e.p["broadcast_dimensions"]
    if shape_of(e.src)[e.d] != shape_of(e.eqn.outvars[0])[bd[e.d]]:
        raise e.mixed("the rows broadcast", e.src)
    return [bd[e.d]]


def _squeeze(e: _Eqn) -> list[int | None]:
    dims = set(e.p["dimensions"])
    if e.d in dims:
        raise e.mixed("the row dim squeezed", e.src)
    return [e.d - sum(1 for a in dims if a < e.d)]


def _expand(e: _Eqn) -> list[int | None]:
    d = e.d
    for a in sorted(e.p["dimensions"]):
        d = d + 1 if a <= d else d
    return [d]


def _slice(e: _Eqn) -> list[int | None]:
    d, p = e.d, e.p
    strides = p.get("strides")
    if (p["start_indices"][d], p["limit_indices"][d]) != (0, shape_of(e.src)[d]) or (
        strides and strides[d] != 1
    ):
        raise e.mixed("part of the rows", e.src, dim=d)
    return [d]


def _dynamic_slice(e: _Eqn) -> list[int | None]:
    if e.first != 0 or any(x is not None for x in e.ins[1:]):
        raise e.mixed("a start index computed from the rows")
    if e.p["slice_sizes"][e.d] != shape_of(e.src)[e.d]:
        raise e.mixed("part of the rows", e.src, dim=e.d)
    return [e.d]


def _update_slice(e: _Eqn) -> list[int | None]:
    if any(x is not None for x in e.ins[2:]):
        raise e.mixed("a start index computed from the rows")
    d = _same(e.eqn, e.ins[:2])
    update = e.eqn.invars[1]
    if shape_of(update)[d] != shape_of(e.eqn.invars[0])[d]:
        raise e.mixed("an update to part of the rows", update, dim=d)
    return [d]


def _concatenate(e: _Eqn) -> list[int | None]:
    d = _same(e.eqn, e.ins)
    if d == e.p["dimension"]:
        raise e.mixed("joined along the rows", e.src, dim=d)
    return [d]


def _pad(e: _Eqn) -> list[int | None]:
    if e.first != 0 or tuple(e.p["padding_config"][e.d]) != (0, 0, 0):
        raise e.mixed("padding the rows", e.src, dim=e.d)
    return [e.d]


def _conv(e: _Eqn) -> list[int | None]:
    lhs_spec, _, out_spec = e.p["dimension_numbers"]
    if e.first != 0 or e.ins[1] is not None or e.d != lhs_spec[0] or e.p["batch_group_count"] != 1:
        raise e.mixed("rows outside the convolution's batch dim")
    return [out_spec[0]]


def _cond(e: _Eqn) -> list[int | None]:
    if e.ins[0] is not None:
        raise e.mixed("a branch index computed from the rows")
    branches = [
        [row_dim(x) for x in _walk(_open(b), e.states[1:])] for b in jaxprs.cond_branches(e.eqn)
    ]
    if any(b != branches[0] for b in branches):
        raise e.mixed("branches that put the rows on different dims")
    return branches[0]


def _reshaped(eqn: Any, shape: tuple, out: tuple, d: int) -> int:
    """The output dim holding exactly the input's rows (same size, same
    elements before it), or :class:`Mixed`."""
    before = math.prod(shape[:d])
    acc = 1
    for j, n in enumerate(out):
        if acc == before and n == shape[d]:
            return j
        acc *= n
    raise mixed(eqn, f"the rows (dim {d}) merged or split with other dims", eqn.invars[0])


def _dot(e: _Eqn) -> list[int | None]:
    return [_dot_dim(e.eqn, e.ins, e.states)]


def _dot_dim(eqn: Any, ins: list[int | None], states: list[State]) -> int:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[:2]
    dl, dr = ins[0], ins[1]
    if dl in lc or dr in rc:
        raise mixed(eqn, "the rows contracted")
    if dl is not None and dr is not None:
        if dl not in lb or dr not in rb or lb.index(dl) != rb.index(dr):
            raise mixed(eqn, "both operands' rows not one batch dim")
        return lb.index(dl)
    if dl is not None:
        if dl in lb:
            _constant_along(eqn, rhs, states[1], rb[lb.index(dl)])
            return lb.index(dl)
        free = [a for a in range(len(shape_of(lhs))) if a not in lc and a not in lb]
        return len(lb) + free.index(dl)
    assert dr is not None
    if dr in rb:
        _constant_along(eqn, lhs, states[0], lb[rb.index(dr)])
        return rb.index(dr)
    lfree = len(shape_of(lhs)) - len(lc) - len(lb)
    free = [a for a in range(len(shape_of(rhs))) if a not in rc and a not in rb]
    return len(lb) + lfree + free.index(dr)


def _fixed_point(body: Any, consts: list, carry: list, rest: list) -> list[State]:
    """The body's output states once its carries' states settle: a carry without
    rows may gain them (an accumulator started from zeros) or lose known-constant
    dims; a carry's rows may not move."""
    for _ in range(2 * len(carry) + 2):
        outs = _walk(body, [*consts, *carry, *rest])
        new = list(carry)
        for k, (a, b) in enumerate(zip(carry, outs[: len(carry)], strict=True)):
            if isinstance(a, int):
                if a != b:
                    raise Mixed(f"a loop carry whose rows move from dim {a} to {row_dim(b)}")
            else:
                new[k] = b if isinstance(b, int) else (a & b) | ((a | b) & {AWARE})
        if new == carry:
            return outs
        carry = new
    raise Mixed("a loop carry whose rows do not settle")  # pragma: no cover


def _scan(e: _Eqn) -> list[int | None]:
    eqn, states = e.eqn, e.states
    sc = jaxprs.scan(eqn)
    nc, ncarry = sc.num_consts, sc.num_carry
    inner = []
    for s in states[nc + ncarry :]:
        if s == 0:
            raise mixed(eqn, "scanned over the rows")
        inner.append(s - 1 if isinstance(s, int) else frozenset(a - (a > 0) for a in s if a != 0))
    outs = _fixed_point(sc.jaxpr, states[:nc], list(states[nc : nc + ncarry]), inner)
    ys = [None if row_dim(s) is None else row_dim(s) + 1 for s in outs[ncarry:]]  # type: ignore[operator]
    return [*(row_dim(s) for s in outs[:ncarry]), *ys]


def _while(e: _Eqn) -> list[int | None]:
    eqn, states = e.eqn, e.states
    loop = jaxprs.while_loop(eqn)
    cn, bn = loop.cond_nconsts, loop.body_nconsts
    outs = _fixed_point(_open(loop.body), states[cn : cn + bn], list(states[cn + bn :]), [])
    _walk(_open(loop.cond), [*states[:cn], *outs])
    return [row_dim(s) for s in outs]


_AXIS_OPS = REDUCE | _CUMULATIVE | {"sort", "rev", "split", "top_k"}
_RULES: dict[str, Callable[[_Eqn], list[int | None]]] = {
    "optimization_barrier": lambda e: list(e.ins),
    "broadcast_in_dim": _broadcast,
    "transpose": lambda e: [list(e.p["permutation"]).index(e.d)],
    "reshape": lambda e: [_reshaped(e.eqn, shape_of(e.src), shape_of(e.eqn.outvars[0]), e.d)],
    "squeeze": _squeeze,
    "expand_dims": _expand,
    "dot_general": _dot,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _update_slice,
    "concatenate": _concatenate,
    "pad": _pad,
    "conv_general_dilated": _conv,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}

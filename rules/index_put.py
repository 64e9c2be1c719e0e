"""index_put and the scatter primitives.

index_put: write (``accumulate=False``) or add (``accumulate=True``) values at
index positions — what ``x.at[idx].set(v)`` / ``.add(v)`` and scatters lower to.

Operands: ``x`` of shape ``[n_0, …, n_{k-1}, *t]``, then ``k`` integer index
tensors of one common shape ``m`` (index tensor ``i`` addresses dim ``i`` of
``x``; a single index tensor addresses dim 0), then ``value`` of shape
``[*m, *t]``. Negative indices count from the end; out-of-range indices are
dropped (JAX's scatter semantics). With ``accumulate=False`` and duplicate
indices the winner is unspecified (as in JAX), so the result is order-dependent.

Algebra:

* The trailing dims ``t`` are untouched by the indexing: each of them is one
  factor shared by ``x``, ``value`` and the output, and passes through sharded.
* ``strategy="default"`` (the reference semantics): the indexed dims of ``x``,
  the index tensors and the leading (index-shaped) dims of ``value`` are all
  replicated, so every device can resolve every index; the output has the layout
  of ``x``.
* ``strategy="local_update"`` (beyond the reference): ``x`` keeps its sharding
  on the indexed dims; indices and values are replicated. Each device rebases
  the indices to its own block (:meth:`LocalContext.offset`), drops the ones it
  does not own and scatters the rest locally: zero communication. In the grad,
  each device gathers the value cotangent only for the rows it owns, so
  ``d value`` is sum-partial over the axes that shard the indexed dims.
* Pending reductions: the op is linear in ``(x, value)`` jointly (for ``set``,
  ``out = x·(1 - mask) + scatter(value)`` with a mask that does not depend on
  the data), so sum/avg-partial operands pass (a replicated operand joins the
  sum as a free local split). ``set`` selects each output element from either
  ``x`` or ``value``, so a max/min-partial operand passes too, with the other
  replicated. ``add`` passes max/min only on ``x`` with ``value`` replicated
  (``max(x) + v = max(x + v)``). Index tensors are never partial.
* Grad: ``d x = g`` with the written positions zeroed (``set``) or ``g``
  (``add``), laid out as ``x``; ``d value = g[idx]``, laid out as ``value``.
  Both are linear in ``g``, so a sum/avg-partial cotangent passes through.

``scatter`` and ``scatter-add`` are the jax primitives (``lax.scatter``,
``lax.scatter_add``, with their dimension numbers: what a jaxpr holds for
``x.at[i].set/add`` and for the grads of a gather or ``take_along_axis``). The
indexed operand dims stay unsharded; window dims and batching dims are shared by
operand and updates (and indices) and keep their sharding, the operand's first.
``scatter-add`` keeps the updates' scatter dims sharded too: each device adds its
own updates, so the result is sum-partial over those axes (the operand joins as
a free local split); plain ``scatter`` gathers them. Pending reductions on the
inputs are resolved. The grad takes the cotangent laid out like the result
(partials resolved): ``d operand`` is laid out like the operand, ``d updates``
like the updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdkit.engine.rule import (
    Example,
    Inferred,
    InferredGrad,
    LocalContext,
    Rule,
    RuleContext,
)
from spmdkit.errors import ShardingConflictError
from spmdkit.spec import TensorSpec

__all__ = [
    "PRIMITIVE_RULES",
    "RULES",
    "IndexPutRule",
    "ScatterRule",
    "index_put_reference",
    "scatter_layout",
]

Dims = tuple[tuple[str, ...], ...]


def index_put_reference(x: jax.Array, *rest: jax.Array, accumulate: bool = False) -> jax.Array:
    """The unsharded op: ``x.at[tuple(indices)].set(value)`` (or ``.add``).

    Args:
      x: the array written into.
      *rest: the index tensors (one per leading dim of ``x`` they address), then
        the value.
      accumulate: add instead of overwrite.
    """
    *idx, value = rest
    at = jnp.asarray(x).at[tuple(idx)]
    return at.add(value) if accumulate else at.set(value)


def _check(ctx: RuleContext, inputs: Sequence[TensorSpec]) -> tuple[int, tuple[int, ...]]:
    """Validate the operands; returns ``(k, index shape)``."""
    op = ctx.op
    if len(inputs) < 3:
        raise ShardingConflictError(
            op=op,
            must="operands are x, one or more index tensors, value",
            given=f"{len(inputs)} operands",
            fix="pass index_put(x, idx, value) or index_put(x, idx0, idx1, ..., value)",
        )
    x, *idx, v = inputs
    k = len(idx)
    if k > x.ndim:
        raise ShardingConflictError(
            op=op,
            must=f"at most one index tensor per dim of x (rank {x.ndim})",
            given=f"{k} index tensors",
            fix="index only the leading dims of x",
        )
    ishape = idx[0].shape
    for i, s in enumerate(idx):
        if s.dtype is not None and not np.issubdtype(s.dtype, np.integer):
            raise ShardingConflictError(
                op=op,
                must="index tensors have an integer dtype",
                given=f"index {i} of dtype {s.dtype}",
                fix="cast the indices: idx.astype(jnp.int32)",
            )
        if s.shape != ishape:
            raise ShardingConflictError(
                op=op,
                must="all index tensors have one shape",
                given=f"index shapes {[t.shape for t in idx]}",
                fix="broadcast the index tensors to a common shape first",
            )
    want = (*ishape, *x.shape[k:])
    if v.shape != want:
        raise ShardingConflictError(
            op=op,
            must=f"value has shape index shape + x's trailing dims = {want}",
            given=f"value of shape {v.shape}",
            fix="broadcast the value first (jnp.broadcast_to)",
        )
    if x.dtype is not None and v.dtype is not None and x.dtype != v.dtype:
        raise ShardingConflictError(
            op=op,
            must="value has x's dtype (index_put never casts silently)",
            given=f"x {x.dtype}, value {v.dtype}",
            fix=f"cast the value: value.astype({x.dtype.name!r})",
        )
    if not isinstance(ctx.attrs.get("accumulate", False), (bool, np.bool_)):
        raise ShardingConflictError(
            op=op,
            must="accumulate is a bool",
            given=repr(ctx.attrs.get("accumulate")),
            fix="pass accumulate=True (add) or accumulate=False (set)",
        )
    return k, ishape


def _pick(sources: Sequence[tuple[str, ...]], used: set[str]) -> tuple[str, ...]:
    """The first source layout with axes not yet used (those axes, in order)."""
    for axes in sources:
        free = tuple(a for a in axes if a not in used)
        if free:
            used.update(free)
            return free
    return ()


def _partial_rule(ops: tuple[str | None, str | None], accumulate: bool):
    """How pending reductions of ``(x, value)`` over one axis pass (see module docstring)."""
    present = {o for o in ops if o is not None}
    if len(present) != 1:
        return None
    op = next(iter(present))
    if op in ("sum", "avg"):
        return op, (op, op)
    if accumulate and ops[1] is not None:
        return None
    return op, ops


class IndexPutRule(Rule):
    """The index_put rule (hand-written: the masked local update has no notation)."""

    name = "index_put"
    strategies = ("default", "local_update")
    doc = "x.at[idx].set/add(value): trailing dims pass; indexed dims replicated or updated locally"

    def __init__(self, examples: Sequence[Example]) -> None:
        self.impl = index_put_reference
        self.examples = tuple(examples)

    def describe(self, shapes: Sequence[tuple[int, ...]] | None = None, **attrs: Any) -> str:
        """One line per strategy."""
        return (
            "default: x[n.. t..], idx[m..], value[m.. t..] -> [n.. t..], n and m replicated; "
            "local_update: n keeps x's sharding, each device writes the rows it owns"
        )

    # -- layouts -----------------------------------------------------------
    def _layout(
        self,
        ctx: RuleContext,
        k: int,
        x: TensorSpec,
        v: TensorSpec,
        nlead: int,
        extra: Sequence[TensorSpec] = (),
        start: dict[int, tuple[str, ...]] | None = None,
    ) -> dict[int, tuple[str, ...]]:
        """x dim → axes: indexed dims (local_update only) from x, trailing dims from x,
        then value, then ``extra`` (output-shaped: outputs or cotangents)."""
        strategy = self.strategy(ctx)
        assign = dict(start or {})
        used = {a for axes in assign.values() for a in axes}
        for d in range(x.ndim):
            if d in assign:
                continue
            if x.shape[d] <= 1:
                assign[d] = ()
                continue
            if d < k:
                srcs = [x.dims[d], *(e.dims[d] for e in extra)] if strategy != "default" else []
            else:
                srcs = [x.dims[d], v.dims[nlead + d - k], *(e.dims[d] for e in extra)]
            assign[d] = _pick(srcs, used)
        return assign

    @staticmethod
    def _specs(
        inputs: Sequence[TensorSpec], k: int, nlead: int, assign: dict[int, tuple[str, ...]]
    ) -> tuple[TensorSpec, ...]:
        x, *idx, v = inputs
        xd = tuple(assign[d] for d in range(x.ndim))
        vd = ((),) * nlead + xd[k:]
        return (
            TensorSpec(x.shape, xd, dtype=x.dtype),
            *(TensorSpec(s.shape, dtype=s.dtype) for s in idx),
            TensorSpec(v.shape, vd, dtype=v.dtype),
        )

    # -- the three inferences ----------------------------------------------
    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Trailing dims merge (x first); indexed dims per strategy; partials per the
        module docstring."""
        k, ishape = _check(ctx, inputs)
        x, v = inputs[0], inputs[-1]
        assign = self._layout(ctx, k, x, v, len(ishape))
        req = list(self._specs(inputs, k, len(ishape), assign))
        used = {a for axes in assign.values() for a in axes}
        acc = bool(ctx.attrs.get("accumulate", False))
        out_partial: dict[str, str] = {}
        x_partial: dict[str, str] = {}
        v_partial: dict[str, str] = {}
        for a in sorted({a for s in (x, v) for a, _ in s.partial} - used):
            res = _partial_rule((x.partial_ops.get(a), v.partial_ops.get(a)), acc)
            if res is None:
                continue
            out_op, (xo, vo) = res
            out_partial[a] = out_op
            if xo:
                x_partial[a] = xo
            if vo:
                v_partial[a] = vo
        if len(set(out_partial.values())) > 1 and not set(out_partial.values()) <= {"sum", "avg"}:
            out_partial, x_partial, v_partial = {}, {}, {}  # mixed max/sum do not commute
        req[0] = req[0].replace(partial=x_partial)
        req[-1] = req[-1].replace(partial=v_partial)
        out = req[0].replace(partial=out_partial)
        return Inferred(tuple(req), (out,))

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """x and value's trailing dims take the output's layout; a sum/avg-partial
        output traces back to sum/avg-partial x and value."""
        k, ishape = _check(ctx, inputs)
        (out,) = outputs
        x = inputs[0]
        if out.shape != x.shape:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"the output has x's shape {x.shape}",
                given=str(out.shape),
                fix="pass the op's output spec",
            )
        plain = TensorSpec(x.shape, dtype=x.dtype)
        vplain = TensorSpec(inputs[-1].shape, dtype=inputs[-1].dtype)
        assign = self._layout(ctx, k, plain, vplain, len(ishape), extra=(out,))
        req = list(self._specs(inputs, k, len(ishape), assign))
        used = {a for axes in assign.values() for a in axes}
        part = {a: op for a, op in out.partial if op in ("sum", "avg") and a not in used}
        req[0] = req[0].replace(partial=part)
        req[-1] = req[-1].replace(partial=part)
        return Inferred(tuple(req), (req[0],))

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """Forward layout first, then dims it left free take the cotangent's layout;
        d value is sum-partial over the axes of locally updated (sharded) indexed dims."""
        k, ishape = _check(ctx, inputs)
        (g,) = out_grads
        x = inputs[0]
        if g.shape != x.shape:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"out_grads have x's shape {x.shape}",
                given=str(g.shape),
                fix="pass the cotangent of the op's output",
            )
        plain = tuple(s.without_partial() for s in inputs)
        fwd = self._layout(ctx, k, plain[0], plain[-1], len(ishape))
        start = {d: a for d, a in fwd.items() if a}
        assign = self._layout(ctx, k, plain[0], plain[-1], len(ishape), extra=(g,), start=start)
        req = self._specs(plain, k, len(ishape), assign)
        used = {a for axes in assign.values() for a in axes}
        g_partial = {a: op for a, op in g.partial if op in ("sum", "avg") and a not in used}
        req_g = req[0].replace(partial=g_partial, dtype=g.dtype)
        owned = {a: "sum" for d in range(k) for a in assign[d]}
        grads = (
            req[0].replace(partial=g_partial),
            *req[1:-1],
            req[-1].replace(partial={**g_partial, **owned}),
        )
        return InferredGrad(req, (req_g,), grads, (req[0],))

    # -- per-device computation -------------------------------------------
    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """Scatter into the local block; with sharded indexed dims (local_update), indices
        are rebased to this device's block and the ones it does not own are dropped."""
        accumulate = bool(lctx.attrs.get("accumulate", False))
        xs = lctx.inputs[0]
        k = len(lctx.inputs) - 2
        sharded = [d for d in range(k) if xs.dims[d]]
        if not sharded:
            return lambda x, *rest: index_put_reference(x, *rest, accumulate=accumulate)

        def local(x: jax.Array, *rest: jax.Array) -> jax.Array:
            *idx, value = rest
            owned = None
            rebased = []
            for d, raw in enumerate(idx):
                n = xs.shape[d]
                i = jnp.where(raw < 0, raw + n, raw)
                ok = (i >= 0) & (i < n)
                if xs.dims[d]:
                    i = i - lctx.offset(xs, d)
                    ok = ok & (i >= 0) & (i < x.shape[d])
                owned = ok if owned is None else owned & ok
                rebased.append(i)
            # a row this device does not own goes out of its local range: dropped
            drop = tuple(jnp.where(owned, i, x.shape[d]) for d, i in enumerate(rebased))
            at = x.at[drop]
            if accumulate:
                return at.add(value, mode="drop")
            return at.set(value, mode="drop")

        return local


# ---------------------------------------------------------------------------
# Examples (unique indices for set: duplicate writes are order-dependent)
# ---------------------------------------------------------------------------


def _values(
    x_shape: tuple[int, ...], m: int, k: int, *, unique: bool, negative: bool = False
) -> Callable[[np.random.Generator], list[np.ndarray]]:
    def make(rng: np.random.Generator) -> list[np.ndarray]:
        lead = x_shape[:k]
        if unique:
            flat = rng.choice(math.prod(lead), size=m, replace=False)
        else:
            flat = rng.integers(0, math.prod(lead), size=m)
        idx = list(np.unravel_index(flat, lead))
        if negative:
            idx[0] = np.where(np.arange(m) % 2 == 0, idx[0] - lead[0], idx[0])
        x = rng.standard_normal(x_shape).astype(np.float32)
        v = rng.standard_normal((m, *x_shape[k:])).astype(np.float32)
        return [x, *(i.astype(np.int32) for i in idx), v]

    return make


_EXAMPLES = (
    Example(
        ((8, 4), (3,), (3, 4)),
        attrs={"accumulate": False},
        dtypes=("float32", "int32", "float32"),
        differentiable=(True, False, True),
        values=_values((8, 4), 3, 1, unique=True, negative=True),
    ),
    Example(
        ((6, 3, 2), (4,), (4,), (4, 2)),
        attrs={"accumulate": True, "strategy": "local_update"},
        dtypes=("float32", "int32", "int32", "float32"),
        differentiable=(True, False, False, True),
        values=_values((6, 3, 2), 4, 2, unique=False),
        uneven=True,
    ),
)

# ---------------------------------------------------------------------------
# The scatter primitives
# ---------------------------------------------------------------------------


def scatter_layout(
    name: str, dn: Any, specs: Sequence[TensorSpec]
) -> tuple[tuple[TensorSpec, ...], TensorSpec]:
    """scatter / scatter-add (operand, indices, updates): the indexed operand dims
    replicated; window dims and batching dims (``take_along_axis``) shared by
    operand, updates (and indices), taking the operand's axes, else the updates',
    else (batching dims) the indices'; the updates' other scatter dims keep their
    axes — for scatter-add each device adds its own updates, so the result is
    sum-partial over those axes (the operand joins as partial for free); plain
    scatter gathers them instead."""
    o, idx, u = specs
    indexed = set(dn.scatter_dims_to_operand_dims)
    o_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    i_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    windowed = [
        d for d in range(o.ndim) if d not in set(dn.inserted_window_dims) and d not in o_batch
    ]
    link = dict(zip(windowed, dn.update_window_dims, strict=True))  # operand dim -> update dim
    scatter_dims = [k for k in range(u.ndim) if k not in set(dn.update_window_dims)]
    idx_dims = list(range(idx.ndim - 1))  # the last indices dim holds the index vectors
    upd_of_idx = dict(zip(idx_dims, scatter_dims, strict=True))
    idx_of_upd = {k: i for i, k in upd_of_idx.items()}
    idx_of_batch = dict(zip(o_batch, i_batch, strict=True))
    for od, idim in idx_of_batch.items():
        link[od] = upd_of_idx[idim]
    out_dims: list[tuple[str, ...]] = []
    used: set[str] = set()
    for d in range(o.ndim):
        axes: tuple[str, ...] = ()
        w = link.get(d)
        if d not in indexed:
            if o.dims[d]:
                axes = o.dims[d]
            elif w is not None and u.shape[w] == o.shape[d] and u.dims[w]:
                axes = u.dims[w]
            elif d in idx_of_batch and idx.shape[idx_of_batch[d]] == o.shape[d]:
                axes = idx.dims[idx_of_batch[d]]  # sharded labels: scatter locally
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out_dims.append(axes)
    u_dims: list[tuple[str, ...]] = [() for _ in range(u.ndim)]
    i_dims: list[tuple[str, ...]] = [() for _ in range(idx.ndim)]
    for d, w in link.items():
        if u.shape[w] == o.shape[d]:
            u_dims[w] = out_dims[d]
            if w in idx_of_upd:
                i_dims[idx_of_upd[w]] = out_dims[d]
    partial: dict[str, str] = {}
    if name == "scatter-add":
        linked = set(link.values())
        for k in scatter_dims:
            if k in linked:
                continue
            axes = tuple(a for a in u.dims[k] if a not in used)
            used.update(axes)
            u_dims[k] = axes
            if k in idx_of_upd:
                i_dims[idx_of_upd[k]] = axes
            partial.update({a: "sum" for a in axes})
    req = (
        TensorSpec(o.shape, out_dims, partial=partial, dtype=o.dtype),
        TensorSpec(idx.shape, i_dims, dtype=idx.dtype),
        TensorSpec(u.shape, u_dims, dtype=u.dtype),
    )
    out = TensorSpec(o.shape, out_dims, partial=partial, dtype=o.dtype)
    return req, out


def _scatter_dn(attrs: Any) -> lax.ScatterDimensionNumbers:
    """The dimension numbers of a call (a plain tuple once the attributes were hashed)."""
    dn = attrs["dimension_numbers"]
    return dn if isinstance(dn, lax.ScatterDimensionNumbers) else lax.ScatterDimensionNumbers(*dn)


def _scatter_impl(add: bool) -> Callable[..., jax.Array]:
    fn = lax.scatter_add if add else lax.scatter

    def impl(
        operand: jax.Array,
        indices: jax.Array,
        updates: jax.Array,
        *,
        dimension_numbers: Any,
        indices_are_sorted: bool = False,
        unique_indices: bool = False,
        mode: Any = None,
        **_: Any,
    ) -> jax.Array:
        dn = _scatter_dn({"dimension_numbers": dimension_numbers})
        return fn(
            operand,
            indices,
            updates,
            dn,
            indices_are_sorted=indices_are_sorted,
            unique_indices=unique_indices,
            mode=mode,
        )

    return impl


class ScatterRule(Rule):
    """``scatter`` / ``scatter-add``, the jax primitives (see the module docstring).
    Not ``searched``: XLA partitions them as this layout says (the updates stay
    where they are), so propagation predicts that rather than a cheaper layout."""

    searched = False

    def __init__(self, name: str, examples: Sequence[Example]) -> None:
        self.name = name
        self.impl = _scatter_impl(name == "scatter-add")
        self.examples = tuple(examples)
        self.doc = (
            "lax.scatter_add: window and batching dims pass; the updates' scatter dims stay "
            "sharded, the result sum-partial over them"
            if name == "scatter-add"
            else "lax.scatter: window and batching dims pass; indexed dims and the updates' "
            "scatter dims unsharded"
        )

    def describe(self, shapes: Sequence[tuple[int, ...]] | None = None, **attrs: Any) -> str:
        """The layout in one line."""
        return self.doc

    def _check(self, ctx: RuleContext, inputs: Sequence[TensorSpec]) -> lax.ScatterDimensionNumbers:
        if len(inputs) != 3:
            raise ShardingConflictError(
                op=ctx.op,
                must="three operands: operand, indices, updates",
                given=f"{len(inputs)} operands",
                fix=f"call {ctx.op} as lax.{self.impl.__name__} does",
            )
        try:
            return _scatter_dn(ctx.attrs)
        except (KeyError, TypeError) as e:
            raise ShardingConflictError(
                op=ctx.op,
                must="dimension_numbers is a lax.ScatterDimensionNumbers",
                given=repr(ctx.attrs.get("dimension_numbers")),
                fix="pass the dimension_numbers of the lax call",
            ) from e

    def _layout(
        self, ctx: RuleContext, specs: Sequence[TensorSpec]
    ) -> tuple[tuple[TensorSpec, ...], TensorSpec]:
        """:func:`scatter_layout`, its failures on operands that do not fit the
        dimension numbers as a typed error."""
        dn = self._check(ctx, specs)
        try:
            return scatter_layout(self.name, dn, specs)
        except (IndexError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ShardingConflictError(
                op=ctx.op,
                must="operand, indices and updates fit the dimension numbers",
                given=f"shapes {[s.shape for s in specs]}, {dn} ({type(e).__name__}: {e})",
                fix="pass the operands and dimension_numbers of the lax call",
            ) from e

    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """:func:`scatter_layout`."""
        req, out = self._layout(ctx, inputs)
        return Inferred(req, (out,))

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """The layout whose result has the output's dims: the operand laid out as the
        output, indices and updates following it (no pending sums asked of them)."""
        (out,) = self._one_output(ctx, inputs, outputs, "outputs")
        o, idx, u = inputs
        want = (
            TensorSpec(o.shape, out.dims, dtype=o.dtype),
            TensorSpec(idx.shape, dtype=idx.dtype),
            TensorSpec(u.shape, dtype=u.dtype),
        )
        req, res = self._layout(ctx, want)
        return Inferred(req, (res,))

    def _one_output(
        self,
        ctx: RuleContext,
        inputs: Sequence[TensorSpec],
        given: Sequence[TensorSpec],
        what: str,
    ) -> Sequence[TensorSpec]:
        self._check(ctx, inputs)
        if len(given) != 1 or given[0].shape != inputs[0].shape:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"one of {what}, of the operand's shape {inputs[0].shape}",
                given=str([g.shape for g in given]),
                fix=f"pass the {what} of the op's result",
            )
        return given

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """The forward layout; the cotangent laid out like the result, partials
        resolved; each input's grad laid out like the input (a device's updates'
        grad is the cotangent read at its own indices; the operand's is the
        cotangent, whole on every device that holds a partial piece)."""
        (g,) = self._one_output(ctx, inputs, out_grads, "out_grads")
        plain = tuple(s.without_partial() for s in inputs)
        req, out = self._layout(ctx, plain)
        req_g = TensorSpec(g.shape, out.dims, dtype=g.dtype)
        grads = tuple(s.without_partial() for s in req)
        return InferredGrad(req, (req_g,), grads, (out,))

    def padding_fills(self, lctx: LocalContext) -> tuple[Any, ...] | None:
        """Padded indices point at 0 and padded updates are 0: added or written, they
        reach only padding (a batching dim's padded row) or add nothing."""
        specs = (*lctx.inputs, *lctx.outputs)
        if all(
            not s.dims[d] or n % lctx.shards(s, d) == 0
            for s in specs
            for d, n in enumerate(s.shape)
        ):
            return None
        return (None, 0, 0)


def _scatter_values(
    shapes: tuple[tuple[int, ...], ...], indexed: int, *, unique: bool
) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """Operand and updates random, indices in ``[0, indexed)`` (distinct per batch
    row for a plain scatter: duplicate writes are order-dependent)."""
    o, i, u = shapes

    def make(rng: np.random.Generator) -> list[np.ndarray]:
        rows = math.prod(i[:-1]) // (i[0] if len(i) > 2 else 1)
        batch = i[0] if len(i) > 2 else 1
        idx = np.stack(
            [
                rng.choice(indexed, size=rows, replace=False)
                if unique
                else rng.integers(0, indexed, size=rows)
                for _ in range(batch)
            ]
        )
        return [
            rng.standard_normal(o).astype(np.float32),
            idx.reshape(i).astype(np.int32),
            rng.standard_normal(u).astype(np.float32),
        ]

    return make


_ROWS_DN = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
_BATCHED_DN = lax.ScatterDimensionNumbers(
    update_window_dims=(),
    inserted_window_dims=(1,),
    scatter_dims_to_operand_dims=(1,),
    operand_batching_dims=(0,),
    scatter_indices_batching_dims=(0,),
)
_SCATTER_IO = {"dtypes": ("float32", "int32", "float32"), "differentiable": (True, False, True)}


def scatter_example(
    shapes: tuple[tuple[int, ...], ...], dn: Any, *, unique: bool, uneven: bool = False
) -> Example:
    """An example of scatter / scatter-add: rows (``x.at[i].add(v)``) or a batched
    scatter (``take_along_axis``'s grad) by ``dn``; indices in range."""
    o = shapes[0]
    indexed = o[dn.scatter_dims_to_operand_dims[0]]
    attrs = {"dimension_numbers": dn, "mode": lax.GatherScatterMode.FILL_OR_DROP}
    return Example(
        shapes,
        attrs=attrs,
        values=_scatter_values(shapes, indexed, unique=unique),
        uneven=uneven,
        **_SCATTER_IO,
    )


def _scatter_examples(unique: bool) -> tuple[Example, ...]:
    return (
        scatter_example(((8, 4), (6, 1), (6, 4)), _ROWS_DN, unique=unique),
        scatter_example(((4, 8), (4, 2, 1), (4, 2)), _BATCHED_DN, unique=unique),
        scatter_example(((8, 6), (3, 1), (3, 6)), _ROWS_DN, unique=unique, uneven=True),
    )


#: The rules of primitives the library has no op of its own for.
PRIMITIVE_RULES = (
    ScatterRule("scatter", _scatter_examples(unique=True)),
    ScatterRule("scatter-add", _scatter_examples(unique=False)),
)

RULES = (IndexPutRule(_EXAMPLES), *PRIMITIVE_RULES)

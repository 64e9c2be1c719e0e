"""Rules declared in factor notation: one factor per tensor dim, each factor's mesh
axes assigned once for all operands and results.

:func:`assign_factors` picks the axes each factor gets from the operands' specs
(the dims that bid first win; a factor's axes go where it is sharded, dims that
disagree are resharded); :class:`FactorRule` turns a notation string into a full
:class:`~spmdkit.engine.rule.Rule`: forward, backward and grad inference, the
partial sums a reduction factor leaves, and its local computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from spmdkit.engine.factor import BROADCAST, Notation, parse_notation
from spmdkit.engine.rule import (
    POLICIES,
    STRATEGY_ATTR,
    Example,
    Inferred,
    InferredGrad,
    LocalContext,
    Rule,
    RuleContext,
    without_strategy,
)
from spmdkit.errors import RegistrationError, ShardingConflictError
from spmdkit.spec import TensorSpec

__all__ = ["Factor", "FactorRule", "FactorSource", "NotationFn", "assign_factors"]


# ---------------------------------------------------------------------------
# Factor assignment
# ---------------------------------------------------------------------------

Factor = Hashable
FactorSource = tuple[Sequence["Factor | None"], TensorSpec]


def _claims(
    sources: Sequence[FactorSource], order: Sequence[Factor] | None
) -> Iterator[tuple[Factor, tuple[str, ...]]]:
    """(factor, mesh axes) of each sharded dim of size > 1, in the order they bid.

    With ``order``: factor by factor, the first such dim of each source. Without:
    source by source, dim by dim.
    """
    if order is None:
        for factors, spec in sources:
            for f, axes, n in zip(factors, spec.dims, spec.shape, strict=True):
                if f is not None and n > 1 and axes:
                    yield f, axes
        return
    for f in order:
        for factors, spec in sources:
            for g, axes, n in zip(factors, spec.dims, spec.shape, strict=True):
                if g == f and n > 1 and axes:
                    yield f, axes
                    break


def assign_factors(
    sources: Sequence[FactorSource],
    *,
    order: Sequence[Factor] | None = None,
    start: Mapping[Factor, tuple[str, ...]] | None = None,
    allowed: Callable[[Factor, tuple[str, ...]], bool] | None = None,
) -> dict[Factor, tuple[str, ...]]:
    """Factor → mesh axes: the first sharded source wins; a mesh axis serves one factor.

    The merge every layout rule starts from. Each source is one tensor: the
    factor of each of its dims (``None`` for a dim that carries none) and its
    spec. A factor takes the mesh axes of the first sharded dim (of size > 1)
    that names it, minus the axes an earlier factor already took; when none are
    left, the next source is asked.

    Args:
      sources: ``(factor per dim, spec)`` pairs, most authoritative first.
      order: the factors to assign, first pick first; each takes the first source
        that shards it, and every one of them is in the result (``()`` when
        unsharded). Without ``order``, the sharded dims bid in source order and
        only the factors that got axes are in the result.
      start: factors already decided (kept as they are, their axes taken).
      allowed: ``allowed(factor, axes) -> bool`` may veto a choice (e.g. an
        uneven split of a factor that is summed away); a vetoed source is skipped.

    Returns:
      The assignment: ``start``'s entries first, then the new ones.

    Example::

        >>> x = TensorSpec((8, 4), P("data", "model"))
        >>> w = TensorSpec((4, 6), P("data", None))
        >>> assign_factors([("mk", x), ("kn", w)], order="mkn")
        {'m': ('data',), 'k': ('model',), 'n': ()}
    """
    assign: dict[Factor, tuple[str, ...]] = dict(start or {})
    used = {a for axes in assign.values() for a in axes}
    for f, axes in _claims(sources, order):
        if f in assign:
            continue
        free = tuple(a for a in axes if a not in used)
        if free and (allowed is None or allowed(f, free)):
            assign[f] = free
            used.update(free)
    if order is None:
        return assign
    return {**dict(start or {}), **{f: assign.get(f, ()) for f in order}}


# ---------------------------------------------------------------------------
# FactorRule
# ---------------------------------------------------------------------------


def _complete(
    nt: Notation, sizes: Mapping[str, int], shapes: Sequence[tuple[int, ...]]
) -> set[Any]:
    """Factors that run through every operand (at full size) and every result."""
    return {
        f
        for f in nt.factors
        if all(f in dims for dims in nt.outputs)
        and all(
            any(g == f and n == sizes.get(f) for g, n in zip(dims, shape, strict=True))
            for dims, shape in zip(nt.inputs, shapes, strict=True)
        )
    }


#: The padding fill of a padded, reduced-away dim per reduce op: the reduction's
#: identity (an average sums zeros, then is rescaled: see ``FactorRule._padded_scale``).
_PAD_FILL: dict[str, float] = {"sum": 0.0, "avg": 0.0, "max": -math.inf, "min": math.inf}

NotationFn = Callable[..., "str | Notation"]


def _reduction_partials(nt: Notation, assign: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """Output partials left by sharded reduction factors: each of their axes, with
    the notation's reduce op."""
    return {a: nt.reduce for f in nt.reduction_factors for a in assign.get(f, ())}


class FactorRule(Rule):
    """A rule declared by factor notation.

    Args:
      name: op name.
      notation: a notation string, or ``fn(shapes, **attrs) -> str | Notation``
        when it depends on ranks or attributes.
      impl: the op, ``impl(*arrays, **attrs)``.
      reduce: reduce op a sharded reduction factor leaves on the output, or
        ``None`` when reduction factors must stay unsharded.
      need_replication: factors that must stay unsharded.
      partial: name of the partial policy in :data:`POLICIES`, or
        ``fn(input_dtypes, **attrs) -> name`` when it depends on the call.
      dtype: ``fn(input_dtypes, **attrs) -> dtype`` for the output (default:
        numpy promotion of the inputs).
      examples: inputs for the validation toolkit.
      doc: one line on the semantics.

    Example::

        >>> FactorRule("matmul", "... m k, k n -> ... m n", impl=jnp.matmul,
        ...            partial="MULTIPLICATIVE")
    """

    def __init__(
        self,
        name: str,
        notation: str | NotationFn,
        *,
        impl: Callable[..., Any],
        reduce: str | None = "sum",
        need_replication: Sequence[str] = (),
        partial: str | Callable[..., str] = "NONE",
        dtype: Callable[..., Any] | None = None,
        examples: Sequence[Example] = (),
        doc: str = "",
        local_impl: Callable[..., Any] | None = None,
    ) -> None:
        if not callable(partial) and partial not in POLICIES:
            raise RegistrationError(
                op=name,
                must=f"partial is one of {sorted(POLICIES)}",
                given=repr(partial),
                fix="pick the policy that matches the op's linearity",
            )
        self.name = name
        self.notation = notation
        self.impl = impl
        self.local_impl = local_impl
        self.reduce = reduce
        self.need_replication = tuple(need_replication)
        self.partial = partial if isinstance(partial, str) else "DEPENDS"
        self._choose_policy = None if isinstance(partial, str) else partial
        self._policy = POLICIES[partial] if isinstance(partial, str) else None
        self._dtype = dtype
        self.examples = tuple(examples)
        self.doc = doc
        self._notations: dict[Any, Notation] = {}

    def __repr__(self) -> str:
        text = self.notation if isinstance(self.notation, str) else "<shape-dependent>"
        return f"FactorRule({self.name!r}, {text!r}, partial={self.partial})"

    # -- notation --------------------------------------------------------
    def notation_for(self, shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]) -> Notation:
        """The expanded notation for these input shapes and attributes (memoized)."""
        try:
            key = (tuple(shapes), tuple(sorted(attrs.items())))
            hit = self._notations.get(key)
        except TypeError:  # unhashable attributes
            return self._build_notation(shapes, attrs)
        if hit is None:
            hit = self._notations[key] = self._build_notation(shapes, attrs)
            if len(self._notations) > 4096:
                self._notations.pop(next(iter(self._notations)))
        return hit

    def _build_notation(
        self, shapes: Sequence[tuple[int, ...]], attrs: Mapping[str, Any]
    ) -> Notation:
        if callable(self.notation):
            try:
                text = self.notation(tuple(shapes), **attrs)
            except ShardingConflictError:
                raise
            except (TypeError, ValueError, IndexError, KeyError) as e:
                raise ShardingConflictError(
                    op=self.name,
                    must="the inputs and attributes fit the op",
                    given=f"{len(shapes)} inputs of shapes {tuple(shapes)}, "
                    f"attrs {dict(attrs)} ({e})",
                    fix="check the operand count, ranks and attribute names",
                ) from e
        else:
            text = self.notation
        if isinstance(text, Notation):
            return text
        return parse_notation(
            text,
            tuple(len(s) for s in shapes),
            need_replication=self.need_replication,
            reduce=self.reduce,
            op=self.name,
        )

    def describe(self, shapes: Sequence[tuple[int, ...]] | None = None, **attrs: Any) -> str:
        """The notation (expanded for ``shapes`` when given) and partial policy."""
        if shapes is None:
            text = self.notation if isinstance(self.notation, str) else "(depends on shapes/attrs)"
            return f"{text}  [partial: {self.partial}]"
        return f"{self.notation_for(shapes, attrs)}  [partial: {self.partial}]"

    def _sizes(
        self, ctx: RuleContext, nt: Notation, shapes: Sequence[tuple[int, ...]]
    ) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for i, (dims, shape) in enumerate(zip(nt.inputs, shapes, strict=True)):
            for f, s in zip(dims, shape, strict=True):
                if f == BROADCAST:
                    if s != 1:
                        raise ShardingConflictError(
                            op=ctx.op,
                            must="a dim marked '1' has size 1",
                            given=f"size {s} at input {i} {shape}",
                            fix="check the operand shapes",
                        )
                    continue
                old = sizes.get(f)
                if old is None or old == 1:
                    sizes[f] = s
                elif s not in (1, old):
                    raise ShardingConflictError(
                        op=ctx.op,
                        must=f"dims sharing factor {f!r} agree (or are 1 and broadcast)",
                        given=f"{old} and {s} (input {i} has shape {shape})",
                        fix="fix the operand shapes or the transpose flags",
                    )
        return sizes

    def _output_dtype(self, ctx: RuleContext, inputs: Sequence[TensorSpec]) -> Any:
        dts = [s.dtype for s in inputs]
        if self._dtype is not None:
            return self._dtype(tuple(dts), **without_strategy(ctx.attrs))
        if any(d is None for d in dts):
            return None
        try:
            return np.result_type(*dts)
        except TypeError:  # no common type (float8 e4m3 x e5m2: the caller's own dtype)
            return None

    # -- the factor assignment -------------------------------------------
    @staticmethod
    def _assign(
        nt: Notation,
        sources: Sequence[tuple[tuple[str, ...], TensorSpec]],
        start: Mapping[str, tuple[str, ...]] | None = None,
    ) -> dict[str, tuple[str, ...]]:
        """:func:`assign_factors` in notation order. Need-replication factors, and
        the reduction factors of a notation with no reduce op, stay unsharded.

        Uneven splits stay: a dim that does not divide its axes is padded on the
        devices. Where the factor runs through every operand and result the
        padding only ever meets padding and is cropped. Where it is reduced away
        — a reduction factor, or a broadcast operand whose grad sums over it —
        :meth:`padding_fills` fills the padding with the reduction's identity (or
        1) and zeroes the outputs' padding, and an average is rescaled from the
        padded block to the global count (:meth:`_padded_scale`); XLA pads such
        dims the same way inside ``jit``.
        """
        fixed = set(nt.need_replication)
        if nt.reduce is None:
            fixed.update(nt.reduction_factors)

        def allowed(f: str, axes: tuple[str, ...]) -> bool:
            return f not in fixed

        return assign_factors(sources, order=nt.factors, start=start, allowed=allowed)

    def _padded_scale(self, lctx: LocalContext) -> float:
        """An average over padded blocks: each device's local mean divides its sum
        by its padded block, so it is scaled by ``block · shards / size`` per
        sharded reduced dim, which makes the mean of the devices' partial averages
        the global mean (``Σ / size``)."""
        if self.reduce != "avg":
            return 1.0
        shapes = [s.shape for s in lctx.inputs]
        ctx = RuleContext(op=lctx.op, axis_sizes=lctx.axis_sizes, attrs=lctx.attrs)
        nt = self.notation_for(shapes, self._notation_attrs(ctx))
        blocks: dict[Any, float] = {}
        for dims, s in zip(nt.inputs, lctx.inputs, strict=True):
            for d, f in enumerate(dims):
                if f in nt.reduction_factors and s.dims[d] and f not in blocks:
                    blocks[f] = lctx.block(s, d) * lctx.shards(s, d) / s.shape[d]
        return math.prod(blocks.values())

    def padding_fills(self, lctx: LocalContext) -> tuple[Any, ...] | None:
        """Fill the padding of uneven blocks so it reaches no real element: with the
        reduce op's identity (0 for sum and avg, ∓inf for max/min) where an uneven dim is
        reduced away, else with 1 (finite under every elementwise op, so a zero
        cotangent times its derivative stays zero in a broadcast operand's grad)."""
        specs = (*lctx.inputs, *lctx.outputs)
        if all(
            not s.dims[d] or n % lctx.shards(s, d) == 0
            for s in specs
            for d, n in enumerate(s.shape)
        ):
            return None
        ctx = RuleContext(op=lctx.op, axis_sizes=lctx.axis_sizes, attrs=lctx.attrs)
        shapes = [s.shape for s in lctx.inputs]
        nt = self.notation_for(shapes, self._notation_attrs(ctx))
        complete = _complete(nt, self._sizes(ctx, nt, shapes), shapes)
        fills: list[Any] = []
        for dims, s in zip(nt.inputs, lctx.inputs, strict=True):
            uneven = [
                f
                for d, (f, n) in enumerate(zip(dims, s.shape, strict=True))
                if s.dims[d] and n % lctx.shards(s, d)
            ]
            if any(f in nt.reduction_factors for f in uneven):
                fills.append(_PAD_FILL[nt.reduce])
            else:
                fills.append(1 if uneven else None)
        if all(f in complete for f in self._uneven_factors(nt, lctx)):
            return None  # the padding only ever meets padding, and is cropped
        return tuple(fills)

    @staticmethod
    def _uneven_factors(nt: Notation, lctx: LocalContext) -> set[Any]:
        return {
            f
            for dims, s in zip(nt.inputs, lctx.inputs, strict=True)
            for d, f in enumerate(dims)
            if s.dims[d] and s.shape[d] % lctx.shards(s, d)
        }

    @staticmethod
    def _layout(
        dims: tuple[str, ...], shape: tuple[int, ...], sizes: Mapping[str, int], assign: Mapping
    ) -> tuple[tuple[str, ...], ...]:
        return tuple(
            () if f == BROADCAST or s != sizes.get(f, s) or s <= 1 else assign.get(f, ())
            for f, s in zip(dims, shape, strict=True)
        )

    def _out_shapes(self, nt: Notation, sizes: Mapping[str, int]) -> list[tuple[int, ...]]:
        return [tuple(1 if f == BROADCAST else sizes[f] for f in dims) for dims in nt.outputs]

    def _partials(
        self,
        ctx: RuleContext,
        nt: Notation,
        inputs: Sequence[TensorSpec],
        assign: Mapping[str, tuple[str, ...]],
    ) -> tuple[list[dict[str, str]], dict[str, str]]:
        """Which input partials pass (required per-input partials) and the output partials."""
        used = {a for axes in assign.values() for a in axes}
        axes = sorted({a for s in inputs for a, _ in s.partial})
        required: list[dict[str, str]] = [{} for _ in inputs]
        out: dict[str, str] = {}
        for a in axes:
            if a in used:
                continue
            ops = tuple(s.partial_ops.get(a) for s in inputs)
            policy = self._policy
            if policy is None:
                attrs = without_strategy(ctx.attrs)
                policy = POLICIES[self._choose_policy(tuple(s.dtype for s in inputs), **attrs)]
            res = policy(ops)
            if res is None:
                continue
            out_op, req = res
            out[a] = out_op
            for i, o in enumerate(req):
                if o is not None:
                    required[i][a] = o
        reduction = _reduction_partials(nt, assign)
        ops = set(out.values()) | set(reduction.values())
        if len(ops) > 1 and not ops <= {"sum", "avg"}:
            keep = next(iter(reduction.values()), None) or next(iter(out.values()))
            for a in [a for a, o in out.items() if o != keep]:
                del out[a]
                for r in required:
                    r.pop(a, None)
        out.update(reduction)
        return required, out

    def _notation_attrs(self, ctx: RuleContext) -> Mapping[str, Any]:
        if STRATEGY_ATTR not in ctx.attrs:
            return ctx.attrs
        self.strategy(ctx)  # validates the name
        return without_strategy(ctx.attrs)

    # -- the three inferences --------------------------------------------
    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Merge input layouts factor by factor; see the module docstring."""
        shapes = [s.shape for s in inputs]
        nt = self.notation_for(shapes, self._notation_attrs(ctx))
        sizes = self._sizes(ctx, nt, shapes)
        assign = self._assign(nt, list(zip(nt.inputs, inputs, strict=True)))
        return self._finish(ctx, nt, sizes, inputs, assign)

    def _finish(
        self,
        ctx: RuleContext,
        nt: Notation,
        sizes: Mapping[str, int],
        inputs: Sequence[TensorSpec],
        assign: Mapping[str, tuple[str, ...]],
        *,
        keep_partial: bool = True,
    ) -> Inferred:
        if keep_partial:
            req_partial, out_partial = self._partials(ctx, nt, inputs, assign)
        else:
            req_partial, out_partial = [{} for _ in inputs], _reduction_partials(nt, assign)
        req = tuple(
            TensorSpec(
                s.shape,
                self._layout(dims, s.shape, sizes, assign),
                partial=req_partial[i],
                dtype=s.dtype,
            )
            for i, (dims, s) in enumerate(zip(nt.inputs, inputs, strict=True))
        )
        dtype = self._output_dtype(ctx, inputs)
        outs = tuple(
            TensorSpec(
                shape,
                self._layout(dims, shape, sizes, assign),
                partial=out_partial,
                dtype=dtype,
            )
            for dims, shape in zip(nt.outputs, self._out_shapes(nt, sizes), strict=True)
        )
        return Inferred(req, outs)

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """Take each factor's layout from the outputs; a sum-partial output axis
        (matching the rule's reduce op) is traced back to the first reduction factor."""
        shapes = [s.shape for s in inputs]
        nt = self.notation_for(shapes, self._notation_attrs(ctx))
        sizes = self._sizes(ctx, nt, shapes)
        self._check_outputs(ctx, nt, sizes, outputs, "outputs")
        assign = self._assign(nt, list(zip(nt.outputs, outputs, strict=True)))
        used = {a for axes in assign.values() for a in axes}
        free = [
            f
            for f in nt.reduction_factors
            if f not in nt.need_replication and nt.reduce is not None and sizes.get(f, 1) > 1
        ]
        if free:
            for a, op in sorted({p for o in outputs for p in o.partial}):
                if op == nt.reduce and a not in used:
                    assign[free[0]] = (*assign.get(free[0], ()), a)
                    used.add(a)
        plain = tuple(s.without_partial() for s in inputs)
        return self._finish(ctx, nt, sizes, plain, assign, keep_partial=False)

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """Forward layout first, then output factors it left free take the cotangent's
        layout. Each input cotangent is sum-partial over the axes of factors it lacks
        (the VJP sums over them), and inherits the cotangent's sum/avg partials (a VJP
        is linear in the cotangent)."""
        shapes = [s.shape for s in inputs]
        nt = self.notation_for(shapes, self._notation_attrs(ctx))
        sizes = self._sizes(ctx, nt, shapes)
        self._check_outputs(ctx, nt, sizes, out_grads, "out_grads")
        plain = tuple(s.without_partial() for s in inputs)
        fwd_assign = self._assign(nt, list(zip(nt.inputs, plain, strict=True)))
        out_factors = {f for dims in nt.outputs for f in dims}
        start = {f: a for f, a in fwd_assign.items() if a or f not in out_factors}
        out_srcs = list(zip(nt.outputs, out_grads, strict=True))
        assign = self._assign(nt, out_srcs, start)
        fwd = self._finish(ctx, nt, sizes, plain, assign, keep_partial=False)
        used = {a for axes in assign.values() for a in axes}
        g_partial = {
            a: op
            for a, op in sorted({p for g in out_grads for p in g.partial})
            if a not in used
            and op in ("sum", "avg")
            and all(g.partial_ops.get(a) == op for g in out_grads)
        }
        req_g = tuple(
            TensorSpec(
                g.shape,
                self._layout(dims, g.shape, sizes, assign),
                partial=g_partial,
                dtype=g.dtype,
            )
            for dims, g in zip(nt.outputs, out_grads, strict=True)
        )
        grads = []
        for dims, s in zip(nt.inputs, fwd.inputs, strict=True):
            present = {f for f, n in zip(dims, s.shape, strict=True) if n == sizes.get(f, n) > 1}
            summed = {a: "sum" for f, axes in assign.items() if f not in present for a in axes}
            grads.append(s.replace(partial={**summed, **g_partial}))
        return InferredGrad(fwd.inputs, req_g, tuple(grads), fwd.outputs)

    def _check_outputs(
        self,
        ctx: RuleContext,
        nt: Notation,
        sizes: Mapping[str, int],
        given: Sequence[TensorSpec],
        what: str,
    ) -> None:
        expected = self._out_shapes(nt, sizes)
        got = [g.shape for g in given]
        if got != expected:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"{what} have shapes {expected}",
                given=str(got),
                fix=f"pass {what} with the op's output shapes",
            )

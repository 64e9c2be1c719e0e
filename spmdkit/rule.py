"""What a rule is, and the factor-notation rule from which most rules are made.

A rule answers three questions about one op on one mesh:

* **forward**: given input specs, which specs must the inputs have and which
  specs do the outputs get;
* **backward** (Paddle's "reverse"): given output specs, which input specs
  produce them;
* **grad**: given the forward inputs and the output cotangents, which specs
  must they have and which specs do the input cotangents get.

:class:`FactorRule` derives all three from one factor notation (see
:mod:`spmdkit.factor`) plus a *partial policy*: how pending reductions on the
inputs travel through the op. Hand-written rules subclass :class:`Rule`.

The partial algebra (one policy per op family; an input partial over an axis
that the policy cannot carry is resolved first, i.e. all-reduced):

============== ======================================================= =========
policy         passes                                                  why
============== ======================================================= =========
NONE           nothing                                                 nonlinear
LINEAR         sum, avg, max, min unchanged                            copy, cast
NEGATE         sum, avg unchanged; max ⇄ min                           -Σ = Σ(-·)
MONOTONE       max, min                                                f(max) = max f
ANTITONE       max ⇄ min (decreasing f)                                f(max) = min f
MAX / MIN      operands partial with that op, the rest replicated      max is associative
ADDITIVE       all-sum (or all-avg) operands; replicated operands      Σa + Σb = Σ(a+b)
               join as partial for free; one max/min operand + others
               replicated                                              max a + c = max(a + c)
SUBTRACT       as ADDITIVE; max/min in the subtrahend flips            c - max a = min(c - a)
MULTIPLICATIVE exactly one sum/avg operand, the rest replicated        (Σa)·b = Σ(a·b)
DIVIDE         a sum/avg numerator over a replicated denominator       (Σa)/b = Σ(a/b)
SELECT         condition replicated; the cases as ADDITIVE             select is linear in cases
REDUCE_SUM     sum, avg                                                Σ commutes with Σ
REDUCE_MAX     max                                                     max commutes with max
REDUCE_MIN     min                                                     min commutes with min
============== ======================================================= =========

A partial axis never passes when the op's other operands shard a dim over
that axis: the sharding wins and the partial is reduce-scattered into it.
Mixed reduce ops on one output (max over one axis, sum over another) do not
commute, so pass-through partials that would mix are resolved.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.errors import RegistrationError, ShardingConflictError
from spmdkit.factor import BROADCAST, Notation, parse_notation
from spmdkit.spec import TensorSpec
from spmdkit.topology import DEFAULT_TOPOLOGY

__all__ = [
    "Example",
    "FactorRule",
    "Inferred",
    "InferredGrad",
    "LocalContext",
    "MustDivide",
    "PartialPolicy",
    "Rule",
    "RuleContext",
    "POLICIES",
    "STRATEGY_ATTR",
    "assign_factors",
    "op_collective",
    "without_strategy",
]

#: The reserved attribute that picks one of a rule's strategies.
STRATEGY_ATTR = "strategy"

# ---------------------------------------------------------------------------
# Partial policies: ops per input on one axis → (output op, required per-input ops)
# ---------------------------------------------------------------------------

PolicyResult = tuple[str, tuple[str | None, ...]] | None
PartialPolicy = Callable[[tuple[str | None, ...]], PolicyResult]


def _map_unary(table: Mapping[str, str]) -> PartialPolicy:
    def policy(ops: tuple[str | None, ...]) -> PolicyResult:
        if len(ops) == 1 and ops[0] in table:
            return table[ops[0]], ops
        return None

    return policy


def _none(ops: tuple[str | None, ...]) -> PolicyResult:
    return None


def _same(ops: tuple[str | None, ...], op: str) -> PolicyResult:
    present = {o for o in ops if o is not None}
    return (op, ops) if present == {op} else None


def _additive_from(ops: tuple[str | None, ...], flip_from: int | None) -> PolicyResult:
    present = [(i, o) for i, o in enumerate(ops) if o is not None]
    kinds = {o for _, o in present}
    if len(kinds) == 1 and kinds <= {"sum", "avg"}:
        op = next(iter(kinds))
        return op, tuple(op for _ in ops)
    if len(present) == 1 and present[0][1] in ("max", "min"):
        i, op = present[0]
        if flip_from is not None and i >= flip_from:
            op = "min" if op == "max" else "max"
        return op, ops
    return None


def _additive(ops: tuple[str | None, ...]) -> PolicyResult:
    return _additive_from(ops, None)


def _subtract(ops: tuple[str | None, ...]) -> PolicyResult:
    return _additive_from(ops, 1)


def _multiplicative(ops: tuple[str | None, ...]) -> PolicyResult:
    present = [o for o in ops if o is not None]
    if len(present) == 1 and present[0] in ("sum", "avg"):
        return present[0], ops
    return None


def _divide(ops: tuple[str | None, ...]) -> PolicyResult:
    if ops[0] in ("sum", "avg") and all(o is None for o in ops[1:]):
        return ops[0], ops
    return None


def _select(ops: tuple[str | None, ...]) -> PolicyResult:
    if ops[0] is not None:
        return None
    cases = ops[1:]
    kinds = {o for o in cases if o is not None}
    if len(kinds) == 1 and kinds <= {"sum", "avg"}:
        op = next(iter(kinds))
        return op, (None, *(op for _ in cases))
    if len(kinds) == 1 and all(o is not None for o in cases):
        return next(iter(kinds)), ops
    return None


#: The named partial policies (see the module docstring).
POLICIES: dict[str, PartialPolicy] = {
    "NONE": _none,
    "LINEAR": _map_unary({"sum": "sum", "avg": "avg", "max": "max", "min": "min"}),
    "NEGATE": _map_unary({"sum": "sum", "avg": "avg", "max": "min", "min": "max"}),
    "MONOTONE": _map_unary({"max": "max", "min": "min"}),
    "ANTITONE": _map_unary({"max": "min", "min": "max"}),
    "MAX": lambda ops: _same(ops, "max"),
    "MIN": lambda ops: _same(ops, "min"),
    "ADDITIVE": _additive,
    "SUBTRACT": _subtract,
    "MULTIPLICATIVE": _multiplicative,
    "DIVIDE": _divide,
    "SELECT": _select,
    "REDUCE_SUM": _map_unary({"sum": "sum", "avg": "avg"}),
    "REDUCE_MAX": _map_unary({"max": "max"}),
    "REDUCE_MIN": _map_unary({"min": "min"}),
}

# ---------------------------------------------------------------------------
# Rule interface
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleContext:
    """What a rule sees besides specs: op name, mesh axis sizes, attributes."""

    op: str
    axis_sizes: Mapping[str, int]
    attrs: Mapping[str, Any]


@dataclass(frozen=True)
class Inferred:
    """Forward or backward answer: required input specs, output specs.

    ``collectives`` are the op's *own* communication: what its local
    computation does besides the reshards of its arguments (the per-row
    statistic all-reduce of a sharded-statistics norm, the vocab-parallel
    cross-entropy's scalar all-reduces, the K/V all-gather of sequence-parallel
    attention). Build them with :func:`op_collective`.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    collectives: tuple[Any, ...] = ()


@dataclass(frozen=True)
class InferredGrad:
    """Grad answer: required forward inputs and cotangents, input cotangents.

    ``collectives``: the grad computation's own communication (see :class:`Inferred`).
    """

    inputs: tuple[TensorSpec, ...]
    out_grads: tuple[TensorSpec, ...]
    input_grads: tuple[TensorSpec, ...]
    forward_outputs: tuple[TensorSpec, ...]
    collectives: tuple[Any, ...] = ()


def op_collective(
    ctx: RuleContext,
    kind: str,
    axes: Sequence[str],
    payload_bytes: int,
    *,
    reduce_op: str | None = None,
    dim: int | None = None,
) -> Any:
    """A collective an op's local computation performs, priced like a reshard step.

    Args:
      ctx: the rule context (mesh axis sizes).
      kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"``
        or ``"collective_permute"`` (one send of the payload to one peer per device).
      axes: the mesh axes of the group.
      payload_bytes: per-device buffer as the HLO shows it (all-reduce operand,
        all-gather output, reduce-scatter input).
      reduce_op: the reduce op of an all-reduce / reduce-scatter.
      dim: the gathered / scattered dim, if any.

    Example::

        >>> op_collective(ctx, "all_reduce", ("model",), rows * 4, reduce_op="sum")
    """
    from spmdkit.resharding import Collective  # a stage package: loaded on use, not with core

    axes = tuple(axes)
    n = math.prod(ctx.axis_sizes[a] for a in axes)
    hops = 2 * (n - 1) if kind == "all_reduce" else n - 1
    wire = payload_bytes * hops // n if payload_bytes else 0
    if kind == "collective_permute":
        wire = payload_bytes
    mesh = _Sizes(dict(ctx.axis_sizes))
    time = DEFAULT_TOPOLOGY.collective_time(kind, wire, n, axes, mesh)
    return Collective(
        kind=kind,
        axes=axes,
        group_size=n,
        dim=dim,
        reduce_op=reduce_op,
        payload_bytes=int(payload_bytes),
        wire_bytes=int(wire),
        time_s=time,
    )


class _Sizes:
    """Just enough of a mesh for the topology model (axis names and sizes)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.shape = sizes
        self.axis_names = tuple(sizes)
        self.axis_sizes = tuple(sizes.values())


def without_strategy(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """``attrs`` minus the reserved ``strategy`` attribute (what ``impl`` takes)."""
    return {k: v for k, v in attrs.items() if k != STRATEGY_ATTR}


@dataclass(frozen=True)
class LocalContext:
    """What a per-device computation knows about its case (see :meth:`Rule.local_fn`).

    Attributes:
      op: the op name.
      attrs: the op attributes, ``strategy`` included.
      inputs: the required input specs: how each device's local pieces are laid out.
      outputs: the claimed output specs.
      axis_sizes: mesh axis name → size.

    The helpers trace ``jax.lax.axis_index``, so call them inside ``shard_map``.
    """

    op: str
    attrs: Mapping[str, Any]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    axis_sizes: Mapping[str, int]

    def index(self, axes: Sequence[str]) -> Any:
        """This device's linear index over ``axes`` (major → minor), traced."""
        import jax

        idx = 0
        for a in axes:
            idx = idx * self.axis_sizes[a] + jax.lax.axis_index(a)
        return idx

    def shards(self, spec: TensorSpec, dim: int) -> int:
        """How many blocks ``dim`` of ``spec`` is split into."""
        return math.prod(self.axis_sizes[a] for a in spec.dims[dim])

    def block(self, spec: TensorSpec, dim: int) -> int:
        """Block size along ``dim`` (``ceil(n / shards)``; the last block may be padded)."""
        return -(-spec.shape[dim] // self.shards(spec, dim))

    def offset(self, spec: TensorSpec, dim: int) -> Any:
        """Global index of this device's first element along ``dim`` of ``spec``, traced."""
        if not spec.dims[dim]:
            return 0
        return self.index(spec.dims[dim]) * self.block(spec, dim)

    def local_shape(self, spec: TensorSpec) -> tuple[int, ...]:
        """Per-device (padded) shape of ``spec``."""
        return tuple(self.block(spec, d) for d in range(len(spec.shape)))

    @property
    def strategy(self) -> str | None:
        """The ``strategy`` attribute, if given."""
        return self.attrs.get(STRATEGY_ATTR)

    def pad(self, spec: TensorSpec, v: Any, fill: Any) -> Any:
        """``v`` (this device's piece of ``spec``) with the padding of its uneven blocks
        set to ``fill`` (``±inf`` becomes the dtype's extreme for integers), traced."""
        import jax
        import jax.numpy as jnp

        valid = None
        for d, n in enumerate(spec.shape):
            if not spec.dims[d] or n % self.shards(spec, d) == 0:
                continue
            pos = self.offset(spec, d) + jax.lax.broadcasted_iota(jnp.int32, v.shape, d)
            valid = pos < n if valid is None else valid & (pos < n)
        if valid is None:
            return v
        if math.isinf(fill) and not jnp.issubdtype(v.dtype, jnp.inexact):
            info = jnp.iinfo(v.dtype) if v.dtype != jnp.bool_ else None
            fill = (fill > 0) if info is None else (info.max if fill > 0 else info.min)
        return jnp.where(valid, v, jnp.asarray(fill, v.dtype))


#: ``where(ctx, inputs, out_grads)``: per input, then per cotangent, a set of dims.
DimsFn = Callable[
    [RuleContext, tuple[TensorSpec, ...], tuple[TensorSpec, ...]], tuple[frozenset[int], ...]
]


@dataclass(frozen=True)
class MustDivide:
    """Dims a rule keeps sharded only when their mesh axes divide them, and why.

    A dim that its axes do not divide is padded on the devices (ceil blocks). A
    rule keeps every such dim sharded, masking the padding in its local
    computation, except where the op's math needs whole blocks; each of those
    cases is one ``MustDivide``. ``docs/rules.md`` prints ``dims`` and ``why``; the
    numeric sweep checks with ``where`` that every uneven dim a rule replicates is
    declared here (an undeclared one fails the sweep).

    Attributes:
      dims: which dims, in words.
      why: why the op's math needs whole blocks there.
      where: ``where(ctx, inputs, out_grads)`` → for one call, per input and then
        per cotangent (``out_grads`` is ``()`` for a forward call), the dims this
        applies to: the rule may replicate them when they do not divide.

    Example::

        >>> MustDivide("a dim reduce_mean averages away",
        ...            "each device would divide by its padded block",
        ...            where=lambda ctx, ins, gs: (frozenset({1}), *(frozenset() for _ in gs)))
    """

    dims: str
    why: str
    where: DimsFn


@dataclass(frozen=True)
class Example:
    """Inputs the validation toolkit runs a rule on.

    Attributes:
      shapes: one shape per input.
      attrs: op attributes.
      dtypes: one dtype name per input (default float32).
      domain: ``"real"``, ``"positive"`` (logs, roots), ``"near_one"`` (long
        products) or ``"unit"`` (|x| < 1).
      differentiable: per input, whether grads flow to it (ints/bools do not).
      rtol: relative tolerance of the numeric check (low-precision casts).
      values: ``fn(rng) -> list of arrays``: the inputs, when random values in
        ``domain`` do not fit (labels in range, unique indices…).
      uneven: also sweep specs (inputs and cotangents) whose sharded dims do not
        divide (ceil blocks, padded with NaN on the devices; give the example
        shapes that do not divide the mesh axes).
    """

    shapes: tuple[tuple[int, ...], ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    dtypes: tuple[str, ...] | None = None
    domain: str = "real"
    differentiable: tuple[bool, ...] | None = None
    rtol: float = 1e-5
    values: Callable[[np.random.Generator], Sequence[np.ndarray]] | None = None
    uneven: bool = False


class Rule:
    """Base class of every rule. Subclasses implement the three inferences.

    Attributes:
      name: the op name the registry knows it by.
      impl: the op itself, ``impl(*arrays, **attrs)`` — the unsharded reference
        and, unless ``local_impl`` says otherwise, what each device runs on its
        local pieces.
      local_impl: per-device computation when it differs from ``impl``.
      examples: inputs for the validation toolkit.
      doc: one line on the semantics.
      strategies: names of the alternative strategies the rule offers.
      scratch_materializes: as a region, the local computation's temporaries are
        buffers XLA cannot fuse away (matmul outputs, a loop's per-iteration
        values: attention's scores), so the memory estimate counts them in its
        lower bound too, not only in the materialized one.
    """

    name: str
    impl: Callable[..., Any]
    local_impl: Callable[..., Any] | None = None
    examples: tuple[Example, ...] = ()
    doc: str = ""
    strategies: tuple[str, ...] = ("default",)
    scratch_materializes: bool = False

    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Input specs → required input specs and output specs."""
        raise NotImplementedError

    @property
    def must_divide(self) -> tuple[MustDivide, ...]:
        """The dims this rule keeps sharded only when they divide (default: none;
        every uneven dim stays sharded)."""
        return ()

    def divisible_dims(
        self,
        ctx: RuleContext,
        inputs: tuple[TensorSpec, ...],
        out_grads: tuple[TensorSpec, ...] = (),
    ) -> tuple[frozenset[int], ...]:
        """Per input, then per cotangent: the dims this call may replicate when their
        axes do not divide them (the union of :attr:`must_divide`'s ``where``).

        Example::

            >>> rule.divisible_dims(ctx, (TensorSpec((32, 6), P("c", None)),))
            (frozenset({0}),)
        """
        out = [frozenset[int]() for _ in (*inputs, *out_grads)]
        for entry in self.must_divide:
            for i, dims in enumerate(entry.where(ctx, inputs, out_grads)):
                out[i] |= dims
        return tuple(out)

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """Output specs → input specs that produce them (inputs are placeholders)."""
        raise NotImplementedError

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """Forward inputs + output cotangents → input cotangent specs."""
        raise NotImplementedError

    def describe(self, shapes: Sequence[tuple[int, ...]] | None = None, **attrs: Any) -> str:
        """A one-line description (the notation where there is one)."""
        return self.doc

    def strategy(self, ctx: RuleContext) -> str:
        """The strategy this call asks for (``strategy`` attribute; default: the first).

        Raises:
          ShardingConflictError: the name is not one of :attr:`strategies`.
        """
        name = ctx.attrs.get(STRATEGY_ATTR, self.strategies[0])
        if name not in self.strategies:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"strategy is one of {self.strategies}",
                given=repr(name),
                fix=f"pass strategy={self.strategies[0]!r} (the reference semantics) or "
                "another listed name",
            )
        return name

    def named_strategy(self, ctx: RuleContext, inputs: Sequence[TensorSpec]) -> str:
        """The name of what the call's strategy does with these (required) operands.

        Strategies may coincide on some layouts (every one of them computes the
        same there); a plan names the one that describes the layout. Default:
        the strategy asked for (:meth:`strategy`).

        Example::

            >>> rule.named_strategy(ctx, (logits_vocab_sharded, labels))
            'vocab_parallel'
        """
        return self.strategy(ctx)

    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """The per-device computation for one case, run inside ``shard_map`` over
        every mesh axis on the local pieces of the required inputs.

        It may use collectives over mesh axes (``psum``…) and ``lctx`` to find
        where its pieces sit; the numeric sweep, the grad check and
        :mod:`spmdkit.ops` all run it. Default: ``local_impl`` (or ``impl``) with
        the attributes minus ``strategy``.
        """
        fn = functools.partial(self.local_impl or self.impl, **without_strategy(lctx.attrs))
        return self.masked(fn, lctx)

    def masked(self, fn: Callable[..., Any], lctx: LocalContext) -> Callable[..., Any]:
        """``fn`` (a per-device computation of this case) with the padding of uneven
        blocks kept out of real elements: inputs filled as :meth:`padding_fills`
        says, outputs rescaled (an average over padded blocks) and their padding
        zeroed, so no cotangent arriving on padding reaches an input. ``fn`` itself
        when the case needs none of it.

        Example::

            >>> local = rule.masked(functools.partial(rule.impl, **attrs), lctx)
        """
        fills = self.padding_fills(lctx)
        if fills is None:
            return fn
        scale = self._padded_scale(lctx)

        def padded(*xs: Any) -> Any:
            xs = tuple(
                x if f is None else lctx.pad(s, x, f)
                for x, s, f in zip(xs, lctx.inputs, fills, strict=True)
            )
            out = fn(*xs)
            outs = out if isinstance(out, tuple) else (out,)
            if scale != 1:
                outs = tuple(y * np.asarray(scale, y.dtype) for y in outs)
            outs = tuple(lctx.pad(s, y, 0) for y, s in zip(outs, lctx.outputs, strict=True))
            return outs if isinstance(out, tuple) else outs[0]

        return padded

    def _padded_scale(self, lctx: LocalContext) -> float:
        """Factor on the local outputs of a padded case (1: none; see FactorRule's)."""
        return 1.0

    def padding_fills(self, lctx: LocalContext) -> tuple[Any, ...] | None:
        """Per input, the value the padding of its uneven blocks takes before the
        local computation (``None``: left as is); ``None`` when nothing is padded or
        the rule needs no filling (the default). Outputs' padding is then zeroed, so
        no cotangent arriving on padding reaches an input."""
        return None

    @property
    def has_custom_local_fn(self) -> bool:
        """True when the subclass overrides :meth:`local_fn` (its computation depends
        on the case's specs)."""
        return type(self).local_fn is not Rule.local_fn


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
        return np.result_type(*dts)

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

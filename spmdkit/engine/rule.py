"""What a rule is, and the factor-notation rule from which most rules are made.

A rule answers three questions about one op on one mesh:

* **forward**: given input specs, which specs must the inputs have and which
  specs do the outputs get;
* **backward** (Paddle's "reverse"): given output specs, which input specs
  produce them;
* **grad**: given the forward inputs and the output cotangents, which specs
  must they have and which specs do the input cotangents get.

:class:`FactorRule` derives all three from one factor notation (see
:mod:`spmdkit.engine.factor`) plus a *partial policy*: how pending reductions on the
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.errors import ShardingConflictError
from spmdkit.spec import TensorSpec
from spmdkit.topology import DEFAULT_TOPOLOGY

__all__ = [
    "Example",
    "Inferred",
    "InferredGrad",
    "KeptResiduals",
    "LocalContext",
    "MustDivide",
    "PartialPolicy",
    "Rule",
    "RuleContext",
    "POLICIES",
    "STRATEGY_ATTR",
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
    routed_bytes: int | None = None,
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
      routed_bytes: an all-to-all of a buffer padded for the worst case: the bytes
        of the rows it carries (``Collective.routed_bytes``), what a backend with
        a ragged all-to-all sends; the payload stays the padded buffer.

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
        routed_bytes=None if routed_bytes is None else int(routed_bytes),
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
class KeptResiduals:
    """A rule's per-device forward that keeps residuals for its grad, and the
    backward that reads them (:meth:`Rule.kept_residuals`): a grad region that
    runs it does not recompute the forward's collectives.

    Attributes:
      forward: ``(*inputs) -> (*outputs, *residuals)``, local pieces, as
        :meth:`Rule.local_fn` with the residuals after the outputs.
      backward: ``(*inputs, *residuals, *output cotangents) -> cotangents`` of the
        differentiable inputs, as ``jax.vjp`` of the local computation gives them
        (pending sums typed as its autodiff types them).
      shapes: each residual's local shape.
      dtypes: each residual's dtype.
      axes: each residual's mesh axes it varies over (the others hold the same
        value): the region passes it as a global array of shape
        ``(prod(sizes of axes), *shape)`` split over them on dim 0.
      layout: the facts of the case the residuals' values depend on, each a
        ``(name, value)`` pair (``moe_experts``: the strategy and the mesh axes of
        its tokens, experts and hidden units). The residuals are local pieces:
        a backward reads them right only on the layout its forward kept them
        under, so a grad region checks that its own case's ``layout``, shapes
        and axes equal those of the forward that kept them
        (:func:`~spmdkit.engine.region.check_kept`).
    """

    forward: Callable[..., tuple[Any, ...]]
    backward: Callable[..., tuple[Any, ...]]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    axes: tuple[tuple[str, ...], ...]
    layout: tuple[tuple[str, Any], ...] = ()


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
    cases is one ``MustDivide``. ``docs/rule-reference.md`` prints ``dims`` and ``why``; the
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
        products), ``"unit"`` (|x| < 1) or ``"above_one"`` (acosh).
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
      searched: whether propagation may try the rule on other operand layouts
        for a cheaper answer (it does where the answer communicates or leaves a
        new pending sum). False where XLA partitions the primitive exactly as the
        rule's first answer says (scatter-add: each device adds its own updates
        and the sum is reduced after), so the prediction stays XLA's.
    """

    name: str
    impl: Callable[..., Any]
    local_impl: Callable[..., Any] | None = None
    examples: tuple[Example, ...] = ()
    doc: str = ""
    strategies: tuple[str, ...] = ("default",)
    scratch_materializes: bool = False
    searched: bool = True

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

    def kept_dtypes(self, dtypes: Sequence[Any]) -> tuple[Any, ...]:
        """The dtypes of the residuals a region of this op keeps from its forward
        for its grad (:class:`KeptResiduals`), given its inputs' dtypes; ``()``
        (the default): none, the grad region recomputes the forward."""
        return ()

    def kept_residuals(self, lctx: LocalContext) -> KeptResiduals | None:
        """The per-device forward that keeps residuals and the backward that reads
        them, for one case (:class:`KeptResiduals`); None where the case keeps
        none (the grad region recomputes the forward). Only rules whose
        :meth:`kept_dtypes` names residuals are asked."""
        return None

    @property
    def has_custom_local_fn(self) -> bool:
        """True when the subclass overrides :meth:`local_fn` (its computation depends
        on the case's specs)."""
        return type(self).local_fn is not Rule.local_fn

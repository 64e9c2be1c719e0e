"""Shape ops: reshape, transpose, broadcast_in_dim, squeeze, expand_dims, concatenate,
stack, split, slice, dynamic_slice, dynamic_update_slice, gather, take_along_axis, pad,
rev.

Op names and attributes are those of the ``jax.lax`` primitives (what a jaxpr
equation carries in ``eqn.params``), so a planner can map an equation to its rule
by ``eqn.primitive.name`` and pass ``eqn.params`` unchanged; ``expand_dims`` and
``take_along_axis`` are the ``jax.numpy`` functions of those names.

Algebra. These ops move elements without combining them, so every output
element is one input element (or a constant). A tensor dim whose elements map
one-to-one onto an output dim *of the same size* keeps its sharding: each device
already holds exactly the block it needs, uneven (ceil-sized) blocks included.
A dim the op reads only partly or out of order (a slice that is not the full
range, a dynamic offset, a padded or concatenated dim, the indexed dims of a
gather) must be replicated, because which device holds an output element would
depend on data or on a shift of the block boundaries. Dims that appear only in
the output (broadcast_in_dim's new dims, expand_dims' size-1 dims, padded dims)
come out replicated.

reshape merges and splits dims. Within one group of input dims whose product is
a group of output dims, a layout survives when the sharded elements form one
contiguous block per device: the input dims before the last sharded one are
split completely (local size 1), the last sharded one is split evenly, the ones
after are whole; the output then takes the same axes, major part first (a merge
keeps the sharding of its major dim; a split puts the sharding on its major
part, spilling over to the next part only when the major part is split
completely). Where that fails (uneven split of a merged dim, a sharded minor dim
under a whole major dim, axes that do not divide the major part) the rule drops
the minor-most axes until it holds — the dropped axes are an all-gather, listed
as a reshard of the input. A group of one input dim and one equal output dim is
pass-through and may be uneven. An uneven split of a merged or split group
survives only when the padded blocks line up on both sides (only the major dim
sharded, ``ceil(n/k)·M = ceil(n'/k)·M'``: ``(32, 2) → (64,)`` over 3); these
are the only dims of the family that must divide (``must_divide``).

Partials. Because each output element is one input element, a pending
reduction of any kind (sum, avg, max, min) commutes with these ops and passes
through — several of them in any mix, since the output holds the same
reductions in the same order — when the op is *one* data operand plus index
operands (reshape, transpose, broadcast_in_dim, squeeze, expand_dims, slice,
split, dynamic_slice, gather, take_along_axis). Ops that interleave several
data operands (concatenate, dynamic_update_slice, pad with its padding value)
pass a partial axis when the data operands that carry it agree on its op: a
replicated operand joins for free (sum: a local to_partial, one device keeps
it and the others hold zero; avg/max/min: as it is, every device holds the
value). An axis that shards a dim of the output is resolved (reduce-scattered)
instead. Index operands must never be partial. A ``gather`` (the primitive),
and a ``slice`` or ``dynamic_slice`` that drops elements, pass no sum: the
enforced step cannot carry a pending sum into them (a partial value cannot be
pinned, and one cannot cross a ``shard_map``), so XLA reduces the operand where
it is made, whole, and the rules say so rather than price the smaller reduction
of the rows they keep (a gather in ``fill`` mode with a finite,
non-zero ``fill_value`` could not pass it anyway: each device would add its own
fill). The grad of every op here is linear in the cotangent, so a sum/avg
cotangent partial passes to the input grads; an input grad is sum-partial over
the axes that shard a factor the input lacks (broadcast's new dims; a gather's
index batch dims, where each device scatter-adds its own indices), uneven
dims included: the local computation zeroes its outputs' padding there, so
the padding of the short blocks never enters the sum.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdkit.engine.factor import Notation
from spmdkit.engine.factor_rule import FactorRule, assign_factors
from spmdkit.engine.rule import (
    Example,
    Inferred,
    InferredGrad,
    LocalContext,
    MustDivide,
    Rule,
    RuleContext,
    without_strategy,
)
from spmdkit.errors import ShardingConflictError
from spmdkit.rules.reduction import along_notation
from spmdkit.spec import TensorSpec

__all__ = [
    "PRIMITIVE_RULES",
    "RULES",
    "DimMap",
    "LocalMapRule",
    "MapRule",
    "ReshapeRule",
    "reshape_layout",
]

Dims = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class DimMap:
    """How an op's dims correspond, for one call's shapes and attributes.

    Attributes:
      inputs: per input, per dim, the factor it carries, or ``None`` when the dim
        must be replicated (read partly, out of order, or indexed).
      outputs: per output, per dim, its factor, or ``None`` (always replicated).
        A factor only outputs carry (a broadcast dim) is never sharded by the
        forward pass, but a cotangent may shard it.
      out_shapes: the output shapes.
      data: per input, whether it is a data operand (partials may pass) rather
        than an index operand (never partial).
      sum_ok: whether a sum partial passes (False where XLA reduces the operand
        before the op: a gather, a slice or dynamic_slice that drops elements).
    """

    inputs: tuple[tuple[str | None, ...], ...]
    outputs: tuple[tuple[str | None, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    data: tuple[bool, ...]
    sum_ok: bool = True


def _err(op: str, must: str, given: str, fix: str) -> ShardingConflictError:
    return ShardingConflictError(op=op, must=must, given=given, fix=fix)


def _ints(op: str, name: str, value: Any, rank: int | None = None) -> tuple[int, ...]:
    """A tuple of Python ints from an attribute (np.int64 entries included)."""
    try:
        out = tuple(int(v) for v in value)
    except TypeError as e:
        raise _err(op, f"{name} is a sequence of ints", repr(value), f"pass {name}=(...)") from e
    if rank is not None and len(out) != rank:
        raise _err(
            op,
            f"{name} has one entry per dim ({rank})",
            f"{name}={value!r}",
            f"pass {rank} entries",
        )
    return out


def _dim(op: str, name: str, d: Any, rank: int) -> int:
    try:
        d = int(d)
    except TypeError as e:
        raise _err(op, f"{name} is an int", repr(d), f"pass {name}=<int>") from e
    if not -rank <= d < rank:
        raise _err(
            op, f"{name} is a dim of a rank-{rank} tensor", f"{name}={d}", f"use [-{rank}, {rank})"
        )
    return d % rank


def _names(prefix: str, shape: tuple[int, ...]) -> list[str | None]:
    """One factor per dim; size-1 dims get none (never sharded)."""
    return [f"{prefix}{i}" if n > 1 else None for i, n in enumerate(shape)]


# ---------------------------------------------------------------------------
# The generic dim-map rule
# ---------------------------------------------------------------------------


def _layout(
    factors: tuple[str | None, ...], shape: tuple[int, ...], assign: Mapping[str, tuple[str, ...]]
) -> Dims:
    return tuple(
        () if f is None or n <= 1 else assign.get(f, ())
        for f, n in zip(factors, shape, strict=True)
    )


def _pass_partials(
    inputs: Sequence[TensorSpec], data: Sequence[bool], used: set[str], sum_ok: bool
) -> tuple[list[dict[str, str]], dict[str, str]]:
    """Per-input required partials and the output partials (see the module docstring).

    Each output element is one element of one data operand, so the pending
    reductions of the operands pass in any mix (sum over one axis, max over
    another): the output holds them in the same order. Per axis, the data
    operands must agree on the op; a replicated operand joins an avg/max/min
    as it is (every device holds the value) and a sum as a local to_partial.
    """
    required = [dict(s.partial_ops) for s in inputs]
    out: dict[str, str] = {}
    for a in sorted({a for s in inputs for a, _ in s.partial}):
        ops = [s.partial_ops.get(a) for s in inputs]
        kinds = {o for o in ops if o is not None}
        index_partial = any(o is not None and not d for o, d in zip(ops, data, strict=True))
        if a in used or index_partial or len(kinds) != 1 or (kinds == {"sum"} and not sum_ok):
            for r in required:
                r.pop(a, None)  # resolved first
            continue
        (op,) = kinds
        out[a] = op
        if op == "sum":
            for i, d in enumerate(data):
                if d:
                    required[i][a] = op
    return required, out


MapFn = Callable[..., DimMap]
LocalAttrs = Callable[[Mapping[str, Any], Any], Mapping[str, Any]]


class MapRule(Rule):
    """A shape-op rule from a :class:`DimMap` built per call.

    Args:
      name: op name (the ``jax.lax`` primitive's name).
      mapping: ``fn(shapes, **attrs) -> DimMap``.
      impl: the op, ``impl(*arrays, **attrs)``.
      local_attrs: ``fn(attrs, lctx) -> attrs`` turning global sizes in the
        attributes into this device's sizes (used by :class:`LocalMapRule`).
      examples: inputs for the validation toolkit.
      doc: one line on the semantics.
    """

    def __init__(
        self,
        name: str,
        mapping: MapFn,
        *,
        impl: Callable[..., Any],
        local_attrs: LocalAttrs | None = None,
        examples: Sequence[Example] = (),
        doc: str = "",
    ) -> None:
        self.name = name
        self.mapping = mapping
        self.impl = impl
        self.local_attrs = local_attrs or (lambda attrs, lctx: attrs)
        self.examples = tuple(examples)
        self.doc = doc

    def __repr__(self) -> str:
        return f"MapRule({self.name!r})"

    def dim_map(self, ctx: RuleContext, inputs: Sequence[TensorSpec]) -> DimMap:
        """The :class:`DimMap` for these inputs; bad shapes/attributes raise a conflict."""
        shapes = tuple(s.shape for s in inputs)
        attrs = without_strategy(ctx.attrs)
        try:
            dm = self.mapping(shapes, **attrs)
        except ShardingConflictError:
            raise
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            raise _err(
                self.name,
                "the inputs and attributes fit the op",
                f"{len(shapes)} inputs of shapes {shapes}, attrs {attrs} ({e})",
                "check the operand count, ranks and attribute names (the jax.lax params)",
            ) from e
        self.strategy(ctx)  # validates the name; every shape op has one strategy
        return dm

    def _specs(
        self,
        dm: DimMap,
        inputs: Sequence[TensorSpec],
        assign: Mapping[str, tuple[str, ...]],
        req_partial: Sequence[Mapping[str, str]],
        out_partial: Mapping[str, str],
    ) -> Inferred:
        req = tuple(
            TensorSpec(s.shape, _layout(f, s.shape, assign), partial=p, dtype=s.dtype)
            for f, s, p in zip(dm.inputs, inputs, req_partial, strict=True)
        )
        dtype = inputs[0].dtype if inputs else None
        outs = tuple(
            TensorSpec(shape, _layout(f, shape, assign), partial=out_partial, dtype=dtype)
            for f, shape in zip(dm.outputs, dm.out_shapes, strict=True)
        )
        return Inferred(req, outs)

    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Each factor takes the first input layout that shards it; see the module docstring."""
        dm = self.dim_map(ctx, inputs)
        assign = assign_factors(list(zip(dm.inputs, inputs, strict=True)))
        used = {a for axes in assign.values() for a in axes}
        req_p, out_p = _pass_partials(inputs, dm.data, used, dm.sum_ok)
        return self._specs(dm, inputs, assign, req_p, out_p)

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """Each factor takes the first output layout that shards it; no partials."""
        dm = self.dim_map(ctx, inputs)
        _check_shapes(self.name, dm.out_shapes, outputs, "outputs")
        assign = assign_factors(list(zip(dm.outputs, outputs, strict=True)))
        plain = [s.without_partial() for s in inputs]
        return self._specs(dm, plain, assign, [{} for _ in inputs], {})

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """Forward layout first; factors it left unsharded take the cotangent's layout.
        An input grad is sum-partial over the axes of factors that input lacks, and
        inherits the cotangent's sum/avg partials."""
        dm = self.dim_map(ctx, inputs)
        _check_shapes(self.name, dm.out_shapes, out_grads, "out_grads")
        plain = [s.without_partial() for s in inputs]
        fwd = assign_factors(list(zip(dm.inputs, plain, strict=True)))
        assign = assign_factors(list(zip(dm.outputs, out_grads, strict=True)), start=fwd)
        used = {a for axes in assign.values() for a in axes}
        g_partial = _cotangent_partials(out_grads, used)
        res = self._specs(dm, plain, assign, [{} for _ in inputs], {})
        req_g = tuple(
            TensorSpec(g.shape, _layout(f, g.shape, assign), partial=g_partial, dtype=g.dtype)
            for f, g in zip(dm.outputs, out_grads, strict=True)
        )
        grads = []
        for factors, s, is_data in zip(dm.inputs, res.inputs, dm.data, strict=True):
            if not is_data:  # index operands get no cotangent
                grads.append(s)
                continue
            present = {f for f, n in zip(factors, s.shape, strict=True) if f is not None and n > 1}
            summed = {a: "sum" for f, axes in assign.items() if f not in present for a in axes}
            grads.append(s.replace(partial={**summed, **g_partial}))
        return InferredGrad(res.inputs, req_g, tuple(grads), res.outputs)

    def padding_fills(self, lctx: LocalContext) -> tuple[Any, ...] | None:
        """No input is filled; the outputs' padding is zeroed when an output dim is
        split unevenly over a factor that a data input lacks (broadcast's new dims,
        a gather's index batch dims, the padded dims a padding value fills): that
        input's grad sums the cotangent over the dim, and the zeroed padding keeps
        the cotangent's padding out of the sum."""
        if all(
            not s.dims[d] or n % lctx.shards(s, d) == 0
            for s in lctx.outputs
            for d, n in enumerate(s.shape)
        ):
            return None  # also the case of a runner built without specs
        ctx = RuleContext(op=self.name, axis_sizes=lctx.axis_sizes, attrs=lctx.attrs)
        dm = self.dim_map(ctx, lctx.inputs)
        uneven = {
            f
            for factors, spec in zip(dm.outputs, lctx.outputs, strict=True)
            for d, f in enumerate(factors)
            if f is not None and spec.dims[d] and spec.shape[d] % lctx.shards(spec, d)
        }
        if not any(
            f not in factors
            for factors, data in zip(dm.inputs, dm.data, strict=True)
            if data
            for f in uneven
        ):
            return None
        return (None,) * len(lctx.inputs)


class LocalMapRule(MapRule):
    """A :class:`MapRule` whose attributes hold global sizes of dims that may stay
    sharded (reshape's ``new_sizes``, a slice's bounds): each device runs the op with
    those sizes made local by ``local_attrs(attrs, lctx)``."""

    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """The op on this device's pieces, with global sizes in attributes made local
        (and the padding handled as :meth:`MapRule.padding_fills` says)."""
        attrs = dict(self.local_attrs(without_strategy(lctx.attrs), lctx))
        return self.masked(functools.partial(self.impl, **attrs), lctx)


def _check_shapes(
    op: str, expected: Sequence[tuple[int, ...]], given: Sequence[TensorSpec], what: str
) -> None:
    got = [g.shape for g in given]
    if got != list(expected):
        raise _err(op, f"{what} have shapes {list(expected)}", str(got), f"pass the op's {what}")


def _cotangent_partials(out_grads: Sequence[TensorSpec], used: set[str]) -> dict[str, str]:
    """Sum/avg cotangent partials that pass to the input grads (the VJP is linear)."""
    return {
        a: op
        for a, op in sorted({p for g in out_grads for p in g.partial})
        if a not in used
        and op in ("sum", "avg")
        and all(g.partial_ops.get(a) == op for g in out_grads)
    }


# ---------------------------------------------------------------------------
# reshape
# ---------------------------------------------------------------------------


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Minimal groups of src dims and dst dims with equal products (size-1 dims left out)."""
    si = [i for i, n in enumerate(src) if n != 1]
    di = [j for j, n in enumerate(dst) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(si) or j < len(di):
        gs: list[int] = []
        gd: list[int] = []
        ps = pd = 1
        while True:
            if gs and gd and ps == pd:
                break
            if (ps <= pd or j >= len(di)) and i < len(si):
                gs.append(si[i])
                ps *= src[si[i]]
                i += 1
            elif j < len(di):
                gd.append(di[j])
                pd *= dst[di[j]]
                j += 1
            else:
                break
        groups.append((gs, gd))
    return groups


def _aligned_uneven(
    src: tuple[int, ...],
    dst: tuple[int, ...],
    gs: list[int],
    gd: list[int],
    dims: Dims,
    axis_sizes: Mapping[str, int],
) -> bool:
    """Whether a merge/split group keeps an uneven split of its major source dim.

    Only the major dim is sharded, over ``k`` devices, and ``k`` does not divide it.
    Device ``i`` holds rows ``[i·b, (i+1)·b)`` of it (``b = ceil(n/k)``, the last
    block padded) times the whole minor dims (``M`` elements): the flat range
    ``[i·b·M, (i+1)·b·M)``. On the output's major dim (``n'``, minor ``M'``) it
    must hold ``[i·B·M', (i+1)·B·M')``, ``B = ceil(n'/k)``: the same ranges, and the
    padding lands on padding, exactly when ``b·M = B·M'``. Example: ``(32, 2) →
    (64,)`` over 3 (``11·2 = 22 = ceil(64/3)``) keeps the split; ``(4, 6) → (24,)``
    over 3 (``2·6 ≠ 8``) does not.
    """
    axes = dims[gs[0]]
    if not axes or any(dims[d] for d in gs[1:]) or not gd:
        return False
    k = math.prod(axis_sizes[a] for a in axes)
    n, n_out = src[gs[0]], dst[gd[0]]
    if n % k == 0:
        return False  # even: the general rule below decides
    minor = math.prod(src[d] for d in gs[1:])
    minor_out = math.prod(dst[d] for d in gd[1:])
    return -(-n // k) * minor == -(-n_out // k) * minor_out


def reshape_layout(
    src: tuple[int, ...],
    dst: tuple[int, ...],
    dims: Dims,
    axis_sizes: Mapping[str, int],
) -> tuple[Dims, Dims]:
    """Layouts of a reshape from ``src`` to ``dst`` that keep as much of ``dims`` as holds.

    Returns ``(src_dims, dst_dims)``: the source layout that can stay (``dims``
    minus the minor-most axes that would not survive) and the destination layout
    it gives. See the module docstring for when an axis survives.

    Example::

        >>> reshape_layout((8, 4), (32,), (("x",), ()), {"x": 4})
        ((('x',), ()), (('x',),))
        >>> reshape_layout((6, 4), (24,), (("x",), ()), {"x": 4})
        (((), ()), ((),))
    """
    out_src: list[tuple[str, ...]] = [() for _ in src]
    out_dst: list[tuple[str, ...]] = [() for _ in dst]
    if 0 in src or 0 in dst:
        return tuple(out_src), tuple(out_dst)
    for gs, gd in _groups(src, dst):
        if len(gs) == 1 and len(gd) == 1:  # pass-through dim: any layout, even uneven
            out_src[gs[0]] = out_dst[gd[0]] = dims[gs[0]]
            continue
        if _aligned_uneven(src, dst, gs, gd, dims, axis_sizes):
            out_src[gs[0]] = out_dst[gd[0]] = dims[gs[0]]
            continue
        flat: list[tuple[str, int]] = []  # (axis, source dim), major → minor
        open_ = True
        for d in gs:
            if not open_:
                break
            p = 1
            for a in dims[d]:
                if src[d] % (p * axis_sizes[a]):
                    open_ = False
                    break
                p *= axis_sizes[a]
                flat.append((a, d))
            open_ = open_ and p == src[d]
        pos = 0
        for d in gd:
            p = 1
            while pos < len(flat) and dst[d] % (p * axis_sizes[flat[pos][0]]) == 0:
                p *= axis_sizes[flat[pos][0]]
                out_dst[d] = (*out_dst[d], flat[pos][0])
                pos += 1
            if p != dst[d]:
                break
        for a, d in flat[:pos]:
            out_src[d] = (*out_src[d], a)
    return tuple(out_src), tuple(out_dst)


def _reshape_attrs(
    op: str, shape: tuple[int, ...], new_sizes: Any, dimensions: Any
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    sizes = list(_ints(op, "new_sizes", new_sizes))
    if sizes.count(-1) == 1:
        rest = math.prod(n for n in sizes if n != -1)
        sizes[sizes.index(-1)] = math.prod(shape) // rest if rest else 0
    if any(n < 0 for n in sizes) or math.prod(sizes) != math.prod(shape):
        raise _err(
            op,
            "new_sizes has as many elements as the input",
            f"input {shape}, new_sizes={new_sizes!r}",
            "pass new_sizes with the same product",
        )
    perm = None
    if dimensions is not None:
        perm = _ints(op, "dimensions", dimensions, len(shape))
        if sorted(perm) != list(range(len(shape))):
            raise _err(op, "dimensions is a permutation", repr(dimensions), "pass a permutation")
    return tuple(sizes), perm


class ReshapeRule(Rule):
    """``lax.reshape(x, new_sizes, dimensions)``: merges and splits dims (see the module
    docstring); every partial passes."""

    name = "reshape"
    doc = "merge/split dims; sharding survives on a merge's major dim / a split's major part"

    def __init__(self, examples: Sequence[Example] = ()) -> None:
        self.examples = tuple(examples)

    @staticmethod
    def impl(
        x: jax.Array, *, new_sizes: Any, dimensions: Any = None, sharding: Any = None, **_: Any
    ) -> jax.Array:
        return lax.reshape(x, tuple(int(n) for n in new_sizes), dimensions)

    def _parse(self, ctx: RuleContext, x: TensorSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if "new_sizes" not in ctx.attrs:
            raise _err(self.name, "new_sizes is given", str(dict(ctx.attrs)), "pass new_sizes=")
        self.strategy(ctx)
        sizes, perm = _reshape_attrs(
            self.name, x.shape, ctx.attrs["new_sizes"], ctx.attrs.get("dimensions")
        )
        return sizes, perm or tuple(range(x.ndim))

    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Keep what survives the merge/split; the dropped axes are a reshard of the input."""
        (x,) = _one(self.name, inputs)
        sizes, perm = self._parse(ctx, x)
        src = tuple(x.shape[p] for p in perm)
        kept, out = reshape_layout(src, sizes, tuple(x.dims[p] for p in perm), ctx.axis_sizes)
        req_dims = [()] * x.ndim
        for k, p in enumerate(perm):
            req_dims[p] = kept[k]
        req = TensorSpec(x.shape, req_dims, partial=x.partial_ops, dtype=x.dtype)
        return Inferred((req,), (TensorSpec(sizes, out, partial=x.partial_ops, dtype=x.dtype),))

    def _from_output(
        self, ctx: RuleContext, x: TensorSpec, y: TensorSpec, sizes: tuple[int, ...], perm: Any
    ) -> Dims:
        """Input layout (in x's dim order) that gives as much of y's layout as can be."""
        src = tuple(x.shape[p] for p in perm)
        _, back = reshape_layout(sizes, src, y.dims, ctx.axis_sizes)
        dims: list[tuple[str, ...]] = [()] * x.ndim
        for k, p in enumerate(perm):
            dims[p] = back[k]
        return tuple(dims)

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """The reshape read backwards from the output layout; no partials."""
        (x,) = _one(self.name, inputs)
        sizes, perm = self._parse(ctx, x)
        _check_shapes(self.name, [sizes], outputs, "outputs")
        dims = self._from_output(ctx, x, outputs[0], sizes, perm)
        return self.forward(ctx, (TensorSpec(x.shape, dims, dtype=x.dtype),))

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """The input's layout where it shards something, else the cotangent's read back;
        the input grad has the input's layout and the cotangent's sum/avg partials."""
        (x,) = _one(self.name, inputs)
        sizes, perm = self._parse(ctx, x)
        _check_shapes(self.name, [sizes], out_grads, "out_grads")
        (g,) = out_grads
        fwd = self.forward(ctx, (x.without_partial(),)).inputs[0]
        back = self._from_output(ctx, x, g, sizes, perm)
        used = set(fwd.sharding_axes)
        dims = list(fwd.dims)
        src = tuple(x.shape[p] for p in perm)
        for gs, _ in _groups(src, sizes):
            group = [perm[k] for k in gs]
            if any(dims[d] for d in group):
                continue
            axes = [a for d in group for a in back[d]]
            if axes and not used.intersection(axes):
                for d in group:
                    dims[d] = back[d]
                used.update(axes)
        res = self.forward(ctx, (TensorSpec(x.shape, dims, dtype=x.dtype),))
        xin, (y,) = res.inputs[0], res.outputs
        g_partial = _cotangent_partials(out_grads, set(y.sharding_axes))
        req_g = y.replace(partial=g_partial, dtype=g.dtype)
        return InferredGrad((xin,), (req_g,), (xin.replace(partial=g_partial),), (y,))

    @property
    def must_divide(self) -> tuple[MustDivide, ...]:
        """The merged and split dims (see :func:`reshape_layout`)."""
        return (
            MustDivide(
                "merged or split dims (a group of several input or output dims with one "
                "product); a dim that maps to one equal dim passes uneven",
                "a padded block of a merged dim is ceil(n/k)·M elements, but the merged "
                "dim's own blocks are ceil(n·M/k): the devices' ranges differ (the "
                "padding would land inside real elements) unless k divides n or the two "
                "happen to agree (ceil(n/k)·M = ceil(n'/k)·M', e.g. (32, 2) → (64,) over 3), "
                "which the rule keeps sharded; a split is the same read backwards",
                self._grouped_dims,
            ),
        )

    def _grouped_dims(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> tuple[frozenset[int], ...]:
        """The input dims, and the cotangent dims, in merge/split groups."""
        (x,) = _one(self.name, inputs)
        sizes, perm = self._parse(ctx, x)
        groups = [
            (gs, gd)
            for gs, gd in _groups(tuple(x.shape[p] for p in perm), sizes)
            if len(gs) != 1 or len(gd) != 1
        ]
        src = frozenset(perm[k] for gs, _ in groups for k in gs)
        dst = frozenset(j for _, gd in groups for j in gd)
        return (src, *(dst for _ in out_grads))

    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """Reshape the local piece to the output's local (block) shape."""
        shape = lctx.local_shape(lctx.outputs[0])
        dimensions = lctx.attrs.get("dimensions")

        def local(x: jax.Array) -> jax.Array:
            return lax.reshape(x, shape, dimensions)

        return local


def _one(op: str, inputs: Sequence[TensorSpec]) -> tuple[TensorSpec]:
    if len(inputs) != 1:
        raise _err(op, "one operand", f"{len(inputs)} operands", "pass exactly one input spec")
    return (inputs[0],)


# ---------------------------------------------------------------------------
# The other ops: mappings and implementations
# ---------------------------------------------------------------------------


def _transpose_map(shapes: Any, *, permutation: Any, **_: Any) -> DimMap:
    (shape,) = shapes
    perm = _ints("transpose", "permutation", permutation, len(shape))
    if sorted(perm) != list(range(len(shape))):
        raise _err(
            "transpose",
            "permutation is a permutation of the dims",
            repr(perm),
            "pass each dim once",
        )
    f = _names("d", shape)
    return DimMap(
        (tuple(f),), (tuple(f[p] for p in perm),), (tuple(shape[p] for p in perm),), (True,)
    )


def _transpose(x: jax.Array, *, permutation: Any, **_: Any) -> jax.Array:
    return lax.transpose(x, tuple(int(p) for p in permutation))


def _broadcast_map(shapes: Any, *, shape: Any, broadcast_dimensions: Any, **_: Any) -> DimMap:
    op = "broadcast_in_dim"
    (src,) = shapes
    out = _ints(op, "shape", shape)
    bdims = _ints(op, "broadcast_dimensions", broadcast_dimensions, len(src))
    if len(set(bdims)) != len(bdims) or any(not 0 <= d < len(out) for d in bdims):
        raise _err(
            op,
            "broadcast_dimensions are distinct output dims",
            repr(bdims),
            "map each operand dim to its own output dim",
        )
    if any(src[i] not in (1, out[d]) for i, d in enumerate(bdims)):
        raise _err(
            op,
            "each operand dim is 1 or its output dim's size",
            f"{src} -> {out}",
            "check shape= and broadcast_dimensions=",
        )
    fo: list[str | None] = [f"n{j}" if n > 1 else None for j, n in enumerate(out)]
    fi: list[str | None] = []
    for i, d in enumerate(bdims):
        fi.append(f"d{i}" if src[i] > 1 else None)
        if src[i] > 1:
            fo[d] = f"d{i}"
    return DimMap((tuple(fi),), (tuple(fo),), (out,), (True,))


def _broadcast(x: jax.Array, *, shape: Any, broadcast_dimensions: Any, **_: Any) -> jax.Array:
    return lax.broadcast_in_dim(
        x, tuple(int(n) for n in shape), tuple(int(d) for d in broadcast_dimensions)
    )


def _broadcast_local(attrs: Mapping[str, Any], lctx: LocalContext) -> Mapping[str, Any]:
    return {**attrs, "shape": lctx.local_shape(lctx.outputs[0])}


def _squeeze_map(shapes: Any, *, dimensions: Any, **_: Any) -> DimMap:
    (shape,) = shapes
    dims = (dimensions,) if isinstance(dimensions, (int, np.integer)) else dimensions
    drop = {_dim("squeeze", "dimensions", d, len(shape)) for d in _ints("squeeze", "x", dims)}
    if any(shape[d] != 1 for d in drop):
        raise _err(
            "squeeze",
            "squeezed dims have size 1",
            f"{shape}, dims {sorted(drop)}",
            "squeeze only size-1 dims",
        )
    f = _names("d", shape)
    keep = [i for i in range(len(shape)) if i not in drop]
    return DimMap(
        (tuple(f),), (tuple(f[i] for i in keep),), (tuple(shape[i] for i in keep),), (True,)
    )


def _squeeze(x: jax.Array, *, dimensions: Any, **_: Any) -> jax.Array:
    dims = (dimensions,) if isinstance(dimensions, (int, np.integer)) else dimensions
    return lax.squeeze(x, tuple(int(d) for d in dims))


def _expand_map(shapes: Any, *, dimensions: Any, **_: Any) -> DimMap:
    (shape,) = shapes
    dims = (dimensions,) if isinstance(dimensions, (int, np.integer)) else dimensions
    rank = len(shape) + len(tuple(dims))
    new = {_dim("expand_dims", "dimensions", d, rank) for d in _ints("expand_dims", "x", dims)}
    if len(new) != len(tuple(dims)):
        raise _err(
            "expand_dims", "dimensions are distinct", repr(dimensions), "name each new dim once"
        )
    f = _names("d", shape)
    it = iter(range(len(shape)))
    out_f: list[str | None] = []
    out_s: list[int] = []
    for j in range(rank):
        if j in new:
            out_f.append(None)
            out_s.append(1)
        else:
            i = next(it)
            out_f.append(f[i])
            out_s.append(shape[i])
    return DimMap((tuple(f),), (tuple(out_f),), (tuple(out_s),), (True,))


def _expand_dims(x: jax.Array, *, dimensions: Any, **_: Any) -> jax.Array:
    dims = (dimensions,) if isinstance(dimensions, (int, np.integer)) else dimensions
    return jnp.expand_dims(x, tuple(int(d) for d in dims))


def _concat_map(shapes: Any, *, dimension: Any, **_: Any) -> DimMap:
    op = "concatenate"
    if not shapes:
        raise _err(op, "at least one operand", "none", "pass the operands")
    rank = len(shapes[0])
    d = _dim(op, "dimension", dimension, rank)
    for s in shapes:
        if len(s) != rank or any(
            a != b for k, (a, b) in enumerate(zip(s, shapes[0], strict=True)) if k != d
        ):
            raise _err(
                op,
                "operands agree on every dim but the concat dim",
                str(shapes),
                "make the operands equal off dimension=",
            )
    out = list(shapes[0])
    out[d] = sum(s[d] for s in shapes)
    f = _names("d", tuple(out))
    f[d] = None
    return DimMap(
        tuple(tuple(f) for _ in shapes), (tuple(f),), (tuple(out),), (True,) * len(shapes)
    )


def _concatenate(*xs: jax.Array, dimension: Any, **_: Any) -> jax.Array:
    return lax.concatenate(xs, int(dimension))


def _stack_map(shapes: Any, *, axis: Any, **_: Any) -> DimMap:
    """``jnp.stack`` (jax's ``stack`` primitive): operands of one shape, a new dim of
    their count at ``axis`` (replicated: each operand is one slice of it)."""
    op = "stack"
    if not shapes or any(tuple(s) != tuple(shapes[0]) for s in shapes):
        raise _err(op, "one or more operands of one shape", str(shapes), "stack equal shapes")
    shape = tuple(shapes[0])
    d = _dim(op, "axis", axis, len(shape) + 1)
    f = _names("d", shape)
    out_f = (*f[:d], None, *f[d:])
    out_s = (*shape[:d], len(shapes), *shape[d:])
    return DimMap(tuple(tuple(f) for _ in shapes), (out_f,), (out_s,), (True,) * len(shapes))


def _stack(*xs: jax.Array, axis: Any, **_: Any) -> jax.Array:
    return jnp.stack(xs, int(axis))


def _unstack_map(shapes: Any, *, axis: Any, **_: Any) -> DimMap:
    """``lax.unstack`` (the transpose of ``stack``): one output per slice of the
    operand's dim ``axis``, which is dropped (replicated: each output is one slice)."""
    (shape,) = shapes
    d = _dim("unstack", "axis", axis, len(shape))
    f = _names("d", shape)
    out_f = (*f[:d], *f[d + 1 :])
    out_s = (*shape[:d], *shape[d + 1 :])
    f[d] = None
    return DimMap((tuple(f),), tuple(out_f for _ in range(shape[d])), (out_s,) * shape[d], (True,))


def _unstack(x: jax.Array, *, axis: Any, **_: Any) -> tuple[jax.Array, ...]:
    return tuple(lax.unstack(x, axis=int(axis)))


def _split_map(shapes: Any, *, sizes: Any, axis: Any, **_: Any) -> DimMap:
    (shape,) = shapes
    d = _dim("split", "axis", axis, len(shape))
    parts = _ints("split", "sizes", sizes)
    if sum(parts) != shape[d] or any(n < 0 for n in parts):
        raise _err(
            "split",
            "sizes add up to the split dim",
            f"{parts} for {shape[d]}",
            "pass non-negative sizes summing to the dim",
        )
    f = _names("d", shape)
    f[d] = None
    outs = tuple(tuple(n if k == d else s for k, s in enumerate(shape)) for n in parts)
    return DimMap((tuple(f),), tuple(tuple(f) for _ in parts), outs, (True,))


def _split(x: jax.Array, *, sizes: Any, axis: Any, **_: Any) -> tuple[jax.Array, ...]:
    return tuple(lax.split(x, tuple(int(n) for n in sizes), axis=int(axis)))


def _full_range(n: int, start: int, limit: int, stride: int) -> bool:
    return start == 0 and limit == n and (stride == 1 or n <= 1)


def _slice_map(
    shapes: Any, *, start_indices: Any, limit_indices: Any, strides: Any = None, **_: Any
) -> DimMap:
    (shape,) = shapes
    r = len(shape)
    start = _ints("slice", "start_indices", start_indices, r)
    limit = _ints("slice", "limit_indices", limit_indices, r)
    step = (1,) * r if strides is None else _ints("slice", "strides", strides, r)
    if (
        any(not 0 <= a <= b <= n for a, b, n in zip(start, limit, shape, strict=True))
        or min(step, default=1) < 1
    ):
        raise _err(
            "slice",
            "0 <= start <= limit <= size and strides >= 1",
            f"{start}, {limit}, {step} on {shape}",
            "pass bounds inside the operand",
        )
    f = _names("d", shape)
    full = [_full_range(*z) for z in zip(shape, start, limit, step, strict=True)]
    f = [g if ok else None for g, ok in zip(f, full, strict=True)]
    out = tuple(-(-(b - a) // s) for a, b, s in zip(start, limit, step, strict=True))
    # a slice that drops elements passes no sum: XLA reduces the operand first
    return DimMap((tuple(f),), (tuple(f),), (out,), (True,), sum_ok=out == tuple(shape))


def _slice(
    x: jax.Array, *, start_indices: Any, limit_indices: Any, strides: Any = None, **_: Any
) -> jax.Array:
    return lax.slice(
        x,
        tuple(int(i) for i in start_indices),
        tuple(int(i) for i in limit_indices),
        None if strides is None else tuple(int(i) for i in strides),
    )


def _slice_local(attrs: Mapping[str, Any], lctx: LocalContext) -> Mapping[str, Any]:
    spec = lctx.inputs[0]
    local = lctx.local_shape(spec)
    limit = list(_ints("slice", "limit_indices", attrs["limit_indices"]))
    for d, axes in enumerate(spec.dims):
        if axes:  # a kept dim is the full range: [0, local size)
            limit[d] = local[d]
    return {**attrs, "limit_indices": tuple(limit)}


def _dynamic_slice_map(shapes: Any, *, slice_sizes: Any, **_: Any) -> DimMap:
    op = "dynamic_slice"
    shape, *idx = shapes
    sizes = _ints(op, "slice_sizes", slice_sizes, len(shape))
    if len(idx) != len(shape) or any(s != () for s in idx):
        raise _err(op, "one scalar index per operand dim", str(shapes), "pass x, *indices")
    if any(not 0 <= s <= n for s, n in zip(sizes, shape, strict=True)):
        raise _err(
            op,
            "0 <= slice_sizes <= operand dims",
            f"{sizes} of {shape}",
            "pass slice_sizes within the operand",
        )
    f = [g if s == n else None for g, s, n in zip(_names("d", shape), sizes, shape, strict=True)]
    return DimMap(
        (tuple(f), *(() for _ in idx)),
        (tuple(f),),
        (sizes,),
        (True, *(False,) * len(idx)),
        sum_ok=sizes == tuple(shape),  # as slice: XLA reduces the operand first
    )


def _dynamic_slice(x: jax.Array, *idx: jax.Array, slice_sizes: Any, **_: Any) -> jax.Array:
    return lax.dynamic_slice(x, idx, tuple(int(s) for s in slice_sizes))


def _dynamic_slice_local(attrs: Mapping[str, Any], lctx: LocalContext) -> Mapping[str, Any]:
    spec = lctx.inputs[0]
    local = lctx.local_shape(spec)
    sizes = [
        local[d] if axes else int(n)
        for d, (axes, n) in enumerate(zip(spec.dims, attrs["slice_sizes"], strict=True))
    ]
    return {**attrs, "slice_sizes": tuple(sizes)}


def _dus_map(shapes: Any, **_: Any) -> DimMap:
    op = "dynamic_update_slice"
    if len(shapes) < 2:
        raise _err(op, "operand, update, *indices", str(shapes), "pass x, update, *indices")
    shape, upd, *idx = shapes
    if len(upd) != len(shape) or any(u > n for u, n in zip(upd, shape, strict=True)):
        raise _err(
            op,
            "update fits inside the operand",
            f"{upd} into {shape}",
            "pass an update of the operand's rank, no larger",
        )
    if len(idx) != len(shape) or any(s != () for s in idx):
        raise _err(op, "one scalar index per operand dim", str(shapes), "pass x, update, *indices")
    f = tuple(g if u == n else None for g, u, n in zip(_names("d", shape), upd, shape, strict=True))
    return DimMap(
        (f, f, *(() for _ in idx)), (f,), (tuple(shape),), (True, True, *(False,) * len(idx))
    )


def _dynamic_update_slice(x: jax.Array, update: jax.Array, *idx: jax.Array, **_: Any) -> jax.Array:
    return lax.dynamic_update_slice(x, update, idx)


def _pad_map(shapes: Any, *, padding_config: Any, **_: Any) -> DimMap:
    op = "pad"
    if len(shapes) != 2 or shapes[1] != ():
        raise _err(op, "operand and a scalar padding value", str(shapes), "pass x, padding_value")
    shape = shapes[0]
    try:
        cfg = [tuple(int(v) for v in c) for c in padding_config]
    except TypeError as e:
        raise _err(
            op,
            "padding_config is ((lo, hi, interior), ...)",
            repr(padding_config),
            "pass the lax.pad padding_config",
        ) from e
    if len(cfg) != len(shape) or any(len(c) != 3 or c[2] < 0 for c in cfg):
        raise _err(
            op,
            "one (lo, hi, interior >= 0) per dim",
            repr(padding_config),
            "pass one triple per operand dim",
        )
    out = tuple(
        n + lo + hi + max(n - 1, 0) * it for n, (lo, hi, it) in zip(shape, cfg, strict=True)
    )
    if any(n < 0 for n in out):
        raise _err(
            op,
            "negative padding leaves a non-negative size",
            str(out),
            "crop less with negative padding",
        )
    f = tuple(g if c == (0, 0, 0) else None for g, c in zip(_names("d", shape), cfg, strict=True))
    return DimMap((f, ()), (f,), (out,), (True, True))


def _pad(x: jax.Array, padding_value: jax.Array, *, padding_config: Any, **_: Any) -> jax.Array:
    cfg = tuple(tuple(int(v) for v in c) for c in padding_config)
    return lax.pad(x, padding_value.astype(x.dtype), cfg)


def _dnums(dimension_numbers: Any) -> lax.GatherDimensionNumbers:
    if isinstance(dimension_numbers, lax.GatherDimensionNumbers):
        return dimension_numbers
    if isinstance(dimension_numbers, Mapping):
        return lax.GatherDimensionNumbers(**dimension_numbers)
    return lax.GatherDimensionNumbers(*dimension_numbers)


def _sum_passes_fill(mode: Any, fill_value: Any) -> bool:
    """A sum partial passes unless out-of-bounds reads fill with a finite non-zero value."""
    if lax.GatherScatterMode.from_any(mode) != lax.GatherScatterMode.FILL_OR_DROP:
        return True
    if fill_value is None:
        return True  # NaN for floats, the only dtypes that carry partials
    v = float(fill_value)
    return v == 0 or not math.isfinite(v)


def _gather_map(
    shapes: Any,
    *,
    dimension_numbers: Any,
    slice_sizes: Any,
    mode: Any = None,
    fill_value: Any = None,
    **_: Any,
) -> DimMap:
    op = "gather"
    if len(shapes) != 2:
        raise _err(op, "operand and indices", str(shapes), "pass x, indices")
    shape, ishape = shapes
    dn = _dnums(dimension_numbers)
    sizes = _ints(op, "slice_sizes", slice_sizes, len(shape))
    if not ishape or ishape[-1] != len(dn.start_index_map):
        raise _err(
            op,
            "indices end in a vector of len(start_index_map)",
            str(ishape),
            "add the trailing index-vector dim to indices",
        )
    collapsed = set(dn.collapsed_slice_dims)
    obatch = list(dn.operand_batching_dims)
    ibatch = list(dn.start_indices_batching_dims)
    offset_src = [d for d in range(len(shape)) if d not in collapsed and d not in obatch]
    if len(offset_src) != len(dn.offset_dims) or len(obatch) != len(ibatch):
        raise _err(
            op,
            "dimension numbers consistent with the operand rank",
            repr(dn),
            "pass the dimension numbers the gather primitive was built with",
        )
    out_rank = len(ishape) - 1 + len(offset_src)
    fx: list[str | None] = [None] * len(shape)
    fi: list[str | None] = [f"i{k}" if n > 1 else None for k, n in enumerate(ishape[:-1])]
    fi.append(None)
    for od, idd in zip(obatch, ibatch, strict=True):
        if shape[od] != ishape[idd]:
            raise _err(
                op,
                "batching dims agree",
                f"{shape} / {ishape}",
                "make operand and index batching dims equal",
            )
        fx[od] = fi[idd]
    indexed = set(dn.start_index_map)
    out_f: list[str | None] = [None] * out_rank
    out_s = [0] * out_rank
    for od, d in zip(dn.offset_dims, offset_src, strict=True):
        out_s[od] = sizes[d]
        if d not in indexed and sizes[d] == shape[d] and shape[d] > 1:
            fx[d] = out_f[od] = f"x{d}"
    rest = [j for j in range(out_rank) if j not in set(dn.offset_dims)]
    for j, k in zip(rest, range(len(ishape) - 1), strict=True):
        out_f[j], out_s[j] = fi[k], ishape[k]
    return DimMap(
        (tuple(fx), tuple(fi)),
        (tuple(out_f),),
        (tuple(out_s),),
        (True, False),
        sum_ok=False,  # XLA reduces the operand first (module docstring)
    )


def _gather(
    x: jax.Array,
    indices: jax.Array,
    *,
    dimension_numbers: Any,
    slice_sizes: Any,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    mode: Any = None,
    fill_value: Any = None,
    **_: Any,
) -> jax.Array:
    return lax.gather(
        x,
        indices,
        _dnums(dimension_numbers),
        tuple(int(s) for s in slice_sizes),
        indices_are_sorted=indices_are_sorted,
        unique_indices=unique_indices,
        mode=mode,
        fill_value=fill_value,
    )


def _gather_local(attrs: Mapping[str, Any], lctx: LocalContext) -> Mapping[str, Any]:
    spec = lctx.inputs[0]
    local = lctx.local_shape(spec)
    sizes = [
        local[d] if axes and n == spec.shape[d] else int(n)
        for d, (axes, n) in enumerate(zip(spec.dims, attrs["slice_sizes"], strict=True))
    ]
    return {**attrs, "slice_sizes": tuple(sizes)}


def _take_along_map(
    shapes: Any, *, axis: Any, mode: Any = None, fill_value: Any = None, **_: Any
) -> DimMap:
    op = "take_along_axis"
    if len(shapes) != 2 or len(shapes[0]) != len(shapes[1]):
        raise _err(op, "arr and indices of equal rank", str(shapes), "pass arr, indices")
    shape, ishape = shapes
    d = _dim(op, "axis", axis, len(shape))
    out = []
    fa: list[str | None] = []
    fi: list[str | None] = []
    for k, (n, m) in enumerate(zip(shape, ishape, strict=True)):
        if k == d:
            fa.append(None)
            fi.append(f"i{k}" if m > 1 else None)
            out.append(m)
            continue
        if n != m and 1 not in (n, m):
            raise _err(
                op,
                "arr and indices broadcast off the axis",
                str(shapes),
                "make the other dims equal or 1",
            )
        size = max(n, m)
        out.append(size)
        fa.append(f"d{k}" if n == size > 1 else None)
        fi.append(f"d{k}" if m == size > 1 else None)
    out_f = tuple(fi[k] if k == d else (f"d{k}" if out[k] > 1 else None) for k in range(len(out)))
    mode_ok = _sum_passes_fill(mode, fill_value)
    return DimMap((tuple(fa), tuple(fi)), (out_f,), (tuple(out),), (True, False), sum_ok=mode_ok)


def _take_along_axis(
    arr: jax.Array,
    indices: jax.Array,
    *,
    axis: Any,
    mode: Any = None,
    fill_value: Any = None,
    **_: Any,
) -> jax.Array:
    return jnp.take_along_axis(arr, indices, axis=int(axis), mode=mode, fill_value=fill_value)


# ---------------------------------------------------------------------------
# Registry entries (alphabetical)
# ---------------------------------------------------------------------------

_F, _I = "float32", "int32"


def _example(shapes: Any, **kw: Any) -> Example:
    """Every example has a dim of 6 or 3, which 4 (and 4 of 8) does not divide: uneven cases."""
    return Example(shapes, uneven=True, **kw)


def _rev_notation(shapes: tuple[tuple[int, ...], ...], *, dimensions: Any) -> Notation:
    return along_notation(shapes, along=tuple(dimensions))


def _rev(x: jax.Array, *, dimensions: Any) -> jax.Array:
    return lax.rev(x, tuple(dimensions))


#: The rules of primitives the library has no op of its own for (``jnp.flip``).
PRIMITIVE_RULES = (
    FactorRule(
        "rev",
        _rev_notation,
        impl=_rev,
        partial="LINEAR",
        examples=(
            Example(((8, 8),), attrs={"dimensions": (0,)}),
            Example(((4, 8, 2),), attrs={"dimensions": (1, 2)}),
        ),
        doc="reverses the dims listed (jnp.flip); they stay unsharded, the rest pass, "
        "every pending reduction passes (a permutation of elements)",
    ),
)

RULES = (
    *PRIMITIVE_RULES,
    LocalMapRule(
        "broadcast_in_dim",
        _broadcast_map,
        impl=_broadcast,
        local_attrs=_broadcast_local,
        examples=(_example(((6, 1),), attrs={"shape": (2, 6, 4), "broadcast_dimensions": (1, 2)}),),
        doc="operand dims map to their output dims; new and broadcast dims replicated",
    ),
    MapRule(
        "concatenate",
        _concat_map,
        impl=_concatenate,
        examples=(_example(((6, 4), (6, 2)), attrs={"dimension": 1}),),
        doc="concat dim replicated; other dims merge; partials pass when all operands carry them",
    ),
    LocalMapRule(
        "dynamic_slice",
        _dynamic_slice_map,
        impl=_dynamic_slice,
        local_attrs=_dynamic_slice_local,
        examples=(
            _example(
                ((6, 8), (), ()),
                attrs={"slice_sizes": (6, 4)},
                dtypes=(_F, _I, _I),
                differentiable=(True, False, False),
            ),
        ),
        doc="sliced dims replicated, full dims keep sharding; indices replicated",
    ),
    MapRule(
        "dynamic_update_slice",
        _dus_map,
        impl=_dynamic_update_slice,
        examples=(
            _example(
                ((6, 8), (6, 3), (), ()),
                dtypes=(_F, _F, _I, _I),
                differentiable=(True, True, False, False),
            ),
        ),
        doc="updated (partial-range) dims replicated; full dims shared by operand and update",
    ),
    MapRule(
        "expand_dims",
        _expand_map,
        impl=_expand_dims,
        examples=(_example(((6, 4),), attrs={"dimensions": (0, 2)}),),
        doc="jnp.expand_dims: new size-1 dims replicated, the others keep their sharding",
    ),
    LocalMapRule(
        "gather",
        _gather_map,
        impl=_gather,
        local_attrs=_gather_local,
        examples=(
            _example(
                ((8, 6), (4, 1)),
                attrs={
                    "dimension_numbers": lax.GatherDimensionNumbers(
                        offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
                    ),
                    "slice_sizes": (1, 6),
                    "mode": lax.GatherScatterMode.CLIP,
                },
                dtypes=(_F, _I),
                differentiable=(True, False),
            ),
        ),
        doc="indexed dims replicated; index batch dims and whole offset dims keep sharding",
    ),
    MapRule(
        "pad",
        _pad_map,
        impl=_pad,
        # rtol: the padding value's grad sums ~30 cotangent elements of split partials
        examples=(
            _example(((6, 4), ()), attrs={"padding_config": ((0, 0, 0), (1, 2, 1))}, rtol=1e-4),
        ),
        doc="padded dims replicated; partials pass when operand and padding value carry them",
    ),
    ReshapeRule(
        examples=(
            _example(((4, 6),), attrs={"new_sizes": (24,), "dimensions": None}),
            _example(((6, 8),), attrs={"new_sizes": (6, 2, 4), "dimensions": None}),
        )
    ),
    LocalMapRule(
        "slice",
        _slice_map,
        impl=_slice,
        local_attrs=_slice_local,
        examples=(
            _example(
                ((6, 8),),
                attrs={"start_indices": (0, 1), "limit_indices": (6, 7), "strides": (1, 2)},
            ),
        ),
        doc="partly read dims replicated; full-range dims keep sharding",
    ),
    MapRule(
        "split",
        _split_map,
        impl=_split,
        examples=(_example(((6, 8),), attrs={"sizes": (2, 6), "axis": 1}),),
        doc="split dim replicated; other dims keep sharding in every piece",
    ),
    MapRule(
        "stack",
        _stack_map,
        impl=_stack,
        examples=(_example(((6, 4), (6, 4), (6, 4)), attrs={"axis": 1}),),
        doc="jnp.stack: the new dim replicated; the operands' dims merge; partials pass "
        "when all operands carry them",
    ),
    MapRule(
        "unstack",
        _unstack_map,
        impl=_unstack,
        examples=(_example(((6, 3, 4),), attrs={"axis": 1}),),
        doc="the transpose of stack: the unstacked dim replicated; the others keep "
        "their sharding in every output",
    ),
    MapRule(
        "squeeze",
        _squeeze_map,
        impl=_squeeze,
        examples=(_example(((6, 1, 4),), attrs={"dimensions": (1,)}),),
        doc="drops size-1 dims; the others keep their sharding",
    ),
    MapRule(
        "take_along_axis",
        _take_along_map,
        impl=_take_along_axis,
        examples=(
            _example(
                ((4, 6), (4, 3)),
                attrs={"axis": 1},
                dtypes=(_F, _I),
                differentiable=(True, False),
            ),
        ),
        doc="jnp.take_along_axis: the axis of arr replicated; other dims follow indices/arr",
    ),
    MapRule(
        "transpose",
        _transpose_map,
        impl=_transpose,
        examples=(_example(((6, 4, 2),), attrs={"permutation": (2, 0, 1)}),),
        doc="permutes the dims' layouts",
    ),
)

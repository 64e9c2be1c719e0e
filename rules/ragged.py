"""Grouped GEMM: ``lax.ragged_dot`` and its primitive ``ragged_dot_general``.

``ragged_dot(lhs[m, k], rhs[g, k, n], group_sizes[g]) -> out[m, n]``: the rows of
``lhs`` come in ``g`` contiguous groups (group ``i`` has ``group_sizes[i]`` rows,
starting after the groups before it) and group ``i`` is multiplied by
``rhs[i]``; rows past ``sum(group_sizes)`` are zero. It is how a mixture of
experts runs its experts on tokens sorted by expert (MaxText's ``sparse_matmul``,
megablox, Megatron-LM's grouped GEMM). A train step holds the primitive in two
modes (``ragged_dot_dimension_numbers``):

* *ragged free dim* (the forward, and the lhs cotangent ``dout @ rhs[i]ᵀ``):
  ``lhs [b… m… k…], rhs [G b… k… n…], group_sizes [b… x… G] -> [b… m… n…]``,
  the ragged dim one of lhs's free dims ``m…`` (``x…``: those outer to it);
* *ragged contracting dim* (the rhs cotangent ``lhs[group]ᵀ @ dout[group]``):
  ``lhs [b… m… k…], rhs [b… k… n…], group_sizes [b… x… G] -> [G b… m… n…]``,
  the ragged dim one of the contracted dims ``k…``.

Algebra. A dim is named by a factor as in ``dot_general`` (:mod:`spmdkit.rules.matmul`):
batch dims ``b``, free dims ``m`` and ``n`` pass through, contracted dims ``k``
are reduction factors (sharded on both operands: each device multiplies its
slices, the output is sum-partial). The op is linear in each of lhs and rhs, so
one sum-partial operand times a replicated one stays sum-partial. The group
count ``G`` and the ragged dim need more:

* ``G`` sharded (expert parallel). Each device holds the weights of a block of
  groups. In the ragged-free-dim mode ``G`` is a reduction factor: a device
  computes the rows of its own groups and zeros elsewhere; every row belongs to
  one group, so the sum over the ``G`` axes of the devices' results is the full
  result: the output is sum-partial over them (lhs replicated over them). In the
  ragged-contracting mode ``G`` is the output's leading dim: each device computes
  the per-group products of its own groups, the output is ``G``-sharded.
* The ragged dim sharded (tokens split over devices). A device holds rows
  ``[r0, r0 + block)``; groups are contiguous, so the rows of each group it
  holds are the intersection of the group's rows with its block, and those
  intersections are again contiguous and in order. Computed from the *global*
  ``group_sizes``, they give the local group sizes exactly: no communication.
  In the ragged-free-dim mode the dim passes through (rows stay where they
  are); in the ragged-contracting mode it is a reduction factor (each device
  sums its own rows' products per group; the output is sum-partial).

Both need the global ``group_sizes`` along ``G`` on every device (a group's
first row is the sum of the sizes before it), so ``group_sizes`` is replicated
along its group dim (its other dims follow the lhs dims they index; it is tiny
and never decides a layout). Each device then runs ``ragged_dot_general`` on
its pieces with its local groups plus two groups of zero weights (or dropped
products), one for the rows before its first local row and one for the rows
after its last. Uneven blocks are padded with zeros (a zero row or weight adds
nothing) and the outputs' padding is zeroed.

The ragged-batch mode (``group_sizes`` over a batch dim) and ``group_offset``
are not covered: jax neither differentiates nor partitions them, and the rule
raises, so the planner counts the equation replicated with a note.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmdkit.engine.factor import Notation
from spmdkit.engine.factor_rule import FactorRule
from spmdkit.engine.rule import (
    Example,
    Inferred,
    InferredGrad,
    LocalContext,
    RuleContext,
    without_strategy,
)
from spmdkit.errors import ShardingConflictError
from spmdkit.spec import TensorSpec

__all__ = ["RULES", "RaggedDotRule", "group_sizes_values", "ragged_dot_notation"]

OP = "ragged_dot_general"

#: The factor of the group count (rhs's group dim, ``group_sizes``'s last dim and,
#: in the ragged-contracting mode, the output's leading dim).
GROUPS = "G"

#: ``lax.ragged_dot``'s dimension numbers, and those of its two cotangents.
FORWARD = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)
LHS_COTANGENT = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)
RHS_COTANGENT = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(),
)


def _fail(must: str, given: str, fix: str) -> ShardingConflictError:
    return ShardingConflictError(op=OP, must=must, given=given, fix=fix)


def _parts(dn: Any, ranks: tuple[int, int]) -> tuple[Any, ...]:
    """(lhs contracting, rhs contracting, lhs batch, rhs batch, ragged dim, rhs group
    dims, ragged mode: ``"free"`` or ``"contracting"``)."""
    try:
        (lc, rc), (lb, rb) = dn.dot_dimension_numbers
        (ragged,) = dn.lhs_ragged_dimensions
        group = tuple(dn.rhs_group_dimensions)
    except (AttributeError, TypeError, ValueError) as e:
        raise _fail(
            "ragged_dot_dimension_numbers is a lax.RaggedDotDimensionNumbers with one ragged dim",
            f"{dn!r} ({e})",
            "pass the attributes of the ragged_dot_general equation",
        ) from e
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    if ragged in lc and not group:
        mode = "contracting"
    elif ragged not in lc and ragged not in lb and len(group) == 1 and 0 <= ragged < ranks[0]:
        mode = "free"
    else:
        raise _fail(
            "the ragged dim is a free or contracting dim of lhs (ragged_dot and its grads)",
            f"ragged dim {ragged} with dimension numbers {dn.dot_dimension_numbers} "
            f"and rhs group dims {group}",
            "the ragged-batch mode has no rule: it runs replicated",
        )
    return lc, rc, lb, rb, ragged, group, mode


def ragged_dot_notation(
    shapes: tuple[tuple[int, ...], ...],
    *,
    ragged_dot_dimension_numbers: Any,
    group_offset: Any = None,
    **_: Any,
) -> Notation:
    """Factor notation of one ``ragged_dot_general`` call (see the module docstring).

    ``group_sizes``'s last dim carries :data:`GROUPS`, which the rule keeps
    unsharded on it whatever the factor gets elsewhere.

    Example::

        >>> str(ragged_dot_notation(((8, 4), (3, 4, 6), (3,)),
        ...                         ragged_dot_dimension_numbers=FORWARD))
        'm0 k0, G k0 n0, G -> m0 n0  [reduce k0,G: sum]'
    """
    if group_offset is not None:
        raise _fail("group_offset is None", repr(group_offset), "jax implements no other")
    if len(shapes) != 3:
        raise _fail(
            "three inputs: lhs, rhs, group_sizes", f"{len(shapes)} inputs", "pass all three"
        )
    lhs, rhs, gs = shapes
    lc, rc, lb, rb, ragged, group, mode = _parts(ragged_dot_dimension_numbers, (len(lhs), len(rhs)))
    lx, ly = ["?"] * len(lhs), ["?"] * len(rhs)
    for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
        lx[a] = ly[b] = f"b{i}"
    for i, (a, b) in enumerate(zip(lc, rc, strict=True)):
        lx[a] = ly[b] = f"k{i}"
    if group:
        ly[group[0]] = GROUPS
    free_l = [d for d in range(len(lhs)) if lx[d] == "?"]
    for i, d in enumerate(free_l):
        lx[d] = f"m{i}"
    free_r = [d for d in range(len(rhs)) if ly[d] == "?"]
    for i, d in enumerate(free_r):
        ly[d] = f"n{i}"
    # group_sizes: [lhs's batch dims, then the free (contracted) dims outer to the ragged one, G]
    if mode == "free":
        prefix = [*lb, *[d for d in free_l if d < ragged]]
    else:
        prefix = [*lb, *[d for d in lc if d < ragged]]
    gdims = (*(lx[d] for d in prefix), GROUPS) if len(gs) > 1 else (GROUPS,)
    if len(gdims) != len(gs):
        raise _fail(
            f"group_sizes has shape [g] or {len(gdims)} dims [batch…, outer…, g]",
            f"shape {gs}",
            "pass the group sizes jax's ragged_dot_general takes",
        )
    out = [f"b{i}" for i in range(len(lb))] + [lx[d] for d in free_l] + [ly[d] for d in free_r]
    if mode == "contracting":
        out = [GROUPS, *out]
    return Notation((tuple(lx), tuple(ly), gdims), (tuple(out),), frozenset(), "sum")


def _reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    ragged_dot_dimension_numbers: Any,
    group_offset: Any = None,
) -> jax.Array:
    """The unsharded op: ``lax.ragged_dot_general`` itself."""
    return lax.ragged_dot_general(
        lhs, rhs, group_sizes, ragged_dot_dimension_numbers=ragged_dot_dimension_numbers
    )


def _local_groups(
    gs: jax.Array, *, row0: Any, rows: int, m: int, group0: Any, groups: int
) -> jax.Array:
    """The group sizes of a device's pieces: ``[before, local groups…, after]``.

    Rows ``[row0, row0 + rows)`` of ``m`` and groups ``[group0, group0 + groups)``
    of the global sizes ``gs`` (``[…, g]``) are held; each local group's rows are its
    global rows clipped to the held ones (contiguous, in order), ``before`` and
    ``after`` the held rows outside the local groups (padding rows included).
    """
    g = gs.shape[-1]
    dt = gs.dtype
    ends = jnp.cumsum(gs, axis=-1, dtype=dt)
    starts = ends - gs
    idx = group0 + jnp.arange(groups)
    valid = idx < g
    pick = jnp.clip(idx, 0, g - 1)
    lo = jnp.asarray(row0, dt)
    hi = jnp.maximum(jnp.minimum(lo + rows, m), lo).astype(dt)
    s = jnp.clip(jnp.take(starts, pick, axis=-1), lo, hi) - lo
    e = jnp.clip(jnp.take(ends, pick, axis=-1), lo, hi) - lo
    sizes = jnp.where(valid, e - s, jnp.zeros((), dt))
    before = jnp.where(valid[0], s[..., 0], jnp.zeros((), dt))
    after = rows - before - jnp.sum(sizes, axis=-1, dtype=dt)
    return jnp.concatenate([before[..., None], sizes, after[..., None]], axis=-1)


def _zero_group(x: jax.Array, dim: int) -> jax.Array:
    shape = list(x.shape)
    shape[dim] = 1
    return jnp.zeros(shape, x.dtype)


class RaggedDotRule(FactorRule):
    """``ragged_dot_general`` in its ragged-free-dim and ragged-contracting modes:
    :func:`ragged_dot_notation`'s factors, ``group_sizes`` replicated along its
    group dim and never bidding, and a local computation that shifts the groups
    to each device's rows and groups (module docstring)."""

    def __init__(self, examples: Sequence[Example]) -> None:
        super().__init__(
            OP,
            ragged_dot_notation,
            impl=_reference,
            partial="MULTIPLICATIVE",
            dtype=_dtype,
            examples=examples,
            doc="lax.ragged_dot_general (grouped GEMM): batch and free dims pass, contracted "
            "dims reduce (sum); G sharded = expert parallel (sum-partial rows of local "
            "groups, or the G-sharded per-group product), the ragged dim sharded = local "
            "group sizes; group_sizes replicated along G",
        )

    def _assign(
        self,
        nt: Notation,
        sources: Sequence[tuple[tuple[str, ...], TensorSpec]],
        start: Mapping[str, tuple[str, ...]] | None = None,
    ) -> dict[str, tuple[str, ...]]:
        """As the factor rule's, with ``group_sizes`` left out of the bidding."""
        bidders = [(dims, s) for dims, s in sources if dims is not nt.inputs[2]]
        return FactorRule._assign(nt, bidders, start)

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
        res = super()._finish(ctx, nt, sizes, inputs, assign, keep_partial=keep_partial)
        gs = res.inputs[2]
        gs = gs.replace(dims=(*gs.dims[:-1], ()), partial={})
        return Inferred((*res.inputs[:2], gs), res.outputs)

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """The factor rule's grad in the ragged-free-dim mode (the op jax differentiates)."""
        attrs = self._notation_attrs(ctx)
        _, _, _, _, _, _, mode = _parts(
            attrs.get("ragged_dot_dimension_numbers"), (inputs[0].ndim, inputs[1].ndim)
        )
        if mode != "free":
            raise _fail(
                "a differentiated ragged_dot_general has its ragged dim free in lhs",
                "the ragged-contracting mode (a ragged_dot's rhs cotangent)",
                "jax has no transpose for it: differentiate ragged_dot, not its grad",
            )
        return super().grad(ctx, inputs, out_grads)

    def padding_fills(self, lctx: LocalContext) -> tuple[Any, ...] | None:
        """Zeros in every padded block (a zero row or weight adds nothing to a group's
        product, and a zero group size holds no row)."""
        specs = (*lctx.inputs, *lctx.outputs)
        even = (
            not s.dims[d] or n % lctx.shards(s, d) == 0
            for s in specs
            for d, n in enumerate(s.shape)
        )
        if all(even):
            return None
        return (0.0, 0.0, 0)

    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """This device's rows and groups, with a zero group before and after them
        (the equation's ``precision`` and ``preferred_element_type`` kept: the
        enforced replay runs a traced equation so, :mod:`spmdkit.compile.enforce`)."""
        attrs = without_strategy(lctx.attrs)
        dn = attrs["ragged_dot_dimension_numbers"]
        lhs_s, rhs_s, gs_s = lctx.inputs
        *_, ragged, group, mode = _parts(dn, (lhs_s.ndim, rhs_s.ndim))
        g = gs_s.shape[-1]
        if mode == "free":
            gspec, gdim = rhs_s, group[0]
        else:
            gspec, gdim = lctx.outputs[0], 0

        def fn(lhs: jax.Array, rhs: jax.Array, gs: jax.Array) -> jax.Array:
            local = _local_groups(
                gs,
                row0=lctx.offset(lhs_s, ragged),
                rows=lhs.shape[ragged],
                m=lhs_s.shape[ragged],
                group0=lctx.offset(gspec, gdim),
                groups=lctx.block(gspec, gdim) if gspec.dims[gdim] else g,
            )
            call = functools.partial(
                lax.ragged_dot_general,
                ragged_dot_dimension_numbers=dn,
                group_sizes=local,
                precision=attrs.get("precision"),
                preferred_element_type=attrs.get("preferred_element_type"),
            )
            if mode == "free":
                zero = _zero_group(rhs, gdim)
                return call(lhs, jnp.concatenate([zero, rhs, zero], axis=gdim))
            out = call(lhs, rhs)
            return lax.slice_in_dim(out, 1, out.shape[0] - 1, axis=0)

        return self.masked(fn, lctx)


def _dtype(dtypes: tuple[Any, ...], **_: Any) -> Any:
    if dtypes[0] is None or dtypes[1] is None:
        return None
    return jnp.promote_types(dtypes[0], dtypes[1])


def group_sizes_values(
    shapes: tuple[tuple[int, ...], ...], *, rows: int, fill: float = 0.75
) -> Callable[[np.random.Generator], list[np.ndarray]]:
    """``Example.values`` for a ragged dot: random floats for lhs and rhs, and valid
    group sizes of shape ``shapes[2]`` (non-negative, some zero, each ``[…, g]``
    summing to about ``fill · rows`` so some trailing rows belong to no group).

    Example::

        >>> values = group_sizes_values(((8, 4), (3, 4, 6), (3,)), rows=8)
        >>> int(values(np.random.default_rng(0))[2].sum()) <= 8
        True
    """

    def values(rng: np.random.Generator) -> list[np.ndarray]:
        lhs, rhs, gs = shapes
        g = gs[-1]
        total = max(1, int(fill * rows))
        flat = []
        for _ in range(int(np.prod(gs[:-1], dtype=int))):
            cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
            sizes = np.diff(np.concatenate([[0], cuts, [total]]))
            flat.append(sizes)
        return [
            rng.standard_normal(lhs).astype(np.float32),
            rng.standard_normal(rhs).astype(np.float32),
            np.asarray(flat, dtype=np.int32).reshape(gs),
        ]

    return values


def _example(shapes: tuple[tuple[int, ...], ...], dn: Any, rows: int, **kw: Any) -> Example:
    contracting = dn is RHS_COTANGENT
    return Example(
        shapes,
        attrs={"ragged_dot_dimension_numbers": dn},
        dtypes=("float32", "float32", "int32"),
        differentiable=(False, False, False) if contracting else (True, True, False),
        values=group_sizes_values(shapes, rows=rows),
        **kw,
    )


_BATCHED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((2,), (2,)), ((0,), (1,))),
    lhs_ragged_dimensions=(1,),
    rhs_group_dimensions=(0,),
)

_EXAMPLES = (
    _example(((8, 4), (4, 4, 8), (4,)), FORWARD, 8),
    _example(((8, 8), (4, 4, 8), (4,)), LHS_COTANGENT, 8),
    _example(((8, 4), (8, 8), (4,)), RHS_COTANGENT, 8),
    _example(((2, 8, 4), (4, 2, 4, 8), (2, 4)), _BATCHED, 8),
    # Uneven: 7 rows, 3 features, 5 groups, 6 outputs: no dim divides 2, 4 or 8
    _example(((7, 3), (5, 3, 6), (5,)), FORWARD, 7, uneven=True),
    _example(((7, 3), (7, 6), (5,)), RHS_COTANGENT, 7, uneven=True),
)

RULES = (RaggedDotRule(_EXAMPLES),)

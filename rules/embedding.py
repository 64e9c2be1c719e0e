"""Embedding lookup: ``embedding(table, ids)`` → ``table[ids]`` of shape ``ids.shape + (D,)``.

``table`` is ``[V, D]`` (floating point), ``ids`` any shape of integers. Ids
outside ``[0, V)`` give a row of NaN (as ``jnp.take``'s default ``fill`` mode
does; nothing wraps around) and no gradient, on every layout.

Algebra. The lookup is a gather: every output row is one table row, so

* the ids' dims (batch, sequence) pass through to the output's leading dims;
* the table's ``D`` dim passes through to the output's last dim (column-sharded
  table → D-sharded output, no communication);
* the table's ``V`` dim disappears from the output. When it is sharded
  (vocab-parallel), each device looks up only the ids that fall in its row
  block (found from its offset; other ids give zeros) and the output is
  sum-partial over the V axes: exactly one device holds each row, the others
  zero. That is the reference behaviour (an axis that disappears becomes
  partial); resolving it costs one all-reduce of the output, or none when the
  consumer takes it partial (a following matmul, a sum).

When the table and the ids name the same axis, the table wins (the table is
usually far larger than the ids) and the ids are gathered over that axis.

Gradient: the table's grad is a scatter-add of the output cotangent. Each
device adds only the cotangent rows of its own ids, so the grad is sum-partial
over the axes sharding the ids' dims (one all-reduce per step, as for any
data-parallel weight). Vocab-parallel: each device scatter-adds the masked rows
into its own row block, so the grad keeps the table's row sharding and the
backward moves nothing. The grad is linear in the cotangent: a sum/avg-partial
cotangent over an axis the case does not use passes to the grad.

Partials: the gather is linear, so a sum/avg-partial table passes to the output
unchanged (and commutes with the vocab-parallel sum); a max/min-partial table
passes only when V is not sharded (max of a sum is not a sum of maxes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.engine.factor_rule import assign_factors
from spmdkit.engine.rule import (
    Example,
    Inferred,
    InferredGrad,
    LocalContext,
    Rule,
    RuleContext,
    without_strategy,
)
from spmdkit.errors import ShardingConflictError
from spmdkit.spec import TensorSpec

__all__ = ["RULES", "embedding_reference"]

OP = "embedding"
_V, _D = "v", "d"


def _fail(must: str, given: str, fix: str) -> ShardingConflictError:
    return ShardingConflictError(op=OP, must=must, given=given, fix=fix)


def check_embedding(
    table_shape: Sequence[int], ids_shape: Sequence[int], table_dtype: Any, ids_dtype: Any
) -> None:
    """Check the operands of a lookup.

    Raises:
      ShardingConflictError: the table is not ``[V, D]`` floats or the ids are not integers.
    """
    if len(tuple(table_shape)) != 2:
        raise _fail(
            "the table is [V, D]",
            f"table of shape {tuple(table_shape)}",
            "reshape the table to [vocab, features]",
        )
    if table_dtype is not None and not jnp.issubdtype(np.dtype(table_dtype), jnp.floating):
        raise _fail("the table is floating point", str(np.dtype(table_dtype)), "cast the table")
    if ids_dtype is not None and not jnp.issubdtype(np.dtype(ids_dtype), jnp.integer):
        raise _fail(
            "ids are integers",
            f"ids of dtype {np.dtype(ids_dtype)} and shape {tuple(ids_shape)}",
            "cast them with .astype(jnp.int32)",
        )


def embedding_reference(table: jax.Array, ids: jax.Array) -> jax.Array:
    """The unsharded op (the rule's ``impl``): ``table[ids]``, NaN rows for bad ids."""
    check_embedding(table.shape, ids.shape, table.dtype, ids.dtype)
    v = table.shape[0]
    bad = (ids < 0) | (ids >= v)
    rows = jnp.take(table, jnp.clip(ids, 0, v - 1), axis=0)
    return jnp.where(bad[..., None], jnp.nan, rows)


class EmbeddingRule(Rule):
    """``embedding``: row-, column- or un-sharded table; ids sharded on any dims."""

    name = OP
    impl = staticmethod(embedding_reference)
    strategies = ("default",)
    doc = "table[ids]; a vocab-sharded table gives a sum-partial output"

    def __init__(self, examples: Sequence[Example] = ()) -> None:
        self.examples = tuple(examples)

    # -- layout ------------------------------------------------------------
    def _check(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]
    ) -> tuple[TensorSpec, TensorSpec]:
        self.strategy(ctx)
        extra = sorted(without_strategy(ctx.attrs))
        if extra:
            raise _fail("no attributes besides strategy", str(extra), "drop them")
        if len(inputs) != 2:
            raise _fail("two inputs: table and ids", f"{len(inputs)} inputs", "pass (table, ids)")
        table, ids = inputs
        check_embedding(table.shape, ids.shape, table.dtype, ids.dtype)
        return table, ids

    @staticmethod
    def _assign(
        ids: TensorSpec,
        sources: Sequence[tuple[list[Any], TensorSpec]],
        start: dict[Any, tuple[str, ...]] | None = None,
    ) -> dict[Any, tuple[str, ...]]:
        """:func:`~spmdkit.engine.factor_rule.assign_factors` over V, D, then the ids' dims."""
        return assign_factors(sources, order=(_V, _D, *range(ids.ndim)), start=start)

    @staticmethod
    def _sources(table: TensorSpec, ids: TensorSpec) -> list[tuple[list[Any], TensorSpec]]:
        return [([_V, _D], table), (list(range(ids.ndim)), ids)]

    @staticmethod
    def _specs(
        table: TensorSpec, ids: TensorSpec, assign: dict[Any, tuple[str, ...]]
    ) -> tuple[tuple[TensorSpec, TensorSpec], TensorSpec]:
        used = {a for axes in assign.values() for a in axes}
        vocab = assign[_V]
        passing = {
            a: op
            for a, op in table.partial
            if a not in used and (op in ("sum", "avg") or not vocab)
        }
        if len(set(passing.values()) - {"sum", "avg"}) and len(set(passing.values())) > 1:
            passing = {a: op for a, op in passing.items() if op in ("sum", "avg")}
        req = (
            TensorSpec(table.shape, (vocab, assign[_D]), partial=passing, dtype=table.dtype),
            TensorSpec(ids.shape, [assign[j] for j in range(ids.ndim)], dtype=ids.dtype),
        )
        out = TensorSpec(
            (*ids.shape, table.shape[1]),
            [*(assign[j] for j in range(ids.ndim)), assign[_D]],
            partial={**passing, **{a: "sum" for a in vocab}},
            dtype=table.dtype,
        )
        return req, out

    # -- the three inferences ----------------------------------------------
    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """V, D from the table; the ids' dims from the ids; V sharded → sum-partial output."""
        table, ids = self._check(ctx, inputs)
        req, out = self._specs(table, ids, self._assign(ids, self._sources(table, ids)))
        return Inferred(req, (out,))

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """The ids' dims and D from the output; a sum-partial output axis shards V."""
        table, ids = self._check(ctx, inputs)
        (out,) = self._outputs(table, ids, outputs, "outputs")
        factors = [*range(ids.ndim), _D]
        assign = self._assign(ids, [(factors, out)])
        used = {a for axes in assign.values() for a in axes}
        vocab = tuple(a for a, op in out.partial if op == "sum" and a not in used)
        if vocab and table.shape[0] > 1:
            assign[_V] = vocab
        req, res = self._specs(table.without_partial(), ids, assign)
        return Inferred(req, (res,))

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """The forward layout, ids' dims and D it left free take the cotangent's; the
        table grad is sum-partial over the ids' axes, row-sharded like the table."""
        table, ids = self._check(ctx, inputs)
        (g,) = self._outputs(table, ids, out_grads, "out_grads")
        plain = (table.without_partial(), ids)
        assign = self._assign(ids, self._sources(*plain))
        start = {f: a for f, a in assign.items() if a or f == _V}
        assign = self._assign(ids, [([*range(ids.ndim), _D], g)], start)
        req, out = self._specs(*plain, assign)
        used = {a for axes in assign.values() for a in axes}
        g_partial = {a: op for a, op in g.partial if a not in used and op in ("sum", "avg")}
        req_g = TensorSpec(g.shape, out.dims, partial=g_partial, dtype=g.dtype)
        summed = {a: "sum" for j in range(ids.ndim) for a in assign[j]}
        d_table = req[0].replace(partial={**summed, **g_partial})
        return InferredGrad(req, (req_g,), (d_table, req[1]), (out,))

    @staticmethod
    def _outputs(
        table: TensorSpec, ids: TensorSpec, given: Sequence[TensorSpec], what: str
    ) -> tuple[TensorSpec]:
        want = (*ids.shape, table.shape[1])
        if len(given) != 1 or given[0].shape != want:
            raise _fail(
                f"{what} are one tensor of shape {want}",
                str([g.shape for g in given]),
                f"pass {what} with the lookup's shape ids.shape + (D,)",
            )
        return (given[0],)

    # -- the local computation ---------------------------------------------
    def local_fn(self, lctx: LocalContext) -> Any:
        """Masked lookup in this device's row block; autodiff scatter-adds locally."""
        table_spec, ids_spec = lctx.inputs
        vocab = table_spec.dims[0]
        v = table_spec.shape[0]

        def fn(table: jax.Array, ids: jax.Array) -> jax.Array:
            block = table.shape[0]
            local = ids - lctx.offset(table_spec, 0)
            hit = (local >= 0) & (local < block) & (ids < v)
            for d in range(ids_spec.ndim):
                n = ids_spec.shape[d]
                if ids_spec.dims[d] and n % lctx.shards(ids_spec, d):
                    pos = jnp.arange(ids.shape[d]) + lctx.offset(ids_spec, d)
                    shape = [-1 if k == d else 1 for k in range(ids.ndim)]
                    hit = hit & (pos < n).reshape(shape)
            rows = jnp.take(table, jnp.clip(local, 0, block - 1), axis=0)
            out = jnp.where(hit[..., None], rows, jnp.zeros((), table.dtype))
            bad = (ids < 0) | (ids >= v)
            if vocab:
                bad = bad & (lctx.index(vocab) == 0)
            return jnp.where(bad[..., None], jnp.nan, out)

        return fn


def _values(table: tuple[int, int], ids: tuple[int, ...]):
    def values(rng: np.random.Generator) -> list[np.ndarray]:
        return [
            rng.standard_normal(table).astype(np.float32),
            rng.integers(0, table[0], size=ids).astype(np.int32),
        ]

    return values


_EXAMPLES = (
    Example(
        ((8, 4), (4, 2)),
        dtypes=("float32", "int32"),
        differentiable=(True, False),
        values=_values((8, 4), (4, 2)),
    ),
    Example(
        ((6, 3), (3,)),
        dtypes=("float32", "int32"),
        differentiable=(True, False),
        values=_values((6, 3), (3,)),
    ),
    # Uneven: no dim (7 vocab rows, 3 features, 5×3 ids) divides 2, 4 or 8, so every
    # sharded dim has padded blocks (with 8 shards some blocks are padding only).
    Example(
        ((7, 3), (5, 3)),
        dtypes=("float32", "int32"),
        differentiable=(True, False),
        values=_values((7, 3), (5, 3)),
        uneven=True,
    ),
)

RULES = (EmbeddingRule(_EXAMPLES),)

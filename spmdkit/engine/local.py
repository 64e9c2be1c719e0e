"""Run a rule's per-device computation as one ``shard_map`` program.

This is where a rule *governs* execution instead of predicting it: the inputs
arrive laid out as the rule requires, every device runs
:meth:`spmdkit.engine.rule.Rule.local_fn` on its pieces (with exactly the collectives
that function contains), and the outputs leave laid out as the rule claims.
Pending reductions (partial outputs) are resolved inside the program with
``psum`` / ``pmax`` / ``pmin`` over their axes unless the caller keeps them.

Used by :mod:`spmdkit.ops` (the rule-enforcing ops) and by
:func:`spmdkit.testing.check_jit` for rules with their own local computation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from spmdkit.engine.inference import InferenceResult
from spmdkit.engine.rule import LocalContext, Rule
from spmdkit.errors import ShardingConflictError
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.vma import shard_map, varying_axes

__all__ = [
    "kept_forward_program",
    "kept_spec",
    "local_context",
    "resolve_partials",
    "shard_program",
]

_REDUCERS: dict[str, Callable[..., Any]] = {
    "sum": jax.lax.psum,
    "avg": jax.lax.pmean,
    "max": jax.lax.pmax,
    "min": jax.lax.pmin,
}


def local_context(
    rule: Rule, res: InferenceResult, attrs: Mapping[str, Any], mesh: MeshLike
) -> LocalContext:
    """The :class:`LocalContext` of a forward inference result."""
    return LocalContext(
        op=rule.name,
        attrs=dict(attrs),
        inputs=tuple(res.inputs),
        outputs=tuple(res.outputs),
        axis_sizes=axis_sizes(mesh),
    )


def resolve_partials(y: jax.Array, spec: TensorSpec) -> jax.Array:
    """Reduce a local value over its spec's partial axes (in the spec's order), in
    ``shard_map``. Axes with the same op are reduced together in one collective."""
    groups: list[tuple[str, list[str]]] = []
    for axis, op in spec.partial:
        if groups and groups[-1][0] == op:
            groups[-1][1].append(axis)
        else:
            groups.append((op, [axis]))
    for op, axes in groups:
        y = _REDUCERS[op](y, tuple(axes))
    return y


def _pspec(spec: TensorSpec) -> P:
    return spec.without_partial().to_partition_spec()


def shard_program(
    rule: Rule,
    res: InferenceResult,
    attrs: Mapping[str, Any],
    mesh: MeshLike,
    scattered: Sequence[TensorSpec] | None = None,
) -> Callable[..., Any]:
    """``shard_map`` of the rule's local computation for one inference result.

    Args:
      rule: the rule.
      res: :func:`spmdkit.infer_forward`'s answer for the call (required inputs,
        claimed outputs).
      attrs: the op attributes (``strategy`` included).
      mesh: the mesh the arrays live on.
      scattered: the outputs' layouts where a pending sum is reduce-scattered
        onto a dim instead of all-reduced (each such axis sharding a dim here,
        partial in ``res.outputs``); None: ``res.outputs`` resolved.

    Returns:
      A function of the (global) input arrays returning a tuple of outputs,
      laid out as ``res.outputs`` with their pending reductions resolved (the
      all-reduce the rule's partial output implies runs inside the program), or
      as ``scattered``.

    Raises:
      ShardingConflictError: a required input is partial (shard_map cannot take a
        pending reduction as input) or a sharded dim does not divide.
    """
    for i, s in enumerate((*res.inputs, *res.outputs)):
        if not s.is_even(mesh):
            raise ShardingConflictError(
                op=rule.name,
                must="every sharded dim divides its mesh axes (shard_map needs even pieces)",
                given=f"spec {s} on mesh {dict(axis_sizes(mesh))} (argument {i})",
                fix="pad the dim to a multiple of the axis size, or shard another dim",
            )
    for i, s in enumerate(res.inputs):
        if s.partial:
            raise ShardingConflictError(
                op=rule.name,
                must="inputs of a rule-enforcing op hold whole values (no pending reduction)",
                given=f"input {i} required as {s}",
                fix="resolve the partial value first (sk.reshard to a spec without partial)",
            )
    lctx = local_context(rule, res, attrs, mesh)
    outs = tuple(res.outputs)
    final = tuple(scattered) if scattered is not None else outs

    def body(*xs: jax.Array) -> tuple[jax.Array, ...]:
        ys = rule.local_fn(lctx)(*xs)
        ys = tuple(ys) if isinstance(ys, (tuple, list)) else (ys,)
        return tuple(_resolve_onto(y, o, f) for y, o, f in zip(ys, outs, final, strict=True))

    return shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(_pspec(s) for s in res.inputs),
        out_specs=tuple(_pspec(o) for o in final),
    )


def _resolve_onto(y: jax.Array, spec: TensorSpec, final: TensorSpec) -> jax.Array:
    """Resolve a local value's pending reductions: a sum over an axis ``final``
    shards a dim over (and ``spec`` does not) reduce-scattered onto that dim, the
    rest as :func:`resolve_partials`."""
    pending = dict(spec.partial)
    done: set[str] = set()
    for j, d in enumerate(final.dims):
        new = tuple(a for a in d if pending.get(a) == "sum" and a not in spec.sharding_axes)
        if new:
            y = jax.lax.psum_scatter(y, new, scatter_dimension=j, tiled=True)
            done.update(new)
    rest = spec.replace(partial={a: r for a, r in spec.partial if a not in done})
    return resolve_partials(y, rest)


def kept_spec(axes: Sequence[str]) -> P:
    """The ``PartitionSpec`` a kept residual travels in between a forward and a grad
    region: its local pieces stacked on a leading dim split over ``axes`` (the
    axes it varies over, :class:`~spmdkit.engine.rule.KeptResiduals`)."""
    return P(tuple(axes) if axes else None)


def kept_forward_program(
    rule: Rule,
    res: InferenceResult,
    kept: Any,
    mesh: MeshLike,
    scattered: Sequence[TensorSpec] | None = None,
) -> Callable[..., Any]:
    """:func:`shard_program` of a rule's forward that keeps residuals for its grad
    (``kept``: the rule's :class:`~spmdkit.engine.rule.KeptResiduals`): the outputs
    as :func:`shard_program` returns them, then each residual as a global array of
    its local pieces stacked on a leading dim (:func:`kept_spec`)."""
    outs = tuple(res.outputs)
    final = tuple(scattered) if scattered is not None else outs
    m = len(outs)

    def body(*xs: jax.Array) -> tuple[jax.Array, ...]:
        ys = kept.forward(*xs)
        main = tuple(_resolve_onto(y, o, f) for y, o, f in zip(ys[:m], outs, final, strict=True))
        extra = tuple(
            _varying_over(v, axes)[None] for v, axes in zip(ys[m:], kept.axes, strict=True)
        )
        return (*main, *extra)

    return shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(_pspec(s) for s in res.inputs),
        out_specs=(*(_pspec(o) for o in final), *(kept_spec(a) for a in kept.axes)),
    )


def _varying_over(v: jax.Array, axes: Sequence[str]) -> jax.Array:
    """``v`` typed varying over ``axes`` (a no-op where it already is)."""
    have = varying_axes(v)
    missing = tuple(a for a in axes if a not in have)
    return jax.lax.pcast(v, missing, to="varying") if missing else v

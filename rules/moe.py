"""Routed experts of a mixture-of-experts layer: ``moe_experts(x [T, D], expert_idx [T, k],
weights [T, k], w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]) -> [T, D]``.

Each token ``t`` goes to the experts ``expert_idx[t, :]`` (distinct, as top-k gives
them); expert ``e`` computes the SwiGLU ``(silu(x W_gate[e]) * (x W_up[e])) W_down[e]``
and the token's output is the sum of its experts' outputs weighted by
``weights[t, :]``. Dropless unless ``capacity_factor`` is set: then each expert
takes at most ``C = ceil(capacity_factor * T * k / E)`` assignments, the first
ones in token order (row-major over ``[T, k]``), and the rest contribute nothing;
a token shard ranks its assignments after those of the shards before it, so the
per-expert counts ``[E]`` (int32) are all-gathered over the token axes.
The unsharded reference gathers each token's experts' weights (dense, per token).

Algebra, factor by factor:

* Tokens ``T`` are independent (``x``, ``expert_idx``, ``weights`` and the output
  share their sharding): the batch axes.
* Experts ``E`` (dim 0 of the three weights): expert parallelism. Each device
  holds ``E / n`` experts and must see every token routed to them. Two ways:

  - ``strategy="all_to_all"`` (the reference strategy): the tokens are also
    sharded over the expert axes. Each device sorts its ``T_local * k``
    assignments by expert, sends each to the device holding its expert in a
    padded all-to-all (a buffer of ``T_local * min(k, E_local)`` rows per peer: the
    most one device can send to one peer, so no token is ever dropped by the
    exchange), runs its experts as grouped GEMMs (``jax.lax.ragged_dot``) on what
    arrived, and sends the results back the same way. Own collectives: the
    per-expert counts ``[n, E_local]`` (int32) and the tokens out and back, three
    all-to-alls over the expert axes; their grads two more (the transposes of the
    token exchanges: the grad keeps the forward's buffers, :func:`residual_programs`).
    Where the backend has a ragged all-to-all (a GPU, a TPU: :func:`ragged_backend`)
    the token exchanges are ``jax.lax.ragged_all_to_all`` sized by the counts: each
    slot of the buffer sends only its rows routed, as the plan prices them there.
  - ``strategy="local"``: the tokens are replicated over the expert axes; each
    device runs its own experts on the assignments routed to them and the
    output is a sum over the expert axes (an all-reduce, resolved by the region,
    or reduce-scattered onto the tokens).

* Expert hidden ``F`` (dim 2 of ``w_gate``/``w_up``, dim 1 of ``w_down``):
  expert tensor parallelism. Each device computes its slice of every hidden
  unit; the output is sum-partial over those axes (row-parallel ``w_down``), and
  in the grad so are ``d x`` and ``d weights``.
* Model dim ``D`` of the weights: FSDP storage over token axes. The weights are
  all-gathered over those axes inside the op (one all-gather each) and their
  grads reduce-scattered back (autodiff's transpose of the gather sums the
  token shards' contributions). A ``D`` sharded over other axes is gathered
  before the op (each device along them would hold the same gradient). ``x``'s ``D`` is
  contracted by the experts and stays whole.
* ``k`` and the routing are replicated per token.

Pending reductions never pass: the op is nonlinear in ``x`` and in the weights,
so partial operands are resolved first; the grads are linear in the cotangent,
which is required whole.

Uneven shards: padded tokens route to no expert (their weight and output are
zero), padded hidden units of ``F`` are zeroed, a padded ``D`` block of the
weights is dropped after the gather; the experts must divide their axes
(otherwise they are replicated).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from spmdkit.engine.rule import (
    Example,
    Inferred,
    InferredGrad,
    KeptResiduals,
    LocalContext,
    MustDivide,
    Rule,
    RuleContext,
    op_collective,
)
from spmdkit.errors import ShardingConflictError
from spmdkit.spec import TensorSpec
from spmdkit.topology import RAGGED_BACKENDS
from spmdkit.vma import varying_axes

__all__ = [
    "RULES",
    "MoeExpertsRule",
    "expert_capacity",
    "experts_example",
    "moe_experts_reference",
    "ragged_backend",
    "residual_programs",
]


def expert_capacity(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Assignments each expert takes in token-dropping mode: ``ceil(factor * T * k / E)``.

    Example::

        >>> expert_capacity(64, 2, 8, 1.25)
        20
    """
    return max(1, math.ceil(factor * tokens * top_k / n_experts))


def _kept(expert_idx: jax.Array, n_experts: int, capacity: int, before: Any = 0) -> jax.Array:
    """``[T, k]`` bool: the assignment is within its expert's capacity, counting in
    row-major order from ``before`` (``[E]``: the assignments earlier shards gave each)."""
    flat = expert_idx.reshape(-1)
    onehot = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)
    rank = jnp.cumsum(onehot, axis=0) - onehot  # earlier assignments to the same expert
    rank = jnp.sum(rank * onehot, axis=1) + jnp.take(
        jnp.asarray(before) + jnp.zeros(n_experts, jnp.int32), jnp.clip(flat, 0, n_experts - 1)
    )
    return (rank < capacity).reshape(expert_idx.shape)


def moe_experts_reference(
    x: jax.Array,
    expert_idx: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    capacity_factor: float | None = None,
    expert_groups: tuple[int, int] | None = None,
) -> jax.Array:
    """The unsharded op, dense per token: each assignment gathers its expert's weights.
    ``expert_groups`` (the routing's group limit) is a promise for the planner's
    price; the op computes the same without it.

    Example::

        >>> y = moe_experts_reference(x, idx, w, wg, wu, wd)   # [T, D]
    """
    n_experts = w_gate.shape[0]
    if capacity_factor is not None:
        cap = expert_capacity(x.shape[0], expert_idx.shape[1], n_experts, capacity_factor)
        weights = jnp.where(_kept(expert_idx, n_experts, cap), weights, 0)
    g = jnp.einsum("td,tkdf->tkf", x, w_gate[expert_idx])
    u = jnp.einsum("td,tkdf->tkf", x, w_up[expert_idx])
    y = jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(g) * u, w_down[expert_idx])
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


# ---------------------------------------------------------------------------
# Checks and layouts
# ---------------------------------------------------------------------------


def _check(ctx: RuleContext, inputs: Sequence[TensorSpec]) -> None:
    op = ctx.op
    if len(inputs) != 6 or [s.ndim for s in inputs] != [2, 2, 2, 3, 3, 3]:
        raise ShardingConflictError(
            op=op,
            must="operands are x [T, D], expert_idx [T, k], weights [T, k], "
            "w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D]",
            given=f"shapes {[s.shape for s in inputs]}",
            fix="flatten the tokens to [T, D] and stack the experts' weights on dim 0",
        )
    x, idx, w, wg, wu, wd = inputs
    t, d = x.shape
    e, _, f = wg.shape
    if idx.shape != w.shape or idx.shape[0] != t or wg.shape != (e, d, f) or wu.shape != wg.shape:
        raise ShardingConflictError(
            op=op,
            must="expert_idx and weights are [T, k] with x's T; w_gate and w_up are [E, D, F] "
            "with x's D",
            given=f"x {x.shape}, expert_idx {idx.shape}, weights {w.shape}, w_gate {wg.shape}, "
            f"w_up {wu.shape}",
            fix="check the operand order and the model dim",
        )
    if wd.shape != (e, f, d):
        raise ShardingConflictError(
            op=op,
            must=f"w_down is [E, F, D] = {(e, f, d)}",
            given=str(wd.shape),
            fix="pass w_down with the hidden dim before the model dim",
        )
    if idx.dtype is not None and not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ShardingConflictError(
            op=op,
            must="expert_idx holds integer expert ids",
            given=f"dtype {idx.dtype}",
            fix="pass the indices top_k returns (int32)",
        )
    floats = {s.dtype for s in (x, w, wg, wu, wd) if s.dtype is not None}
    if any(not jnp.issubdtype(dt, jnp.floating) for dt in floats):
        raise ShardingConflictError(
            op=op,
            must="x, weights and the expert weights are floating point",
            given=f"dtypes {sorted(str(dt) for dt in floats)}",
            fix="cast them to a float dtype",
        )
    groups = ctx.attrs.get("expert_groups")
    if groups is not None and not (
        isinstance(groups, tuple)
        and len(groups) == 2
        and all(isinstance(n, int) and n >= 1 for n in groups)
        and e % groups[0] == 0
        and groups[1] <= groups[0]
    ):
        raise ShardingConflictError(
            op=op,
            must="expert_groups is None or (groups, group_top_k): groups divides the "
            "experts, 1 <= group_top_k <= groups",
            given=f"expert_groups={groups!r} with {e} experts",
            fix="pass the router's group limit, e.g. expert_groups=(8, 4) for 256 experts",
        )
    cf = ctx.attrs.get("capacity_factor")
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0):
        raise ShardingConflictError(
            op=op,
            must="capacity_factor is None (dropless) or a positive number",
            given=repr(cf),
            fix="pass e.g. capacity_factor=1.25, or None",
        )


def _size(sizes: Any, axes: Sequence[str]) -> int:
    return math.prod(sizes[a] for a in axes)


def _first(*dims: Sequence[str]) -> tuple[str, ...]:
    for d in dims:
        if d:
            return tuple(d)
    return ()


class _Layout:
    """Axes of the factors: tokens ``t``, experts ``ep``, hidden ``tp``, weights' ``D`` ``fs``."""

    def __init__(self, t: tuple, ep: tuple, tp: tuple, fs: tuple) -> None:
        self.t, self.ep, self.tp, self.fs = t, ep, tp, fs

    def specs(self, inputs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
        """The operands and the output laid out (no partials)."""
        x, idx, w, wg, wu, wd = inputs
        t, ep, tp, fs = self.t, self.ep, self.tp, self.fs
        tok = TensorSpec(x.shape, (t, ()), dtype=x.dtype)
        return (
            tok,
            TensorSpec(idx.shape, (t, ()), dtype=idx.dtype),
            TensorSpec(w.shape, (t, ()), dtype=w.dtype),
            TensorSpec(wg.shape, (ep, fs, tp), dtype=wg.dtype),
            TensorSpec(wu.shape, (ep, fs, tp), dtype=wu.dtype),
            TensorSpec(wd.shape, (ep, tp, fs), dtype=wd.dtype),
            tok,
        )


def _experts_where(ctx: RuleContext, inputs: tuple, out_grads: tuple) -> tuple[frozenset[int], ...]:
    return (
        frozenset(),
        frozenset(),
        frozenset(),
        frozenset({0}),
        frozenset({0}),
        frozenset({0}),
        *(frozenset() for _ in out_grads),
    )


def _tokens_where(ctx: RuleContext, inputs: tuple, out_grads: tuple) -> tuple[frozenset[int], ...]:
    on = frozenset({0}) if ctx.attrs.get("strategy", "all_to_all") == "all_to_all" else frozenset()
    return (on, on, on, frozenset(), frozenset(), frozenset(), *(on for _ in out_grads))


_MUST_DIVIDE = (
    MustDivide(
        "the experts E of w_gate, w_up, w_down",
        "a device runs whole experts (expert e lives on device e // (E/n)); "
        "experts that do not divide their axes are replicated",
        _experts_where,
    ),
    MustDivide(
        "the tokens T under strategy 'all_to_all', where the expert axes join their axes",
        "the all-to-all exchanges equal blocks of tokens between the devices of the "
        "expert axes; tokens that do not divide them stay on their own axes",
        _tokens_where,
    ),
)


class MoeExpertsRule(Rule):
    """The routed-experts rule (hand-written: strategies, own all-to-alls, FSDP gathers)."""

    name = "moe_experts"
    strategies = ("all_to_all", "local")
    must_divide = _MUST_DIVIDE
    scratch_materializes = True  # the exchange buffers and the grouped GEMMs' outputs
    doc = "routed SwiGLU experts (dropless); T pass, E: all-to-all or local, F: expert TP"

    def __init__(self, examples: Sequence[Example]) -> None:
        self.impl = moe_experts_reference
        self.examples = tuple(examples)

    def describe(self, shapes: Sequence[tuple[int, ...]] | None = None, **attrs: Any) -> str:
        """One line on the layouts of the strategies."""
        return (
            "x[T D], idx/weights[T k], w_gate/w_up[E D F], w_down[E F D] -> [T D]; T pass; "
            "F: expert TP (sum-partial output); weights' D: FSDP (gathered inside); "
            "all_to_all: T also over E's axes, tokens exchanged; local: T off E's axes, "
            "sum-partial output"
        )

    def _layout(
        self, ctx: RuleContext, inputs: Sequence[TensorSpec], tokens: Sequence[str] = ()
    ) -> _Layout:
        x, idx, w, wg, wu, wd = inputs
        sizes = ctx.axis_sizes
        n_experts, d, f = wg.shape
        ep = _first(wg.dims[0], wu.dims[0], wd.dims[0])
        if ep and n_experts % _size(sizes, ep):
            ep = ()
        t = tuple(tokens) or _first(x.dims[0], idx.dims[0], w.dims[0])
        t = tuple(a for a in t if a not in ep or self.strategy(ctx) == "all_to_all")
        if self.strategy(ctx) == "all_to_all":
            extra = tuple(a for a in ep if a not in t)
            if extra and x.shape[0] % _size(sizes, (*t, *extra)) == 0:
                t = (*t, *extra)
            elif extra:
                ep = tuple(a for a in ep if a in t)
                if ep and n_experts % _size(sizes, ep):
                    ep = ()
        tp = tuple(a for a in _first(wg.dims[2], wu.dims[2], wd.dims[1]) if a not in (*t, *ep))
        fs = tuple(a for a in _first(wg.dims[1], wu.dims[1], wd.dims[2]) if a in t and a not in ep)
        return _Layout(t, ep, tp if f > 1 else (), fs if d > 1 else ())

    def _own(self, ctx: RuleContext, lay: _Layout, inputs: Sequence[TensorSpec], *, grad: bool):
        """The op's own collectives: the weights' FSDP gathers (and, in the grad,
        their reduce-scatters), the token exchange's all-to-alls (in the grad the
        transposes of the two token exchanges, whose buffers the grad reads from
        the forward: :func:`residual_programs`), and in token-dropping
        mode the per-expert counts gathered over the token axes (``_kept_here``: an
        integer gather, with no transpose in the grad)."""
        x, idx, _, wg, wu, wd = inputs
        sizes = ctx.axis_sizes
        out = []
        if ctx.attrs.get("capacity_factor") is not None and _size(sizes, lay.t) > 1:
            counts = _size(sizes, lay.t) * wg.shape[0] * 4  # int32 [shards, E]
            out.append(op_collective(ctx, "all_gather", lay.t, counts, dim=0))
        if lay.fs:
            n_fs = _size(sizes, lay.fs)
            for w, dim in ((wg, 1), (wu, 1), (wd, 2)):
                dims = [lay.ep, (), lay.tp] if dim == 1 else [lay.ep, lay.tp, ()]
                rows = -(-w.shape[dim] // n_fs) * n_fs  # the gathered, padded D
                nbytes = _block_bytes(w, dims, sizes) // w.shape[dim] * rows
                out.append(op_collective(ctx, "all_gather", lay.fs, nbytes, dim=dim))
                if grad:
                    out.append(
                        op_collective(
                            ctx, "reduce_scatter", lay.fs, nbytes, reduce_op="sum", dim=dim
                        )
                    )
        if lay.ep and self.strategy(ctx) == "all_to_all" and _size(sizes, lay.ep) > 1:
            n = _size(sizes, lay.ep)
            counts = n * (wg.shape[0] // n) * 4
            buf = n * _buffer_rows(x.shape[0], idx.shape[1], wg.shape[0], sizes, lay) * x.shape[1]
            buf *= x.itemsize
            # the rows a device routes, balanced: what a ragged all-to-all sends
            routed = -(-x.shape[0] // _size(sizes, lay.t)) * idx.shape[1] * x.shape[1]
            routed *= x.itemsize
            if not grad:  # the grad reads the forward's counts (residual_programs)
                out.append(op_collective(ctx, "all_to_all", lay.ep, counts))
            # forward: the tokens out and the results back; grad: their transposes
            out += [
                op_collective(ctx, "all_to_all", lay.ep, buf, routed_bytes=routed) for _ in range(2)
            ]
        return tuple(out)

    # -- the three inferences ----------------------------------------------
    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Tokens pass, experts per strategy, hidden units sum-partial on the output."""
        _check(ctx, inputs)
        plain = tuple(s.without_partial() for s in inputs)
        lay = self._layout(ctx, plain)
        *req, out = lay.specs(plain)
        part = {a: "sum" for a in lay.tp}
        if self.strategy(ctx) == "local":
            part.update({a: "sum" for a in lay.ep})
        return Inferred(
            tuple(req), (out.replace(partial=part),), self._own(ctx, lay, plain, grad=False)
        )

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """The tokens' axes from the output; the weights as the forward lays them out."""
        _check(ctx, inputs)
        (o,) = outputs
        plain = tuple(TensorSpec(s.shape, dtype=s.dtype) for s in inputs)
        if o.shape != plain[0].shape:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"the output has x's shape {plain[0].shape}",
                given=str(o.shape),
                fix="pass the op's output spec",
            )
        lay = self._layout(ctx, plain, tokens=o.dims[0] if o.dims else ())
        *req, out = lay.specs(plain)
        part = {a: "sum" for a in lay.tp}
        if self.strategy(ctx) == "local":
            part.update({a: "sum" for a in lay.ep})
        return Inferred(
            tuple(req), (out.replace(partial=part),), self._own(ctx, lay, plain, grad=False)
        )

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """The forward layout; ``d x`` and ``d weights`` sum-partial over the hidden axes
        (and the expert axes, ``local``); the expert weights' grads sum-partial over the
        token axes that neither hold their experts nor gather their ``D``."""
        _check(ctx, inputs)
        (g,) = out_grads
        plain = tuple(s.without_partial() for s in inputs)
        if g.shape != plain[0].shape:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"out_grads have x's shape {plain[0].shape}",
                given=str(g.shape),
                fix="pass the cotangent of the op's output",
            )
        lay = self._layout(ctx, plain)
        x, idx, w, wg, wu, wd, out = lay.specs(plain)
        act = {a: "sum" for a in lay.tp}
        if self.strategy(ctx) == "local":
            act.update({a: "sum" for a in lay.ep})
        wpart = {a: "sum" for a in lay.t if a not in (*lay.ep, *lay.fs)}
        if self.strategy(ctx) == "local":
            wpart = {a: "sum" for a in lay.t if a not in lay.fs}
        grads = (
            x.replace(partial=act),
            idx,
            w.replace(partial=act),
            wg.replace(partial=wpart),
            wu.replace(partial=wpart),
            wd.replace(partial=wpart),
        )
        fwd_out = out.replace(partial=act)
        return InferredGrad(
            (x, idx, w, wg, wu, wd),
            (out.replace(dtype=g.dtype),),
            grads,
            (fwd_out,),
            self._own(ctx, lay, plain, grad=True),
        )

    # -- per-device computation -------------------------------------------
    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """Sort, exchange, grouped GEMMs, exchange back, combine (module docstring)."""
        return _local_program(lctx, self.strategy_of(lctx))

    def kept_dtypes(self, dtypes: Sequence[Any]) -> tuple[Any, ...]:
        """The grad region reads the forward's exchanged buffers (:func:`residual_programs`):
        the rows received (``x``'s dtype), their counts (int32), the results back
        (``w_down``'s dtype)."""
        return (dtypes[0], jnp.dtype("int32"), dtypes[5])

    def kept_residuals(self, lctx: LocalContext) -> KeptResiduals | None:
        """:func:`residual_programs` (None where the layout exchanges nothing)."""
        return residual_programs(lctx)

    def strategy_of(self, lctx: LocalContext) -> str:
        """The strategy a per-device program runs."""
        return lctx.attrs.get("strategy", self.strategies[0])


def _block_bytes(spec: TensorSpec, dims: Sequence[Sequence[str]], sizes: Any) -> int:
    """Per-device bytes of ``spec`` laid out as ``dims`` (ceil blocks)."""
    n = 1
    for s, d in zip(spec.shape, dims, strict=True):
        n *= -(-s // _size(sizes, d))
    return n * spec.itemsize


def _buffer_rows(tokens: int, top_k: int, n_experts: int, sizes: Any, lay: _Layout) -> int:
    """Rows of the exchange buffer per peer: the most assignments one device can
    route to one peer (each token's experts are distinct)."""
    t_local = -(-tokens // _size(sizes, lay.t))
    return t_local * min(top_k, n_experts // _size(sizes, lay.ep))


# ---------------------------------------------------------------------------
# Per-device program
# ---------------------------------------------------------------------------


def _grouped_swiglu(
    rows: jax.Array, group: jax.Array, n_groups: int, wg: jax.Array, wu: jax.Array, wd: jax.Array
) -> jax.Array:
    """The SwiGLU of each row's expert (``group``; ``n_groups`` means none: zero) as
    grouped GEMMs: rows sorted by expert, one ``ragged_dot`` per weight, unsorted."""
    order = jnp.argsort(group, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(group, n_groups, dtype=jnp.int32), axis=0)
    xs = rows[order]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, wg, sizes)) * jax.lax.ragged_dot(xs, wu, sizes)
    ys = jax.lax.ragged_dot(h.astype(wd.dtype), wd, sizes)
    return jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)


class _Program(NamedTuple):
    """The per-device program of one layout, in the stages the forward and the
    backward from residuals share (:func:`_program`)."""

    weights: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
    tokens: Callable[..., tuple[jax.Array, jax.Array, jax.Array, Any]]
    combine: Callable[..., jax.Array]
    exchanged: bool
    ep: tuple[str, ...]
    n_ep: int
    e_local: int
    local_experts: Callable[..., jax.Array]


def _program(lctx: LocalContext, strategy: str) -> _Program:
    """The stages of the per-device program: the experts' weights gathered and
    masked (``weights``), the tokens masked and the routing weights of dropped
    assignments zeroed (``tokens``), the weighted combine (``combine``), and for a
    layout with no exchange the experts run on the local assignments."""
    xs, idxs, _, wgs, _, _ = lctx.inputs
    n_tokens, d = xs.shape
    n_experts, _, f = wgs.shape
    t_axes, ep, fs = xs.dims[0], tuple(wgs.dims[0]), wgs.dims[1]
    n_ep = math.prod(lctx.axis_sizes[a] for a in ep)
    e_local = n_experts // n_ep
    cf = lctx.attrs.get("capacity_factor")
    cap = None if cf is None else expert_capacity(n_tokens, idxs.shape[1], n_experts, cf)
    uneven_t = n_tokens % lctx.shards(xs, 0) != 0
    uneven_f = f % lctx.shards(wgs, 2) != 0

    def weights(wg, wu, wd):
        if fs:  # FSDP storage: gather the model dim (autodiff scatters the grads back)
            wg = jax.lax.all_gather(wg, fs, axis=1, tiled=True)[:, :d]
            wu = jax.lax.all_gather(wu, fs, axis=1, tiled=True)[:, :d]
            wd = jax.lax.all_gather(wd, fs, axis=2, tiled=True)[:, :, :d]
        if uneven_f:  # padded hidden units: zero weights, zero contribution
            hid = lctx.offset(wgs, 2) + jnp.arange(wg.shape[2]) < f
            wg = jnp.where(hid[None, None, :], wg, jnp.zeros_like(wg))
            wu = jnp.where(hid[None, None, :], wu, jnp.zeros_like(wu))
            wd = jnp.where(hid[None, :, None], wd, jnp.zeros_like(wd))
        return wg, wu, wd

    def tokens(x, idx, w):
        real = None
        if uneven_t:  # padded tokens route nowhere (expert id E)
            real = (lctx.offset(xs, 0) + jnp.arange(x.shape[0]) < n_tokens)[:, None]
            x = jnp.where(real, x, jnp.zeros_like(x))
            idx = jnp.where(real, idx, n_experts)
            w = jnp.where(real, w, jnp.zeros_like(w))
        if cap is not None:
            w = jnp.where(_kept_here(lctx, idx, t_axes, n_experts, cap), w, jnp.zeros_like(w))
        return x, idx, w, real

    def combine(y, w, real, dtype):
        t, k = w.shape
        out = jnp.einsum("tkd,tk->td", y.reshape(t, k, -1), w.astype(y.dtype))
        if real is not None:
            out = jnp.where(real, out, jnp.zeros_like(out))
        return out.astype(dtype)

    def local_experts(rows, flat, wg, wu, wd):
        first = lctx.index(ep) * e_local if ep else 0
        rows = _varying(rows, ep)
        mine = flat - first
        mine = jnp.where((mine >= 0) & (mine < e_local), mine, e_local)
        return _grouped_swiglu(rows, mine, e_local, wg, wu, wd)

    exchanged = strategy == "all_to_all" and n_ep > 1
    return _Program(weights, tokens, combine, exchanged, ep, n_ep, e_local, local_experts)


def _local_program(lctx: LocalContext, strategy: str) -> Callable[..., Any]:
    prog = _program(lctx, strategy)

    def local(x, idx, w, wg, wu, wd):
        wg, wu, wd = prog.weights(wg, wu, wd)
        dtype = x.dtype
        x, idx, w, real = prog.tokens(x, idx, w)
        t, k = idx.shape
        flat = idx.reshape(t * k)
        rows = jnp.repeat(x, k, axis=0)
        if prog.exchanged:
            y = _exchange(
                lctx,
                rows,
                flat,
                wg,
                wu,
                wd,
                prog.ep,
                prog.n_ep,
                prog.e_local,
                t * min(k, prog.e_local),
            )
        else:
            y = prog.local_experts(rows, flat, wg, wu, wd)
        return prog.combine(y, w, real, dtype)

    return local


def _varying(v: jax.Array, axes: Sequence[str]) -> jax.Array:
    """``v`` typed as varying over ``axes`` (inside a ``shard_map`` that checks types):
    a value the same on each device of an axis that each device then uses its own
    way, so its cotangent is summed over the axis."""
    mat = getattr(jax.typeof(v), "mat", None)
    have = getattr(mat, "varying", None)
    if have is None:
        have = getattr(jax.typeof(v), "vma", frozenset())
    missing = tuple(a for a in axes if a not in have)
    return jax.lax.pcast(v, missing, to="varying") if missing else v


def _kept_here(
    lctx: LocalContext, idx: jax.Array, t_axes: Sequence[str], n_experts: int, cap: int
) -> jax.Array:
    """Token-dropping mode on a token shard: ranks continue from the assignments the
    earlier shards give each expert (their counts all-gathered over the token axes)."""
    before: Any = 0
    if t_axes:
        counts = jnp.sum(jax.nn.one_hot(idx.reshape(-1), n_experts, dtype=jnp.int32), axis=0)
        every = jax.lax.all_gather(counts, tuple(t_axes), axis=0, tiled=False)
        me = lctx.index(t_axes)
        earlier = (jnp.arange(every.shape[0]) < me)[:, None]
        before = jnp.sum(jnp.where(earlier, every, 0), axis=0)
    return _kept(idx, n_experts, cap, before)


class _Route(NamedTuple):
    """Where a device's assignments go in its exchange buffer (:func:`_route`)."""

    order: jax.Array  # the assignments sorted by expert
    dest: jax.Array  # each sorted assignment's peer (``n_ep``: routed nowhere, dropped)
    pos: jax.Array  # its row in the buffer to that peer
    per_expert: jax.Array  # [n_ep, e_local] assignments to each expert


def _route(flat: jax.Array, n_ep: int, e_local: int) -> _Route:
    """The exchange layout of the assignments to experts ``flat`` (local: no collective)."""
    n = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    per_expert = jnp.sum(jax.nn.one_hot(flat, n_ep * e_local, dtype=jnp.int32), axis=0)
    per_expert = per_expert.reshape(n_ep, e_local)
    per_dest = jnp.sum(per_expert, axis=1)
    dest = sorted_e // e_local  # n_ep (out of range) for routed-nowhere rows: dropped
    start = jnp.cumsum(per_dest) - per_dest
    pos = jnp.arange(n) - jnp.take(start, jnp.clip(dest, 0, n_ep - 1))
    return _Route(order, dest, pos, per_expert)


def _dispatch(rows: jax.Array, route: _Route, n_ep: int, per_peer: int) -> jax.Array:
    """The send buffer ``[n_ep, per_peer, D]``: each assignment's row at its peer's slot."""
    send = jnp.zeros((n_ep, per_peer, rows.shape[1]), rows.dtype)
    return send.at[route.dest, route.pos].set(rows[route.order], mode="drop")


def _expert_side(
    got: jax.Array, counts: jax.Array, e_local: int, wg: jax.Array, wu: jax.Array, wd: jax.Array
) -> jax.Array:
    """The local experts on the rows received (``got [n_ep, per_peer, D]``, each
    source's rows sorted by local expert, ``counts [n_ep, e_local]`` of them)."""
    n_ep, per_peer, _ = got.shape
    ends = jnp.cumsum(counts, axis=1)
    slot = jnp.arange(per_peer)
    group = jnp.sum(slot[None, :, None] >= ends[:, None, :], axis=-1)  # e_local: padding
    done = _grouped_swiglu(got.reshape(n_ep * per_peer, -1), group.reshape(-1), e_local, wg, wu, wd)
    return done.reshape(n_ep, per_peer, -1)


def _collect(back: jax.Array, route: _Route) -> jax.Array:
    """The results received back, ``[t*k, D]`` in assignment order (zero for an
    assignment routed nowhere)."""
    ys = back.at[route.dest, route.pos].get(mode="fill", fill_value=0)
    return jnp.zeros_like(ys).at[route.order].set(ys, unique_indices=True)


#: The ``checkpoint_name`` of the exchanged buffers the op keeps for its backward
#: (the forward region's kept residuals carry it too:
#: :func:`spmdkit.engine.region.kept_name`); a remat policy keeping it
#: (``save_out_proj_experts``) skips rerunning the exchange.
KEPT_NAME = "moe_experts"


def _exchange(
    lctx: LocalContext,
    rows: jax.Array,
    flat: jax.Array,
    wg: jax.Array,
    wu: jax.Array,
    wd: jax.Array,
    ep: Sequence[str],
    n_ep: int,
    e_local: int,
    per_peer: int,
) -> jax.Array:
    """Expert parallelism by an all-to-all (padded, or ragged where the backend has
    one): each assignment (``rows``, expert ``flat``) goes to its expert's device,
    the experts run there, the results come back; ``[t*k, D]`` in assignment order
    (zero for an expert id out of range)."""
    y, _, _ = _exchange_keeping(rows, flat, wg, wu, wd, tuple(ep), n_ep, e_local, per_peer)
    return y


def _exchange_keeping(
    rows: jax.Array,
    flat: jax.Array,
    wg: jax.Array,
    wu: jax.Array,
    wd: jax.Array,
    ep: tuple[str, ...],
    n_ep: int,
    e_local: int,
    per_peer: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_exchange`'s results with the rows received and their per-expert
    counts (what the backward reads: :func:`residual_programs`). The three
    exchanged results carry the ``checkpoint_name`` :data:`KEPT_NAME`: a remat
    policy that keeps it runs the backward of the program traced inline (a
    pipelined stage's) without exchanging again."""
    route = _route(flat, n_ep, e_local)
    sent = _dispatch(rows, route, n_ep, per_peer)
    ragged = ragged_backend()
    got = None if ragged else _slot_exchange(sent, ep, None)
    counts = jax.lax.all_to_all(route.per_expert, ep, 0, 0, tiled=True)  # [source, expert]
    counts = checkpoint_name(counts, KEPT_NAME)
    sizes = _slot_sizes(route, counts) if ragged else None  # a ragged one's, by the counts
    got = checkpoint_name(_slot_exchange(sent, ep, sizes) if got is None else got, KEPT_NAME)
    done = _expert_side(got, counts, e_local, wg, wu, wd)
    back = checkpoint_name(_slot_exchange(done, ep, sizes and sizes[::-1]), KEPT_NAME)
    return _collect(back, route), got, counts


def _slot_sizes(route: _Route, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rows this device sends each peer and the rows it receives from each (for
    the results' way back, the other way round)."""
    return jnp.sum(route.per_expert, axis=1), jnp.sum(counts, axis=1)


#: The ragged all-to-all the exchange calls where the backend has one (a test of the
#: offsets on CPU puts :func:`spmdkit.testing.ragged.ragged_all_to_all_reference` here).
_ragged_all_to_all = jax.lax.ragged_all_to_all


def ragged_backend() -> bool:
    """Whether the exchange runs as a ragged all-to-all: the default backend is one
    of :data:`spmdkit.topology.RAGGED_BACKENDS` (XLA:CPU has none), where the plan
    prices only the rows routed (:func:`spmdkit.planner.experts.ragged_exchange`)."""
    return jax.default_backend() in RAGGED_BACKENDS


def _slot_exchange(
    buf: jax.Array, ep: Sequence[str], sizes: tuple[jax.Array, jax.Array] | None
) -> jax.Array:
    """A buffer of one slot per peer ``[n_ep, per_peer, ...]`` exchanged: peer ``j``
    receives this device's slot ``j`` as its slot of this device. ``sizes``: None
    sends every slot whole (the padded all-to-all); ``(sends, gets)``, where the
    backend has a ragged all-to-all (:func:`ragged_backend`), sends only the first
    ``sends[j]`` rows of slot ``j`` (the rest is padding) and receives ``gets[i]``
    rows from peer ``i``, the received slots zero past them."""
    if sizes is None:
        return jax.lax.all_to_all(buf, tuple(ep), 0, 0, tiled=True)
    sends, gets = sizes
    n_ep, per_peer = buf.shape[:2]
    flat = buf.reshape(n_ep * per_peer, *buf.shape[2:])
    me = jax.lax.axis_index(tuple(ep)).astype(jnp.int32)
    starts = _varying(jnp.arange(n_ep, dtype=jnp.int32) * per_peer, ep)
    landing = jnp.full((n_ep,), per_peer, jnp.int32) * me
    out = _ragged_all_to_all(
        flat,
        jnp.zeros_like(flat),
        starts,
        _varying(sends.astype(jnp.int32), ep),
        _varying(landing, ep),
        _varying(gets.astype(jnp.int32), ep),
        axis_name=tuple(ep),
    )
    return out.reshape(buf.shape)


def residual_programs(lctx: LocalContext) -> KeptResiduals | None:
    """The per-device forward that keeps its exchanged buffers, and the backward
    that reads them instead of exchanging again; None for a layout with no
    exchange (strategy ``local``, or the experts on one device group).

    ``forward(x, idx, w, w_gate, w_up, w_down)`` returns the output and the
    residuals ``(got, counts, y)``: the rows the device received for its experts
    ``[n_ep, per_peer, D]``, their per-expert counts ``[n_ep, E_local]`` (int32)
    and each assignment's expert output received back ``[t*k, D]``.
    ``backward(x, idx, w, w_gate, w_up, w_down, got, counts, y, ct)`` returns the
    cotangents of ``x``, ``weights`` and the three expert weights, as ``jax.vjp``
    of the rule's per-device program gives them, with two all-to-alls (the
    transposes of the forward's token exchanges) and no count exchange: the
    forward's exchanges are not run again. The experts' GEMMs and the local
    routing (sort, masks, the FSDP gathers of the weights) are.
    """
    prog = _program(lctx, lctx.attrs.get("strategy", MoeExpertsRule.strategies[0]))
    if not prog.exchanged:
        return None
    ep, n_ep, e_local = prog.ep, prog.n_ep, prog.e_local
    xs, idxs, _, wgs, _, wds = lctx.inputs
    t_local, k, d = lctx.block(xs, 0), idxs.shape[1], xs.shape[1]
    per_peer = t_local * min(k, e_local)
    t_axes, tp = tuple(xs.dims[0]), tuple(a for a in wgs.dims[2] if a not in xs.dims[0])
    shapes = ((n_ep, per_peer, d), (n_ep, e_local), (t_local * k, d))
    dtypes = (xs.dtype, jnp.dtype("int32"), wds.dtype)
    axes = (t_axes, t_axes, (*t_axes, *tp))

    def forward(x, idx, w, wg, wu, wd):
        wg, wu, wd = prog.weights(wg, wu, wd)
        dtype = x.dtype
        x, idx, w, real = prog.tokens(x, idx, w)
        t, k = idx.shape
        rows = jnp.repeat(x, k, axis=0)
        y, got, counts = _exchange_keeping(
            rows, idx.reshape(t * k), wg, wu, wd, ep, n_ep, e_local, t * min(k, e_local)
        )
        kept = (got, counts, y)
        for v, want in zip(kept, axes, strict=True):
            have = varying_axes(v)
            if have and have != set(want):  # pragma: no cover - a typing change in jax
                raise AssertionError(f"moe_experts residual varies over {have}, not {want}")
        return (prog.combine(y, w, real, dtype), *kept)

    def backward(x, idx, w, wg, wu, wd, got, counts, y, ct):
        dtype = x.dtype
        _, idx_m, _, real = prog.tokens(x, idx, w)
        t, k = idx_m.shape
        route = _route(idx_m.reshape(t * k), n_ep, e_local)
        masked, tok_vjp = jax.vjp(lambda x, w: prog.tokens(x, idx, w)[::2], x, w)
        out, comb_vjp = jax.vjp(lambda y, w: prog.combine(y, w, real, dtype), y, masked[1])
        d_y, d_wm = comb_vjp(_varying(ct, sorted(varying_axes(out), key=str)))
        # the results came back varying as the experts' outputs (over the hidden axes too)
        at = _varying(jnp.zeros_like(got), sorted(varying_axes(y), key=str))
        _, collect_vjp = jax.vjp(lambda b: _collect(b, route), at)
        (d_back,) = collect_vjp(d_y)
        sizes = _slot_sizes(route, counts) if ragged_backend() else None
        d_done = _slot_exchange(d_back, ep, sizes)  # the results' way back, transposed

        def experts(got, wg, wu, wd):
            return _expert_side(got, counts, e_local, *prog.weights(wg, wu, wd))

        _, exp_vjp = jax.vjp(experts, got, wg, wu, wd)
        d_got, d_wg, d_wu, d_wd = exp_vjp(d_done)
        d_send = _slot_exchange(d_got, ep, sizes and sizes[::-1])  # the tokens' way out
        per_peer = got.shape[1]
        _, send_vjp = jax.vjp(
            lambda xm: _dispatch(jnp.repeat(xm, k, axis=0), route, n_ep, per_peer), masked[0]
        )
        (d_xm,) = send_vjp(d_send)
        d_x, d_w = tok_vjp((d_xm, d_wm))
        return d_x, d_w, d_wg, d_wu, d_wd

    layout = (
        ("strategy", "all_to_all"),
        ("token axes", t_axes),
        ("expert axes", tuple(ep)),
        ("hidden axes", tp),
    )
    return KeptResiduals(forward, backward, shapes, dtypes, axes, layout)


# ---------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------


def _routing(shape_x: tuple[int, int], k: int, n_experts: int, shape_w: tuple[int, ...]):
    """Values for an example: random tokens and weights, distinct experts per token."""

    def values(rng: Any) -> list[Any]:
        import numpy as np

        t, d = shape_x
        idx = np.stack([rng.permutation(n_experts)[:k] for _ in range(t)]).astype(np.int32)
        return [
            rng.standard_normal((t, d)).astype(np.float32),
            idx,
            rng.random((t, k)).astype(np.float32),
            *(rng.standard_normal(s).astype(np.float32) * 0.5 for s in shape_w),
        ]

    return values


def experts_example(t: int, d: int, k: int, e: int, f: int, **kw: Any) -> Example:
    """An example of ``moe_experts``: ``t`` tokens of ``d``, top-``k`` of ``e`` experts
    (distinct per token) with hidden ``f``; ``kw`` passed to :class:`Example`.

    Example::

        >>> experts_example(32, 64, 2, 6, 32, attrs={"strategy": "local"}, uneven=True)
    """
    shapes = ((t, d), (t, k), (t, k), (e, d, f), (e, d, f), (e, f, d))
    return Example(
        shapes,
        dtypes=("float32", "int32", "float32", "float32", "float32", "float32"),
        differentiable=(True, False, True, True, True, True),
        values=_routing((t, d), k, e, shapes[3:]),
        **kw,
    )


_EXAMPLES = (
    experts_example(16, 8, 2, 8, 8),
    experts_example(16, 8, 2, 8, 8, attrs={"strategy": "local", "capacity_factor": 1.0}),
    # Uneven: 6 tokens, 6 hidden units (padded blocks on 4 and 8 devices)
    experts_example(6, 4, 2, 4, 6, attrs={"capacity_factor": 1.5}, uneven=True),
)

RULES = (MoeExpertsRule(_EXAMPLES),)

"""Scaled dot-product attention: ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` →
``[B, Sq, H, D]``, with grouped-query attention when ``Hkv < H`` (query head
``h`` reads key/value head ``h // (H / Hkv)``), an optional causal mask (query
``i`` sees keys ``j ≤ i``, top-left aligned as ``jax.nn.dot_product_attention``)
and ``scale`` (default ``1/sqrt(D)``).

Algebra:

* Batch ``B`` is independent: it passes through sharded on q, k, v and the output.
* Heads ``H`` are independent (tensor parallel): the query heads pass through
  sharded; the key/value heads follow with the same axes when the blocks line
  up (each device's query heads read only its own kv heads: the axes divide
  ``Hkv``, or, uneven, ``ceil(H/n) = (H/Hkv)·ceil(Hkv/n)``), otherwise they are
  replicated and each device reads the kv head of each of its query heads. In the
  grad, replicated kv heads receive contributions from every device's query heads:
  ``d k`` and ``d v`` are sum-partial over the head axes.
* The head dim ``D`` is contracted by ``q·k`` inside a softmax: replicated.
* Sequence. Every query row needs every key (the softmax normalizes over all of
  them), so the key sequence ``Sk`` can stay sharded only with a schedule that
  brings every key block to every query block:

  - ``strategy="default"`` (reference semantics): ``Sq`` and ``Sk`` replicated.
  - ``strategy="gather_kv"``: ``Sq`` keeps its sharding (the causal mask is
    offset by the device's block start); K and V, if they come sharded on
    ``Sk``, are laid out over the same axes and all-gathered inside the op —
    stated as the op's own collectives (two all-gathers of the full local K/V,
    ``B/b · Sk · Hkv/h · D`` elements each); their grads come back reduce-scattered.
    If K/V come replicated on ``Sk`` nothing moves and ``d k``, ``d v`` are
    sum-partial over the ``Sq`` axes.
  - ``strategy="ring"``: ``Sq`` and ``Sk`` sharded over the same axes; each device
    keeps its query block and passes K/V blocks around the ring (``n - 1``
    collective-permutes of one K and one V block each, ``n`` = the axes' size)
    while it accumulates an online (flash-style) softmax (a ``lax.scan``: the
    compiled program holds one permute pair in a loop of ``n - 1`` trips). Same
    bytes on the wire as the all-gather, stated as those ``2 (n - 1)``
    collective-permutes (``4 (n - 1)`` in the grad); the
    forward holds one K/V block at a time (autodiff's residuals still keep every
    visited block for the backward). Grads travel back around the ring.

* Pending reductions: attention is linear in ``v`` only, so a sum/avg-partial
  ``v`` with whole ``q`` and ``k`` passes to the output; any partial ``q`` or ``k``
  is resolved first. The grads are linear in the cotangent: a sum/avg-partial
  cotangent passes to ``d q``, ``d k``, ``d v``.
* Uneven shards: padded query rows/heads (and kv heads) are zeroed on entry
  and their outputs zeroed on exit, and padded keys are masked, so padding
  never reaches a real element (forward or grad).

Local computation (``implementation``): unset, the op's own algorithm above
(float32 scores; the reference is ``jax.nn.dot_product_attention``). Set to one
of :data:`spmdkit.kernels.ATTENTION_IMPLEMENTATIONS`, every strategy runs that
kernel on the local blocks and the reference is the same kernel unsharded:
``default`` calls it as is, ``gather_kv`` after the gathers with the query
block's global offset in the causal mask, ``ring`` once per arriving K/V block
with the block's key offset, merging the partial outputs by their log-sum-exp
(the blockwise kernel's custom VJP takes the log-sum-exp's cotangent). cuDNN's
fused kernel masks causally from its block's position 0, so ``"cudnn"`` with a
causal mask refuses a sequence-sharded query (``"auto"`` runs the blockwise
kernel there). ``block_size`` is the blockwise kernel's key block. The layouts
and collectives do not depend on the implementation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from spmdkit.context_parallel import BalancedOrder
from spmdkit.engine.rule import (
    Example,
    Inferred,
    InferredGrad,
    LocalContext,
    MustDivide,
    Rule,
    RuleContext,
    op_collective,
)
from spmdkit.errors import ShardingConflictError
from spmdkit.kernels import (
    ATTENTION_IMPLEMENTATIONS,
    attention_kernel,
    blockwise_attention_lse,
    plain_attention_lse,
)
from spmdkit.spec import TensorSpec

__all__ = ["RULES", "AttentionRule", "attention_reference"]

#: Large negative score for masked keys (finite, so fully masked blocks stay NaN-free).
_MASKED = -1e30

#: Default key/value block of the blockwise implementation.
_BLOCK = 512


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
    block_size: int = _BLOCK,
    balanced: int | None = None,
) -> jax.Array:
    """The unsharded op: ``jax.nn.dot_product_attention`` (XLA implementation), or,
    with ``implementation``, :func:`spmdkit.kernels.attention_kernel` (the reference
    models' attention: ``"xla"``, ``"blockwise"``, ``"cudnn"``, ``"auto"``). With
    ``balanced=n`` and ``causal``, the sequence dims are in
    :class:`~spmdkit.context_parallel.BalancedOrder` ``(n)``: the op is the natural-order op on
    the restored operands, its output put back in the balanced order."""
    if causal and balanced and balanced > 1:
        order = BalancedOrder(balanced)
        q, k, v = (order.restore(t, 1) for t in (q, k, v))
        out = attention_reference(
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            implementation=implementation,
            block_size=block_size,
        )
        return order.apply(out, 1)
    if implementation is None:
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="xla"
        )
    return attention_kernel(
        q,
        k,
        v,
        causal=causal,
        implementation=implementation,
        block_size=block_size,
        scale=scale,
    )


def _check(ctx: RuleContext, inputs: Sequence[TensorSpec]) -> None:
    op = ctx.op
    if len(inputs) != 3:
        raise ShardingConflictError(
            op=op,
            must="operands are q, k, v",
            given=f"{len(inputs)} operands",
            fix="pass attention(q, k, v)",
        )
    q, k, v = inputs
    if any(s.ndim != 4 for s in inputs):
        raise ShardingConflictError(
            op=op,
            must="q, k, v have rank 4: [batch, seq, heads, head_dim]",
            given=f"shapes {q.shape}, {k.shape}, {v.shape}",
            fix="reshape to [B, S, H, D] (add a batch dim of 1 if needed)",
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ShardingConflictError(
            op=op,
            must="k and v have one shape [B, Sk, Hkv, D] with q's B and D",
            given=f"q {q.shape}, k {k.shape}, v {v.shape}",
            fix="check the operand order and the head dim",
        )
    h, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or h % hkv:
        raise ShardingConflictError(
            op=op,
            must="the query heads are a multiple of the key/value heads (grouped-query)",
            given=f"{h} query heads, {hkv} key/value heads",
            fix="use Hkv dividing H (Hkv == H: multi-head; Hkv == 1: multi-query)",
        )
    dts = {s.dtype for s in inputs if s.dtype is not None}
    if len(dts) > 1:
        raise ShardingConflictError(
            op=op,
            must="q, k, v share one dtype (attention never casts silently)",
            given=f"dtypes {q.dtype}, {k.dtype}, {v.dtype}",
            fix="cast the operands to one dtype",
        )
    if any(not jnp.issubdtype(d, jnp.floating) for d in dts):
        raise ShardingConflictError(
            op=op,
            must="q, k, v are floating point",
            given=f"dtype {next(iter(dts))}",
            fix="cast the operands to a float dtype",
        )
    _check_implementation(ctx)
    _check_balanced(ctx, q, k)


def _check_implementation(ctx: RuleContext) -> None:
    impl = ctx.attrs.get("implementation")
    if impl is not None and impl not in ATTENTION_IMPLEMENTATIONS:
        raise ShardingConflictError(
            op=ctx.op,
            must=f"implementation is None (the op's own) or one of {ATTENTION_IMPLEMENTATIONS}",
            given=repr(impl),
            fix='pass implementation="blockwise", "xla", "cudnn" or "auto"',
        )
    block = ctx.attrs.get("block_size", _BLOCK)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ShardingConflictError(
            op=ctx.op,
            must="block_size is a positive int",
            given=repr(block),
            fix="pass e.g. block_size=512",
        )


def _balanced(attrs: Any) -> BalancedOrder | None:
    """The balanced order the operands' sequence dims are in (``balanced=n`` under a
    causal mask; the order does not matter without one), or None."""
    n = attrs.get("balanced")
    return BalancedOrder(n) if attrs.get("causal") and n and n > 1 else None


def _check_balanced(ctx: RuleContext, q: TensorSpec, k: TensorSpec) -> None:
    n = ctx.attrs.get("balanced")
    if n is None:
        return
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ShardingConflictError(
            op=ctx.op,
            must="balanced is a positive int (the shards of the balanced sequence order)",
            given=repr(n),
            fix="pass balanced=<the context axes' size>, or leave it unset",
        )
    order = _balanced(ctx.attrs)
    if order is not None and (q.shape[1] != k.shape[1] or q.shape[1] % order.chunks):
        raise ShardingConflictError(
            op=ctx.op,
            must=f"with balanced={n}, q and k have one sequence length, a multiple of {2 * n}",
            given=f"q {q.shape}, k {k.shape}",
            fix="pad the sequence to a multiple of 2 · balanced, or drop balanced",
        )


def _check_sequence(ctx: RuleContext, lay: _Layout, q: TensorSpec | None = None) -> None:
    """cuDNN's fused kernel masks causally from position 0 of its query block: it
    cannot run on a sequence-sharded query block, so those strategies refuse it.
    In the balanced order a sequence shard must hold whole chunks (its shard count
    divides ``2n``), so the kernels see runs of consecutive positions."""
    order = _balanced(ctx.attrs)
    if order is not None and q is not None and lay.sq:
        m = _size(ctx, lay.sq)
        if order.chunks % m:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"the sequence shards ({m}) divide the balanced order's {order.chunks} chunks",
                given=f"balanced={order.shards} with the sequence over {lay.sq} ({m} shards)",
                fix=f"pass balanced={m} (the size of the sequence's axes), or shard the "
                "sequence over fewer devices",
            )
    if ctx.attrs.get("implementation") == "cudnn" and ctx.attrs.get("causal") and lay.sq:
        raise ShardingConflictError(
            op=ctx.op,
            must="implementation='cudnn' keep the query sequence whole under a causal mask",
            given=f"strategy {ctx.attrs.get('strategy')!r} with the query sequence over {lay.sq}",
            fix='use strategy="default", or implementation="blockwise" / "auto" '
            "for sequence-sharded attention",
        )


def _pick(sources: Sequence[tuple[str, ...]], used: set[str]) -> tuple[str, ...]:
    for axes in sources:
        free = tuple(a for a in axes if a not in used)
        if free:
            used.update(free)
            return free
    return ()


def _size(ctx: RuleContext, axes: Sequence[str]) -> int:
    return math.prod(ctx.axis_sizes[a] for a in axes)


def _heads_align(heads: int, kv_heads: int, n: int) -> bool:
    """Whether ``n`` blocks of the query heads and ``n`` blocks of the kv heads line up:
    each device's query heads then read only its own kv heads. Blocks are ceil-sized
    (the last ones padded), so this holds when ``n`` divides the kv heads and, uneven,
    when a query block is exactly a group of kv blocks: ``ceil(H/n) = (H/Hkv)·ceil(Hkv/n)``.

    Example::

        >>> _heads_align(4, 2, 3), _heads_align(4, 2, 4)
        (True, False)
    """
    if kv_heads % n == 0:
        return True
    return kv_heads > 1 and -(-heads // n) == heads // kv_heads * -(-kv_heads // n)


def _kv_heads_where(
    ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
) -> tuple[frozenset[int], ...]:
    return (frozenset(), frozenset({2}), frozenset({2}), *(frozenset() for _ in out_grads))


_MUST_DIVIDE = (
    MustDivide(
        "the key/value heads of k and v (grouped-query attention, Hkv < H)",
        "query head h reads kv head h // (H/Hkv); sharded like the query heads, each "
        "device's query-head block must map onto its own kv-head block, which holds "
        "when the head axes divide Hkv or ceil(H/n) = (H/Hkv)·ceil(Hkv/n); otherwise "
        "the kv heads are replicated (the query heads stay sharded)",
        _kv_heads_where,
    ),
)


class _Layout:
    """Axes of the factors B, Sq, H (queries), Sk, Hkv for one call."""

    def __init__(self, b: tuple, sq: tuple, h: tuple, sk: tuple, hkv: tuple) -> None:
        self.b, self.sq, self.h, self.sk, self.hkv = b, sq, h, sk, hkv

    @property
    def used(self) -> set[str]:
        return {a for axes in (self.b, self.sq, self.h, self.sk, self.hkv) for a in axes}

    def specs(
        self, q: TensorSpec, k: TensorSpec, v: TensorSpec
    ) -> tuple[TensorSpec, TensorSpec, TensorSpec, TensorSpec]:
        qd = (self.b, self.sq, self.h, ())
        kd = (self.b, self.sk, self.hkv, ())
        return (
            TensorSpec(q.shape, qd, dtype=q.dtype),
            TensorSpec(k.shape, kd, dtype=k.dtype),
            TensorSpec(v.shape, kd, dtype=v.dtype),
            TensorSpec(q.shape, qd, dtype=q.dtype),
        )


class AttentionRule(Rule):
    """The attention rule (hand-written: strategies, GQA head mapping, own collectives)."""

    name = "attention"
    strategies = ("default", "gather_kv", "ring")
    must_divide = _MUST_DIVIDE
    scratch_materializes = True  # the scores (all at once, or a key block per scan step)
    doc = "scaled dot-product attention (GQA, causal); B and H pass, sequence per strategy"

    def __init__(self, examples: Sequence[Example]) -> None:
        self.impl = attention_reference
        self.examples = tuple(examples)

    def describe(self, shapes: Sequence[tuple[int, ...]] | None = None, **attrs: Any) -> str:
        """One line on the layouts of the strategies."""
        return (
            "q[B Sq H D], k/v[B Sk Hkv D] -> [B Sq H D]; B, H pass; D replicated; "
            "default: Sq, Sk replicated; gather_kv: Sq sharded, K/V all-gathered; "
            "ring: Sq, Sk sharded alike, K/V blocks permuted"
        )

    # -- layouts -----------------------------------------------------------
    def _layout(
        self,
        ctx: RuleContext,
        q: TensorSpec,
        k: TensorSpec,
        v: TensorSpec,
        extra: Sequence[TensorSpec] = (),
        start: _Layout | None = None,
    ) -> _Layout:
        """Assign axes factor by factor: q first, then k, v, then output-shaped ``extra``."""
        strategy = self.strategy(ctx)
        used: set[str] = set(start.used) if start else set()
        seqs = strategy != "default"

        def take(current: tuple, sources: list, size: int) -> tuple:
            if current or size <= 1:
                return current
            return _pick(sources, used)

        b = take(
            start.b if start else (),
            [q.dims[0], k.dims[0], v.dims[0], *(e.dims[0] for e in extra)],
            q.shape[0],
        )
        h_src = [q.dims[2], k.dims[2], v.dims[2], *(e.dims[2] for e in extra)]
        h = take(start.h if start else (), h_src, q.shape[2])
        hkv = h if h and _heads_align(q.shape[2], k.shape[2], _size(ctx, h)) else ()
        sq: tuple = start.sq if start else ()
        sk: tuple = start.sk if start else ()
        if seqs:
            sq_src = [q.dims[1], k.dims[1], v.dims[1], *(e.dims[1] for e in extra)]
            sq = take(sq, sq_src, q.shape[1])
            if strategy == "ring":
                sk = sq
            elif not sk and sq and (k.dims[1] or v.dims[1]):
                sk = sq  # K/V arrive sequence-sharded: keep them so and gather inside
        return _Layout(b, sq, h, sk, hkv)

    def _own(self, ctx: RuleContext, lay: _Layout, k: TensorSpec, *, grad: bool) -> tuple:
        """The op's own collectives: K/V gathered (gather_kv) or passed around (ring)."""
        if not lay.sk or _size(ctx, lay.sk) == 1:
            return ()
        n = _size(ctx, lay.sk)
        kloc = TensorSpec(k.shape, (lay.b, lay.sk, lay.hkv, ()), dtype=k.dtype)
        block = math.prod(-(-s // _size(ctx, d)) for s, d in zip(k.shape, kloc.dims, strict=True))
        gathered = block * n * kloc.itemsize
        if self.strategy(ctx) == "ring":  # one K and one V block per step, n - 1 steps
            sends = 2 * (n - 1) * (2 if grad else 1)  # the grads travel back the same way
            one = block * kloc.itemsize
            return tuple(
                op_collective(ctx, "collective_permute", lay.sk, one) for _ in range(sends)
            )
        out = [op_collective(ctx, "all_gather", lay.sk, gathered, dim=1) for _ in range(2)]
        if grad:
            out += [
                op_collective(ctx, "reduce_scatter", lay.sk, gathered, reduce_op="sum", dim=1)
                for _ in range(2)
            ]
        return tuple(out)

    # -- the three inferences ----------------------------------------------
    def forward(self, ctx: RuleContext, inputs: tuple[TensorSpec, ...]) -> Inferred:
        """Batch and heads pass; the sequence per strategy; a partial v passes (linear)."""
        _check(ctx, inputs)
        q, k, v = inputs
        lay = self._layout(ctx, q, k, v)
        _check_sequence(ctx, lay, q)
        rq, rk, rv, out = lay.specs(q, k, v)
        part = {}
        if not q.partial and not k.partial:
            part = {a: op for a, op in v.partial if op in ("sum", "avg") and a not in lay.used}
        rv = rv.replace(partial=part)
        out = out.replace(partial=part)
        return Inferred((rq, rk, rv), (out,), self._own(ctx, lay, k, grad=False))

    def backward(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
    ) -> Inferred:
        """Batch, heads (and, beyond the reference, the query sequence) from the
        output; a sum/avg-partial output traces back to a partial v."""
        _check(ctx, inputs)
        (o,) = outputs
        q, k, v = (TensorSpec(s.shape, dtype=s.dtype) for s in inputs)
        if o.shape != q.shape:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"the output has q's shape {q.shape}",
                given=str(o.shape),
                fix="pass the op's output spec",
            )
        lay = self._layout(ctx, q, k, v, extra=(o,))
        _check_sequence(ctx, lay, q)
        rq, rk, rv, out = lay.specs(q, k, v)
        part = {a: op for a, op in o.partial if op in ("sum", "avg") and a not in lay.used}
        rv = rv.replace(partial=part)
        return Inferred(
            (rq, rk, rv), (out.replace(partial=part),), self._own(ctx, lay, k, grad=False)
        )

    def grad(
        self, ctx: RuleContext, inputs: tuple[TensorSpec, ...], out_grads: tuple[TensorSpec, ...]
    ) -> InferredGrad:
        """Forward layout first, free factors from the cotangent. d k, d v are
        sum-partial over the axes of query factors they lack (query heads when kv
        heads are replicated, the query sequence when K/V are replicated on it)."""
        _check(ctx, inputs)
        (g,) = out_grads
        q, k, v = (s.without_partial() for s in inputs)
        if g.shape != q.shape:
            raise ShardingConflictError(
                op=ctx.op,
                must=f"out_grads have q's shape {q.shape}",
                given=str(g.shape),
                fix="pass the cotangent of the op's output",
            )
        fwd = self._layout(ctx, q, k, v)
        lay = self._layout(ctx, q, k, v, extra=(g,), start=fwd)
        _check_sequence(ctx, lay, q)
        rq, rk, rv, out = lay.specs(q, k, v)
        gp = {a: op for a, op in g.partial if op in ("sum", "avg") and a not in lay.used}
        missing = {a: "sum" for a in lay.h if a not in lay.hkv}
        missing.update({a: "sum" for a in lay.sq if a not in lay.sk})
        grads = (
            rq.replace(partial=gp),
            rk.replace(partial={**gp, **missing}),
            rv.replace(partial={**gp, **missing}),
        )
        return InferredGrad(
            (rq, rk, rv),
            (out.replace(partial=gp, dtype=g.dtype),),
            grads,
            (out,),
            self._own(ctx, lay, k, grad=True),
        )

    # -- per-device computation -------------------------------------------
    def local_fn(self, lctx: LocalContext) -> Callable[..., Any]:
        """Attention on the local blocks, laid out as ``lctx.inputs`` (see the module
        docstring: gathers for gather_kv, the ring for ring, GQA head mapping)."""
        qs, ks, _ = lctx.inputs
        strategy = lctx.attrs.get("strategy", self.strategies[0])
        kernel = lctx.attrs.get("implementation") is not None
        _, n_q, n_heads, _ = qs.shape
        n_kv_heads = ks.shape[2]
        group = n_heads // n_kv_heads
        sk_axes = ks.dims[1]
        n_sk = math.prod(lctx.axis_sizes[a] for a in sk_axes)
        heads_together = qs.dims[2] == ks.dims[2]
        uneven_q = [d for d in (1, 2) if qs.shape[d] % lctx.shards(qs, d)]
        uneven_kv = heads_together and n_kv_heads % lctx.shards(ks, 2) != 0

        def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            dtype = q.dtype
            q = q if kernel else q.astype(jnp.float32)
            q_pos = lctx.offset(qs, 1) + jnp.arange(q.shape[1])
            h_pos = lctx.offset(qs, 2) + jnp.arange(q.shape[2])
            valid = None
            if uneven_q:  # padded query rows/heads: zero in, zero out (no NaN reaches dk, dv)
                valid = (q_pos < n_q)[None, :, None, None] & (h_pos < n_heads)[None, None, :, None]
                q = jnp.where(valid, q, jnp.zeros_like(q))
            if uneven_kv:  # padded kv heads (only padded query heads read them)
                kv_ok = (lctx.offset(ks, 2) + jnp.arange(k.shape[2]) < n_kv_heads)[
                    None, None, :, None
                ]
                k = jnp.where(kv_ok, k, jnp.zeros_like(k))
                v = jnp.where(kv_ok, v, jnp.zeros_like(v))
            sel = jnp.clip(h_pos // group, 0, n_kv_heads - 1)

            def view(t: jax.Array) -> jax.Array:
                # after any communication: K/V move in their own dtype and head count
                if not heads_together:  # kv heads replicated: the kv head of each query head
                    t = jnp.take(t, sel, axis=2)
                return t if kernel else t.astype(jnp.float32)

            if kernel:
                out = _kernel_local(lctx, q, k, v, view, strategy, n_sk)
            else:
                out = _own_local(lctx, q, k, v, view, q_pos, group if heads_together else 1)
            if valid is not None:
                out = jnp.where(valid, out, jnp.zeros_like(out))
            return out.astype(dtype)

        return local


def _own_local(
    lctx: LocalContext,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    view: Callable[[jax.Array], jax.Array],
    q_pos: jax.Array,
    g: int,
) -> jax.Array:
    """The op's own local algorithm (``implementation`` unset): float32 scores of
    all keys at once, or the ring's online softmax; ``[b, s, H_local, d]`` float32."""
    qs, ks, _ = lctx.inputs
    causal = bool(lctx.attrs.get("causal", False))
    scale = lctx.attrs.get("scale")
    strategy = lctx.attrs.get("strategy", "default")
    scale = float(1.0 / math.sqrt(qs.shape[3]) if scale is None else scale)
    sk_axes, n_k = ks.dims[1], ks.shape[1]
    n_sk = math.prod(lctx.axis_sizes[a] for a in sk_axes)
    b, s, hl, d = q.shape
    q5 = q.reshape(b, s, hl // g, g, d) * scale
    order = _balanced(lctx.attrs)
    if strategy == "ring" and n_sk > 1:
        out = _ring(lctx, ks, q5, k, v, view, q_pos, causal, n_sk, order)
    else:
        if sk_axes:  # gather_kv: K/V sequence-sharded, gathered here
            k = jax.lax.all_gather(k, sk_axes, axis=1, tiled=True)[:, :n_k]
            v = jax.lax.all_gather(v, sk_axes, axis=1, tiled=True)[:, :n_k]
        k_pos = jnp.arange(k.shape[1])
        mask = _mask(q_pos, k_pos, n_k, causal, order)
        _, total, acc = _block(q5, view(k), view(v), mask)
        out = acc / total[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, hl, d)


def _kernel_local(
    lctx: LocalContext,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    view: Callable[[jax.Array], jax.Array],
    strategy: str,
    n_sk: int,
) -> jax.Array:
    """The requested ``implementation`` (:mod:`spmdkit.kernels`) on the local blocks:
    as is (batch/heads parallel), after gathering K/V (``gather_kv``), or per
    arriving K/V block of the ring, merged by log-sum-exp (``ring``)."""
    qs, ks, _ = lctx.inputs
    attrs = lctx.attrs
    causal = bool(attrs.get("causal", False))
    impl, block = attrs.get("implementation"), int(attrs.get("block_size", _BLOCK))
    q_off = lctx.offset(qs, 1) if qs.dims[1] else None
    order = _balanced(attrs)
    if order is not None:  # chunk-sized key blocks: whole blocks skip (even work)
        block = _chunk_block(block, order.chunk_size(qs.shape[1]))
    if strategy == "ring" and n_sk > 1:
        if impl == "xla":
            part = functools.partial(plain_attention_lse, causal=causal, scale=attrs.get("scale"))
        else:  # auto / blockwise (cuDNN's fused kernel returns no log-sum-exp)
            part = functools.partial(
                blockwise_attention_lse, causal=causal, block_size=block, scale=attrs.get("scale")
            )
        return _kernel_ring(lctx, q, k, v, view, q_off, part, n_sk)
    sk_axes, n_k = ks.dims[1], ks.shape[1]
    if sk_axes:  # gather_kv: K/V sequence-sharded, gathered here
        k = jax.lax.all_gather(k, sk_axes, axis=1, tiled=True)[:, :n_k]
        v = jax.lax.all_gather(v, sk_axes, axis=1, tiled=True)[:, :n_k]
    if order is not None:
        kernel = functools.partial(
            attention_kernel,
            causal=causal,
            implementation=impl,
            block_size=block,
            scale=attrs.get("scale"),
        )
        return _balanced_gathered(lctx, kernel, q, k, v, view, order)
    return attention_kernel(
        q,
        view(k),
        view(v),
        causal=causal,
        implementation=impl,
        block_size=block,
        scale=attrs.get("scale"),
        q_offset=q_off,
    )


def _kernel_ring(
    lctx: LocalContext,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    view: Callable[[jax.Array], jax.Array],
    q_off: Any,
    part: Callable[..., tuple[jax.Array, jax.Array]],
    n: int,
) -> jax.Array:
    """The ring with a kernel: each arriving K/V block's partial attention and
    log-sum-exp (``part``), merged into a float32 running output."""
    _, ks, _ = lctx.inputs
    axes, sk, blk = ks.dims[1], ks.shape[1], lctx.block(ks, 1)
    me = lctx.index(axes)
    if sk % n:  # padded keys: zeros (masked by k_limit; no garbage reaches a product)
        real = (lctx.offset(ks, 1) + jnp.arange(blk) < sk)[None, :, None, None]
        k, v = jnp.where(real, k, jnp.zeros_like(k)), jnp.where(real, v, jnp.zeros_like(v))
    perm = [(i, (i + 1) % n) for i in range(n)]
    b, s, h, _ = q.shape

    def rows(w: jax.Array) -> jax.Array:  # [b, kv, g, s] -> [b, s, h, 1]
        return jnp.moveaxis(w, 3, 1).reshape(b, s, h)[..., None]

    order = _balanced(lctx.attrs)

    def visit(step: Any, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        k_off = ((me - step) % n) * blk  # the block that arrived
        if order is not None:
            return _balanced_part(lctx, part, q, view(k), view(v), k_off, order)
        return part(q, view(k), view(v), q_offset=q_off, k_offset=k_off, k_limit=sk)

    def body(carry: tuple, step: jax.Array) -> tuple[tuple, None]:
        out, lse, k, v = carry
        k = jax.lax.ppermute(k, axes, perm)
        v = jax.lax.ppermute(v, axes, perm)
        o, l_blk = visit(step, k, v)
        new = jnp.logaddexp(lse, l_blk)
        out = out * rows(jnp.exp(lse - new)) + o.astype(jnp.float32) * rows(jnp.exp(l_blk - new))
        return (out, new, k, v), None

    # the own block, then the first arriving block outside the loop: its permutes read
    # the op's inputs, as the forward region's do, so XLA computes them once when a
    # grad region recomputes the forward in the same scope (and so does the prediction)
    out, lse = visit(0, k, v)
    carry, _ = body((out.astype(jnp.float32), lse, k, v), 1)
    (out, _, _, _), _ = jax.lax.scan(body, carry, jnp.arange(2, n))
    return out


def _chunk_block(block: int, chunk: int) -> int:
    """The largest key block ``<= block`` that divides a chunk of the balanced order
    (a block never straddles two chunks, so the kernel skips whole masked chunks)."""
    return max(b for b in range(1, min(block, chunk) + 1) if chunk % b == 0)


def _chunks(start: Any, length: int, chunk: int, order: BalancedOrder) -> list[tuple[int, Any]]:
    """The balanced order's chunks in the ``length`` indices from global index
    ``start`` (traced): ``(local start, natural position of its first token)``."""
    first = start // chunk
    return [(i * chunk, order.natural_chunk(first + i) * chunk) for i in range(length // chunk)]


def _merge(acc: Any, o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two partial attentions (output ``[b, s, h, d]``, log-sum-exp ``[b, kv, g, s]``)
    of disjoint key sets merged into one, float32."""
    if acc is None:
        return o.astype(jnp.float32), lse
    out, old = acc
    b, s, h, _ = out.shape
    new = jnp.logaddexp(old, lse)

    def rows(w: jax.Array) -> jax.Array:  # [b, kv, g, s] -> [b, s, h, 1]
        return jnp.moveaxis(w, 3, 1).reshape(b, s, h)[..., None]

    return out * rows(jnp.exp(old - new)) + o.astype(jnp.float32) * rows(jnp.exp(lse - new)), new


def _balanced_part(
    lctx: LocalContext,
    part: Callable[..., tuple[jax.Array, jax.Array]],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_start: Any,
    order: BalancedOrder,
) -> tuple[jax.Array, jax.Array]:
    """The ring's partial attention of the local queries to one arrived K/V block,
    both in the balanced order: one kernel call per (query chunk, key chunk), each
    a run of consecutive positions (a chunk after the query chunk is skipped whole
    by the kernel), merged per query chunk."""
    qs = lctx.inputs[0]
    c = order.chunk_size(qs.shape[1])
    outs, lses = [], []
    for qa, q_off in _chunks(lctx.offset(qs, 1), q.shape[1], c, order):
        acc = None
        for ka, k_off in _chunks(k_start, k.shape[1], c, order):
            o, lse = part(
                q[:, qa : qa + c],
                k[:, ka : ka + c],
                v[:, ka : ka + c],
                q_offset=q_off,
                k_offset=k_off,
                k_limit=None,
            )
            acc = _merge(acc, o, lse)
        outs.append(acc[0])
        lses.append(acc[1])
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=3)


def _balanced_gathered(
    lctx: LocalContext,
    kernel: Callable[..., jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    view: Callable[[jax.Array], jax.Array],
    order: BalancedOrder,
) -> jax.Array:
    """The kernel on whole (gathered) K/V in the balanced order: K/V restored to
    the natural order, then one call per local query chunk at its natural offset
    (the kernel skips the key blocks after the chunk); a whole query sequence is
    restored too and its output put back."""
    qs = lctx.inputs[0]
    k, v = view(order.restore(k, 1)), view(order.restore(v, 1))
    if not qs.dims[1]:
        return order.apply(kernel(order.restore(q, 1), k, v), 1)
    c = order.chunk_size(qs.shape[1])
    parts = [
        kernel(q[:, qa : qa + c], k, v, q_offset=q_off)
        for qa, q_off in _chunks(lctx.offset(qs, 1), q.shape[1], c, order)
    ]
    return jnp.concatenate(parts, axis=1)


def _mask(
    q_pos: jax.Array, k_pos: jax.Array, sk: int, causal: bool, order: BalancedOrder | None = None
) -> jax.Array:
    """[Sq_local, Sk_block] visibility: real keys, and keys ≤ query when causal.
    ``q_pos``/``k_pos`` are global indices; in a balanced ``order`` the causal mask
    compares the natural positions at those indices."""
    mask = (k_pos < sk)[None, :]
    if causal:
        if order is not None:
            q_pos, k_pos = (order.position_of(jnp.clip(p, 0, sk - 1), sk) for p in (q_pos, k_pos))
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    return mask


def _block(
    q5: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax statistics of one key block: row max, row sum, unnormalized output.

    Shapes: q5 [B, Sq, Hkv, G, D] (pre-scaled), k, v [B, Sk, Hkv, D];
    returns m, l [B, Hkv, G, Sq] and acc [B, Hkv, G, Sq, D].
    """
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q5, k)
    s = jnp.where(mask, s, _MASKED)
    m = jnp.max(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    return m, jnp.sum(p, axis=-1), jnp.einsum("bhgqk,bkhd->bhgqd", p, v)


def _ring(
    lctx: LocalContext,
    ks: TensorSpec,
    q5: jax.Array,
    k: jax.Array,
    v: jax.Array,
    view: Callable[[jax.Array], jax.Array],
    q_pos: jax.Array,
    causal: bool,
    n: int,
    order: BalancedOrder | None = None,
) -> jax.Array:
    """Online softmax over the key blocks as they pass around the ring of ``ks``'s
    sequence axes; each step sends this device's current block to the next device.
    ``view`` turns an arrived block into what the local query heads read."""
    axes = ks.dims[1]
    sk = ks.shape[1]
    blk = lctx.block(ks, 1)
    me = lctx.index(axes)
    real = (lctx.offset(ks, 1) + jnp.arange(blk) < sk)[None, :, None, None]
    k, v = jnp.where(real, k, jnp.zeros_like(k)), jnp.where(real, v, jnp.zeros_like(v))
    perm = [(i, (i + 1) % n) for i in range(n)]

    def visit(step: Any, k: jax.Array, v: jax.Array):
        k_pos = ((me - step) % n) * blk + jnp.arange(blk)  # the block that arrived
        return _block(q5, view(k), view(v), _mask(q_pos, k_pos, sk, causal, order))

    def body(carry: tuple, step: jax.Array) -> tuple[tuple, None]:
        m, total, acc, k, v = carry
        k = jax.lax.ppermute(k, axes, perm)
        v = jax.lax.ppermute(v, axes, perm)
        bm, btotal, bacc = visit(step, k, v)
        new = jnp.maximum(m, bm)
        a, c = jnp.exp(m - new), jnp.exp(bm - new)
        carry = (new, total * a + btotal * c, acc * a[..., None] + bacc * c[..., None], k, v)
        return carry, None

    # own block first, then n - 1 steps that each receive the next block
    m, total, acc = visit(0, k, v)
    (_, total, acc, _, _), _ = jax.lax.scan(body, (m, total, acc, k, v), jnp.arange(1, n))
    return acc / total[..., None]


# ---------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------

_EXAMPLES = (
    Example(((2, 8, 4, 4), (2, 8, 2, 4), (2, 8, 2, 4)), attrs={"causal": True}),
    Example(
        ((2, 6, 4, 4), (2, 6, 1, 4), (2, 6, 1, 4)),
        attrs={"causal": True, "strategy": "gather_kv"},
        uneven=True,
    ),
)

RULES = (AttentionRule(_EXAMPLES),)

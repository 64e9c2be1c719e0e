"""Local attention kernels: the computations an ``attention`` op runs on one device.

Three implementations of scaled dot-product attention with grouped-query heads
(``q [b, Sq, H, d]``, ``k, v [b, Sk, Hkv, d]``, ``Hkv`` dividing ``H``), chosen by
:func:`attention_kernel`'s ``implementation``:

* ``"xla"``: :func:`plain_attention`, the plain computation (materializes the
  ``[b, Hkv, group, Sq, Sk]`` scores; autodiff keeps the probabilities).
* ``"blockwise"``: :func:`blockwise_attention`, flash-style: a scan over key/value
  blocks with an online softmax, a ``jax.custom_vjp`` whose residuals are O(S)
  (``q, k, v``, the output and the per-row log-sum-exp) and whose backward is
  flash-attention 2's.
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, the fused
  kernel (a GPU whose cuDNN accepts the shapes and dtypes).
* ``"auto"`` (or ``None``): cuDNN on a GPU when it accepts the inputs, else blockwise.

Positions make the kernels usable on one block of a sequence-sharded layout:
``q_offset`` is the global position of the first query row (causal masking
compares global positions), ``k_offset`` that of the first key, and ``k_limit``
the global key count (keys at or beyond it are padding and masked). Without
them the kernels are the reference models' attention, unchanged.
:func:`blockwise_attention_lse` / :func:`plain_attention_lse` also return the
per-row log-sum-exp (differentiable), which a ring schedule needs to merge the
partial results of key blocks.

Matmuls take the input dtype and accumulate in float32; the softmax statistics
are float32; probabilities are cast to ``v``'s dtype before multiplying ``v``. The
output has ``q``'s dtype.

Example::

    >>> q = jnp.ones((2, 100, 4, 16)); kv = jnp.ones((2, 100, 2, 16))
    >>> attention_kernel(q, kv, kv, causal=True, implementation="blockwise",
    ...                  block_size=32).shape
    (2, 100, 4, 16)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from spmdkit.errors import SpmdError
from spmdkit.state import register_context

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "AttentionError",
    "attention_kernel",
    "blockwise_attention",
    "blockwise_attention_lse",
    "on_gpu",
    "plain_attention",
    "plain_attention_lse",
    "record_visits",
    "recording_visits",
    "resolve_implementation",
    "Visit",
]

ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("auto", "xla", "blockwise", "cudnn")
"""The implementations :func:`attention_kernel` (and the ``attention`` op's
``implementation=``) accept."""


def resolve_implementation(implementation: str | None) -> str:
    """``implementation`` checked against :data:`ATTENTION_IMPLEMENTATIONS`
    (``None``: ``"auto"``).

    Raises:
      AttentionError: an unknown implementation.

    Example::

        >>> resolve_implementation(None)
        'auto'
    """
    impl = "auto" if implementation is None else implementation
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise AttentionError(
            op="attention",
            must=f"implementation be one of {ATTENTION_IMPLEMENTATIONS} or None",
            given=repr(implementation),
            fix='pass implementation="auto" (or None)',
        )
    return impl


class AttentionError(SpmdError, ValueError):
    """Attention was asked for an implementation it cannot run.

    Broken example: ``attention_kernel(q, k, v, implementation="cudnn")`` on a CPU-only machine.
    """


def on_gpu() -> bool:
    """Whether the default backend is a GPU (where ``"auto"`` tries cuDNN)."""
    return jax.default_backend() in ("gpu", "cuda")


def _check_qkv(op: str, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    ok = (
        q.ndim == 4
        and k.shape == v.shape
        and k.ndim == 4
        and (q.shape[0], q.shape[3]) == (k.shape[0], k.shape[3])
        and k.shape[2] > 0
        and q.shape[2] % k.shape[2] == 0
    )
    if not ok:
        raise AttentionError(
            op=op,
            must="q be [b, Sq, heads, d], k and v [b, Sk, kv_heads, d] with kv_heads | heads",
            given=f"q {q.shape}, k {k.shape}, v {v.shape}",
            fix="reshape the projections to [batch, seq, heads, head_dim]",
        )


def _positions(n: int, offset: Any) -> jax.Array:
    pos = jnp.arange(n)
    return pos if offset is None else offset + pos


def _scale(d: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def attention_kernel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    implementation: str | None = None,
    block_size: int = 512,
    scale: float | None = None,
    q_offset: Any = None,
) -> jax.Array:
    """Scaled dot-product attention by the chosen implementation (module docstring).

    Args:
      q: ``[batch, Sq, heads, head_dim]``.
      k: ``[batch, Sk, kv_heads, head_dim]``; ``heads`` a multiple of ``kv_heads``.
      v: like ``k``.
      causal: mask out keys after each query (global positions).
      implementation: one of :data:`ATTENTION_IMPLEMENTATIONS` or ``None`` (auto).
      block_size: key/value block length of the blockwise version.
      scale: logit scale (default ``1/sqrt(head_dim)``).
      q_offset: global position of the first query row (an int or a traced scalar;
        ``None``: 0).

    Returns:
      ``[batch, Sq, heads, head_dim]`` in ``q``'s dtype.

    Raises:
      AttentionError: unknown implementation, bad shapes, or ``"cudnn"`` where it
        cannot run (no GPU, inputs cuDNN rejects, or a query offset under ``causal``).
    """
    impl = resolve_implementation(implementation)
    _check_qkv("attention", q, k, v)
    if impl == "xla":
        return plain_attention(q, k, v, causal=causal, scale=scale, q_offset=q_offset)
    fused = not (causal and q_offset is not None)  # cuDNN's causal mask is top-left
    if impl == "cudnn" and not fused:
        raise AttentionError(
            op="attention",
            must="cuDNN's causal attention start its query block at position 0",
            given="a query block at an offset (a sequence-sharded layout)",
            fix='use implementation="auto" or "blockwise" for sequence-sharded attention',
        )
    if impl == "cudnn" or (impl == "auto" and fused):
        out = _cudnn(q, k, v, causal, scale, impl == "cudnn")
        if out is not None:
            return out
    return blockwise_attention(
        q, k, v, causal=causal, block_size=block_size, scale=scale, q_offset=q_offset
    )


def _cudnn(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, scale: float | None, strict: bool
) -> jax.Array | None:
    """cuDNN's fused attention; None where ``"auto"`` falls back to blockwise
    (``strict``: ``"cudnn"`` was asked for, so a refusal raises)."""
    if not on_gpu():
        if not strict:
            return None
        raise AttentionError(
            op="attention",
            must="a GPU with cuDNN be the default backend for implementation='cudnn'",
            given=f"backend {jax.default_backend()!r}",
            fix='pass implementation="auto" or "blockwise"',
        )
    try:
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="cudnn"
        )
    except (ValueError, NotImplementedError, RuntimeError, TypeError) as err:
        if not strict:
            return None
        raise AttentionError(
            op="attention",
            must="cuDNN's fused attention accept the inputs",
            given=f"q {q.shape} {q.dtype}, k {k.shape}; cuDNN said: {err}",
            fix='use bf16/fp16 inputs, or implementation="blockwise"',
        ) from err


def _causal_keep(n_q: int, q_offset: Any, kpos: jax.Array) -> jax.Array:
    return kpos[None, :] <= _positions(n_q, q_offset)[:, None]


def plain_attention_lse(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_offset: Any = None,
    k_offset: Any = None,
    k_limit: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The plain computation and its per-row log-sum-exp ``[b, kv_heads, group, Sq]``
    (float32). Rows that see no key give a finite, very negative log-sum-exp."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k).astype(jnp.float32)
    scores = _divide(scores, d, _scale(d, scale))
    keep = _key_keep(k.shape[1], k.shape[1], k_offset, k_limit)
    if causal:
        keep = keep[None, :] & _causal_keep(s, q_offset, _positions(k.shape[1], k_offset))
    if causal or k_limit is not None:
        scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, s, h, d), jax.nn.logsumexp(scores, axis=-1)


def plain_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_offset: Any = None,
) -> jax.Array:
    """The plain computation (``"xla"``): scores, softmax, weighted values.

    Example::

        >>> plain_attention(q, kv, kv, causal=True).shape == q.shape
        True
    """
    _check_qkv("attention", q, k, v)
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k).astype(jnp.float32)
    scores = _divide(scores, d, _scale(d, scale))
    if causal:
        mask = _causal_keep(s, q_offset, jnp.arange(k.shape[1]))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, s, h, d)


def _key_keep(n: int, length: int, k_offset: Any, k_limit: int | None) -> jax.Array:
    """Which of ``n`` local key slots are real: inside the local ``length`` and,
    with ``k_limit``, before the global key count."""
    local = jnp.arange(n)
    keep = local < length
    if k_limit is not None:
        keep = keep & (_positions(n, k_offset) < k_limit)
    return keep


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    block_size: int = 512,
    scale: float | None = None,
    q_offset: Any = None,
) -> jax.Array:
    """Flash-style attention: key/value blocks, online softmax, O(S) residuals.

    The forward runs a ``lax.scan`` over key/value blocks of ``block_size`` keys,
    keeping a running row max and row sum (float32) and a float32 output
    accumulator; it saves only ``q``, ``k``, ``v``, the output and the per-row
    log-sum-exp. The backward (a ``jax.custom_vjp``) recomputes each block's
    probabilities from the saved log-sum-exp and accumulates dQ in a scan carry
    while emitting each block's dK and dV (flash-attention 2's backward, with
    ``D = rowsum(dO * O)``). The largest temporary is one block of scores,
    ``[b, kv_heads, group, Sq, block]``.

    ``block_size`` is clamped to the key length. When it does not divide it, the
    keys and values are zero-padded to a whole number of blocks and the padded
    keys are masked out (so any block size works).

    Args:
      q: ``[batch, Sq, heads, head_dim]``.
      k: ``[batch, Sk, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
      v: like ``k``.
      causal: mask out keys after each query; every query row must see key 0.
      block_size: keys per block (>= 1).
      scale: logit scale (default ``1/sqrt(head_dim)``).
      q_offset: global position of the first query row (``None``: 0).

    Returns:
      ``[batch, Sq, heads, head_dim]``, equal to the plain attention.

    Raises:
      AttentionError: bad shapes or ``block_size < 1``.

    Example::

        >>> blockwise_attention(q, kv, kv, block_size=32).shape   # 4 blocks, last one padded
        (2, 100, 4, 16)
    """
    _check_qkv("blockwise_attention", q, k, v)
    _check_block(block_size)
    pos = _Pos(causal, min(block_size, k.shape[1]), _scale(q.shape[3], scale), None, None)
    # one manual-axis type for the three: a custom VJP's cotangents must match its
    # inputs' types, and a replicated K/V's cotangent varies with the query's
    # (the cast's transpose sums it over those axes)
    q, k, v = (_varying(x, q, k, v) for x in (q, k, v))
    return _flash(q, k, v, q_offset, pos)


def blockwise_attention_lse(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    block_size: int = 512,
    scale: float | None = None,
    q_offset: Any = None,
    k_offset: Any = None,
    k_limit: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`blockwise_attention` on one key block of a longer sequence, with the
    per-row log-sum-exp ``[b, kv_heads, group, Sq]`` (float32, differentiable).

    ``k_offset`` is the global position of the first key, ``k_limit`` the global
    key count. Rows that see no key of this block give the mean of its values with
    a log-sum-exp at float32's lowest value, so a log-sum-exp-weighted merge gives
    them weight 0 (no NaN, forward or backward).
    """
    _check_qkv("blockwise_attention", q, k, v)
    _check_block(block_size)
    blk = min(block_size, k.shape[1])
    pos = _Pos(causal, blk, _scale(q.shape[3], scale), k_limit, True)
    q, k, v = (_varying(x, q, k, v) for x in (q, k, v))  # as blockwise_attention
    return _flash_lse(q, k, v, (q_offset, k_offset), pos)


def _check_block(block_size: Any) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise AttentionError(
            op="blockwise_attention",
            must="block_size be a positive int",
            given=repr(block_size),
            fix="pass e.g. block_size=512",
        )


class _Pos(tuple):
    """The static facts of a blockwise call: (causal, block, scale, k_limit, lse)."""

    def __new__(cls, causal: bool, block: int, scale: float, k_limit: Any, lse: Any) -> _Pos:
        return super().__new__(cls, (causal, block, scale, k_limit, lse))


def _varying(x: jax.Array, *refs: Any) -> jax.Array:
    """``x`` typed varying over every manual axis some of ``refs`` vary over (a scan
    carry initialized from constants inside ``shard_map`` must match its body's
    output type); a no-op outside ``shard_map``."""
    want: set[str] = set()
    for r in jax.tree.leaves(refs):
        want |= set(_vma(r))
    axes = tuple(sorted(want - set(_vma(x))))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _vma(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    found = getattr(aval, "vma", None)  # some jax versions expose it as .vma
    if found is None:
        mat = getattr(aval, "manual_axis_type", None)
        found = getattr(mat, "varying", ()) or ()
    return frozenset(found)


def _to_blocks(x: jax.Array, block: int) -> jax.Array:
    """``[b, s, kv, d]`` -> ``[n_blocks, b, block, kv, d]``, zero-padded at the end."""
    b, s, kv, d = x.shape
    n = -(-s // block)
    if n * block != s:
        x = jnp.pad(x, ((0, 0), (0, n * block - s), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(b, n, block, kv, d), 1, 0)


def _from_blocks(x: jax.Array, s: int) -> jax.Array:
    """Inverse of :func:`_to_blocks` (drops the padding)."""
    n, b, block, kv, d = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(b, n * block, kv, d)[:, :s]


def _block_scores(
    qg: jax.Array, kj: jax.Array, j: jax.Array, sk: int, offsets: Any, pos: _Pos
) -> jax.Array:
    """Scaled float32 scores ``[b, kv, g, Sq, block]`` of block ``j``; masked keys
    (after the query, padding, beyond ``k_limit``) get the lowest float32, so
    ``exp(score - max)`` is 0 there."""
    causal, _, scale, k_limit, _ = pos
    q_offset, k_offset = offsets
    block = kj.shape[1]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, kj, preferred_element_type=jnp.float32)
    scores = _divide(scores, qg.shape[-1], scale)
    kpos = j * block + jnp.arange(block)
    keep = kpos < sk
    if k_limit is not None:
        keep = keep & (_positions(block, k_offset) + j * block < k_limit)
    if causal:
        gpos = kpos if k_offset is None else k_offset + kpos
        keep = keep[None, :] & _causal_keep(qg.shape[1], q_offset, gpos)
    # The mask depends only on positions: inside a scan over layers, JAX's partial
    # evaluation hoists such loop-invariant values out of the layer scan, and its
    # broadcast to the scores' shape would be stacked per key block as a residual
    # ([blocks, b, kv, g, S, block] booleans: 32 GiB at Llama-3 8B's shapes). Tying
    # the small mask to the scores keeps the broadcast inside the loop body.
    scores, keep = jax.lax.optimization_barrier((scores, keep))
    return jnp.where(keep, scores, jnp.finfo(jnp.float32).min)


class Visit(NamedTuple):
    """One key block a blockwise kernel computed (:func:`record_visits`).

    Attributes:
      kind: ``"forward"`` or ``"backward"``.
      q_offset: global position of the call's first query row.
      q_len: the call's query rows.
      k_offset: global position of the block's first key.
      k_len: the block's keys.
      flops: the block's matmul FLOPs (forward: ``q·k`` and ``p·v``; backward:
        ``dv``, ``dp``, ``dk``, ``dq``).
    """

    kind: str
    q_offset: int
    q_len: int
    k_offset: int
    k_len: int
    flops: int


_VISITS: contextvars.ContextVar[list | None] = register_context(
    contextvars.ContextVar("spmdkit_kernel_visits", default=None),
    module=__name__,
    name="_VISITS",
    set_by="`record_visits()`",
    read_by="the attention kernels' debug callbacks",
    why="the list the blockwise kernels' visits are recorded into while a program runs "
    "(measuring only).",
)


@contextlib.contextmanager
def record_visits() -> Iterator[list[Visit]]:
    """Record every key block the blockwise kernels compute at run time, per device.

    Functions traced inside the ``with`` get a host callback in the branch that
    computes a block (not in the one that skips it), so the list fills when the
    compiled program runs, once per device and block: the work each device did,
    read off the program, not from a formula. Trace a fresh function inside (a
    cached trace has no callbacks). Only for measuring: the callbacks cost time.

    Example::

        >>> with record_visits() as visits:
        ...     jax.block_until_ready(jax.jit(f)(q, k, v))
        >>> sum(v.flops for v in visits if v.kind == "forward")
    """
    sink: list[Visit] = []
    token = _VISITS.set(sink)
    try:
        yield sink
    finally:
        _VISITS.reset(token)


def recording_visits() -> bool:
    """Whether a :func:`record_visits` block is open here: a program traced now
    holds callbacks into that block's list, so a cache of traced programs must
    neither serve it one traced before nor keep the one traced in it
    (:func:`spmdkit.engine.region.region_jaxpr`)."""
    return _VISITS.get() is not None


def _record(qg: jax.Array, offsets: Any, j: Any, pos: _Pos, kind: str) -> None:
    sink = _VISITS.get()
    if sink is None:
        return
    b, s, kv, g, d = qg.shape
    block = pos[1]
    flops = (4 if kind == "forward" else 8) * b * kv * g * s * block * d
    q_offset, k_offset = offsets
    q0 = jnp.asarray(0 if q_offset is None else q_offset)
    k0 = j * block + (0 if k_offset is None else k_offset)

    def append(q0: Any, k0: Any) -> None:
        sink.append(Visit(kind, int(q0), s, int(k0), block, flops))

    jax.debug.callback(append, q0, k0)


def _may_skip(offsets: Any, pos: _Pos) -> bool:
    """Whether a blockwise call may skip key blocks (:func:`_skipping`): only a call
    on a block of a longer sequence (offsets or a key limit)."""
    causal, _, _, k_limit, _ = pos
    return k_limit is not None or (causal and tuple(offsets) != (None, None))


def _skipping(
    visit: Any, skip: Any, carry: Any, xs: Any, offsets: Any, s: int, sk: int, pos: _Pos
) -> Any:
    """``visit(carry, xs)`` for key block ``xs[2]`` where some query row can see a key
    of it, else ``skip(carry, xs)`` (a ``lax.cond``: a skipped block costs nothing at
    run time). Only on a block of a longer sequence (offsets or a key limit): the
    whole-sequence kernel sees key 0 from every row and keeps its plain scan."""
    causal, block, _, k_limit, _ = pos
    q_offset, k_offset = offsets
    if not _may_skip(offsets, pos):
        return visit(carry, xs)
    j = xs[2]
    k0 = j * block + (0 if k_offset is None else k_offset)
    keep = j * block < sk
    if k_limit is not None:
        keep = keep & (k0 < k_limit)
    if causal:
        keep = keep & (k0 <= (0 if q_offset is None else q_offset) + s - 1)
    return jax.lax.cond(keep, visit, skip, carry, xs)


def _exact_sqrt(d: int, scale: float) -> bool:
    """Whether ``scale`` is the default ``1/sqrt(d)`` (then divide by ``sqrt(d)``,
    bit for bit the reference models' attention)."""
    return scale == 1.0 / math.sqrt(d)


def _divide(scores: jax.Array, d: int, scale: float) -> jax.Array:
    return scores / math.sqrt(d) if _exact_sqrt(d, scale) else scores * scale


# q, dO and dQ stay token-major ([b, s, kv, group, d], a reshape of [b, s, heads, d]):
# transposing them to heads-first before the loops lets XLA reshard a sequence-
# parallel layout with an all-to-all that the planner does not predict.


def _flash_forward(q, k, v, offsets, pos):
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    f32 = jnp.float32
    sk = k.shape[1]

    def visit(carry, xs):
        acc, m, total = carry
        kj, vj, j = xs
        _record(qg, offsets, j, pos, "forward")
        scores = _block_scores(qg, kj, j, sk, offsets, pos)
        # with no offsets key 0 is in block 0 and visible to every row, so m_new is a
        # real score from the first step on and masked entries get exp(min - m_new) = 0
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        corr = jnp.exp(m - m_new)
        total = total * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj, preferred_element_type=f32)
        return (acc * corr[..., None] + pv, m_new, total)

    def step(carry, xs):
        return _skipping(visit, lambda c, _: c, carry, xs, offsets, s, sk, pos), None

    stats = (b, kv, h // kv, s)
    low = jnp.finfo(f32).min
    init = (jnp.zeros((*stats, d), f32), jnp.full(stats, low, f32), jnp.zeros(stats, f32))
    init = tuple(_varying(x, q, k, v, offsets) for x in init)
    kb, vb = _to_blocks(k, pos[1]), _to_blocks(v, pos[1])
    (acc, m, total), _ = jax.lax.scan(step, init, (kb, vb, jnp.arange(kb.shape[0])))
    if not _may_skip(offsets, pos):  # the whole sequence: every row sees key 0
        out = (acc / total[..., None]).astype(q.dtype)  # [b, kv, g, s, d]
        return jnp.moveaxis(out, 3, 1).reshape(b, s, h, d), m + jnp.log(total)
    # a row whose every block was skipped has total 0: output 0, log-sum-exp lowest
    seen = total > 0
    out = (acc / jnp.where(seen, total, 1.0)[..., None]).astype(q.dtype)  # [b, kv, g, s, d]
    out = jnp.moveaxis(out, 3, 1).reshape(b, s, h, d)
    return out, jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), low)


def _flash_backward(offsets, pos, res, d_out, d_lse=None):
    q, k, v, out, lse = res
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    f32 = jnp.float32
    sk = k.shape[1]
    qg, dog = q.reshape(b, s, kv, g, d), d_out.reshape(b, s, kv, g, d)
    # D = rowsum(dO * O), float32, in the scores' [b, kv, g, s] layout; a cotangent
    # of the log-sum-exp adds P * d_lse to the scores' cotangent: D - d_lse
    delta = jnp.einsum(
        "bqkgd,bqkgd->bkgq", dog.astype(f32), out.reshape(b, s, kv, g, d).astype(f32)
    )
    if d_lse is not None:
        delta = delta - d_lse

    def visit(dq, xs):
        kj, vj, j = xs
        _record(qg, offsets, j, pos, "backward")
        p = jnp.exp(_block_scores(qg, kj, j, sk, offsets, pos) - lse[..., None])
        dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype), dog, preferred_element_type=f32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, vj, preferred_element_type=f32)
        ds = _divide(p * (dp - delta[..., None]), d, pos[2]).astype(q.dtype)
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qg, preferred_element_type=f32)
        dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=f32)
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    def skip(dq, xs):
        kj, vj, _ = xs
        return dq, (jnp.zeros_like(kj), jnp.zeros_like(vj))

    def step(dq, xs):
        return _skipping(visit, skip, dq, xs, offsets, s, sk, pos)

    kb, vb = _to_blocks(k, pos[1]), _to_blocks(v, pos[1])
    dq0 = _varying(jnp.zeros(qg.shape, f32), q, k, v, d_out, lse, offsets)
    dq, (dk, dv) = jax.lax.scan(step, dq0, (kb, vb, jnp.arange(kb.shape[0])))
    return dq.reshape(b, s, h, d).astype(q.dtype), _from_blocks(dk, sk), _from_blocks(dv, sk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, q_offset, pos):
    return _flash_forward(q, k, v, (q_offset, None), pos)[0]


def _flash_fwd(q, k, v, q_offset, pos):
    out, lse = _flash_forward(q, k, v, (q_offset, None), pos)
    return out, (q, k, v, out, lse, q_offset)


def _flash_bwd(pos, res, d_out):
    *res, q_offset = res
    dq, dk, dv = _flash_backward((q_offset, None), pos, tuple(res), d_out)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_lse(q, k, v, offsets, pos):
    return _flash_forward(q, k, v, offsets, pos)


def _flash_lse_fwd(q, k, v, offsets, pos):
    out, lse = _flash_forward(q, k, v, offsets, pos)
    return (out, lse), (q, k, v, out, lse, offsets)


def _flash_lse_bwd(pos, res, cts):
    *res, offsets = res
    d_out, d_lse = cts
    dq, dk, dv = _flash_backward(offsets, pos, tuple(res), d_out, d_lse)
    return dq, dk, dv, None


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)

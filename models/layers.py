"""Shared pieces of the reference models: the swappable computations and small layers.

The NNX models' norms are :mod:`spmdkit.nn` modules (``LayerNorm``, ``RMSNorm``,
``GroupNorm``, ``BatchNorm``) and their losses :func:`spmdkit.nn.cross_entropy`;
the language models' token tables are ``sk.nn.Embed`` modules (:func:`token_embed`;
the table at ``embed/embedding``, the tied head its ``attend``).
The functions at the top (``layer_norm``, ``rms_norm``, ``group_norm``,
``sync_batch_norm``, ``embedding_lookup``, ``softmax_cross_entropy``) are the same
:mod:`spmdkit.ops` calls for code that holds the parameters itself (tests);
``attention`` is the models' own (blockwise / cuDNN).

The layers below them create their parameters with logical axis names in flax's
standard ``out_sharding`` metadata and never mention a mesh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit import nn as sknn
from spmdkit import ops
from spmdkit.errors import SpmdError
from spmdkit.nn.calls import call_op
from spmdkit.planner import BATCH_NAMES, PARAM_NAMES

__all__ = [
    "ModelConfigError",
    "PARAM_AXES",
    "BATCH_AXES",
    "layer_norm",
    "rms_norm",
    "group_norm",
    "batch_norm",
    "sync_batch_norm",
    "attention",
    "blockwise_attention",
    "AttentionError",
    "ATTENTION_IMPLEMENTATIONS",
    "embedding_lookup",
    "softmax_cross_entropy",
    "batch_stats",
    "rope",
    "param",
    "fan_in_init",
    "token_embed",
    "check_config",
    "count_params",
    "norm_rngs",
    "make_layers",
    "run_layers",
]

PARAM_AXES: frozenset[str] = frozenset(PARAM_NAMES)
"""Every logical axis name a parameter of the reference models may carry (the
names every preset of :mod:`spmdkit.planner` maps)."""

BATCH_AXES: frozenset[str] = frozenset(BATCH_NAMES)
"""Every logical axis name a batch field of the reference models may carry."""

Initializer = Callable[..., jax.Array]


class ModelConfigError(SpmdError, ValueError):
    """A model config is inconsistent.

    Broken example: ``ConvNetConfig(widths=(16, 32), blocks=(1,), norms=("group",))``.
    """


# ---------------------------------------------------------------------------
# Swappable computations (spmdkit.ops will provide sharded versions).
# ---------------------------------------------------------------------------


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *, eps: float) -> jax.Array:
    """Layer norm over the last dim, statistics in float32 (:func:`spmdkit.ops.layer_norm`)."""
    y = call_op(ops.layer_norm, *_f32(x, scale, bias), epsilon=eps)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float) -> jax.Array:
    """RMS norm over the last dim, statistics in float32 (:func:`spmdkit.ops.rms_norm`)."""
    return call_op(ops.rms_norm, *_f32(x, scale), epsilon=eps).astype(x.dtype)


def group_norm(
    x: jax.Array, scale: jax.Array, bias: jax.Array, *, groups: int, eps: float
) -> jax.Array:
    """Group norm of an NHWC tensor: statistics per sample over (H, W, C/groups)
    (:func:`spmdkit.ops.group_norm`, in float32)."""
    y = call_op(
        ops.group_norm, *_f32(x, scale, bias), num_groups=groups, epsilon=eps, data_format="NHWC"
    )
    return y.astype(x.dtype)


def _f32(*xs: jax.Array) -> list[jax.Array]:
    return [x.astype(jnp.float32) for x in xs]


def batch_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    *,
    eps: float,
) -> jax.Array:
    """Normalize the channels (last dim) with the given statistics."""
    y = (x.astype(jnp.float32) - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale + bias).astype(x.dtype)


def batch_stats(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-channel mean and (biased) variance over every dim but the last."""
    axes = tuple(range(x.ndim - 1))
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=axes)
    var = jnp.mean(jnp.square(xf - mean), axis=axes)
    return mean, var


def sync_batch_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    *,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Batch norm of an NHWC tensor by :func:`spmdkit.ops.sync_batch_norm`: in
    training with the global batch statistics (float32), else with ``mean``/``var``.

    Returns:
      ``(y, new_mean, new_var)``: the running statistics updated as flax does
      (``momentum · old + (1 - momentum) · batch``; unchanged when not training).
    """
    y, new_mean, new_var = call_op(
        ops.sync_batch_norm,
        x.astype(jnp.float32),
        mean,
        var,
        *_f32(scale, bias),
        training=training,
        momentum=momentum,
        epsilon=eps,
        data_format="NHWC",
    )
    return y.astype(x.dtype), new_mean, new_var


ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("auto", "xla", "blockwise", "cudnn")
"""What ``attention(..., implementation=)`` and the configs' ``attention`` field accept."""


class AttentionError(SpmdError, ValueError):
    """Attention was asked for an implementation it cannot run.

    Broken example: ``attention(q, k, v, implementation="cudnn")`` on a CPU-only machine.
    """


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    implementation: str | None = None,
    block_size: int = 512,
) -> jax.Array:
    """Scaled dot-product attention with grouped-query support.

    Implementations:

    * ``"xla"``: the plain computation; materializes the ``[b, kv, group, S, S]``
      scores (and keeps the probabilities for the backward).
    * ``"blockwise"``: :func:`blockwise_attention`, flash-style, O(S) residuals and
      no S×S value in its jaxpr.
    * ``"cudnn"``: ``jax.nn.dot_product_attention(..., implementation="cudnn")``, the
      fused kernel; only on a GPU whose cuDNN accepts the shapes and dtypes (bf16/fp16).
    * ``None`` / ``"auto"``: cuDNN on a GPU when it accepts the inputs, else blockwise.
      On a CPU-only machine (the planner's abstract tracing included) this traces the
      blockwise version, whose memory profile is the fused kernel's.

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k: ``[batch, seq, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``.
      v: like ``k``.
      causal: mask out keys after each query.
      implementation: one of :data:`ATTENTION_IMPLEMENTATIONS` or ``None`` (auto).
      block_size: key/value block length of the blockwise version.

    Returns:
      ``[batch, seq, heads, head_dim]``.

    Raises:
      AttentionError: unknown implementation, bad shapes, or ``"cudnn"`` where it cannot run.

    Example::

        >>> q = jnp.ones((1, 1024, 8, 64)); kv = jnp.ones((1, 1024, 2, 64))
        >>> attention(q, kv, kv, implementation="blockwise", block_size=256).shape
        (1, 1024, 8, 64)
    """
    impl = "auto" if implementation is None else implementation
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise AttentionError(
            op="attention",
            must=f"implementation be one of {ATTENTION_IMPLEMENTATIONS} or None",
            given=repr(implementation),
            fix='pass implementation="auto" (or None)',
        )
    _check_qkv(q, k, v)
    if impl == "xla":
        return _plain_attention(q, k, v, causal=causal)
    if impl in ("cudnn", "auto") and _on_gpu():
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError, TypeError) as err:
            if impl == "cudnn":
                raise AttentionError(
                    op="attention",
                    must="cuDNN's fused attention accept the inputs",
                    given=f"q {q.shape} {q.dtype}, k {k.shape}; cuDNN said: {err}",
                    fix='use bf16/fp16 inputs, or implementation="blockwise"',
                ) from err
    elif impl == "cudnn":
        raise AttentionError(
            op="attention",
            must="a GPU with cuDNN be the default backend for implementation='cudnn'",
            given=f"backend {jax.default_backend()!r}",
            fix='pass implementation="auto" or "blockwise"',
        )
    return blockwise_attention(q, k, v, causal=causal, block_size=block_size)


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    ok = (
        q.ndim == 4
        and k.shape == v.shape
        and k.ndim == 4
        and (q.shape[0], q.shape[1], q.shape[3]) == (k.shape[0], k.shape[1], k.shape[3])
        and k.shape[2] > 0
        and q.shape[2] % k.shape[2] == 0
    )
    if not ok:
        raise AttentionError(
            op="attention",
            must="q be [b, s, heads, d], k and v [b, s, kv_heads, d] with kv_heads | heads",
            given=f"q {q.shape}, k {k.shape}, v {v.shape}",
            fix="reshape the projections to [batch, seq, heads, head_dim]",
        )


def _plain_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool) -> jax.Array:
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k).astype(jnp.float32) / math.sqrt(d)
    if causal:
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, s, h, d)


def blockwise_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, block_size: int = 512
) -> jax.Array:
    """Flash-style attention: key/value blocks, online softmax, O(S) residuals.

    The forward runs a ``lax.scan`` over key/value blocks of ``block_size`` keys,
    keeping a running row max and row sum (float32) and a float32 output
    accumulator; it saves only ``q``, ``k``, ``v``, the output and the per-row
    log-sum-exp. The backward (a ``jax.custom_vjp``) recomputes each block's
    probabilities from the saved log-sum-exp and accumulates dQ in a scan carry
    while emitting each block's dK and dV (flash-attention 2's backward, with
    ``D = rowsum(dO * O)``). The largest temporary is one block of scores,
    ``[b, kv_heads, group, S, block]``; no value has two dims of size S unless
    ``block_size >= S``.

    ``block_size`` is clamped to the sequence length. When it does not divide the
    sequence, the keys and values are zero-padded to a whole number of blocks and
    the padded keys are masked out (so any block size works).

    Matmuls take the input dtype and accumulate in float32; the softmax statistics
    are float32; probabilities are cast to ``v``'s dtype before multiplying ``v``,
    as the plain version does. The output has ``q``'s dtype.

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k: ``[batch, seq, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
      v: like ``k``.
      causal: mask out keys after each query.
      block_size: keys per block (>= 1).

    Returns:
      ``[batch, seq, heads, head_dim]``, equal to the plain attention.

    Raises:
      AttentionError: bad shapes or ``block_size < 1``.

    Example::

        >>> q = jnp.ones((2, 100, 4, 16)); kv = jnp.ones((2, 100, 2, 16))
        >>> blockwise_attention(q, kv, kv, block_size=32).shape   # 4 blocks, last one padded
        (2, 100, 4, 16)
    """
    _check_qkv(q, k, v)
    if not isinstance(block_size, int) or block_size < 1:
        raise AttentionError(
            op="blockwise_attention",
            must="block_size be a positive int",
            given=repr(block_size),
            fix="pass e.g. block_size=512",
        )
    return _flash(q, k, v, causal, min(block_size, q.shape[1]))


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


def _block_scores(qg: jax.Array, kj: jax.Array, j: jax.Array, causal: bool) -> jax.Array:
    """Scaled float32 scores ``[b, kv, g, S, block]`` of block ``j``; masked keys (after
    the query, or padding) get the lowest float32, so ``exp(score - max)`` is 0 there."""
    s, block = qg.shape[1], kj.shape[1]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, kj, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(qg.shape[-1])
    kpos = j * block + jnp.arange(block)
    keep = kpos < s
    if causal:
        keep = keep[None, :] & (kpos[None, :] <= jnp.arange(s)[:, None])
    # The mask depends only on positions: inside a scan over layers, JAX's partial
    # evaluation hoists such loop-invariant values out of the layer scan, and its
    # broadcast to the scores' shape would be stacked per key block as a residual
    # ([blocks, b, kv, g, S, block] booleans: 32 GiB at Llama-3 8B's shapes). Tying
    # the small mask to the scores keeps the broadcast inside the loop body.
    scores, keep = jax.lax.optimization_barrier((scores, keep))
    return jnp.where(keep, scores, jnp.finfo(jnp.float32).min)


# q, dO and dQ stay token-major ([b, s, kv, group, d], a reshape of [b, s, heads, d]):
# transposing them to heads-first before the loops lets XLA reshard a sequence-
# parallel layout with an all-to-all that the planner does not predict.


def _flash_forward(q, k, v, causal, block):
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    f32 = jnp.float32

    def step(carry, xs):
        acc, m, total = carry
        kj, vj, j = xs
        scores = _block_scores(qg, kj, j, causal)
        # key 0 is in block 0 and visible to every row, so m_new is a real score
        # from the first step on and masked entries get exp(min - m_new) = 0
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        corr = jnp.exp(m - m_new)
        total = total * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj, preferred_element_type=f32)
        return (acc * corr[..., None] + pv, m_new, total), None

    stats = (b, kv, h // kv, s)
    low = jnp.finfo(f32).min
    init = (jnp.zeros((*stats, d), f32), jnp.full(stats, low, f32), jnp.zeros(stats, f32))
    kb, vb = _to_blocks(k, block), _to_blocks(v, block)
    (acc, m, total), _ = jax.lax.scan(step, init, (kb, vb, jnp.arange(kb.shape[0])))
    out = (acc / total[..., None]).astype(q.dtype)  # [b, kv, g, s, d]
    out = jnp.moveaxis(out, 3, 1).reshape(b, s, h, d)
    return out, m + jnp.log(total)


def _flash_backward(causal, block, res, d_out):
    q, k, v, out, lse = res
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    f32 = jnp.float32
    qg, dog = q.reshape(b, s, kv, g, d), d_out.reshape(b, s, kv, g, d)
    # D = rowsum(dO * O), float32, in the scores' [b, kv, g, s] layout
    delta = jnp.einsum(
        "bqkgd,bqkgd->bkgq", dog.astype(f32), out.reshape(b, s, kv, g, d).astype(f32)
    )

    def step(dq, xs):
        kj, vj, j = xs
        p = jnp.exp(_block_scores(qg, kj, j, causal) - lse[..., None])
        dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype), dog, preferred_element_type=f32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, vj, preferred_element_type=f32)
        ds = (p * (dp - delta[..., None]) / math.sqrt(d)).astype(q.dtype)
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qg, preferred_element_type=f32)
        dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=f32)
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    kb, vb = _to_blocks(k, block), _to_blocks(v, block)
    dq0 = jnp.zeros(qg.shape, f32)
    dq, (dk, dv) = jax.lax.scan(step, dq0, (kb, vb, jnp.arange(kb.shape[0])))
    return dq.reshape(b, s, h, d).astype(q.dtype), _from_blocks(dk, s), _from_blocks(dv, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, causal, block):
    return _flash_forward(q, k, v, causal, block)[0]


def _flash_fwd(q, k, v, causal, block):
    out, lse = _flash_forward(q, k, v, causal, block)
    return out, (q, k, v, out, lse)


_flash.defvjp(_flash_fwd, _flash_backward)


def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of ``table [vocab, embed]`` at integer ``ids`` (by
    :func:`spmdkit.ops.embedding_lookup`)."""
    return call_op(ops.embedding_lookup, table, ids)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits [..., classes]`` against integer ``labels [...]``,
    in float32: :func:`spmdkit.nn.cross_entropy` (the models' losses call it)."""
    return sknn.cross_entropy(logits, labels)


def rope(x: jax.Array, *, theta: float) -> jax.Array:
    """Rotary position embedding of ``x [batch, seq, heads, head_dim]`` (half-split pairs)."""
    s, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------
# Parameters and small layers.
# ---------------------------------------------------------------------------


def check_config(name: str, *conditions: tuple[bool, str], given: Any) -> None:
    """Raise :class:`ModelConfigError` for the first ``(holds, what must hold)`` that fails."""
    for holds, must in conditions:
        if not holds:
            raise ModelConfigError(
                op=name, must=must, given=repr(given), fix=f"choose sizes where {must}"
            )


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    names: Sequence[str | None],
    dtype: Any = jnp.float32,
) -> nnx.Param:
    """A parameter whose ``out_sharding`` metadata holds its logical axis names.

    Args:
      rngs: the model's rng streams (the ``params`` stream is used).
      init: a ``jax.nn.initializers`` initializer ``(key, shape, dtype)``.
      shape: the parameter's shape.
      names: one logical axis name per dim, from :data:`PARAM_AXES`.
      dtype: the parameter dtype.

    Example::

        >>> w = param(nnx.Rngs(0), jax.nn.initializers.normal(0.02), (64, 256),
        ...           ("embed", "mlp"))
    """
    # Constant initializers take no key: drawing one costs ~10 ms per parameter when
    # traced (nnx.eval_shape), because flax probes the rng counter tracer's sharding.
    key = None if init in _CONSTANT_INITS else rngs.params()
    return nnx.Param(init(key, tuple(shape), dtype), out_sharding=tuple(names))


_CONSTANT_INITS = (jax.nn.initializers.zeros, jax.nn.initializers.ones)


def token_embed(cfg: Any, rngs: nnx.Rngs) -> sknn.Embed:
    """The token table of the language models: ``sk.nn.Embed(cfg.vocab, cfg.d_model)``.

    Its parameter is ``<attribute>/embedding [vocab, d_model]`` named ``("vocab",
    "embed")``, drawn from ``normal(0.02)`` with one ``params`` key (the draw the
    models' top-level ``embed`` table made before it was a module, so every value is
    unchanged). ``dtype`` is left ``None``: the lookup returns the table's dtype
    and ``attend`` (the tied head) casts the table to the activations' dtype, as the
    models' other weights are.

    Example::

        >>> emb = token_embed(GPTConfig(), nnx.Rngs(0))
        >>> logits = emb.attend(emb(tokens))
    """
    return sknn.Embed(
        cfg.vocab,
        cfg.d_model,
        param_dtype=cfg.param_dtype,
        embedding_init=jax.nn.initializers.normal(0.02),
        rngs=rngs,
    )


def fan_in_init(fan_in: int) -> Initializer:
    """Normal init with standard deviation ``1/sqrt(fan_in)`` (for any kernel layout)."""
    return jax.nn.initializers.normal(1.0 / math.sqrt(fan_in))


def norm_rngs() -> nnx.Rngs:
    """The ``rngs`` the models give their :mod:`spmdkit.nn` norms.

    flax's norms draw a key per parameter even for their constant (ones/zeros)
    initializers; a stream of their own leaves the model's other draws — and so
    every parameter value, checkpoint and figure — as they were when the norms
    drew nothing.

    Example::

        >>> ln = spmdkit.nn.LayerNorm(64, epsilon=1e-5, rngs=norm_rngs())
    """
    return nnx.Rngs(0)


def count_params(model: nnx.Module) -> int:
    """Number of parameter elements of a (possibly abstract) model."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(math.prod(x.shape) for x in leaves)


# ---------------------------------------------------------------------------
# Layer stacks: a python list of blocks, or one block scanned over a `layers` dim.
# ---------------------------------------------------------------------------

_LAYERS_META = {nnx.PARTITION_NAME: "layers"}


def make_layers(cfg: Any, rngs: nnx.Rngs, block_cls: type, **kwargs) -> nnx.Module:
    """``cfg.n_layers`` blocks: an ``nnx.List``, or one block stacked on ``layers``."""
    if not cfg.scan_layers:
        return nnx.List([block_cls(cfg, rngs=rngs, **kwargs) for _ in range(cfg.n_layers)])

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYERS_META)
    def create(r: nnx.Rngs) -> nnx.Module:
        return block_cls(cfg, rngs=r, **kwargs)

    return create(rngs)


def run_layers(cfg: Any, layers: nnx.Module, x: jax.Array) -> jax.Array:
    """Apply the blocks made by :func:`make_layers` in order."""
    if not cfg.scan_layers:
        for block in layers:
            x = block(x)
        return x

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=_LAYERS_META)
    def body(h: jax.Array, block: nnx.Module) -> jax.Array:
        return block(h)

    return body(x, layers)

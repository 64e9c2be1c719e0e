"""Shared pieces of the reference models: the swappable computations and small layers.

The NNX models' norms are :mod:`spmdkit.nn` modules (``LayerNorm``, ``RMSNorm``,
``GroupNorm``, ``BatchNorm``) and their losses :func:`spmdkit.nn.cross_entropy`;
the language models' token tables are ``sk.nn.Embed`` modules (:func:`token_embed`;
the table at ``embed/embedding``, the tied head its ``attend``).
The functions at the top (``layer_norm``, ``rms_norm``, ``group_norm``,
``sync_batch_norm``, ``embedding_lookup``, ``softmax_cross_entropy``) are the same
:mod:`spmdkit.ops` calls for code that holds the parameters itself (tests);
``attention`` is the ``attention`` op running the models' kernel (blockwise /
cuDNN / plain, :mod:`spmdkit.kernels`), a region the planner lays out.

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
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spmdkit import nn as sknn
from spmdkit import ops
from spmdkit.context_parallel import current_order
from spmdkit.errors import SpmdError
from spmdkit.kernels import (
    ATTENTION_IMPLEMENTATIONS,
    AttentionError,
    blockwise_attention,
    on_gpu,
    resolve_implementation,
)
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
    "swiglu",
    "gelu",
    "batch_stats",
    "rope",
    "positions",
    "CHECKPOINT_NAMES",
    "tag",
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


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    implementation: str | None = None,
    block_size: int = 512,
) -> jax.Array:
    """Scaled dot-product attention with grouped-query support: the ``attention`` op
    (:func:`spmdkit.ops.attention`, through :func:`spmdkit.nn.attention_fn`) running
    the chosen kernel of :mod:`spmdkit.kernels`.

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

    Under the planner's trace (and ``sk.jit``'s Auto axes) the call is one region:
    the planner lays it out with the op's rule and searches its strategies (batch /
    heads parallel; ``gather_kv`` and ``ring`` for a sequence-sharded layout), and
    every strategy runs this kernel on the local blocks. The region's backward
    recomputes the kernel's forward from ``q``, ``k``, ``v`` and runs its backward
    (the blockwise custom VJP included).

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
    impl = resolve_implementation(implementation)
    _check_shapes(q, k, v)
    if impl == "cudnn" and not on_gpu():
        raise AttentionError(
            op="attention",
            must="a GPU with cuDNN be the default backend for implementation='cudnn'",
            given=f"backend {jax.default_backend()!r}",
            fix='pass implementation="auto" or "blockwise"',
        )
    if not isinstance(block_size, int) or block_size < 1:
        raise AttentionError(
            op="attention",
            must="block_size be a positive int",
            given=repr(block_size),
            fix="pass e.g. block_size=512",
        )
    return sknn.attention_fn(q, k, v, is_causal=causal, implementation=impl, block_size=block_size)


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
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


def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of ``table [vocab, embed]`` at integer ``ids`` (by
    :func:`spmdkit.ops.embedding_lookup`)."""
    return call_op(ops.embedding_lookup, table, ids)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits [..., classes]`` against integer ``labels [...]``,
    in float32: :func:`spmdkit.nn.cross_entropy` (the models' losses call it)."""
    return sknn.cross_entropy(logits, labels)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated activation of a SwiGLU MLP, ``silu(gate) * up``, saving only its
    two inputs for the backward pass.

    Autodiff of ``jax.nn.silu(gate) * up`` keeps about six ``[tokens, mlp]``
    tensors per layer for the backward (the sigmoid, ``silu(gate)`` and the
    products of its derivative besides the inputs); this keeps ``gate`` and
    ``up`` and recomputes the sigmoid in the backward, as Transformer Engine's
    fused SwiGLU does. Values and gradients are those of ``jax.nn.silu(gate) *
    up`` (same dtype, to rounding). It holds no matmul: the projections feeding
    it (and their ``checkpoint_name`` tags, ``mlpwi_0``/``mlpwi_1``) stay outside,
    so the named recompute policies find them. The planner lays it out
    elementwise (its body, inlined).

    Args:
      gate: the gate projection's output, any shape.
      up: the up projection's output, ``gate``'s shape and dtype.

    Raises:
      ModelConfigError: ``gate`` and ``up`` differ in shape or dtype.
    """
    _check_gated(gate, up)
    return jax.nn.silu(gate) * up


def _check_gated(gate: jax.Array, up: jax.Array) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ModelConfigError(
            op="swiglu",
            must="gate and up have one shape and dtype",
            given=f"gate {gate.dtype}{list(gate.shape)}, up {up.dtype}{list(up.shape)}",
            fix="feed both from projections of the same input to the same width",
        )


def _swiglu_fwd(gate: jax.Array, up: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    _check_gated(gate, up)
    return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_bwd(res: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    gate, up = res
    sig = jax.nn.sigmoid(gate)
    d_silu = dy * up  # the cotangent of silu(gate)
    # d silu(g) / dg = s + g·s·(1 - s), in the order autodiff of g·sigmoid(g) sums it
    d_gate = d_silu * sig + (d_silu * gate) * (sig * (1 - sig))
    return d_gate, dy * (gate * sig)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
    """``jax.nn.gelu(x, approximate)`` saving only ``x`` for the backward pass.

    Autodiff of the tanh form keeps five ``x``-shaped values per call for the
    backward (``x``, ``3·x²``, ``tanh(·)``, ``1 - tanh(·)`` and the CDF), the
    erf form three; this keeps ``x`` and recomputes the derivative in the
    backward, as Megatron-LM's and Transformer Engine's fused bias-GELU do. The
    forward is ``jax.nn.gelu`` itself (the same values, bit for bit) and the
    backward is autodiff's pullback of it, recomputed from ``x`` (the same
    operations, so the same gradient to rounding). It holds no matmul: the
    projection feeding it (and its ``checkpoint_name`` tag, ``mlpwi``) stays
    outside, so the named recompute policies and :func:`spmdkit.step.fp8.fp8_loss`
    (which leaves a ``custom_vjp``'s body alone) find it. The planner lays it
    out elementwise (its body, inlined).

    Args:
      x: the MLP's input projection, any shape, a floating dtype.
      approximate: the tanh approximation (GPT-2's and GPT-3's; ``True``) or the
        exact erf form (``False``), as in ``jax.nn.gelu``.

    Raises:
      ModelConfigError: ``x`` is not floating, or ``approximate`` is not a bool.

    Example::

        >>> h = gelu(tag(x @ w_in, "mlpwi"))  # jax.nn.gelu(..., approximate=True)
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ModelConfigError(
            op="gelu",
            must="x be a floating-point array",
            given=f"{type(x).__name__} of dtype {dtype}",
            fix="cast the projection to its compute dtype (e.g. x.astype(jnp.float32))",
        )
    if not isinstance(approximate, (bool, np.bool_)):
        raise ModelConfigError(
            op="gelu",
            must="approximate be a Python bool (it picks the formula when tracing)",
            given=repr(approximate),
            fix="pass approximate=True (tanh form) or approximate=False (erf form)",
        )
    return _gelu(x, bool(approximate))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gelu(x: jax.Array, approximate: bool) -> jax.Array:
    return jax.nn.gelu(x, approximate=approximate)


def _gelu_fwd(x: jax.Array, approximate: bool) -> tuple[jax.Array, jax.Array]:
    return jax.nn.gelu(x, approximate=approximate), x


def _gelu_bwd(approximate: bool, x: jax.Array, dy: jax.Array) -> tuple[jax.Array]:
    # autodiff's pullback, recomputed: its residuals live only inside the backward
    _, pullback = jax.vjp(functools.partial(jax.nn.gelu, approximate=approximate), x)
    return pullback(dy)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


#: The ``jax.ad_checkpoint.checkpoint_name`` tags the reference decoders put on
#: their projections, MaxText's names (``layers.py`` of MaxText's decoders):
#: Q/K/V/out projections; the MLP's input projections (``mlpwi``, or the gated
#: pair ``mlpwi_0``/``mlpwi_1``) and its output projection. The recompute
#: policies of :mod:`spmdkit.step.recipe` select values by these names.
CHECKPOINT_NAMES = (
    "query_proj",
    "key_proj",
    "value_proj",
    "out_proj",
    "mlpwi",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
)


def tag(x: jax.Array, name: str) -> jax.Array:
    """``x`` tagged for the recompute policies (``jax.ad_checkpoint.checkpoint_name``):
    an identity that plans as one (the ``name`` rule), one of :data:`CHECKPOINT_NAMES`."""
    return checkpoint_name(x, name)


def positions(seq_len: int) -> jax.Array | None:
    """The natural positions of the tokens of the loss being traced, ``int32
    [seq_len]``, when its batch is in a context-parallel plan's balanced order
    (:func:`spmdkit.context_parallel.current_order`); ``None`` in the natural order."""
    order = current_order()
    return None if order is None else order.positions(seq_len)


def rope(x: jax.Array, *, theta: float) -> jax.Array:
    """Rotary position embedding of ``x [batch, seq, heads, head_dim]`` (half-split
    pairs), at the tokens' natural positions (:func:`positions`)."""
    s, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    pos = positions(s)
    pos = jnp.arange(s, dtype=jnp.float32) if pos is None else pos.astype(jnp.float32)
    angles = pos[:, None] * inv_freq[None, :]
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


def make_layers(
    cfg: Any, rngs: nnx.Rngs, block_cls: type, *, n_layers: int | None = None, **kwargs
) -> nnx.Module:
    """``n_layers`` blocks (default ``cfg.n_layers``): an ``nnx.List``, or one block
    stacked on ``layers``."""
    n = cfg.n_layers if n_layers is None else n_layers
    if not cfg.scan_layers:
        return nnx.List([block_cls(cfg, rngs=rngs, **kwargs) for _ in range(n)])

    @nnx.split_rngs(splits=n)
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

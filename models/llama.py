"""Llama style decoder (Flax NNX): RMSNorm, RoPE, SwiGLU, grouped-query attention.

Parameters carry logical axis names only (``vocab``, ``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``norm``, and ``layers`` for stacked layers);
there is no sharding code here.

Layers are either a python list of blocks (``scan_layers=False``) or one block whose
parameters are stacked along a leading ``layers`` dim (``scan_layers=True``), built
with ``nnx.vmap`` and run with ``nnx.scan``. The stacked form traces and compiles one
block instead of ``n_layers``; its parameter paths are ``layers/<name>`` with shape
``(n_layers, ...)`` instead of ``layers/<i>/<name>``. :func:`stack_layers` converts
the state of a looped model into the stacked form (same weights, same loss).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit import nn as sknn

from . import layers as lyr
from .gpt import LM_BATCH_AXES, gpt_loss, lm_batch
from .layers import make_layers, run_layers

__all__ = [
    "LlamaConfig",
    "Llama",
    "LlamaBlock",
    "CONFIGS",
    "llama_loss",
    "lm_batch",
    "LM_BATCH_AXES",
    "stack_layers",
]

llama_loss = gpt_loss


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama style model.

    Attributes:
      vocab: token vocabulary size.
      d_model: width of the residual stream.
      n_layers: number of transformer blocks.
      n_heads: query heads; n_kv_heads: key/value heads (divides ``n_heads``).
      head_dim: width of one head.
      d_mlp: hidden width of the SwiGLU MLP.
      seq_len: sequence length of the batches :func:`lm_batch` makes.
      rope_theta: RoPE base; norm_eps: RMSNorm epsilon.
      scan_layers: stack the layers on a ``layers`` dim and run them with ``nnx.scan``.
      tie_embeddings: share the token table with the output projection.
      dtype: compute dtype; ``None`` computes in the dtype the parameters reach
        the model in (a recipe's ``compute_dtype`` casts fp32 master parameters
        to bf16 before they do). Weights are cast to the activations' dtype where
        they are used, so an explicit ``dtype`` with another ``param_dtype`` keeps
        every layer (and the scan carry) in ``dtype``.
      param_dtype: parameter dtype.
      attention: attention implementation, one of
        :data:`~spmdkit.models.layers.ATTENTION_IMPLEMENTATIONS` (``"auto"``: cuDNN's
        fused kernel on a GPU that accepts the inputs, else the blockwise version).
    """

    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_mlp: int = 192
    seq_len: int = 16
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    scan_layers: bool = False
    tie_embeddings: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    attention: str = "auto"

    def __post_init__(self) -> None:
        lyr.check_config(
            "LlamaConfig",
            (self.n_heads % self.n_kv_heads == 0, "n_kv_heads divide n_heads"),
            (self.head_dim % 2 == 0, "head_dim be even (RoPE rotates pairs)"),
            (
                self.attention in lyr.ATTENTION_IMPLEMENTATIONS,
                f"attention be one of {lyr.ATTENTION_IMPLEMENTATIONS}",
            ),
            given=self,
        )


class GQAttention(nnx.Module):
    """Causal grouped-query attention with RoPE, no biases."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, h, kv, hd, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        self.theta = cfg.rope_theta
        self.implementation = cfg.attention
        init = lyr.fan_in_init(d)
        self.wq = lyr.param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"), pd)
        self.wk = lyr.param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = lyr.param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = lyr.param(
            rngs, lyr.fan_in_init(h * hd), (h, hd, d), ("heads", "head_dim", "embed"), pd
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        q = lyr.tag(jnp.einsum("bsd,dhk->bshk", x, self.wq[...].astype(dt)), "query_proj")
        k = lyr.tag(jnp.einsum("bsd,dhk->bshk", x, self.wk[...].astype(dt)), "key_proj")
        v = lyr.tag(jnp.einsum("bsd,dhk->bshk", x, self.wv[...].astype(dt)), "value_proj")
        q, k = lyr.rope(q, theta=self.theta), lyr.rope(k, theta=self.theta)
        o = lyr.attention(q, k, v, causal=True, implementation=self.implementation)
        return lyr.tag(jnp.einsum("bshk,hkd->bsd", o, self.wo[...].astype(dt)), "out_proj")


class SwiGLU(nnx.Module):
    """``down(silu(x @ gate) * (x @ up))``, the gating by :func:`~models.layers.swiglu`
    (its backward keeps only the two projections' outputs)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, m, pd = cfg.d_model, cfg.d_mlp, cfg.param_dtype
        self.gate = lyr.param(rngs, lyr.fan_in_init(d), (d, m), ("embed", "mlp"), pd)
        self.up = lyr.param(rngs, lyr.fan_in_init(d), (d, m), ("embed", "mlp"), pd)
        self.down = lyr.param(rngs, lyr.fan_in_init(m), (m, d), ("mlp", "embed"), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        gate = lyr.tag(x @ self.gate[...].astype(dt), "mlpwi_0")
        h = lyr.swiglu(gate, lyr.tag(x @ self.up[...].astype(dt), "mlpwi_1"))
        return lyr.tag(h @ self.down[...].astype(dt), "mlpwo")


def rms_norm(cfg: LlamaConfig) -> sknn.RMSNorm:
    """``spmdkit.nn.RMSNorm`` of the residual stream (param ``scale`` on ``norm``)."""
    return sknn.RMSNorm(
        cfg.d_model,
        epsilon=cfg.norm_eps,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=lyr.norm_rngs(),
    )


class LlamaBlock(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    ``mlp`` is a :class:`SwiGLU` unless ``mlp_factory`` builds something else
    (the MoE model passes its expert layer).
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, mlp_factory=None):
        self.attn_norm = rms_norm(cfg)
        self.attn = GQAttention(cfg, rngs=rngs)
        self.mlp_norm = rms_norm(cfg)
        self.mlp = mlp_factory(cfg, rngs=rngs) if mlp_factory else SwiGLU(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """Llama style language model; ``model(tokens [batch, seq]) -> logits [batch, seq, vocab]``.

    Example::

        >>> with nnx.use_eager_sharding(False):
        ...     model = Llama(LlamaConfig(scan_layers=True), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 256)
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.param_dtype
        self.embed = lyr.token_embed(cfg, rngs)  # table at embed/embedding
        self.layers = make_layers(cfg, rngs, LlamaBlock)
        self.norm = rms_norm(cfg)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else lyr.param(
                rngs, lyr.fan_in_init(cfg.d_model), (cfg.d_model, cfg.vocab), ("embed", "vocab"), pd
            )
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = self.embed(tokens)
        x = x.astype(cfg.dtype) if cfg.dtype is not None else x
        x = self.norm(run_layers(cfg, self.layers, x))
        if self.lm_head is None:
            return self.embed.attend(x)  # tied: x @ embedding.T
        return x @ self.lm_head[...].astype(x.dtype)


def stack_layers(looped: nnx.State) -> nnx.State:
    """The state of a ``scan_layers=False`` model rearranged for ``scan_layers=True``.

    ``layers/<i>/<path>`` leaves become one ``layers/<path>`` leaf stacked on a new
    leading dim; every other leaf is kept. Use with ``nnx.update(scanned_model, ...)``.
    """
    flat = dict(nnx.to_flat_state(looped))
    per_layer: dict[tuple, list] = {}
    out = {}
    for path, leaf in flat.items():
        if path[0] == "layers":
            per_layer.setdefault(path[2:], []).append((int(path[1]), leaf))
        else:
            out[path] = leaf
    for rest, items in per_layer.items():
        items.sort(key=lambda t: t[0])
        first = items[0][1]
        stacked = jnp.stack([v[...] for _, v in items])
        names = first.get_metadata().get("out_sharding")
        meta = {"out_sharding": ("layers", *names)} if names else {}
        out[("layers", *rest)] = first.replace(stacked, **meta)
    return nnx.from_flat_state(out)


CONFIGS: dict[str, Any] = {
    "tiny": LlamaConfig,
    "tiny_scan": lambda: LlamaConfig(scan_layers=True),
    "tiny_pipe": lambda: LlamaConfig(n_layers=4, scan_layers=True),
    "small": lambda: LlamaConfig(
        vocab=1024,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        d_mlp=768,
        seq_len=128,
        scan_layers=True,
    ),
    "8b": lambda: LlamaConfig(
        vocab=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_mlp=14336,
        seq_len=8192,
        scan_layers=True,
    ),
    "70b": lambda: LlamaConfig(
        vocab=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        d_mlp=28672,
        seq_len=8192,
        scan_layers=True,
    ),
}
"""Llama sizes: ``tiny`` (looped), ``tiny_scan`` and ``tiny_pipe`` (4 stacked layers, for
pipelined tests) compile in seconds on CPU; ``8b``
and ``70b`` are Llama-3's published dims (stacked layers)."""

"""GPT-2 style decoder (Flax NNX): LayerNorm, GELU MLP, learned positions, tied embeddings.

Parameters carry logical axis names only (``vocab``, ``embed``, ``pos``, ``heads``,
``head_dim``, ``mlp``, ``norm``); there is no sharding code here. Logits are
``h @ embedding.T`` (the token table, an ``sk.nn.Embed`` at ``embed/embedding``, is
tied to the output projection through its ``attend``), attention is
causal, dropout is off by default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmdkit import nn as sknn

from . import layers as lyr

__all__ = ["GPTConfig", "GPT", "CONFIGS", "gpt_loss", "lm_batch", "LM_BATCH_AXES"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT-2 style model.

    Attributes:
      vocab: token vocabulary size.
      d_model: width of the residual stream.
      n_layers: number of transformer blocks.
      n_heads: attention heads (``d_model`` must be a multiple).
      d_mlp: hidden width of the MLP (GPT-2 uses ``4 * d_model``).
      max_seq: rows of the learned position table.
      seq_len: sequence length of the batches :func:`lm_batch` makes.
      dropout: dropout rate on the residual branches and embeddings (0 disables).
      scan_layers: stack the blocks on a ``layers`` dim and run them with
        ``nnx.scan`` (params ``blocks/<name>`` of shape ``(n_layers, ...)``); what
        per-layer recompute (``Recipe(remat=...)``) needs.
      dtype: compute dtype; ``None`` computes in the dtype the parameters reach
        the model in (a recipe's ``compute_dtype`` casts fp32 master parameters
        to bf16 before they do); weights are cast to the activations' dtype where
        they are used.
      param_dtype: parameter dtype.
      attention: attention implementation, one of
        :data:`~spmdkit.models.layers.ATTENTION_IMPLEMENTATIONS` (``"auto"``: cuDNN's
        fused kernel on a GPU that accepts the inputs, else the blockwise version).
    """

    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_mlp: int = 256
    max_seq: int = 16
    seq_len: int = 16
    dropout: float = 0.0
    scan_layers: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    attention: str = "auto"

    def __post_init__(self) -> None:
        lyr.check_config(
            "GPTConfig",
            (self.d_model % self.n_heads == 0, "n_heads divide d_model"),
            (self.seq_len <= self.max_seq, "seq_len <= max_seq (rows of the position table)"),
            (0.0 <= self.dropout < 1.0, "0 <= dropout < 1"),
            (
                self.attention in lyr.ATTENTION_IMPLEMENTATIONS,
                f"attention be one of {lyr.ATTENTION_IMPLEMENTATIONS}",
            ),
            (
                not (self.scan_layers and self.dropout > 0),
                "dropout == 0 with scan_layers (the scanned blocks share no rng stream)",
            ),
            given=self,
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class _Dense(nnx.Module):
    """``x @ kernel + bias`` with the kernel's dims named."""

    def __init__(self, din, dout, names, *, cfg: GPTConfig, rngs: nnx.Rngs):
        self.kernel = lyr.param(rngs, lyr.fan_in_init(din), (din, dout), names, cfg.param_dtype)
        self.bias = _zeros(rngs, (dout,), names[1:], cfg.param_dtype)

    def __call__(self, x):
        return x @ self.kernel[...].astype(x.dtype) + self.bias[...].astype(x.dtype)


def _zeros(rngs, shape, names, dtype):
    return lyr.param(rngs, jax.nn.initializers.zeros, shape, names, dtype)


class GPTAttention(nnx.Module):
    """Causal multi-head self-attention with biases (q, k, v, out projections)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, h, hd, pd = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.param_dtype
        self.implementation = cfg.attention
        init = lyr.fan_in_init(d)
        names = ("embed", "heads", "head_dim")
        self.wq = lyr.param(rngs, init, (d, h, hd), names, pd)
        self.wk = lyr.param(rngs, init, (d, h, hd), names, pd)
        self.wv = lyr.param(rngs, init, (d, h, hd), names, pd)
        self.bq = _zeros(rngs, (h, hd), names[1:], pd)
        self.bk = _zeros(rngs, (h, hd), names[1:], pd)
        self.bv = _zeros(rngs, (h, hd), names[1:], pd)
        self.wo = lyr.param(
            rngs, lyr.fan_in_init(d), (h, hd, d), ("heads", "head_dim", "embed"), pd
        )
        self.bo = _zeros(rngs, (d,), ("embed",), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        q = jnp.einsum("bsd,dhk->bshk", x, self.wq[...].astype(dt)) + self.bq[...].astype(dt)
        k = jnp.einsum("bsd,dhk->bshk", x, self.wk[...].astype(dt)) + self.bk[...].astype(dt)
        v = jnp.einsum("bsd,dhk->bshk", x, self.wv[...].astype(dt)) + self.bv[...].astype(dt)
        q, k, v = lyr.tag(q, "query_proj"), lyr.tag(k, "key_proj"), lyr.tag(v, "value_proj")
        o = lyr.attention(q, k, v, causal=True, implementation=self.implementation)
        out = jnp.einsum("bshk,hkd->bsd", o, self.wo[...].astype(dt)) + self.bo[...].astype(dt)
        return lyr.tag(out, "out_proj")


def _layer_norm(cfg: GPTConfig) -> sknn.LayerNorm:
    """``spmdkit.nn.LayerNorm`` (params ``scale``/``bias`` on ``norm``), GPT-2's epsilon."""
    return sknn.LayerNorm(
        cfg.d_model,
        epsilon=1e-5,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=lyr.norm_rngs(),
    )


class GPTBlock(nnx.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(cfg)
        self.attn = GPTAttention(cfg, rngs=rngs)
        self.ln2 = _layer_norm(cfg)
        self.fc = _Dense(cfg.d_model, cfg.d_mlp, ("embed", "mlp"), cfg=cfg, rngs=rngs)
        self.proj = _Dense(cfg.d_mlp, cfg.d_model, ("mlp", "embed"), cfg=cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs) if cfg.dropout > 0 else None

    def _drop(self, x):
        return self.dropout(x) if self.dropout is not None else x

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self._drop(self.attn(self.ln1(x)))
        h = lyr.gelu(lyr.tag(self.fc(self.ln2(x)), "mlpwi"), approximate=True)
        return x + self._drop(lyr.tag(self.proj(h), "mlpwo"))


class GPT(nnx.Module):
    """GPT-2 style language model; ``model(tokens [batch, seq]) -> logits [batch, seq, vocab]``.

    Example::

        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 256)
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.param_dtype
        self.embed = lyr.token_embed(cfg, rngs)  # table at embed/embedding
        self.pos = lyr.param(
            rngs, jax.nn.initializers.normal(0.01), (cfg.max_seq, cfg.d_model), ("pos", "embed"), pd
        )
        self.blocks = lyr.make_layers(cfg, rngs, GPTBlock)
        self.ln_f = _layer_norm(cfg)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs) if cfg.dropout > 0 else None

    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        s = tokens.shape[1]
        at = lyr.positions(s)  # a context-parallel batch's natural positions
        x = self.embed(tokens) + (self.pos[:s] if at is None else jnp.take(self.pos[...], at, 0))
        x = x.astype(cfg.dtype) if cfg.dtype is not None else x
        if self.dropout is not None:
            x = self.dropout(x)
        x = self.ln_f(lyr.run_layers(cfg, self.blocks, x))
        return self.embed.attend(x)  # tied: x @ embedding.T


CONFIGS: dict[str, Any] = {
    "tiny": GPTConfig,
    "tiny_pipe": lambda: GPTConfig(n_layers=4, scan_layers=True),
    "small": lambda: GPTConfig(
        vocab=1024, d_model=256, n_layers=4, n_heads=8, d_mlp=1024, max_seq=128, seq_len=128
    ),
    "124m": lambda: GPTConfig(
        vocab=50257, d_model=768, n_layers=12, n_heads=12, d_mlp=3072, max_seq=1024, seq_len=1024
    ),
    "350m": lambda: GPTConfig(
        vocab=50257, d_model=1024, n_layers=24, n_heads=16, d_mlp=4096, max_seq=1024, seq_len=1024
    ),
    "774m": lambda: GPTConfig(
        vocab=50257, d_model=1280, n_layers=36, n_heads=20, d_mlp=5120, max_seq=1024, seq_len=1024
    ),
    "1.5b": lambda: GPTConfig(
        vocab=50257, d_model=1600, n_layers=48, n_heads=25, d_mlp=6400, max_seq=1024, seq_len=1024
    ),
    "gpt3_175b": lambda: GPTConfig(
        vocab=50257,
        d_model=12288,
        n_layers=96,
        n_heads=96,
        d_mlp=49152,
        max_seq=2048,
        seq_len=2048,
        scan_layers=True,
    ),
}
"""GPT-2 sizes: ``tiny`` compiles in seconds on CPU (``tiny_pipe``: 4 stacked, scanned
layers, what pipelined tests split into 2 or 4 stages); ``124m`` … ``1.5b`` are the
published ones; ``gpt3_175b`` is GPT-3 175B as the GPT-3 paper sizes it (96 layers,
width 12,288, 96 heads, 2,048 tokens; GPT-2's 50,257-token vocabulary), scanned,
for abstract planning (the calibration table's NeMo row)."""


LM_BATCH_AXES: dict[str, tuple[str | None, ...]] = {
    "tokens": ("batch", "seq"),
    "targets": ("batch", "seq"),
}
"""Logical axis names of the language-model batch fields."""


def lm_batch(cfg: Any, batch_size: int, rng: np.random.Generator | None) -> dict:
    """A next-token batch: ``tokens`` and ``targets`` (tokens shifted by one), int32.

    Args:
      cfg: any config with ``vocab`` and ``seq_len``.
      batch_size: global batch size.
      rng: numpy generator for random tokens; ``None`` gives ``jax.ShapeDtypeStruct`` s.
    """
    shape = (batch_size, cfg.seq_len)
    if rng is None:
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in LM_BATCH_AXES}
    seq = rng.integers(0, cfg.vocab, size=(batch_size, cfg.seq_len + 1), dtype=np.int32)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def gpt_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy of a model returning logits."""
    return sknn.cross_entropy(model(batch["tokens"]), batch["targets"])

"""Qwen3-MoE style decoder (Flax NNX): GQA attention with qk-norm, every block's MLP
dropless routed experts.

The attention is :class:`~spmdkit.models.llama.GQAttention`'s (RoPE, no biases)
with Qwen3's qk-norm: an RMSNorm over ``head_dim`` of each query and key head
(one ``scale`` per norm, shared by the heads) before RoPE. The MLP is
:func:`~spmdkit.models.routed.expert_layer`'s :class:`spmdkit.nn.MoE` in every
block (no dense blocks, no shared expert in Qwen3).

The same decoder with ``qk_norm=False`` holds the dropless forms of two other
published models: Mixtral 8x7B (8 experts top-2) and GPT-OSS 120B (128 experts
top-4; its attention sinks, alternating sliding-window layers, the biases of its
projections and experts and its clamped SwiGLU are left out; the biases
are a tiny share of its parameters). The GShard form of Mixtral, with an
expert capacity, stays :mod:`spmdkit.models.moe`.

Parameters carry logical axis names only: ``vocab``, ``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``expert``, ``norm``, ``layers``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit import nn as sknn

from . import layers as lyr
from .gpt import LM_BATCH_AXES, lm_batch
from .layers import make_layers
from .llama import GQAttention, LlamaConfig, rms_norm
from .routed import ExpertSettings, RoutedBlock, routed_loss, run_moe_layers

__all__ = [
    "Qwen3MoEConfig",
    "Qwen3MoE",
    "QKNormAttention",
    "CONFIGS",
    "qwen3_moe_loss",
    "lm_batch",
    "LM_BATCH_AXES",
]

qwen3_moe_loss = routed_loss


@dataclasses.dataclass(frozen=True)
class Qwen3MoEConfig(LlamaConfig, ExpertSettings):
    """A :class:`~spmdkit.models.llama.LlamaConfig` (``d_mlp`` unused: every block is
    MoE) with the expert settings of :class:`~spmdkit.models.routed.ExpertSettings`.

    Attributes:
      qk_norm: RMSNorm over ``head_dim`` of the queries and keys (Qwen3).
    """

    qk_norm: bool = True
    scan_layers: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_experts("Qwen3MoEConfig")


class QKNormAttention(GQAttention):
    """:class:`~spmdkit.models.llama.GQAttention` with RMSNorm on each query and key
    head before RoPE (``q_norm``/``k_norm``, ``scale [head_dim]`` named ``norm``)."""

    def __init__(self, cfg: Qwen3MoEConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.cfg = cfg
        self.q_norm = self._norm(cfg) if cfg.qk_norm else nnx.data(None)
        self.k_norm = self._norm(cfg) if cfg.qk_norm else nnx.data(None)

    @staticmethod
    def _norm(cfg: Qwen3MoEConfig) -> sknn.RMSNorm:
        return sknn.RMSNorm(
            cfg.head_dim,
            epsilon=cfg.norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=lyr.norm_rngs(),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        q = lyr.tag(jnp.einsum("bsd,dhk->bshk", x, self.wq[...].astype(dt)), "query_proj")
        k = lyr.tag(jnp.einsum("bsd,dhk->bshk", x, self.wk[...].astype(dt)), "key_proj")
        v = lyr.tag(jnp.einsum("bsd,dhk->bshk", x, self.wv[...].astype(dt)), "value_proj")
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = lyr.rope(q, theta=self.theta), lyr.rope(k, theta=self.theta)
        o = lyr.attention(q, k, v, causal=True, implementation=self.implementation)
        return lyr.tag(jnp.einsum("bshk,hkd->bsd", o, self.wo[...].astype(dt)), "out_proj")


class Qwen3MoEBlock(RoutedBlock):
    """Pre-norm block with qk-norm GQA and routed experts; ``block(x) -> (x, aux)``."""

    attention = QKNormAttention


class Qwen3MoE(nnx.Module):
    """Qwen3-MoE style language model; ``model(tokens) -> (logits, aux_loss)``, the
    auxiliary loss summed over the layers (each already weighted).

    Example::

        >>> with nnx.use_eager_sharding(False):
        ...     model = Qwen3MoE(Qwen3MoEConfig(), rngs=nnx.Rngs(0))
        >>> logits, aux = model(jnp.zeros((2, 16), jnp.int32))
    """

    def __init__(self, cfg: Qwen3MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = lyr.token_embed(cfg, rngs)  # table at embed/embedding
        self.layers = make_layers(cfg, rngs, Qwen3MoEBlock)
        self.norm = rms_norm(cfg)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else lyr.param(
                rngs,
                lyr.fan_in_init(cfg.d_model),
                (cfg.d_model, cfg.vocab),
                ("embed", "vocab"),
                cfg.param_dtype,
            )
        )

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        x = self.embed(tokens)
        x = x.astype(cfg.dtype) if cfg.dtype is not None else x
        x, aux = run_moe_layers(cfg, self.layers, x)
        x = self.norm(x)
        if self.lm_head is None:
            return self.embed.attend(x), aux
        return x @ self.lm_head[...].astype(x.dtype), aux


CONFIGS: dict[str, Any] = {
    "tiny": Qwen3MoEConfig,
    "small": lambda: Qwen3MoEConfig(
        vocab=1024,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        seq_len=128,
        n_experts=16,
        top_k=4,
        d_ff_expert=128,
    ),
    "30b_a3b": lambda: Qwen3MoEConfig(
        vocab=151936,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        seq_len=4096,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        n_experts=128,
        top_k=8,
        d_ff_expert=768,
    ),
    "235b_a22b": lambda: Qwen3MoEConfig(
        vocab=151936,
        d_model=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        seq_len=4096,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        n_experts=128,
        top_k=8,
        d_ff_expert=1536,
    ),
    "gpt_oss_120b": lambda: Qwen3MoEConfig(
        vocab=201088,
        d_model=2880,
        n_layers=36,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        seq_len=4096,
        rope_theta=150_000.0,
        qk_norm=False,
        n_experts=128,
        top_k=4,
        d_ff_expert=2880,
    ),
    "mixtral_8x7b": lambda: Qwen3MoEConfig(
        vocab=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        seq_len=4096,
        rope_theta=1_000_000.0,
        qk_norm=False,
        n_experts=8,
        top_k=2,
        d_ff_expert=14336,
        load_balance_weight=0.02,
    ),
}
"""Qwen3-MoE sizes: ``tiny`` (8 experts top-2, scanned) compiles in seconds on CPU;
``30b_a3b`` and ``235b_a22b`` have Qwen3's published dims (128 experts top-8);
``gpt_oss_120b`` GPT-OSS 120B's (128 experts top-4, its extras left out: module
docstring) and ``mixtral_8x7b`` Mixtral 8x7B's, dropless."""

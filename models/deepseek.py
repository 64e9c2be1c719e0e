"""DeepSeek-V2/V3 style decoder (Flax NNX): MLA attention, the first layers dense,
the rest dropless routed + shared experts.

Multi-head latent attention (MLA)
    Queries come from a low-rank projection (``wq_a [embed, q_lora]``, RMSNorm,
    ``wq_b [q_lora, heads, head_dim]``) or, with ``q_lora_rank=None`` (V2-Lite), a
    full one (``wq [embed, heads, head_dim]``). Keys and values share one
    compressed latent: ``wkv_a [embed, kv_lora]``, RMSNorm, then per head
    ``wk_b [kv_lora, heads, head_dim]`` (the keys' non-RoPE part) and
    ``wv_b [kv_lora, heads, head_dim]`` (the values). RoPE is decoupled: each
    query head has ``qk_rope_head_dim`` extra rotated dims, and one rotated key
    of that width (``wk_rope [embed, head_dim]``) is shared by every head. The
    published checkpoints hold ``wkv_a`` and ``wk_rope`` as one matrix and
    ``wk_b``/``wv_b`` as one; split, the products are the same. The values are
    zero-padded to the query/key width for the attention kernel (one kernel for
    both widths), the padding sliced off after. Training runs the decompressed
    form; the absorbed (inference) form is not here. YaRN's long-context
    scaling is left out (pre-training length).

Layers
    ``n_dense_layers`` blocks with a SwiGLU MLP (``d_mlp``), then
    ``n_layers - n_dense_layers`` blocks with the experts of
    :func:`~spmdkit.models.routed.expert_layer`: two stacks (``dense_layers``,
    ``moe_layers``), each a python list or one block scanned over ``layers``.

Multi-token prediction (``mtp_layers=1``)
    DeepSeek-V3's MTP module (one depth, as its paper and Megatron-LM's
    ``mtp_num_layers=1`` train it): after the stack, the main model's hidden state
    and the embedding of the next token (the embedding output one position on:
    the table is shared, so no second lookup), each RMS-normed, are concatenated
    and projected back to the width (``mtp/proj [mlp, embed]``, ``2 · d_model``
    in), run through one more MoE block, normed and multiplied by the shared
    output head; its cross-entropy against the token two ahead, weighted by
    ``mtp_weight``, joins the auxiliary loss. Off by default (``mtp_layers=0``).

Parameters carry logical axis names only: ``embed``, ``vocab``, ``heads``,
``head_dim``, ``q_lora`` and ``kv_lora`` (the low-rank dims, replicated by the
tensor-parallel presets), ``mlp``, ``expert``, ``norm``, ``layers``.
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
from .layers import make_layers, run_layers
from .llama import SwiGLU, rms_norm
from .routed import ExpertSettings, RoutedBlock, routed_loss, run_moe_layers

__all__ = [
    "DeepSeekConfig",
    "DeepSeek",
    "MLAttention",
    "CONFIGS",
    "deepseek_loss",
    "lm_batch",
    "LM_BATCH_AXES",
]

deepseek_loss = routed_loss


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig(ExpertSettings):
    """Sizes of a DeepSeek style model (and the expert settings of
    :class:`~spmdkit.models.routed.ExpertSettings`).

    Attributes:
      vocab: token vocabulary size.
      d_model: width of the residual stream.
      n_layers: all blocks; n_dense_layers: the first blocks, with a dense MLP.
      n_heads: attention heads.
      q_lora_rank: rank of the query compression (``None``: a full projection).
      kv_lora_rank: rank of the shared key/value latent.
      qk_nope_head_dim: per-head query/key dims without RoPE.
      qk_rope_head_dim: per-head rotated query dims (and the shared rotated key's).
      v_head_dim: per-head value dims (at most the query/key width).
      d_mlp: hidden width of the dense blocks' SwiGLU.
      seq_len: sequence length of the batches :func:`lm_batch` makes.
      rope_theta: RoPE base; norm_eps: RMSNorm epsilon.
      scan_layers: stack each layer stack on a ``layers`` dim and run it with ``nnx.scan``.
      dtype: compute dtype (``None``: the parameters' dtype as they reach the model).
      param_dtype: parameter dtype.
      attention: attention implementation, one of
        :data:`~spmdkit.models.layers.ATTENTION_IMPLEMENTATIONS`.
      mtp_layers: multi-token-prediction depths after the stack: 0 (none) or 1
        (DeepSeek-V3's, module docstring).
      mtp_weight: the MTP loss's weight in the total (DeepSeek-V3's 0.1 early in
        training, Megatron-Bridge's ``mtp_loss_scaling_factor``).
    """

    vocab: int = 256
    d_model: int = 64
    n_layers: int = 3
    n_dense_layers: int = 1
    n_heads: int = 4
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    d_mlp: int = 128
    seq_len: int = 16
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    scan_layers: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    attention: str = "auto"
    mtp_layers: int = 0
    mtp_weight: float = 0.1

    def __post_init__(self) -> None:
        self.check_experts("DeepSeekConfig")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        lyr.check_config(
            "DeepSeekConfig",
            (0 <= self.n_dense_layers <= self.n_layers, "0 <= n_dense_layers <= n_layers"),
            (self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim be even (RoPE rotates pairs)"),
            (0 < self.v_head_dim <= qk, "0 < v_head_dim <= qk_nope_head_dim + qk_rope_head_dim"),
            (self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank be None or > 0"),
            (self.mtp_layers in (0, 1), "mtp_layers be 0 or 1 (one prediction depth)"),
            (
                self.attention in lyr.ATTENTION_IMPLEMENTATIONS,
                f"attention be one of {lyr.ATTENTION_IMPLEMENTATIONS}",
            ),
            given=self,
        )

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _rms(width: int, cfg: DeepSeekConfig) -> sknn.RMSNorm:
    return sknn.RMSNorm(
        width,
        epsilon=cfg.norm_eps,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=lyr.norm_rngs(),
    )


class MLAttention(nnx.Module):
    """Causal multi-head latent attention (module docstring), no biases."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        d, h, pd = cfg.d_model, cfg.n_heads, cfg.param_dtype
        nope, rope, vd, r = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.wq = lyr.param(
                rngs, lyr.fan_in_init(d), (d, h, nope + rope), ("embed", "heads", "head_dim"), pd
            )
            self.wq_a = self.q_norm = self.wq_b = nnx.data(None)
        else:
            q = cfg.q_lora_rank
            self.wq = nnx.data(None)
            self.wq_a = lyr.param(rngs, lyr.fan_in_init(d), (d, q), ("embed", "q_lora"), pd)
            self.q_norm = _rms(q, cfg)
            self.wq_b = lyr.param(
                rngs, lyr.fan_in_init(q), (q, h, nope + rope), ("q_lora", "heads", "head_dim"), pd
            )
        self.wkv_a = lyr.param(rngs, lyr.fan_in_init(d), (d, r), ("embed", "kv_lora"), pd)
        self.wk_rope = lyr.param(rngs, lyr.fan_in_init(d), (d, rope), ("embed", "head_dim"), pd)
        self.kv_norm = _rms(r, cfg)
        self.wk_b = lyr.param(
            rngs, lyr.fan_in_init(r), (r, h, nope), ("kv_lora", "heads", "head_dim"), pd
        )
        self.wv_b = lyr.param(
            rngs, lyr.fan_in_init(r), (r, h, vd), ("kv_lora", "heads", "head_dim"), pd
        )
        self.wo = lyr.param(
            rngs, lyr.fan_in_init(h * vd), (h, vd, d), ("heads", "head_dim", "embed"), pd
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, x.dtype
        nope, h = cfg.qk_nope_head_dim, cfg.n_heads
        if self.wq is not None:
            q = jnp.einsum("bsd,dhk->bshk", x, self.wq[...].astype(dt))
        else:
            cq = self.q_norm(x @ self.wq_a[...].astype(dt))
            q = jnp.einsum("bsr,rhk->bshk", cq, self.wq_b[...].astype(dt))
        q = lyr.tag(q, "query_proj")
        q_nope, q_rope = q[..., :nope], lyr.rope(q[..., nope:], theta=cfg.rope_theta)
        ckv = self.kv_norm(x @ self.wkv_a[...].astype(dt))
        k_nope = lyr.tag(jnp.einsum("bsr,rhk->bshk", ckv, self.wk_b[...].astype(dt)), "key_proj")
        v = lyr.tag(jnp.einsum("bsr,rhk->bshk", ckv, self.wv_b[...].astype(dt)), "value_proj")
        k_rope = lyr.rope((x @ self.wk_rope[...].astype(dt))[:, :, None, :], theta=cfg.rope_theta)
        k_rope = jnp.broadcast_to(k_rope, (*k_rope.shape[:2], h, k_rope.shape[-1]))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        pad = cfg.qk_head_dim - cfg.v_head_dim
        vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad))) if pad else v
        o = lyr.attention(q, k, vp, causal=True, implementation=cfg.attention)
        o = o[..., : cfg.v_head_dim]
        return lyr.tag(jnp.einsum("bshk,hkd->bsd", o, self.wo[...].astype(dt)), "out_proj")


class DenseBlock(nnx.Module):
    """Pre-norm block with MLA and a SwiGLU MLP; ``block(x) -> x``."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        self.attn_norm = rms_norm(cfg)
        self.attn = MLAttention(cfg, rngs=rngs)
        self.mlp_norm = rms_norm(cfg)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MoEBlock(RoutedBlock):
    """Pre-norm block with MLA and routed + shared experts; ``block(x) -> (x, aux)``."""

    attention = MLAttention


class MultiTokenPrediction(nnx.Module):
    """DeepSeek-V3's multi-token-prediction module, one depth (module docstring):
    ``mtp(h, e_next) -> (x, aux)``, ``h`` the stack's output and ``e_next`` the
    next token's embedding at each position; the caller applies ``norm`` and the
    shared head."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        self.hidden_norm = rms_norm(cfg)
        self.embed_norm = rms_norm(cfg)
        self.proj = lyr.param(
            rngs,
            lyr.fan_in_init(2 * cfg.d_model),
            (2 * cfg.d_model, cfg.d_model),
            ("mlp", "embed"),
            cfg.param_dtype,
        )
        self.block = MoEBlock(cfg, rngs=rngs)
        self.norm = rms_norm(cfg)

    def __call__(self, h: jax.Array, e_next: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = jnp.concatenate([self.hidden_norm(h), self.embed_norm(e_next)], axis=-1)
        return self.block(x @ self.proj[...].astype(x.dtype))


class DeepSeek(nnx.Module):
    """DeepSeek style language model; ``model(tokens) -> (logits, aux_loss)``, the
    auxiliary loss summed over the MoE layers (each already weighted).

    Example::

        >>> with nnx.use_eager_sharding(False):
        ...     model = DeepSeek(DeepSeekConfig(), rngs=nnx.Rngs(0))
        >>> logits, aux = model(jnp.zeros((2, 16), jnp.int32))
    """

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = lyr.token_embed(cfg, rngs)  # table at embed/embedding
        n_moe = cfg.n_layers - cfg.n_dense_layers
        self.dense_layers = nnx.data(
            make_layers(cfg, rngs, DenseBlock, n_layers=cfg.n_dense_layers)
            if cfg.n_dense_layers
            else None
        )
        self.moe_layers = nnx.data(
            make_layers(cfg, rngs, MoEBlock, n_layers=n_moe) if n_moe else None
        )
        self.norm = rms_norm(cfg)
        self.mtp = nnx.data(MultiTokenPrediction(cfg, rngs=rngs) if cfg.mtp_layers else None)
        self.lm_head = lyr.param(
            rngs,
            lyr.fan_in_init(cfg.d_model),
            (cfg.d_model, cfg.vocab),
            ("embed", "vocab"),
            cfg.param_dtype,
        )

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        x = self.embed(tokens)
        x = x.astype(cfg.dtype) if cfg.dtype is not None else x
        embedded = x
        if self.dense_layers is not None:
            x = run_layers(cfg, self.dense_layers, x)
        aux = jnp.zeros((), jnp.float32)
        if self.moe_layers is not None:
            x, aux = run_moe_layers(cfg, self.moe_layers, x)
        if self.mtp is not None:
            # position i predicts token i + 2 from the stack's state and token i + 1
            h, a = self.mtp(x, jnp.roll(embedded, -1, axis=1))
            h = self.mtp.norm(h)
            ahead = h @ self.lm_head[...].astype(h.dtype)
            ce = sknn.cross_entropy(ahead[:, :-2], tokens[:, 2:])
            aux = aux + a + cfg.mtp_weight * ce
        x = self.norm(x)
        return x @ self.lm_head[...].astype(x.dtype), aux


CONFIGS: dict[str, Any] = {
    "tiny": DeepSeekConfig,
    "tiny_v3": lambda: DeepSeekConfig(
        n_shared_experts=1,
        score="sigmoid",
        routed_scaling=2.5,
        expert_groups=4,
        group_top_k=2,
        aux_loss_free_bias=True,
        load_balance="sequence",
        load_balance_weight=1e-4,
    ),
    "small": lambda: DeepSeekConfig(
        vocab=1024,
        d_model=256,
        n_layers=4,
        n_heads=8,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        d_mlp=768,
        seq_len=128,
        n_experts=16,
        top_k=4,
        d_ff_expert=128,
        n_shared_experts=1,
    ),
    "16b": lambda: DeepSeekConfig(
        vocab=102400,
        d_model=2048,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        d_mlp=10944,
        seq_len=4096,
        n_experts=64,
        top_k=6,
        d_ff_expert=1408,
        n_shared_experts=2,
        score="softmax",
        normalize_top_k=False,
        load_balance_weight=1e-3,
    ),
    "v3_671b": lambda: DeepSeekConfig(
        vocab=129280,
        d_model=7168,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        d_mlp=18432,
        seq_len=4096,
        n_experts=256,
        top_k=8,
        d_ff_expert=2048,
        n_shared_experts=1,
        score="sigmoid",
        normalize_top_k=True,
        routed_scaling=2.5,
        expert_groups=8,
        group_top_k=4,
        aux_loss_free_bias=True,
        load_balance="sequence",
        load_balance_weight=1e-4,
    ),
}
"""DeepSeek sizes: ``tiny`` (softmax router, 1 dense + 2 MoE blocks, 8 experts top-2,
scanned) and ``tiny_v3`` (V3's routing: sigmoid scores, the aux-loss-free bias,
group-limited to 2 of 4 expert groups, one shared expert, scaling 2.5, the
sequence-wise balance loss) compile in seconds on CPU; ``16b`` has DeepSeek-V2-Lite's
published dims (no query compression, 64 experts top-6 + 2 shared); ``v3_671b``
DeepSeek-V3's (its routing limited to 4 of 8 expert groups)."""

"""Mixture-of-experts decoder (Flax NNX), Mixtral style: GQA attention, top-k routed experts.

The experts of one layer are ONE set of stacked parameters with a leading ``expert``
logical axis (``w_gate``/``w_up``: ``(expert, embed, mlp)``, ``w_down``:
``(expert, mlp, embed)``), so expert parallelism shards them by mapping ``expert``
to a mesh axis. Tokens reach the experts GShard-style: each sequence of the batch
is a routing group; :func:`route` builds one-hot ``dispatch`` and weighted
``combine`` tensors ``[batch, seq, expert, capacity]``; two einsums move tokens to
``[expert, batch, capacity, embed]`` and back. With ``batch`` and ``expert``
sharded on the same mesh axis those einsums are exactly an all-to-all.

Each expert takes at most ``capacity = ceil(capacity_factor * seq * top_k / n_experts)``
tokens per group; tokens over capacity are dropped (their MoE output is zero and
the residual stream carries them). First choices claim capacity before second
choices. The Switch/GShard load-balancing loss is returned beside the logits and
added to the cross-entropy by :func:`moe_loss`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit import nn as sknn

from . import layers as lyr
from .gpt import LM_BATCH_AXES, lm_batch
from .llama import GQAttention, LlamaConfig, make_layers, rms_norm

__all__ = [
    "MoEConfig",
    "MoE",
    "MoELayer",
    "Routing",
    "route",
    "capacity",
    "CONFIGS",
    "moe_loss",
    "lm_batch",
    "LM_BATCH_AXES",
]


@dataclasses.dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A :class:`~spmdkit.models.llama.LlamaConfig` plus the expert settings.

    Attributes:
      n_experts: experts per layer.
      top_k: experts each token is sent to.
      capacity_factor: slack of each expert's capacity over an even split.
      aux_loss_weight: weight of the load-balancing loss in :func:`moe_loss`.
      normalize_top_k: renormalize the chosen experts' router probabilities to sum to 1.
    """

    n_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    normalize_top_k: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        lyr.check_config(
            "MoEConfig",
            (1 <= self.top_k <= self.n_experts, "1 <= top_k <= n_experts"),
            (self.capacity_factor > 0, "capacity_factor > 0"),
            given=self,
        )


class Routing(NamedTuple):
    """What :func:`route` decides for ``[groups, seq]`` tokens.

    Attributes:
      dispatch: ``[groups, seq, expert, capacity]`` 0/1; one 1 per kept (token, choice).
      combine: like ``dispatch``, holding the router weight of each kept choice.
      aux_loss: scalar load-balancing loss (1.0 when routing is perfectly even).
      dropped: ``[groups, seq, top_k]`` bool, choices dropped for lack of capacity.
    """

    dispatch: jax.Array
    combine: jax.Array
    aux_loss: jax.Array
    dropped: jax.Array


def capacity(seq: int, *, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens one expert takes per routing group: ``ceil(cf * seq * top_k / n_experts)``,
    at least 1 and at most ``seq``."""
    return max(1, min(seq, math.ceil(capacity_factor * seq * top_k / n_experts)))


def route(logits: jax.Array, *, top_k: int, capacity: int, normalize_top_k: bool = True) -> Routing:
    """Top-k routing with expert capacity.

    Args:
      logits: router logits ``[groups, seq, expert]``.
      top_k: experts per token.
      capacity: tokens each expert takes per group; later tokens (and second
        choices after all first choices) over it are dropped.
      normalize_top_k: renormalize the kept top-k probabilities of a token to sum to 1
        (before dropping).

    Returns:
      A :class:`Routing`.

    Example::

        >>> r = route(jnp.zeros((1, 8, 4)), top_k=1, capacity=2)
        >>> int(r.dispatch.sum())  # all 8 tokens pick expert 0; 2 fit
        2
    """
    g, s, e = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)  # [g, s, k]
    if normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    choice = jax.nn.one_hot(experts, e, dtype=jnp.int32)  # [g, s, k, e]
    # Priority: every first choice before any second choice, in token order.
    by_priority = choice.transpose(0, 2, 1, 3).reshape(g, top_k * s, e)
    position = jnp.cumsum(by_priority, axis=1) - 1
    position = position.reshape(g, top_k, s, e).transpose(0, 2, 1, 3)  # [g, s, k, e]
    keep = choice * (position < capacity)
    slot = jnp.sum(position * keep, axis=-1)  # [g, s, k]
    kept = jnp.sum(keep, axis=-1)  # [g, s, k] 0/1
    slot_hot = jax.nn.one_hot(slot, capacity, dtype=jnp.float32) * kept[..., None]
    dispatch = jnp.einsum("gske,gskc->gsec", keep.astype(jnp.float32), slot_hot)
    combine = jnp.einsum("gsk,gske,gskc->gsec", weights, keep.astype(jnp.float32), slot_hot)
    # Load balance: fraction of routed choices per expert times mean router probability.
    density = jnp.mean(choice.astype(jnp.float32), axis=(0, 1, 2))
    mean_prob = jnp.mean(probs, axis=(0, 1))
    aux = e * jnp.sum(density * mean_prob)
    return Routing(dispatch, combine, aux, kept == 0)


class MoELayer(nnx.Module):
    """Routed SwiGLU experts; ``layer(x [batch, seq, embed]) -> (y, aux_loss)``."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        d, m, e, pd = cfg.d_model, cfg.d_mlp, cfg.n_experts, cfg.param_dtype
        self.cfg = cfg
        self.router = lyr.param(rngs, lyr.fan_in_init(d), (d, e), ("embed", "expert"), pd)
        self.w_gate = lyr.param(rngs, lyr.fan_in_init(d), (e, d, m), ("expert", "embed", "mlp"), pd)
        self.w_up = lyr.param(rngs, lyr.fan_in_init(d), (e, d, m), ("expert", "embed", "mlp"), pd)
        self.w_down = lyr.param(rngs, lyr.fan_in_init(m), (e, m, d), ("expert", "mlp", "embed"), pd)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        cap = capacity(
            x.shape[1],
            n_experts=cfg.n_experts,
            top_k=cfg.top_k,
            capacity_factor=cfg.capacity_factor,
        )
        dt = x.dtype
        logits = jnp.einsum("bsd,de->bse", x, self.router[...].astype(dt))
        r = route(logits, top_k=cfg.top_k, capacity=cap, normalize_top_k=cfg.normalize_top_k)
        xe = jnp.einsum("bsec,bsd->ebcd", r.dispatch.astype(x.dtype), x)
        gate = jnp.einsum("ebcd,edm->ebcm", xe, self.w_gate[...].astype(dt))
        up = jnp.einsum("ebcd,edm->ebcm", xe, self.w_up[...].astype(dt))
        ye = jnp.einsum("ebcm,emd->ebcd", jax.nn.silu(gate) * up, self.w_down[...].astype(dt))
        y = jnp.einsum("bsec,ebcd->bsd", r.combine.astype(x.dtype), ye)
        return y, r.aux_loss


class MoEBlock(nnx.Module):
    """Pre-norm block with an expert MLP; ``block(x) -> (x, aux_loss)``."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.attn_norm = rms_norm(cfg)
        self.attn = GQAttention(cfg, rngs=rngs)
        self.mlp_norm = rms_norm(cfg)
        self.moe = MoELayer(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.mlp_norm(x))
        return x + y, aux


class MoE(nnx.Module):
    """MoE language model; ``model(tokens) -> (logits [batch, seq, vocab], aux_loss)``.

    ``aux_loss`` is the load-balancing loss averaged over layers.

    Example::

        >>> with nnx.use_eager_sharding(False):
        ...     model = MoE(MoEConfig(), rngs=nnx.Rngs(0))
        >>> logits, aux = model(jnp.zeros((2, 16), jnp.int32))
    """

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.param_dtype
        self.embed = lyr.token_embed(cfg, rngs)  # table at embed/embedding
        self.layers = make_layers(cfg, rngs, MoEBlock)
        self.norm = rms_norm(cfg)
        self.lm_head = lyr.param(
            rngs, lyr.fan_in_init(cfg.d_model), (cfg.d_model, cfg.vocab), ("embed", "vocab"), pd
        )

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        x = self.embed(tokens)
        x = x.astype(cfg.dtype) if cfg.dtype is not None else x
        aux = jnp.zeros((), jnp.float32)
        if cfg.scan_layers:

            @nnx.scan(
                in_axes=(nnx.Carry, 0),
                out_axes=nnx.Carry,
                transform_metadata={nnx.PARTITION_NAME: "layers"},
            )
            def body(carry, block):
                h, total = carry
                h, a = block(h)
                return h, total + a

            x, aux = body((x, aux), self.layers)
        else:
            for block in self.layers:
                x, a = block(x)
                aux = aux + a
        x = self.norm(x)
        return x @ self.lm_head[...].astype(x.dtype), aux / cfg.n_layers


def moe_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy plus ``aux_loss_weight`` times the load-balancing loss."""
    logits, aux = model(batch["tokens"])
    ce = sknn.cross_entropy(logits, batch["targets"])
    return ce + model.cfg.aux_loss_weight * aux


CONFIGS: dict[str, Any] = {
    "tiny": MoEConfig,
    "tiny_scan": lambda: MoEConfig(scan_layers=True),
    "tiny_pipe": lambda: MoEConfig(n_layers=4, scan_layers=True),
    "small": lambda: MoEConfig(
        vocab=1024,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        d_mlp=512,
        seq_len=128,
        n_experts=8,
        scan_layers=True,
    ),
    "mixtral_8x7b": lambda: MoEConfig(
        vocab=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_mlp=14336,
        seq_len=4096,
        rope_theta=1_000_000.0,
        n_experts=8,
        top_k=2,
        scan_layers=True,
    ),
}
"""MoE sizes: ``tiny``/``tiny_scan`` and ``tiny_pipe`` (4 stacked layers, for pipelined
tests) compile in seconds on CPU; ``mixtral_8x7b`` has
Mixtral 8x7B's published dims (8 experts, top-2)."""

"""Shared pieces of the dropless MoE decoders (:mod:`~spmdkit.models.deepseek`,
:mod:`~spmdkit.models.qwen3_moe`): the expert settings, the expert layer, the layer
stack that sums the auxiliary losses, the loss, and the active-parameter count.

The expert layer is :class:`spmdkit.nn.MoE` (router, top-k, the ``moe_experts`` op:
sort, grouped GEMMs, an all-to-all under expert parallelism; shared experts; the
load-balancing and z losses; DeepSeek's aux-loss-free bias as ``ExpertBias`` state).
Its parameters are named ``(expert, embed, mlp)`` / ``(expert, mlp, embed)``, the
router ``(embed, None)`` (every score is read by top-k, so the expert dim of the
router stays whole), the shared experts ``(embed, mlp)`` / ``(mlp, embed)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmdkit import nn as sknn

from . import layers as lyr
from .llama import rms_norm

__all__ = [
    "ExpertSettings",
    "expert_layer",
    "RoutedBlock",
    "run_moe_layers",
    "routed_loss",
    "count_active_params",
]


@dataclasses.dataclass(frozen=True)
class ExpertSettings:
    """The routed-expert fields the MoE decoders' configs share (a mixin).

    Attributes:
      n_experts: routed experts per MoE layer.
      top_k: routed experts per token.
      d_ff_expert: hidden width of one routed (and one shared) expert.
      n_shared_experts: experts every token goes through.
      score: router scores, ``"softmax"`` or ``"sigmoid"``.
      normalize_top_k: renormalise the chosen scores to sum to 1.
      routed_scaling: factor on the routed experts' weights.
      expert_groups: expert groups of group-limited routing (``None``: none;
        :class:`spmdkit.nn.MoE`'s ``groups``).
      group_top_k: groups a token may route to (its ``group_top_k``).
      aux_loss_free_bias: DeepSeek-V3's per-expert routing bias (model state).
      bias_update_rate: its step per training call.
      load_balance: ``"global"``, ``"sequence"`` or ``None``.
      load_balance_weight: weight of the load-balancing loss.
      z_loss_weight: weight of the router z-loss.
      capacity_factor: ``None`` (dropless) or a capacity for token dropping.
      moe_strategy: the ``moe_experts`` strategy (``None``: the planner's choice).
    """

    n_experts: int = 8
    top_k: int = 2
    d_ff_expert: int = 32
    n_shared_experts: int = 0
    score: str = "softmax"
    normalize_top_k: bool = True
    routed_scaling: float = 1.0
    expert_groups: int | None = None
    group_top_k: int | None = None
    aux_loss_free_bias: bool = False
    bias_update_rate: float = 1e-3
    load_balance: str | None = "global"
    load_balance_weight: float = 1e-3
    z_loss_weight: float = 0.0
    capacity_factor: float | None = None
    moe_strategy: str | None = None

    def check_experts(self, name: str) -> None:
        """Raise :class:`~spmdkit.models.layers.ModelConfigError` for bad expert sizes."""
        lyr.check_config(
            name,
            (1 <= self.top_k <= self.n_experts, "1 <= top_k <= n_experts"),
            (self.d_ff_expert >= 1, "d_ff_expert >= 1"),
            (self.n_shared_experts >= 0, "n_shared_experts >= 0"),
            given=self,
        )


def expert_layer(cfg: Any, rngs: nnx.Rngs) -> sknn.MoE:
    """The :class:`spmdkit.nn.MoE` layer ``cfg`` (an :class:`ExpertSettings`) describes."""
    return sknn.MoE(
        cfg.d_model,
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
        d_ff_expert=cfg.d_ff_expert,
        n_shared_experts=cfg.n_shared_experts,
        score=cfg.score,
        normalize_top_k=cfg.normalize_top_k,
        routed_scaling=cfg.routed_scaling,
        groups=cfg.expert_groups,
        group_top_k=cfg.group_top_k,
        aux_loss_free_bias=cfg.aux_loss_free_bias,
        bias_update_rate=cfg.bias_update_rate,
        load_balance=cfg.load_balance,
        load_balance_weight=cfg.load_balance_weight,
        z_loss_weight=cfg.z_loss_weight,
        capacity_factor=cfg.capacity_factor,
        strategy=cfg.moe_strategy,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


_LAYERS_META = {nnx.PARTITION_NAME: "layers"}


def run_moe_layers(cfg: Any, layers: nnx.Module, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Apply blocks ``block(x) -> (x, aux)`` made by :func:`~spmdkit.models.layers.make_layers`
    in order; ``(x, sum of the blocks' aux losses)``."""
    aux = jnp.zeros((), jnp.float32)
    if not cfg.scan_layers:
        for block in layers:
            x, a = block(x)
            aux = aux + a
        return x, aux

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=_LAYERS_META)
    def body(carry: tuple[jax.Array, jax.Array], block: nnx.Module):
        h, total = carry
        h, a = block(h)
        return h, total + a

    return body((x, aux), layers)


def routed_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy plus the MoE layers' weighted auxiliary losses
    (summed over the layers: each layer's loss is already weighted)."""
    logits, aux = model(batch["tokens"])
    return sknn.cross_entropy(logits, batch["targets"]) + aux


def count_active_params(model: nnx.Module, *, input_embedding: bool = True) -> int:
    """Parameters one token uses: every parameter, the routed experts' (dims named
    ``expert``) scaled by ``top_k / n_experts``; ``input_embedding=False`` leaves
    out the token table's lookup (publishers differ: Mixtral and Qwen3 count it,
    DeepSeek and GPT-OSS do not).

    Example::

        >>> count_active_params(abstract_model("qwen3_moe", "30b_a3b"))  # about 3.3e9
    """
    cfg = model.cfg
    total = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        n = math.prod(var.shape)
        names = var.get_metadata().get("out_sharding") or ()
        if "expert" in names:
            n *= cfg.top_k / cfg.n_experts
        if not input_embedding and path[:2] == ("embed", "embedding"):
            n = 0
        total += n
    return round(total)


class RoutedBlock(nnx.Module):
    """Pre-norm block with a model's attention (the subclass's ``attention``) and
    routed experts (:func:`expert_layer`); ``block(x) -> (x, aux)``."""

    attention: Any = None  # an attention module class taking (cfg, rngs=)

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs):
        self.attn_norm = rms_norm(cfg)
        self.attn = self.attention(cfg, rngs=rngs)
        self.mlp_norm = rms_norm(cfg)
        self.moe = expert_layer(cfg, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.mlp_norm(x))
        return x + y, aux

"""A user's own mixture-of-experts decoder: ``jnp.argsort`` and ``jax.lax.ragged_dot``.

Written as public jax code writes a dropless MoE (MaxText's sparse path, the
megablocks idea) without spmdkit's ``nn.MoE`` or ``ops.moe_experts``: a linen module
with plain ``self.param`` weights and no sharding names. Each token's router picks
its top-2 of four experts; the token copies are sorted by expert with
``jnp.argsort``, the SwiGLU experts run as three grouped GEMMs
(``jax.lax.ragged_dot`` with the per-expert counts from ``jnp.bincount``), the rows
are unsorted and summed with the renormalised router weights.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class RaggedExperts(nn.Module):
    """Top-k routed SwiGLU experts over the tokens of ``x`` [batch, seq, dim]."""

    experts: int = 4
    hidden: int = 64
    top_k: int = 2

    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        init = nn.initializers.lecun_normal()
        router = self.param("router", init, (d, self.experts))
        w_gate = self.param("w_gate", init, (self.experts, d, self.hidden))
        w_up = self.param("w_up", init, (self.experts, d, self.hidden))
        w_down = self.param("w_down", init, (self.experts, self.hidden, d))

        tokens = x.reshape(b * s, d)
        probs = jax.nn.softmax(tokens @ router, axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)
        weights = weights / weights.sum(axis=-1, keepdims=True)

        flat = chosen.reshape(-1)  # [tokens * k], token-major
        order = jnp.argsort(flat)
        rows = tokens[order // self.top_k]  # each copy's token, grouped by expert
        sizes = jnp.bincount(flat, length=self.experts).astype(jnp.int32)
        gate = jax.lax.ragged_dot(rows, w_gate, sizes)
        up = jax.lax.ragged_dot(rows, w_up, sizes)
        out = jax.lax.ragged_dot(nn.silu(gate) * up, w_down, sizes)

        out = out[jnp.argsort(order)].reshape(b * s, self.top_k, d)
        return jnp.einsum("tkd,tk->td", out, weights).reshape(b, s, d)


class MoeDecoder(nn.Module):
    """Embedding, two pre-norm MoE blocks with residuals, tied read-out."""

    vocab: int = 64
    dim: int = 32
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.dim, name="embed")
        x = embed(tokens)
        for i in range(self.layers):
            x = x + RaggedExperts(name=f"moe_{i}")(nn.RMSNorm()(x))
        return embed.attend(nn.RMSNorm()(x))


def moe_loss(variables, batch):
    logits = MoeDecoder().apply(variables, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

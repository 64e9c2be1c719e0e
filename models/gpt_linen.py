"""GPT-2 style decoder written in flax linen, to prove linen support.

Same architecture and :class:`~spmdkit.models.gpt.GPTConfig` as the NNX
:mod:`~spmdkit.models.gpt`; every parameter is created through
``nn.with_logical_partitioning(init, names)`` with the same logical axis names.
The norms are :class:`spmdkit.nn.linen.LayerNorm` (flax linen's, computed by
``spmdkit.ops.layer_norm``) and the loss :func:`spmdkit.nn.cross_entropy`.

Two ways to use it:

* **linen** (``init``/``apply``): ``GPTLinen(cfg)`` is an ordinary ``nn.Module``.
  ``jax.eval_shape(module.init, key, tokens)["params"]`` is a tree of
  ``nn.LogicallyPartitioned`` boxes; each box's ``.names`` holds the logical axis
  names and ``.value`` the ``ShapeDtypeStruct``; ``nn.get_partition_spec(tree)``
  turns the boxes into ``PartitionSpec`` s of logical names and ``nn.unbox``
  strips them.
* **NNX** (what :data:`spmdkit.models.MODELS` ``["gpt_linen"]`` builds):
  :func:`build` wraps the module in ``nnx.bridge.ToNNX`` and initializes it lazily
  with a sample batch. The bridge turns every ``LogicallyPartitioned`` box into an
  ``nnx.Param`` whose ``out_sharding`` metadata holds the same logical names, so a
  planner reads the linen model exactly like the NNX ones. Parameter paths are
  linen's (``params`` dict nesting: ``block_0/attn/wq``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from spmdkit import nn as sknn
from spmdkit.nn import linen as sklinen

from . import layers as lyr
from .gpt import GPTConfig

__all__ = ["GPTLinen", "build", "gpt_linen_loss"]


def _p(module: nn.Module, name: str, init, shape, names, dtype):
    return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


def _fan_in(n: int):
    return lyr.fan_in_init(n)


def _layer_norm(cfg: GPTConfig, name: str) -> sklinen.LayerNorm:
    """``spmdkit.nn.linen.LayerNorm`` (params ``<name>/scale``, ``<name>/bias`` on ``norm``)."""
    return sklinen.LayerNorm(epsilon=1e-5, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)


def _token_embed(parent: nn.Module, cfg: GPTConfig) -> sklinen.Embed:
    """``sk.nn.linen.Embed(vocab, d_model, name="embed")``: the table at
    ``embed/embedding`` on ``("vocab", "embed")``, looked up by the ``embedding`` op
    and tied to the head through ``attend``.

    linen derives a submodule's keys from its name, so the table's key is drawn in
    ``parent`` (when initializing), where the top-level ``embed`` parameter drew it
    before the table was a module: every initial value is unchanged.
    """
    key = parent.make_rng("params") if parent.is_initializing() else None
    normal = nn.initializers.normal(0.02)

    def init(own_key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
        # (flax also calls it abstractly, when applying, to check the shape)
        return normal(own_key if key is None else key, shape, dtype)

    return sklinen.Embed(
        cfg.vocab, cfg.d_model, param_dtype=cfg.param_dtype, embedding_init=init, name="embed"
    )


class _Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        d, h, hd, m, pd = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_mlp, cfg.param_dtype
        zeros = nn.initializers.zeros
        y = _layer_norm(cfg, "ln1")(x)
        qkv = []
        for n in ("q", "k", "v"):
            w = _p(self, f"w{n}", _fan_in(d), (d, h, hd), ("embed", "heads", "head_dim"), pd)
            b = _p(self, f"b{n}", zeros, (h, hd), ("heads", "head_dim"), pd)
            qkv.append(jnp.einsum("bsd,dhk->bshk", y, w) + b)
        o = lyr.attention(*qkv, causal=True, implementation=cfg.attention)
        wo = _p(self, "wo", _fan_in(d), (h, hd, d), ("heads", "head_dim", "embed"), pd)
        bo = _p(self, "bo", zeros, (d,), ("embed",), pd)
        x = x + jnp.einsum("bshk,hkd->bsd", o, wo) + bo
        y = _layer_norm(cfg, "ln2")(x)
        w1 = _p(self, "fc_kernel", _fan_in(d), (d, m), ("embed", "mlp"), pd)
        b1 = _p(self, "fc_bias", zeros, (m,), ("mlp",), pd)
        w2 = _p(self, "proj_kernel", _fan_in(m), (m, d), ("mlp", "embed"), pd)
        b2 = _p(self, "proj_bias", zeros, (d,), ("embed",), pd)
        return x + lyr.gelu(y @ w1 + b1, approximate=True) @ w2 + b2


class GPTLinen(nn.Module):
    """Linen GPT-2; ``GPTLinen(cfg).apply(variables, tokens) -> logits [batch, seq, vocab]``.

    Dropout is not implemented here (``cfg.dropout`` must be 0).

    Example::

        >>> module = GPTLinen(GPTConfig())
        >>> boxes = jax.eval_shape(module.init, jax.random.key(0),
        ...                        jnp.zeros((1, 16), jnp.int32))["params"]
        >>> boxes["embed"]["embedding"].names
        ('vocab', 'embed')
    """

    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        pd = cfg.param_dtype
        embed = _token_embed(self, cfg)
        pos = _p(
            self,
            "pos",
            nn.initializers.normal(0.01),
            (cfg.max_seq, cfg.d_model),
            ("pos", "embed"),
            pd,
        )
        x = embed(tokens) + pos[: tokens.shape[1]]
        x = x.astype(cfg.dtype) if cfg.dtype is not None else x
        for i in range(cfg.n_layers):
            x = _Block(cfg, name=f"block_{i}")(x)
        x = _layer_norm(cfg, "ln_f")(x)
        return embed.attend(x)  # tied: x @ embedding.T


def build(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The linen GPT wrapped as an NNX module (``nnx.bridge.ToNNX``), initialized.

    Works under ``nnx.eval_shape`` like the NNX models (flax eager sharding off).

    Args:
      cfg: model sizes; ``cfg.dropout`` must be 0.
      rngs: rng streams; ``params`` (or ``default``) initializes the weights.
    """
    if cfg.dropout:
        raise lyr.ModelConfigError(
            op="gpt_linen",
            must="dropout be 0 (the linen GPT has no dropout)",
            given=f"dropout={cfg.dropout}",
            fix="use the NNX 'gpt' model for dropout, or set dropout=0.0",
        )
    model = nnx.bridge.ToNNX(GPTLinen(cfg), rngs=rngs)
    nnx.bridge.lazy_init(model, jnp.zeros((1, min(cfg.seq_len, cfg.max_seq)), jnp.int32))
    # The model draws no randomness after init; dropping the wrapper's rng streams
    # leaves only parameters in its state (nothing else to checkpoint or shard).
    model.to_nnx__rngs = None
    return model


def gpt_linen_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy of the wrapped linen GPT."""
    return sknn.cross_entropy(model(batch["tokens"]), batch["targets"])

"""More foreign-style flax models, each as its authors would write it outside spmdkit.

They use only flax and jax, with the idioms of public code rather than flax's
ready-made attention: a GPT-2 in NNX with one fused ``c_attn`` projection split in
three and tied embeddings; a BERT encoder in linen with ``DenseGeneral`` heads, a
padding mask and post-norm; a Llama in linen with its own RMSNorm parameter, rotary
embeddings and grouped-query attention; an MLP-Mixer in NNX (token mixing through
transposes); a VGG-style linen CNN with ``BatchNorm``; an NNX bottleneck ResNet with
``nnx.BatchNorm``; a ConvNeXt-style linen net with depthwise convolutions and layer
scale.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# -- GPT-2, NNX, fused qkv ----------------------------------------------------------------


class Gpt2Attention(nnx.Module):
    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.c_attn = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.c_proj = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        b, t, c = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        heads = lambda y: y.reshape(b, t, self.heads, c // self.heads).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / np.sqrt(c // self.heads))
        att = jnp.where(jnp.tril(jnp.ones((t, t))) == 0, -jnp.inf, att)
        y = jax.nn.softmax(att, axis=-1) @ v
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, c))


class Gpt2Block(nnx.Module):
    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.ln_1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = Gpt2Attention(dim, heads, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(dim, rngs=rngs)
        self.c_fc = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.c_proj = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(nnx.gelu(self.c_fc(self.ln_2(x)), approximate=True))


class Gpt2(nnx.Module):
    def __init__(self, vocab=64, block=16, dim=32, heads=4, layers=2, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(vocab, dim, rngs=rngs)
        self.wpe = nnx.Embed(block, dim, rngs=rngs)
        self.h = nnx.List([Gpt2Block(dim, heads, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, idx):
        x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.wte.attend(self.ln_f(x))


def gpt2_loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


# -- BERT, linen, post-norm, padding mask --------------------------------------------------


class BertSelfAttention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x, mask):
        d = x.shape[-1]
        proj = lambda name: nn.DenseGeneral((self.heads, d // self.heads), name=name)(x)  # noqa: E731
        q, k, v = proj("query"), proj("key"), proj("value")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(x.dtype)
        scores = scores + (1.0 - mask[:, None, None, :]) * -10000.0
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.DenseGeneral(d, axis=(-2, -1), name="output")(ctx)


class BertLayer(nn.Module):
    heads: int
    intermediate: int

    @nn.compact
    def __call__(self, x, mask):
        x = nn.LayerNorm(epsilon=1e-12)(x + BertSelfAttention(self.heads)(x, mask))
        h = nn.gelu(nn.Dense(self.intermediate, name="intermediate")(x), approximate=False)
        return nn.LayerNorm(epsilon=1e-12)(x + nn.Dense(x.shape[-1], name="output")(h))


class Bert(nn.Module):
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    intermediate: int = 64
    layers: int = 2
    classes: int = 4

    @nn.compact
    def __call__(self, input_ids, attention_mask, token_type_ids):
        positions = jnp.arange(input_ids.shape[1])[None]
        x = nn.Embed(self.vocab, self.dim, name="word_embeddings")(input_ids)
        x = x + nn.Embed(64, self.dim, name="position_embeddings")(positions)
        x = x + nn.Embed(2, self.dim, name="token_type_embeddings")(token_type_ids)
        x = nn.LayerNorm(epsilon=1e-12)(x)
        mask = attention_mask.astype(x.dtype)
        for i in range(self.layers):
            x = BertLayer(self.heads, self.intermediate, name=f"layer_{i}")(x, mask)
        pooled = jnp.tanh(nn.Dense(self.dim, name="pooler")(x[:, 0]))
        return nn.Dense(self.classes, name="classifier")(pooled)


def bert_loss(variables, batch):
    logits = Bert().apply(variables, batch["input_ids"], batch["mask"], batch["types"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


# -- Llama, linen, RoPE + grouped-query attention -------------------------------------------


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)


def rope(x, base=10000.0):
    """Rotary embedding of ``x`` [batch, seq, heads, head_dim], halves rotated."""
    half = x.shape[-1] // 2
    freqs = 1.0 / base ** (jnp.arange(half) / half)
    angles = jnp.arange(x.shape[1])[:, None] * freqs[None]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class LlamaAttention(nn.Module):
    heads: int
    kv_heads: int

    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        hd = d // self.heads
        q = nn.Dense(self.heads * hd, use_bias=False, name="q_proj")(x).reshape(b, s, -1, hd)
        k = nn.Dense(self.kv_heads * hd, use_bias=False, name="k_proj")(x).reshape(b, s, -1, hd)
        v = nn.Dense(self.kv_heads * hd, use_bias=False, name="v_proj")(x).reshape(b, s, -1, hd)
        q, k = rope(q), rope(k)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.Dense(d, use_bias=False, name="o_proj")(out.reshape(b, s, d))


class LlamaLayer(nn.Module):
    heads: int
    kv_heads: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        x = x + LlamaAttention(self.heads, self.kv_heads, name="self_attn")(RMSNorm()(x))
        h = RMSNorm()(x)
        gate = nn.Dense(self.hidden, use_bias=False, name="gate_proj")(h)
        up = nn.Dense(self.hidden, use_bias=False, name="up_proj")(h)
        return x + nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(nn.silu(gate) * up)


class Llama(nn.Module):
    vocab: int = 64
    dim: int = 64
    heads: int = 8
    kv_heads: int = 4
    hidden: int = 128
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, name="embed_tokens")(tokens)
        for i in range(self.layers):
            x = LlamaLayer(self.heads, self.kv_heads, self.hidden, name=f"layers_{i}")(x)
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(RMSNorm()(x))


def llama_loss(variables, batch):
    logits = Llama().apply(variables, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


# -- MLP-Mixer, NNX ---------------------------------------------------------------------


class MixerBlock(nnx.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int, *, rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.token_fc1 = nnx.Linear(tokens, token_hidden, rngs=rngs)
        self.token_fc2 = nnx.Linear(token_hidden, tokens, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.channel_fc1 = nnx.Linear(dim, channel_hidden, rngs=rngs)
        self.channel_fc2 = nnx.Linear(channel_hidden, dim, rngs=rngs)

    def __call__(self, x):
        y = jnp.swapaxes(self.norm1(x), 1, 2)
        y = self.token_fc2(nnx.gelu(self.token_fc1(y)))
        x = x + jnp.swapaxes(y, 1, 2)
        return x + self.channel_fc2(nnx.gelu(self.channel_fc1(self.norm2(x))))


class Mixer(nnx.Module):
    def __init__(self, patch=4, dim=32, layers=2, classes=16, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, dim, (patch, patch), strides=(patch, patch), rngs=rngs)
        self.blocks = nnx.List([MixerBlock(16, dim, 32, 64, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, images):
        x = self.stem(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(axis=1))


def mixer_loss(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


# -- VGG-style CNN, linen, BatchNorm ------------------------------------------------------


class Vgg(nn.Module):
    widths: tuple = (16, 32)
    classes: int = 16

    @nn.compact
    def __call__(self, x, train: bool = True):
        for width in self.widths:
            for _ in range(2):
                x = nn.Conv(width, (3, 3), padding="SAME")(x)
                x = nn.BatchNorm(use_running_average=not train)(x)
                x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(self.classes)(x)


def vgg_loss(variables, batch):
    logits, updates = Vgg().apply(variables, batch["image"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, updates


# -- bottleneck ResNet, NNX, BatchNorm ----------------------------------------------------


class Bottleneck(nnx.Module):
    def __init__(self, cin: int, width: int, strides: int, *, rngs: nnx.Rngs):
        cout = 4 * width
        self.conv1 = nnx.Conv(cin, width, (1, 1), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, rngs=rngs)
        self.conv2 = nnx.Conv(width, width, (3, 3), strides=strides, use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(width, rngs=rngs)
        self.conv3 = nnx.Conv(width, cout, (1, 1), use_bias=False, rngs=rngs)
        self.bn3 = nnx.BatchNorm(cout, scale_init=nnx.initializers.zeros, rngs=rngs)
        self.project = strides != 1 or cin != cout
        if self.project:
            self.proj = nnx.Conv(cin, cout, (1, 1), strides=strides, use_bias=False, rngs=rngs)
            self.proj_bn = nnx.BatchNorm(cout, rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = nnx.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        if self.project:
            x = self.proj_bn(self.proj(x))
        return nnx.relu(x + y)


class NnxResNet(nnx.Module):
    def __init__(self, width=8, classes=16, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, 16, (3, 3), use_bias=False, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(16, rngs=rngs)
        self.stage1 = Bottleneck(16, width, 1, rngs=rngs)
        self.stage2 = Bottleneck(4 * width, 2 * width, 2, rngs=rngs)
        self.fc = nnx.Linear(8 * width, classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem_bn(self.stem(x)))
        x = self.stage2(self.stage1(x))
        return self.fc(x.mean(axis=(1, 2)))


def nnx_resnet_loss(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


# -- ConvNeXt-style, linen, depthwise conv + layer scale ----------------------------------


class ConvNeXtBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        y = nn.Conv(c, (7, 7), feature_group_count=c, name="dwconv")(x)
        y = nn.LayerNorm(epsilon=1e-6)(y)
        y = nn.Dense(4 * c, name="pwconv1")(y)
        y = nn.Dense(c, name="pwconv2")(nn.gelu(y))
        gamma = self.param("gamma", nn.initializers.constant(1e-6), (c,))
        return x + gamma * y


class ConvNeXt(nn.Module):
    dims: tuple = (16, 32)
    classes: int = 16

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.dims[0], (4, 4), strides=(4, 4), name="stem")(x)
        x = nn.LayerNorm(epsilon=1e-6)(x)
        for i, d in enumerate(self.dims):
            if i:
                x = nn.LayerNorm(epsilon=1e-6)(x)
                x = nn.Conv(d, (2, 2), strides=(2, 2), name=f"downsample_{i}")(x)
            x = ConvNeXtBlock(name=f"stage_{i}")(x)
        return nn.Dense(self.classes, name="head")(nn.LayerNorm()(x.mean(axis=(1, 2))))


def convnext_loss(variables, batch):
    logits = ConvNeXt().apply(variables, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


# -- batches ---------------------------------------------------------------------------------


def bert_batch(batch: int, seq: int, vocab: int, seed: int) -> dict:
    """Token ids with right padding (each row's length drawn), segment ids, a label."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 2, seq + 1, (batch,))
    mask = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
    return {
        "input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int32) * mask,
        "mask": mask,
        "types": (np.arange(seq)[None] >= seq // 2).astype(np.int32).repeat(batch, 0),
        "label": rng.integers(0, 4, (batch,), dtype=np.int32),
    }

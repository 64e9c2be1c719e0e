"""Foreign-style flax models: what a user brings, written from flax's standard layers.

None of these know spmdkit. They follow the habits of public flax code: an NNX
decoder from ``nnx.Embed``/``nnx.Linear``/``nnx.Einsum`` with no sharding metadata;
a linen decoder in the style of flax's lm1b example (``nn.MultiHeadDotProductAttention``
whose ``DenseGeneral`` kernels get the two names of the flat initializer,
``("embed", "kv")``); a linen ResNet with ``BatchNorm`` and max-pooling (flax's
imagenet example); an NNX ViT; a linen U-Net-ish conv net with ``GroupNorm``,
average pooling and transposed convolutions; an NNX conv net with
``nnx.BatchNorm`` (its running statistics are state, updated in place).

Each model comes as a :class:`ZooCase`: how to build it, a loss, a batch.
:data:`OUTSIDE` adds the models of ``tests/zoo/outside.py``: transformers with their
own attention (GPT-2, BERT, Llama), an MLP-Mixer and conv nets with batch norm or
depthwise convolutions, as their authors write them outside spmdkit. :data:`MOE`
holds a mixture-of-experts decoder of ``tests/zoo/moe.py`` (``jnp.argsort`` and
``jax.lax.ragged_dot``), planned with every preset, not only the zoo's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# -- an NNX decoder, no sharding metadata ---------------------------------------------


class NnxAttention(nnx.Module):
    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.q = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.out = nnx.Einsum("bshd,hdD->bsD", (heads, dim // heads, dim), rngs=rngs)

    def __call__(self, x):
        b, s, d = x.shape
        split = lambda t: t.reshape(b, s, self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        mask = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v))


class NnxBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = NnxAttention(dim, heads, rngs=rngs)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.gate = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class NnxDecoder(nnx.Module):
    def __init__(self, vocab=64, dim=32, heads=4, hidden=64, layers=2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(dim, heads, hidden, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def nnx_decoder_loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


# -- a linen decoder in the style of flax's lm1b example ------------------------------


class LinenMlp(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.xavier_uniform()
        h = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(
            x
        )
        h = nn.gelu(h)
        return nn.Dense(
            x.shape[-1], kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed"))
        )(h)


class LinenBlock(nn.Module):
    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x, mask):
        ln = lambda: nn.LayerNorm(  # noqa: E731
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        )
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.xavier_uniform(), ("embed", "kv")
            ),
            use_bias=False,
            name="attn",
        )(ln()(x), mask=mask)
        x = x + h
        return x + LinenMlp(self.hidden, name="mlp")(ln()(x))


class LinenDecoder(nn.Module):
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(
            self.vocab,
            self.dim,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(1.0), ("vocab", "embed")
            ),
        )
        x = embed(tokens)
        mask = nn.make_causal_mask(tokens)
        for i in range(self.layers):
            x = LinenBlock(self.heads, self.hidden, name=f"block_{i}")(x, mask)
        x = nn.LayerNorm()(x)
        return embed.attend(x)


def linen_decoder_loss(variables, batch):
    logits = LinenDecoder().apply(variables, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


# -- a linen ResNet in the style of flax's imagenet example ---------------------------


class ResBlock(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)  # noqa: E731
        y = nn.Conv(self.filters, (3, 3), (self.strides, self.strides), use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = norm()(y)
        if x.shape != y.shape:
            x = nn.Conv(self.filters, (1, 1), (self.strides, self.strides), use_bias=False)(x)
            x = norm()(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    classes: int = 16
    width: int = 16

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = ResBlock(self.width)(x, train)
        x = ResBlock(2 * self.width, strides=2)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes)(x)


def resnet_loss(variables, batch):
    logits, updates = ResNet().apply(variables, batch["image"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, updates


# -- an NNX ViT --------------------------------------------------------------------------


class VitBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class ViT(nnx.Module):
    def __init__(self, patch=4, dim=32, heads=4, hidden=64, layers=2, classes=16, *, rngs):
        self.patch = nnx.Conv(3, dim, (patch, patch), strides=(patch, patch), rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, dim)))
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (1, 17, dim)) * 0.02)
        self.blocks = nnx.List([VitBlock(dim, heads, hidden, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, images):
        x = self.patch(images)
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d)
        x = jnp.concatenate([jnp.broadcast_to(self.cls[...], (b, 1, d)), x], axis=1)
        x = x + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def vit_loss(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


# -- an NNX conv net with batch norm ------------------------------------------------------


class NnxConvNet(nnx.Module):
    def __init__(self, width=16, classes=16, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, width, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), strides=(2, 2), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(2 * width, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(2 * width, classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.head(jnp.mean(x, axis=(1, 2)))


def nnx_cnn_loss(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


# -- a linen U-Net-ish conv net ------------------------------------------------------------


class UNet(nn.Module):
    width: int = 16

    @nn.compact
    def __call__(self, x):
        def conv(y, features):
            y = nn.Conv(features, (3, 3))(y)
            return nn.silu(nn.GroupNorm(num_groups=4)(y))

        d1 = conv(x, self.width)
        d2 = conv(nn.avg_pool(d1, (2, 2), strides=(2, 2)), 2 * self.width)
        mid = conv(nn.max_pool(d2, (2, 2), strides=(2, 2)), 2 * self.width)
        u2 = nn.ConvTranspose(2 * self.width, (2, 2), strides=(2, 2))(mid)
        u2 = conv(jnp.concatenate([u2, d2], axis=-1), 2 * self.width)
        u1 = nn.ConvTranspose(self.width, (2, 2), strides=(2, 2))(u2)
        u1 = conv(jnp.concatenate([u1, d1], axis=-1), self.width)
        return nn.Conv(x.shape[-1], (1, 1))(u1)


def unet_loss(variables, batch):
    pred = UNet().apply(variables, batch["noisy"])
    return jnp.mean((pred - batch["clean"]) ** 2)


# -- the cases ------------------------------------------------------------------------------


def _tokens(batch: int, seq: int, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    t = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    return {"tokens": t[:, :-1], "labels": t[:, 1:]}


def _images(batch: int, size: int, classes: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.standard_normal((batch, size, size, 3)).astype(np.float32),
        "label": rng.integers(0, classes, (batch,), dtype=np.int32),
    }


def _noisy(batch: int, size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    clean = rng.standard_normal((batch, size, size, 3)).astype(np.float32)
    noise = 0.1 * rng.standard_normal(clean.shape).astype(np.float32)
    return {"noisy": clean + noise, "clean": clean}


@dataclass(frozen=True)
class ZooCase:
    """One zoo model: ``model()`` makes what a user would hand to ``sk.plan``
    (an NNX init function or a linen module), ``loss`` and ``batch`` as the user
    writes them; ``init_args`` for linen's ``init``."""

    name: str
    kind: str
    model: Callable[[], Any]
    loss: Callable[[Any, Any], Any]
    batch: Callable[[], dict]
    init_args: Callable[[], tuple] = tuple


ZOO = {
    "nnx_decoder": ZooCase(
        "nnx_decoder",
        "nnx",
        lambda: lambda: NnxDecoder(rngs=nnx.Rngs(0)),
        nnx_decoder_loss,
        lambda: _tokens(8, 16, 64, 0),
    ),
    "linen_decoder": ZooCase(
        "linen_decoder",
        "linen",
        LinenDecoder,
        linen_decoder_loss,
        lambda: _tokens(8, 16, 64, 1),
        lambda: (jnp.zeros((8, 16), jnp.int32),),
    ),
    "resnet": ZooCase(
        "resnet",
        "linen",
        ResNet,
        resnet_loss,
        lambda: _images(8, 16, 16, 2),
        lambda: (jnp.zeros((8, 16, 16, 3)),),
    ),
    "vit": ZooCase(
        "vit",
        "nnx",
        lambda: lambda: ViT(rngs=nnx.Rngs(0)),
        vit_loss,
        lambda: _images(8, 16, 16, 3),
    ),
    "nnx_cnn": ZooCase(
        "nnx_cnn",
        "nnx",
        lambda: lambda: NnxConvNet(rngs=nnx.Rngs(0)),
        nnx_cnn_loss,
        lambda: _images(8, 16, 16, 5),
    ),
    "unet": ZooCase(
        "unet",
        "linen",
        UNet,
        unet_loss,
        lambda: _noisy(8, 16, 4),
        lambda: (jnp.zeros((8, 16, 16, 3)),),
    ),
}


def _outside() -> dict:
    """The models of tests/zoo/outside.py as cases."""
    from tests.zoo import outside as o

    img = lambda: (jnp.zeros((8, 16, 16, 3)),)  # noqa: E731
    tok = lambda: (jnp.zeros((8, 16), jnp.int32),)  # noqa: E731
    cases = [
        ZooCase(
            "gpt2_nnx",
            "nnx",
            lambda: lambda: o.Gpt2(rngs=nnx.Rngs(0)),
            o.gpt2_loss,
            lambda: _tokens(8, 16, 64, 6),
        ),
        ZooCase(
            "bert_linen",
            "linen",
            o.Bert,
            o.bert_loss,
            lambda: o.bert_batch(8, 16, 64, 7),
            lambda: (*tok(), *tok(), *tok()),
        ),
        ZooCase("llama_linen", "linen", o.Llama, o.llama_loss, lambda: _tokens(8, 16, 64, 8), tok),
        ZooCase(
            "mixer_nnx",
            "nnx",
            lambda: lambda: o.Mixer(rngs=nnx.Rngs(0)),
            o.mixer_loss,
            lambda: _images(8, 16, 16, 9),
        ),
        ZooCase("vgg_linen", "linen", o.Vgg, o.vgg_loss, lambda: _images(8, 16, 16, 10), img),
        ZooCase(
            "resnet_nnx",
            "nnx",
            lambda: lambda: o.NnxResNet(rngs=nnx.Rngs(0)),
            o.nnx_resnet_loss,
            lambda: _images(8, 16, 16, 11),
        ),
        ZooCase(
            "convnext_linen",
            "linen",
            o.ConvNeXt,
            o.convnext_loss,
            lambda: _images(8, 16, 16, 12),
            img,
        ),
    ]
    return {c.name: c for c in cases}


#: The models written outside spmdkit's habits (tests/zoo/outside.py).
OUTSIDE = _outside()
ZOO.update(OUTSIDE)


def _moe() -> dict:
    """The user's own MoE decoder of tests/zoo/moe.py as a case."""
    from tests.zoo import moe

    return {
        "moe_ragged": ZooCase(
            "moe_ragged",
            "linen",
            moe.MoeDecoder,
            moe.moe_loss,
            lambda: _tokens(8, 16, 64, 13),
            lambda: (jnp.zeros((8, 16), jnp.int32),),
        )
    }


#: Models planned with every preset and auto, outside the zoo's sampled matrix.
MOE = _moe()

"""A small NNX language model written only for the plan tests (not in models/)."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import spmdkit as sk


def _param(rngs, names, shape):
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), names)
    return nnx.Param(init(rngs.params(), shape))


class Mixer(nnx.Module):
    def __init__(self, d, h, hd, f, rngs):
        self.scale = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))
        self.qkv = _param(rngs, ("embed", "heads", "head_dim"), (d, h, hd))
        self.out = _param(rngs, ("heads", "head_dim", "embed"), (h, hd, d))
        self.up = _param(rngs, ("embed", "mlp"), (d, f))
        self.down = _param(rngs, ("mlp", "embed"), (f, d))

    def __call__(self, x):
        y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]
        v = jnp.einsum("bsd,dhk->bshk", y, self.qkv[...])
        x = x + jnp.einsum("bshk,hkd->bsd", jnp.tanh(v), self.out[...])
        return x + jax.nn.gelu(x @ self.up[...]) @ self.down[...]


class Toy(nnx.Module):
    def __init__(self, vocab=64, d=32, h=4, hd=8, f=64, layers=2, *, rngs):
        self.table = _param(rngs, ("vocab", "embed"), (vocab, d))
        self.mixers = nnx.List([Mixer(d, h, hd, f, rngs) for _ in range(layers)])
        self.unembed = _param(rngs, ("embed", "vocab"), (d, vocab))

    def __call__(self, tokens):
        x = jnp.take(self.table[...], tokens, axis=0)
        for m in self.mixers:
            x = m(x)
        return x @ self.unembed[...]


def toy_loss(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def toy_batch(b=8, s=16, vocab=64, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "tokens": jax.random.randint(k1, (b, s), 0, vocab),
        "targets": jax.random.randint(k2, (b, s), 0, vocab),
    }


def toy_init():
    return Toy(rngs=nnx.Rngs(0))


class OpsMixer(nnx.Module):
    def __init__(self, d, f, rngs, strategy):
        self.scale = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))
        self.up = _param(rngs, ("embed", "mlp"), (d, f))
        self.down = _param(rngs, ("mlp", "embed"), (f, d))
        self.strategy = strategy

    def __call__(self, x):
        y = sk.ops.rms_norm(x, self.scale[...], strategy=self.strategy)
        return x + jax.nn.gelu(y @ self.up[...]) @ self.down[...]


class OpsToy(nnx.Module):
    """The toy written with ``spmdkit.ops`` (no in_specs): norms, lookup and loss are
    regions the planner lays out (``norm_strategy`` fixes the norms' strategy)."""

    def __init__(self, vocab=64, d=32, f=64, layers=2, *, rngs, norm_strategy=None):
        self.table = _param(rngs, ("vocab", "embed"), (vocab, d))
        self.mixers = nnx.List([OpsMixer(d, f, rngs, norm_strategy) for _ in range(layers)])
        self.unembed = _param(rngs, ("embed", "vocab"), (d, vocab))

    def __call__(self, tokens):
        x = sk.ops.embedding_lookup(self.table[...], tokens)
        for m in self.mixers:
            x = m(x)
        return x @ self.unembed[...]


def ops_toy_loss(model, batch):
    return sk.ops.softmax_cross_entropy(model(batch["tokens"]), batch["targets"])


def ops_toy_init(norm_strategy=None):
    return OpsToy(rngs=nnx.Rngs(0), norm_strategy=norm_strategy)

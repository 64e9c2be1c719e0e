"""A model defined outside ``spmdkit.models``, as a user writes one, for the CLI's
``MODEL=module:factory`` tests (``spmdkit plan tests.cli.mymodel:make_spec``).

A small language model in flax NNX without sharding names, its layers stacked
with ``nnx.vmap`` and run with ``nnx.scan`` (flax's scan-over-layers pattern),
and the factories the CLI accepts: a model spec, a function returning one, a
function returning a described model; and one it refuses (a bare module).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import spmdkit as sk
from spmdkit.models import ModelSpec


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    d_model: int = 16
    layers: int = 2
    seq: int = 8


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.up = nnx.Linear(cfg.d_model, 2 * cfg.d_model, rngs=rngs)
        self.down = nnx.Linear(2 * cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(nnx.gelu(self.up(x), approximate=False))


class TinyLM(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def layer(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return self.head(layer(self.embed(tokens), self.blocks))


def lm_loss(model: TinyLM, batch: dict) -> jax.Array:
    logp = jax.nn.log_softmax(model(batch["tokens"]))
    onehot = jax.nn.one_hot(batch["labels"], logp.shape[-1])
    return -jnp.mean(jnp.sum(onehot * logp, -1))


def lm_batch(cfg: Config, batch_size: int, rng: np.random.Generator | None) -> dict:
    """Random tokens and labels; shapes only when ``rng`` is None."""
    shape = (batch_size, cfg.seq)
    if rng is None:
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("tokens", "labels")}
    return {k: rng.integers(0, cfg.vocab, shape).astype(np.int32) for k in ("tokens", "labels")}


SPEC = ModelSpec(
    name="tinylm",
    configs={"small": Config, "wide": lambda: Config(d_model=32)},
    build=TinyLM,
    loss=lm_loss,
    batch=lm_batch,
    batch_axes={"tokens": ("batch", "seq"), "labels": ("batch", "seq")},
)


def make_spec() -> ModelSpec:
    """The model spec: every command (plan, report, train) runs it."""
    return SPEC


def make_info(batch_size: int = 8) -> sk.ModelInfo:
    """The model described with one batch: ``spmdkit plan`` only."""
    batch = lm_batch(Config(), batch_size, np.random.default_rng(0))
    return sk.describe(lambda: TinyLM(Config(), nnx.Rngs(0)), loss=lm_loss, batch=batch)


def make_module() -> TinyLM:
    """A bare module (no loss, no batch): refused, with the fix."""
    return TinyLM(Config(), nnx.Rngs(0))


def make_with_seed(seed: int) -> TinyLM:
    """A factory with an argument the CLI cannot give: refused."""
    return TinyLM(Config(), nnx.Rngs(seed))

"""Rules that are wrong on purpose, registered for a test: the checks must catch them."""

import jax.numpy as jnp
import pytest

import spmdkit as sk
from spmdkit.engine.rule import Inferred, Rule

T = sk.TensorSpec


class _ShardedSoftmax(Rule):
    """Wrong on purpose: claims softmax runs with its axis sharded."""

    name = "t_bad_softmax"
    examples = (sk.Example(((8, 8),)),)

    @staticmethod
    def impl(x):
        return jnp.exp(x) / jnp.sum(jnp.exp(x), axis=-1, keepdims=True)

    def forward(self, ctx, inputs):
        (x,) = inputs
        return Inferred((x.without_partial(),), (x.without_partial(),))


class _SumAsSharded(Rule):
    """Wrong on purpose: claims a sum over a sharded dim leaves a replicated result."""

    name = "t_bad_sum"
    examples = (sk.Example(((8, 8),)),)

    @staticmethod
    def impl(x):
        return jnp.sum(x, axis=1)

    def forward(self, ctx, inputs):
        (x,) = inputs
        return Inferred((x.without_partial(),), (T((8,), (x.dims[0],)),))


@pytest.fixture
def bad_rules():
    """Both wrong rules, registered for the test and unregistered after it."""
    rules = [_ShardedSoftmax(), _SumAsSharded()]
    for r in rules:
        sk.register_rule(r)
    yield rules
    for r in rules:
        sk.unregister_rule(r.name)
